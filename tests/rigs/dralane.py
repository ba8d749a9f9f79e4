"""The DRA lane: a control plane, a real kubelet on containerd 2 (:class:`tests.rigs.node.Node`, CDI
on: the DRA plugin under test writes its specs to ``Node.cdi_dir``), a simulated TPU host and
``accelnode dra``; and the claims and pods its tests and bench use.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.rigs import image as images
from tests.rigs.devcluster import ControlPlane, _Proc, _tail
from tests.rigs.node import Node, NodeError
from tests.rigs.simhost import SimHost


# ---------------------------------------------------------------------------------------------
# the DRA lane: control plane, a containerd 2 node, a simulated TPU host, `accelnode dra`

DRIVER = "tpu.google.com"
# the node labels GKE gives a host of each preset the lane runs
LABELS = {"v5e-4": {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice", "cloud.google.com/gke-tpu-topology": "2x2"},
          "v7x-4": {"cloud.google.com/gke-tpu-accelerator": "tpu7x", "cloud.google.com/gke-tpu-topology": "2x2x1"}}
DEVICE_CLASS = Path(__file__).resolve().parents[2] / "overlays/dra/deviceclass.yaml"


class DRALane:
    """A control plane for real kubelets, a :class:`tests.rigs.node.Node` labelled as a TPU node of
    ``preset`` (a v5e 2x2 by default; :data:`LABELS`), a simulated host of that preset and ``accelnode dra`` serving it from the host (as the admin: the
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
            self.node = Node(self.workdir / "n", self.tools_bin, self.cp, name="accelnode-dra", labels=LABELS[self.preset])
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
            self.wait(lambda: len(self.chip_devices()) == chips, f"the node's ResourceSlice with {chips} chips")
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
        return [d["name"] for s in self.slices() for d in s["spec"].get("devices", [])]

    def chip_devices(self) -> list[str]:
        """The 1-chip devices (``tpu-<index>``; blocks are ``tpu-<first>-<last>``)."""
        return [d for d in self.slice_devices() if d.count("-") == 1]

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
