"""A fresh VM on loopback that joins with a real ``kubeadm join``: :class:`JoinNode`.

Like :class:`tests.rigs.node.Node` (containerd + runc + CNI in a work directory), but nothing
configures kubelet: ``kubeadm join`` (run by ``accelnode bootstrap``, or by hand) writes
``/etc/kubernetes`` and ``/var/lib/kubelet`` and starts kubelet through ``systemctl``, as on a
VM. So that those fixed paths are the VM's and not this host's, every process of the VM runs in
a mount namespace of its own (:meth:`JoinNode.vm_argv`: ``nsenter --mount``) in which
``/etc/kubernetes`` and ``/var/lib/kubelet`` are bind mounts of directories in the work
directory; the rest of the file system, the network and the cgroups are the host's. There is no
systemd: ``systemctl`` on the VM's ``PATH`` is :mod:`tests.rigs.unitctl`, which starts kubelet
from the shipped unit files (``daemonsets/systemd/kubelet.service`` + ``kubelet.service.d/``).

What differs from a VM is in :meth:`JoinNode.kubelet_patch`, handed to kubeadm as a patch of the
cluster's KubeletConfiguration (``accelnode bootstrap --patches``): no systemd, so the cgroupfs
driver; this host's cgroup v1 (where it is); loopback listeners on free ports; logs in the work
directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from tests.rigs import image as images
from tests.rigs import unitctl
from tests.rigs.devcluster import ControlPlane
from tests.rigs.node import CGROUP_V1, SYSCTLS, Node, NodeError, _kubepods_cgroups, prerequisites

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "daemonsets" / "systemd"
BOUND = (Path("/etc/kubernetes"), Path("/var/lib/kubelet"))  # the VM's own, in its mount namespace

# kubeadm preflight checks this rig fails, each ignored and why (the same for accelnode bootstrap
# and for kubeadm by hand); kubeadm only warns about an unresolvable node name (Hostname).
#   SystemVerification, on a cgroup v1 host only (tests.rigs.node.CGROUP_V1, which also gives
#     kubelet failCgroupV1: false): kubeadm 1.35+ fails it there. Passes on a cgroup v2 VM.
#   FileContent--proc-sys-net-ipv4-ip_forward: the host's sysctl is 0 and is not the rig's to
#     change (its network namespace is the host's; pods use the host's network, nothing is
#     routed). A VM gets it from node-startup.sh (/etc/sysctl.d/99-kubernetes.conf).
IGNORED_PREFLIGHT = (*(("SystemVerification",) if CGROUP_V1 else ()), "FileContent--proc-sys-net-ipv4-ip_forward")


class JoinNode(Node):
    def __init__(self, workdir: Path, tools_bin: Path, control_plane: ControlPlane, *, name: str, log=lambda m: None):
        super().__init__(workdir, tools_bin, control_plane, name=name, log=log)
        self.etc_kubernetes = self.workdir / "etc-kubernetes"
        self.root_dir = self.workdir / "var-lib-kubelet"  # the VM's /var/lib/kubelet
        self.device_plugins = self.root_dir / "device-plugins"
        self.bin = self.workdir / "bin"  # first on the VM's PATH: systemctl, kubelet
        self.units = self.workdir / "units"
        self.unit_state = self.workdir / "units-state"
        self.patches = self.workdir / "kubeadm-patches"
        self._holder: subprocess.Popen | None = None
        self._made_mountpoints: list[Path] = []

    # -- the VM ----------------------------------------------------------------------------------

    def start(self, import_images: list[images.Image] = ()) -> None:
        missing = prerequisites(self.tools_bin)
        if missing:
            raise NodeError("missing: " + "; ".join(missing))
        self.workdir.mkdir(parents=True, exist_ok=True)
        for key in SYSCTLS:
            self._sysctls[key] = Path("/proc/sys", key).read_text().strip()
        self._cgroups_before = set(_kubepods_cgroups())
        try:
            self._start_namespace()
            shutil.copytree(UNITS, self.units, ignore=shutil.ignore_patterns("*.sh"))
            unitctl.install(self.bin, self.units, self.unit_state, self.tools_bin)
            # kubelet on the VM's PATH, as node-startup.sh installs it (/usr/local/bin): kubeadm
            # 1.37's KubeletVersion preflight runs `kubelet --version` and fails the join without it
            (self.bin / "kubelet").symlink_to(self.tools_bin / "kubelet")
            self.patches.mkdir(parents=True, exist_ok=True)
            (self.patches / "kubeletconfiguration+merge.yaml").write_text(yaml.safe_dump(self.kubelet_patch()))
            self.start_containerd()
            self.import_images(import_images)
        except BaseException:
            self.stop()
            raise

    def kubelet_patch(self) -> dict:
        """This node's changes to the cluster's KubeletConfiguration (kube-system/kubelet-config):
        the settings every rig kubelet has (:meth:`Node.kubelet_settings`)."""
        return self.kubelet_settings()

    def vm_argv(self, argv: list[str]) -> list[str]:
        assert self._holder is not None, "start() first"
        return ["nsenter", f"--mount=/proc/{self._holder.pid}/ns/mnt", "--", *argv]

    def vm_env(self, **extra: str) -> dict[str, str]:
        return dict(os.environ, PATH=f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}", **extra)

    def join_args(self) -> list[str]:
        """What ``accelnode bootstrap`` is given on this VM (kubeadm by hand: the same as flags)."""
        return ["--cri-socket", f"unix://{self.socket}", "--patches", str(self.patches),
                *(f"--ignore-preflight-errors={c}" for c in IGNORED_PREFLIGHT)]

    def bootstrap(self, metadata_host: str, log: Path, *extra: str) -> subprocess.Popen:
        """``accelnode bootstrap`` on this VM, as its unit runs it, parked in the metadata long poll."""
        from tests.conftest import accelnode_cmd, tool

        with open(log, "ab") as out:
            return subprocess.Popen(self.vm_argv([*accelnode_cmd(), "bootstrap", "--kubeadm", tool("kubeadm"),
                                                  "--log-format", "json", *self.join_args(), *extra]),
                                    env=self.vm_env(GCE_METADATA_HOST=metadata_host), stdout=out,
                                    stderr=subprocess.STDOUT)

    def kubeadm_join(self, token: str, endpoint: str, ca_hash: str, log: Path) -> subprocess.Popen:
        """``kubeadm join`` typed by hand on this VM with the same values and node settings."""
        from tests.conftest import tool

        with open(log, "ab") as out:
            return subprocess.Popen(self.vm_argv([tool("kubeadm"), "join", endpoint, "--token", token,
                                                  "--discovery-token-ca-cert-hash", ca_hash,
                                                  "--node-name", self.name, *self.join_args()]),
                                    env=self.vm_env(), stdout=out, stderr=subprocess.STDOUT)

    def kubelet_log(self) -> Path:
        return self.unit_state / "kubelet.service.log"

    def logs(self) -> str:
        from tests.rigs.devcluster import _tail

        return "\n".join(f"--- {p.name} ---\n{_tail(p, 30)}" for p in (self.kubelet_log(),
                                                                      self.workdir / "containerd.log"))

    def stop(self) -> None:
        if self.bin.exists() and self._holder is not None:
            subprocess.run(self.vm_argv([str(self.bin / "systemctl"), "stop", "kubelet"]), capture_output=True,
                           timeout=30, env=self.vm_env())
        super().stop()
        if self._holder is not None:
            os.killpg(self._holder.pid, signal.SIGKILL)
            self._holder.wait()
            self._holder = None
        for path in self._made_mountpoints:
            try:
                path.rmdir()
            except OSError:
                pass
        self._made_mountpoints = []

    # -- internals -------------------------------------------------------------------------------

    def _start_namespace(self) -> None:
        binds = []
        for target, source in zip(BOUND, (self.etc_kubernetes, self.root_dir)):
            source.mkdir(parents=True, exist_ok=True)
            if not target.exists():  # the host's mount point, empty; removed again on stop
                target.mkdir(parents=True)
                self._made_mountpoints.insert(0, target)
            binds.append(f"mount --bind {source} {target}")
        script = " && ".join(binds) + " && exec sleep infinity"
        self._holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                        start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._holder.poll() is not None:
                raise NodeError(f"the VM's mount namespace did not come up (exit {self._holder.returncode})")
            if _ns_has_mount(self._holder.pid, BOUND[-1]):
                return
            time.sleep(0.05)
        raise NodeError("the VM's mount namespace did not come up in 10 s")

    def _restore_device_plugins(self) -> None:
        pass  # kubelet's device-plugins directory is the VM's (self.device_plugins), not the host's


def _ns_has_mount(pid: int, target: Path) -> bool:
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            return any(line.split()[4] == str(target) for line in f)
    except OSError:
        return False
