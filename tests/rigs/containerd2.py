"""The second node lane: the same real kubelet on containerd 2 (tools/mk/containerd2.mk) with CDI on.

Why a second lane: Debian's containerd 1.6.20 has no CDI, and kubelet 1.35 hands a DRA driver's
devices to the runtime only as CRI ``CDI_devices``, which 1.6 drops without an error: a DRA pod
there starts without its chips. containerd 2 reads them (``enable_cdi`` defaults to true since
2.0; set here anyway) and mounts ``image`` volumes (2.1+). Debian's runc runs its containers.

:class:`Containerd2Node` is :class:`tests.rigs.node.Node` with containerd 2's daemon, shim and
ctr from ``.tools/containerd2/bin`` (named by full path, so nothing on PATH changes), a version 3
config and its own CDI spec directory (``cdi_dir``): the DRA plugin under test writes there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.rigs import image as images
from tests.rigs.devcluster import ControlPlane, _Proc, _tail
from tests.rigs.node import NAMESPACE, Node, NodeError
from tests.rigs.simhost import SimHost

NAMES = ("containerd", "containerd-shim-runc-v2", "ctr")


def bin_dir(tools_bin: Path) -> Path:
    return Path(tools_bin).parent / "containerd2" / "bin"


def prerequisites(tools_bin: Path) -> list[str]:
    d = bin_dir(tools_bin)
    return [f"{d / n} (make tools; tools/mk/containerd2.mk)" for n in NAMES if not (d / n).exists()]


class Containerd2Node(Node):
    def __init__(self, workdir: Path, tools_bin: Path, control_plane, **kw):
        super().__init__(workdir, tools_bin, control_plane, **kw)
        self.bin = bin_dir(tools_bin)
        self.cdi_dir = self.workdir / "cdi"

    def start(self, import_images=()) -> None:
        missing = prerequisites(self.tools_bin)
        if missing:
            raise NodeError("missing: " + "; ".join(missing))
        super().start(import_images)

    def start_containerd(self) -> None:
        d = self.containerd_dir
        for sub in ("root", "state", "opt", "net.d", "cni-state"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        self.hosts_dir.mkdir(parents=True, exist_ok=True)
        runtime, images_ = "plugins.'io.containerd.cri.v1.runtime'", "plugins.'io.containerd.cri.v1.images'"
        (d / "config.toml").write_text(f"""version = 3
root = '{d / 'root'}'
state = '{d / 'state'}'
[grpc]
  address = '{self.socket}'
[ttrpc]
  address = '{self.socket}.ttrpc'
[debug]
  address = ''
[metrics]
  address = ''
[plugins.'io.containerd.internal.v1.opt']
  path = '{d / 'opt'}'
[{images_}]
  snapshotter = 'overlayfs'
  [{images_}.pinned_images]
    sandbox = '{images.PAUSE_NAME}'
  [{images_}.registry]
    config_path = '{self.hosts_dir}'
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
[{runtime}]
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ['{self.cdi_dir}']
  [{runtime}.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = '{d / 'net.d'}'
  [{runtime}.containerd]
    default_runtime_name = 'runc'
    [{runtime}.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      runtime_path = '{self.bin / 'containerd-shim-runc-v2'}'
      [{runtime}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = '{shutil.which('runc')}'
""")
        (d / "net.d" / "10-accelnode.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "accelnode-e2e",
            "plugins": [{"type": "bridge", "bridge": "accelnode0", "isGateway": False, "ipMasq": False,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.124.0/24"}]],
                                  "dataDir": str(d / "cni-state")}}]}))
        self._containerd = _Proc("containerd", [str(self.bin / "containerd"), "--config", str(d / "config.toml"),
                                                "--log-level", "warn"], self.workdir / "containerd.log")
        self._containerd.start()
        self._poll(lambda: self.ctr("version", check=False).returncode == 0, self._containerd, "containerd answering",
                   30)

    def plain_http_registry(self, host: str) -> None:
        """Pull from ``host`` (``127.0.0.1:PORT``, a test registry) over plain HTTP; read at each pull."""
        (self.hosts_dir / host).mkdir(parents=True, exist_ok=True)
        (self.hosts_dir / host / "hosts.toml").write_text(
            f"server = 'http://{host}'\n[host.'http://{host}']\n  capabilities = ['pull', 'resolve']\n")

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / "ctr"), "--address", str(self.socket), "--namespace", NAMESPACE, *args],
                              capture_output=True, text=True, timeout=120, check=check)


# ---------------------------------------------------------------------------------------------
# the DRA lane: control plane, a containerd 2 node, a simulated TPU host, `accelnode dra`

DRIVER = "tpu.google.com"
LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice", "cloud.google.com/gke-tpu-topology": "2x2"}
DEVICE_CLASS = Path(__file__).resolve().parents[2] / "overlays/dra/deviceclass.yaml"


class DRALane:
    """A control plane for real kubelets, a :class:`Containerd2Node` labelled as a v5e 2x2 TPU node,
    a simulated v5e-4 host and ``accelnode dra`` serving it from the host (as the admin: the
    plugin's own account is tested in tests/dra/test_rbac.py), the DeviceClass applied and the
    node's slice published. ``workdir`` must be short: kubelet's plugin sockets live under it."""

    def __init__(self, workdir: Path, tools_bin: Path, preset: str = "v5e-4"):
        self.workdir, self.tools_bin, self.preset = Path(workdir), Path(tools_bin), preset
        self.cp = self.node = self.host = self.plugin = None

    def start(self, import_images=()) -> "DRALane":
        self.cp = ControlPlane(self.workdir / "cp", self.tools_bin, kubelets=True)
        try:
            self.cp.start()
            self.host = SimHost.preset(self.workdir / "host", self.preset)
            self.node = Containerd2Node(self.workdir / "n", self.tools_bin, self.cp, name="accelnode-dra", labels=LABELS)
            self.node.start(import_images)
            self.plugin = _Proc("accelnode dra", [
                sys.executable, "-m", "accelnode", "dra", "--node-name", self.node.name,
                "--kubeconfig", str(self.cp.kubeconfig("admin")), "--kubelet-root", str(self.node.root_dir),
                "--cdi-dir", str(self.node.cdi_dir),
                "--sysfs-root", str(self.host.sysfs_root), "--dev-root", str(self.host.dev_root),
                "--metrics-address", "", "--log-format", "text"], self.workdir / "dra.log")
            self.plugin.start()
            self.kubectl("apply", "-f", str(DEVICE_CLASS))
            chips = len(self.host.chips())
            self.wait(lambda: len(self.slice_devices()) == chips, f"the node's ResourceSlice with {chips} chips")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.plugin is not None:
            self.plugin.stop()
        if self.node is not None:
            self.node.stop()
        if self.cp is not None:
            self.cp.stop()

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([str(self.tools_bin / "kubectl"), f"--kubeconfig={self.cp.kubeconfig('admin')}", *args],
                             input=stdin, capture_output=True, text=True, timeout=120)
        if check and out.returncode != 0:
            raise NodeError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, *docs: dict) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))

    def wait(self, predicate, what: str, timeout: float = 120.0, interval: float = 0.2):
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            if time.monotonic() > deadline:
                raise NodeError(f"timed out waiting for {what} (last: {value!r})\n{self.diagnose()}")
            time.sleep(interval)
        return value

    def slices(self) -> list[dict]:
        return self.get("resourceslices", "--field-selector", f"spec.nodeName={self.node.name}")["items"]

    def slice_devices(self) -> list[str]:
        return [d["name"] for s in self.slices() for d in s["spec"]["devices"]]

    def diagnose(self) -> str:
        return "\n".join([self.kubectl("get", "pods,resourceclaims", "-A", "-o", "wide", check=False).stdout,
                          self.kubectl("get", "events", "-A", check=False).stdout[-3000:],
                          "--- accelnode dra\n" + _tail(self.workdir / "dra.log", 20),
                          "--- kube-scheduler.log\n" + _tail(self.cp.workdir / "kube-scheduler.log", 10),
                          self.node.logs()])


def claim_template(name: str, ns: str, count: int, *, ici_block: int | None = None, gen: str | None = None) -> dict:
    """``count`` chips of our DeviceClass; of one aligned ICI block of ``ici_block`` chips; of generation ``gen``."""
    exactly = {"deviceClassName": DRIVER, "count": count}
    if gen:
        exactly["selectors"] = [{"cel": {"expression": f'device.attributes["{DRIVER}"].tpuGen == "{gen}"'}}]
    spec = {"devices": {"requests": [{"name": "tpu", "exactly": exactly}]}}
    if ici_block:
        spec["devices"]["constraints"] = [{"requests": ["tpu"], "matchAttribute": f"{DRIVER}/iciBlock{ici_block}"}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": ns}, "spec": {"spec": spec}}


def claim_pod(name: str, ns: str, template: str, probe: str) -> dict:
    """A pod whose container runs python ``probe`` in the accelnode image and holds a claim from ``template``."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "resourceClaims": [{"name": "tpu", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "worker", "image": images.NAME, "imagePullPolicy": "Never",
                                     "command": ["python3", "-c", probe], "resources": {"claims": [{"name": "tpu"}]}}]}}
