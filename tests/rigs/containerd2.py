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
from pathlib import Path

from tests.rigs import image as images
from tests.rigs.devcluster import _Proc
from tests.rigs.node import NAMESPACE, Node, NodeError

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
        self.hosts_dir = self.workdir / "certs.d"  # containerd's registry hosts (hosts.toml per registry)

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
