"""A real node on loopback: containerd 2 (built by tools/mk/containerd2.mk) + Debian's runc and CNI
plugins, and kubelet (built from the same Kubernetes module as the control plane), under one work
directory.

Used by the end-to-end tests (``tests/node/``, ``tests/dra_node/``, the join lane of
``tests/rigs/joinnode.py``), ``make demo`` and the benches. What one :class:`Node` does, and
undoes on :meth:`Node.stop`:

- containerd 2 (daemon, runc shim and ctr from ``.tools/containerd2/bin``, named by full path so
  nothing on PATH changes) with its root, state, socket, CNI config, ``/opt`` plugin dir and CDI
  spec directory (:attr:`Node.cdi_dir`, where a DRA plugin under test writes) in the work
  directory; the CRI plugin pins its sandbox image (``localhost/accelnode/pause``, Debian's static
  catatonit), reads registry hosts from :attr:`Node.hosts_dir` and sets ``restrict_oom_score_adj``
  (root without CAP_SYS_RESOURCE cannot lower a process's oom_score_adj: runc's "can't get final
  child's PID from pipe");
- a bridge CNI conflist (containerd reports the network ready only with one; our pods use the
  host's network, so the bridge is never made);
- kubelet with ``--root-dir`` in the work directory, ``--hostname-override``, its server and
  healthz on free loopback ports (kubelet refuses a loopback node IP: the Node's InternalIP is the
  host's, where nothing of ours listens), the settings of :meth:`Node.kubelet_settings` (the
  cgroupfs driver, ``oomScoreAdj: 0`` as above, :data:`CGROUP_V1`'s ``failCgroupV1: false``,
  container logs in the work directory), x509 client authentication with the control plane's CA;
- what kubelet changes outside the work directory is recorded first and put back: the sysctls
  ``vm.overcommit_memory``, ``kernel.panic``, ``kernel.panic_on_oops``;
  ``/var/lib/kubelet/device-plugins`` (a fixed path in kubelet; removed if it did not exist);
  ``/var/log/containers`` links; the ``kubepods`` cgroups.

Why containerd 2 and not Debian's containerd 1.6.20 (the lane until Kubernetes 1.35): 1.6 has no
CDI, so a DRA driver's devices (handed over only as CRI ``CDI_devices``) are dropped without an
error; it has no ``RuntimeConfig`` CRI call, for which kubelet 1.37 only falls back with a
warning (and counts ``kubelet_cri_losing_support{version="1.38.0"}``); it mounts no ``image``
volumes. docs/deploy.md has the evidence.

Stopping kills kubelet, then every container and sandbox containerd still runs, then
containerd, unmounts whatever is left under the work directory and removes it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from tests.rigs import image as images
from tests.rigs.devcluster import ControlPlane, _Proc, _tail, free_port

DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")  # kubelet's, not configurable
CONTAINER_LOGS = Path("/var/log/containers")  # kubelet's links to the pod logs
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
NAMESPACE = "k8s.io"  # containerd namespace of the CRI plugin
CONTAINERD_NAMES = ("containerd", "containerd-shim-runc-v2", "ctr")  # tools/mk/containerd2.mk
# This host's cgroup hierarchy. kubelet 1.35+ refuses cgroup v1 unless its configuration says
# failCgroupV1: false (KEP-5573; still honoured in 1.37, to be removed later), and kubeadm's
# SystemVerification preflight fails on it (tests/rigs/joinnode.py). The only place the rigs
# allow cgroup v1; production nodes run cgroup v2 (docs/deploy.md).
CGROUP_V1 = not Path("/sys/fs/cgroup/cgroup.controllers").exists()


class NodeError(RuntimeError):
    """The node could not start (the message names the step and the log tail)."""


def containerd_bin(tools_bin: Path) -> Path:
    """Where tools/mk/containerd2.mk installs containerd 2: beside ``.tools/bin``, not in it."""
    return Path(tools_bin).parent / "containerd2" / "bin"


def prerequisites(tools_bin: Path) -> list[str]:
    """What is missing for a node here (empty when nothing is)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (containers, mounts, cgroups)")
    if not os.access(tools_bin / "kubelet", os.X_OK):
        missing.append(f"kubelet in {tools_bin} (make tools; tools/mk/k8s.mk)")
    d = containerd_bin(tools_bin)
    missing += [f"{d / n} (make tools; tools/mk/containerd2.mk)" for n in CONTAINERD_NAMES if not (d / n).exists()]
    for exe in ("runc", "mmdebstrap", "catatonit"):
        if not shutil.which(exe):
            missing.append(f"{exe} (Debian packages in tools/apt/kubelet.txt: make system-deps)")
    if not os.path.exists("/usr/lib/cni/bridge"):
        missing.append("/usr/lib/cni/bridge (Debian package containernetworking-plugins)")
    return missing


class Node:
    def __init__(self, workdir: Path, tools_bin: Path, control_plane: ControlPlane, *, name: str = "accelnode-e2e",
                 labels: dict[str, str] | None = None, log=lambda msg: None, verbosity: int = 1):
        self.workdir = Path(workdir)
        self.verbosity = verbosity  # kubelet's --v (2 logs each pod's sync events: bench/bench_e2e.py)
        self.tools_bin = Path(tools_bin)
        self.cp = control_plane
        self.name = name
        self.labels = labels or {}
        self.log = log
        self.root_dir = self.workdir / "kubelet"  # kubelet --root-dir
        self.containerd_dir = self.workdir / "containerd"
        self.containerd_bin = containerd_bin(self.tools_bin)
        self.cdi_dir = self.workdir / "cdi"  # containerd's CDI spec directory (a DRA plugin writes there)
        # containerd's registry hosts (hosts.toml per registry): containerd's config_path, and the
        # agent's /etc/containerd/certs.d (write_overlay), so both read the same mirrors
        self.hosts_dir = self.workdir / "certs.d"
        self.socket = self.workdir / "containerd.sock"
        self.pod_logs = self.workdir / "pod-logs"
        self.kubelet_port = free_port()
        self.healthz_port = free_port()
        self._containerd: _Proc | None = None
        self._kubelet: _Proc | None = None
        self._sysctls: dict[str, str] = {}
        self._made_device_plugins = False
        self._made_var_lib_kubelet = False
        self._made_container_logs = False
        self._cgroups_before: set[Path] = set()

    # -- public ----------------------------------------------------------------------------------

    def start(self, import_images: list[images.Image] = ()) -> None:
        missing = prerequisites(self.tools_bin)
        if missing:
            raise NodeError("missing: " + "; ".join(missing))
        if (DEVICE_PLUGINS / "kubelet.sock").exists():
            raise NodeError(f"{DEVICE_PLUGINS}/kubelet.sock exists: another kubelet runs here (or one left it)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        for key in SYSCTLS:
            self._sysctls[key] = Path("/proc/sys", key).read_text().strip()
        self._made_var_lib_kubelet = not DEVICE_PLUGINS.parent.exists()
        self._made_device_plugins = not DEVICE_PLUGINS.exists()
        self._made_container_logs = not CONTAINER_LOGS.exists()
        self._cgroups_before = set(_kubepods_cgroups())
        try:
            self.start_containerd()
            self.import_images(import_images)
            self.start_kubelet()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

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
      runtime_path = '{self.containerd_bin / 'containerd-shim-runc-v2'}'
      [{runtime}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = '{shutil.which('runc')}'
""")
        (d / "net.d" / "10-accelnode.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "accelnode-e2e",
            "plugins": [{"type": "bridge", "bridge": "accelnode0", "isGateway": False, "ipMasq": False,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.123.0/24"}]],
                                  "dataDir": str(d / "cni-state")}}]}))
        self._containerd = _Proc("containerd", self.vm_argv([str(self.containerd_bin / "containerd"), "--config",
                                                             str(d / "config.toml"), "--log-level", "warn"]),
                                 self.workdir / "containerd.log")
        self._containerd.start()
        self._poll(lambda: self.ctr("version", check=False).returncode == 0, self._containerd, "containerd answering",
                   30)

    def import_images(self, import_images: list[images.Image]) -> None:
        """The sandbox image and ``import_images`` into containerd's CRI namespace."""
        for img in (images.build_pause(), *import_images):
            self.log(f"node: importing {img.name} into containerd")
            images.ctr_import(img, str(self.socket), ctr=str(self.containerd_bin / "ctr"))

    def plain_http_registry(self, host: str) -> None:
        """Pull from ``host`` (``127.0.0.1:PORT``, a test registry) over plain HTTP; read at each pull."""
        (self.hosts_dir / host).mkdir(parents=True, exist_ok=True)
        (self.hosts_dir / host / "hosts.toml").write_text(
            f"server = 'http://{host}'\n[host.'http://{host}']\n  capabilities = ['pull', 'resolve']\n")

    def vm_argv(self, argv: list[str]) -> list[str]:
        """How a process of this node is started (a subclass runs it in the node's namespace)."""
        return argv

    def start_kubelet(self) -> None:
        self.root_dir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "volume-plugins").mkdir(exist_ok=True)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            **self.kubelet_settings(), "readOnlyPort": 0,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.cp.ca_file)}},
            "authorization": {"mode": "AlwaysAllow"},  # x509 from the control plane's CA only, on loopback
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "volumePluginDir": str(self.workdir / "volume-plugins"),
            "serializeImagePulls": False,
        }
        path = self.workdir / "kubelet-config.yaml"
        path.write_text(yaml.safe_dump(config))
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        argv = [str(self.tools_bin / "kubelet"), f"--config={path}",
                f"--kubeconfig={self.cp.node_kubeconfig(self.name)}", f"--root-dir={self.root_dir}",
                f"--cert-dir={self.workdir / 'kubelet-pki'}", f"--hostname-override={self.name}",
                f"--v={self.verbosity}", *([f"--node-labels={labels}"] if labels else [])]
        self._kubelet = _Proc("kubelet", argv, self.workdir / "kubelet.log")
        self._kubelet.start()

    def kubelet_settings(self) -> dict:
        """What every kubelet of the rigs sets (this one's config, the join lane's kubeadm patch):
        loopback listeners on free ports, no systemd (the cgroupfs driver, as containerd's runc
        options), this host's cgroup v1 (:data:`CGROUP_V1`), logs in the work directory, eviction
        and image GC that never act on a busy test host, fast status updates."""
        self.pod_logs.mkdir(parents=True, exist_ok=True)
        return {
            "cgroupDriver": "cgroupfs", **({"failCgroupV1": False} if CGROUP_V1 else {}),
            "failSwapOn": False, "oomScoreAdj": 0,
            "address": "127.0.0.1", "port": self.kubelet_port,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.healthz_port,
            "podLogsDir": str(self.pod_logs), "resolvConf": "/etc/resolv.conf",
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "maxPods": 30, "nodeStatusUpdateFrequency": "2s", "syncFrequency": "5s",
        }

    def stop_kubelet(self) -> None:
        if self._kubelet is not None:
            self._kubelet.stop()

    def restart_kubelet(self) -> None:
        self.stop_kubelet()
        self._kubelet.start()

    def kubelet_running(self) -> bool:
        return self._kubelet is not None and self._kubelet.popen is not None and self._kubelet.popen.poll() is None

    def wait_ready(self, timeout: float = 120) -> None:
        self._poll(self.ready, self._kubelet, f"Node {self.name} Ready", timeout)

    def ready(self) -> bool:
        out = subprocess.run([str(self.tools_bin / "kubectl"), f"--kubeconfig={self.cp.kubeconfig('admin')}",
                              "get", "node", self.name, "-o", "json"], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            return False
        conds = json.loads(out.stdout)["status"].get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.containerd_bin / "ctr"), "--address", str(self.socket),
                               "--namespace", NAMESPACE, *args], capture_output=True, text=True, timeout=120, check=check)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{_tail(p, 30)}" for p in (self.workdir / "kubelet.log",
                                                                      self.workdir / "containerd.log"))

    def pod_log(self, namespace: str, pod: str, container: str) -> str:
        """What a container wrote (kubelet's log files, CRI format: time stream tag text)."""
        out = []
        for f in sorted(self.pod_logs.glob(f"{namespace}_{pod}_*/{container}/*.log")):
            for line in f.read_text(errors="replace").splitlines():
                parts = line.split(" ", 3)
                out.append(parts[3] if len(parts) == 4 else line)
        return "\n".join(out)

    def stop(self) -> None:
        """Everything :meth:`start` did, undone; safe to call twice."""
        if self._kubelet is not None:
            self._kubelet.stop()
        if self._containerd is not None and not self._containerd.exited() and self._containerd.popen is not None:
            self._kill_containers()
            self._containerd.stop()
        _kill_shims(self.socket)
        self._unmount_all()
        for key, value in self._sysctls.items():
            try:
                Path("/proc/sys", key).write_text(value)
            except OSError:
                pass
        for cg in sorted(set(_kubepods_cgroups()) - self._cgroups_before, key=lambda p: -len(p.parts)):
            try:
                cg.rmdir()
            except OSError:
                pass
        self._restore_container_logs()
        self._restore_device_plugins()
        self._sysctls = {}

    def _restore_container_logs(self) -> None:
        if CONTAINER_LOGS.exists():
            for link in CONTAINER_LOGS.iterdir():
                if link.is_symlink() and os.readlink(link).startswith(str(self.pod_logs)):
                    link.unlink()
            if self._made_container_logs:
                shutil.rmtree(CONTAINER_LOGS, ignore_errors=True)

    def _restore_device_plugins(self) -> None:
        if self._made_var_lib_kubelet:
            shutil.rmtree(DEVICE_PLUGINS.parent, ignore_errors=True)
        elif self._made_device_plugins:
            shutil.rmtree(DEVICE_PLUGINS, ignore_errors=True)
        else:
            for f in ("kubelet.sock", "kubelet_internal_checkpoint"):
                (DEVICE_PLUGINS / f).unlink(missing_ok=True)

    # -- internals -------------------------------------------------------------------------------

    def _kill_containers(self) -> None:
        out = self.ctr("tasks", "list", "-q", check=False)
        for task in out.stdout.split():
            self.ctr("tasks", "kill", "-a", "-s", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.ctr("tasks", "list", "-q", check=False).stdout.strip():
            for task in self.ctr("tasks", "list", "-q", check=False).stdout.split():
                self.ctr("tasks", "delete", "-f", task, check=False)
            time.sleep(0.2)
        for c in self.ctr("containers", "list", "-q", check=False).stdout.split():
            self.ctr("containers", "delete", c, check=False)

    def _unmount_all(self) -> None:
        """Unmount everything under the work directory, deepest first (lazy for the stubborn)."""
        for _ in range(3):
            mounts = _mounts_under(self.workdir)
            if not mounts:
                return
            for m in sorted(mounts, key=lambda p: -len(p)):
                subprocess.run(["umount", m], capture_output=True)
        for m in sorted(_mounts_under(self.workdir), key=lambda p: -len(p)):
            subprocess.run(["umount", "-l", m], capture_output=True)

    def _poll(self, predicate, proc: _Proc | None, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.exited():
                raise NodeError(f"{proc.name} exited while waiting for {what}:\n{self.logs()}")
            if predicate():
                return
            time.sleep(0.5)
        raise NodeError(f"timed out after {timeout:.0f}s waiting for {what}:\n{self.logs()}")

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    return [p for p in points if p.startswith(prefix)]


def _kubepods_cgroups() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    out = []
    for ctrl in base.iterdir() if base.exists() else ():
        top = ctrl / "kubepods"
        if top.is_dir():
            out += [top, *(p for p in top.rglob("*") if p.is_dir())]
    return out


def _kill_shims(socket: Path) -> None:
    """containerd-shim-runc-v2 processes of this containerd that outlived it."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"containerd-shim-runc-v2") and str(socket).encode() in b" ".join(cmd):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# the kustomize overlay that fits daemonsets/ to this node

SYSTEM_NS = "accelnode-system"


def write_overlay(out: Path, base: Path, node: Node, *, sysfs_root: Path, dev_root: Path, api_port: int,
                  accelerator_type: str = "", topology: str = "", base_docs: list[dict] | None = None,
                  capture_repositories: dict | None = None) -> dict:
    """A kustomization in ``out`` over ``base`` (daemonsets/) for a :class:`Node` on loopback.

    Every pod uses the host's network (no kube-proxy, no pod network here) and reaches the API
    server at 127.0.0.1 (``KUBERNETES_SERVICE_HOST``/``PORT``: kubelet's service variables give
    way to a container's own); every listener gets a free loopback port. The kubelet paths are
    the node's ``--root-dir``; the device plugin and the agent read the simulated host
    (``sysfs_root``, ``dev_root``, mounted at the same paths so that device paths mean the same
    inside and out); the agent talks plain HTTP to a loopback registry. The controller runs one
    replica; the API server reaches its webhooks through Service ``accelnode-controller`` made an
    ExternalName of 127.0.0.1 on the webhook port (the serving certificate still names the
    Service). ``capture_repositories``: the controller's --capture-repositories rules (a file
    mounted at the same path). Returns the ports: ``device_plugin``, ``csi``, ``agent``,
    ``controller``, ``webhook``.
    """
    ports = {k: free_port() for k in ("device_plugin", "csi", "agent", "controller", "webhook")}
    api = [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
           {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)}]
    kdir = node.root_dir
    caches = node.workdir / "caches"
    udev = node.workdir / "udev"
    udev.mkdir(parents=True, exist_ok=True)

    def probes(port: int) -> dict:
        return {p: {"httpGet": {"host": "127.0.0.1", "port": port}} for p in ("readinessProbe", "livenessProbe")}

    def env(**kv) -> list[dict]:
        return [{"name": f"ACCELNODE_{k.upper()}", "value": str(v)} for k, v in kv.items()]

    hw_env = env(sysfs_root=sysfs_root, dev_root=dev_root)
    device_plugin = {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "accelnode-tpu-device-plugin",
                                                                  "namespace": SYSTEM_NS},
        "spec": {"template": {"spec": {
            "containers": [{
                "name": "device-plugin",
                "env": api + hw_env + env(metrics_address=f"127.0.0.1:{ports['device_plugin']}")
                + (env(accelerator_type=accelerator_type) if accelerator_type else [])
                + (env(topology=topology) if topology else []),
                **probes(ports["device_plugin"]),
                "volumeMounts": [{"$patch": "replace"},
                                 {"name": "dev", "mountPath": str(dev_root)},
                                 {"name": "sys", "mountPath": str(sysfs_root), "readOnly": True},
                                 {"name": "device-plugins", "mountPath": str(DEVICE_PLUGINS)},
                                 {"name": "udev", "mountPath": "/run/udev", "readOnly": True}]}],
            "volumes": [{"name": "dev", "hostPath": {"path": str(dev_root)}},
                        {"name": "sys", "hostPath": {"path": str(sysfs_root)}},
                        {"name": "udev", "hostPath": {"path": str(udev)}}]}}}}
    plugin_dir = kdir / "plugins" / "csi.gkm.io"
    csi_node = {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "accelnode-csi-node", "namespace": SYSTEM_NS},
        "spec": {"template": {"spec": {
            "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
            "containers": [
                {"name": "csi",
                 "env": api + env(endpoint=f"unix://{plugin_dir}/csi.sock", plugins_registry=kdir / "plugins_registry",
                                  kubelet_dir=kdir, metrics_address=f"127.0.0.1:{ports['csi']}"),
                 **probes(ports["csi"]),
                 "volumeMounts": [{"$patch": "replace"},
                                  {"name": "kubelet-pods", "mountPath": str(kdir / "pods"),
                                   "mountPropagation": "Bidirectional"},
                                  {"name": "plugin-dir", "mountPath": str(plugin_dir)},
                                  {"name": "registration-dir", "mountPath": str(kdir / "plugins_registry")},
                                  {"name": "cache-store", "mountPath": "/var/lib/accelnode/caches", "readOnly": True},
                                  # under kubelet's root dir, which kubelet makes rshared (Bidirectional needs a
                                  # shared mount on the host; the rig's host mounts are private)
                                  {"name": "views", "mountPath": "/var/lib/accelnode/views",
                                   "mountPropagation": "Bidirectional"},
                                  {"name": "agent-socket", "mountPath": "/run/accelnode"}]},
                {"name": "agent",
                 "env": api + hw_env + env(metrics_address=f"127.0.0.1:{ports['agent']}", plain_http="true",
                                           gc_interval=5),
                 **probes(ports["agent"]),
                 "volumeMounts": [{"$patch": "replace"},
                                  {"name": "cache-store", "mountPath": "/var/lib/accelnode/caches"},
                                  {"name": "agent-socket", "mountPath": "/run/accelnode"},
                                  {"name": "views", "mountPath": "/var/lib/accelnode/views", "readOnly": True,
                                   "mountPropagation": "HostToContainer"},
                                  {"name": "sys", "mountPath": str(sysfs_root), "readOnly": True},
                                  {"name": "dev", "mountPath": str(dev_root), "readOnly": True},
                                  {"name": "registry-credentials", "mountPath": "/etc/accelnode/registry/.docker",
                                   "readOnly": True},
                                  # the rig's containerd hosts directory (Node.hosts_dir), where the base
                                  # mounts the node's /etc/containerd/certs.d
                                  {"name": "containerd-hosts", "mountPath": "/etc/containerd/certs.d",
                                   "readOnly": True}]}],
            "volumes": [{"name": "kubelet-pods", "hostPath": {"path": str(kdir / "pods")}},
                        {"name": "plugin-dir", "hostPath": {"path": str(plugin_dir)}},
                        {"name": "registration-dir", "hostPath": {"path": str(kdir / "plugins_registry")}},
                        {"name": "cache-store", "hostPath": {"path": str(caches)}},
                        {"name": "views", "hostPath": {"path": str(kdir / "accelnode-views"), "type": "DirectoryOrCreate"}},
                        {"name": "sys", "hostPath": {"path": str(sysfs_root)}},
                        {"name": "dev", "hostPath": {"path": str(dev_root)}},
                        {"name": "containerd-hosts", "hostPath": {"path": str(node.hosts_dir)}}]}}}}
    capture_env, capture_mount, capture_volume = [], [], []
    if capture_repositories is not None:
        rules = node.workdir / "capture-repositories.json"
        rules.write_text(json.dumps(capture_repositories))
        capture_env = env(capture_repositories=rules)
        capture_mount = [{"name": "capture-repositories", "mountPath": str(rules), "readOnly": True}]
        capture_volume = [{"name": "capture-repositories", "hostPath": {"path": str(rules), "type": "File"}}]
    controller = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "accelnode-controller", "namespace": SYSTEM_NS},
        "spec": {"replicas": 1, "template": {"spec": {
            "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
            "containers": [{
                "name": "controller",
                "env": api + env(webhook_address=f"127.0.0.1:{ports['webhook']}",
                                 metrics_address=f"127.0.0.1:{ports['controller']}", plain_http="true") + capture_env,
                "ports": [{"$patch": "replace"}, {"name": "webhook", "containerPort": ports["webhook"]},
                          {"name": "metrics", "containerPort": ports["controller"]}],
                **({"volumeMounts": capture_mount} if capture_mount else {}),
                **probes(ports["controller"])}],
            **({"volumes": capture_volume} if capture_volume else {})}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "accelnode-controller", "namespace": SYSTEM_NS},
               "spec": {"type": "ExternalName", "externalName": "127.0.0.1", "selector": None,
                        "ports": [{"$patch": "replace"}, {"name": "webhook", "port": ports["webhook"]}]}}
    patches = [{"path": f"{n}.yaml"} for n in ("device-plugin", "csi-node", "controller", "service")]
    for name, doc in (("device-plugin", device_plugin), ("csi-node", csi_node), ("controller", controller),
                      ("service", service)):
        (out / f"{name}.yaml").parent.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    for doc in base_docs or ():  # each webhook's Service port: the ExternalName's
        if doc["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            ops = [{"op": "add", "path": f"/webhooks/{i}/clientConfig/service/port", "value": ports["webhook"]}
                   for i, _ in enumerate(doc["webhooks"])]
            patches.append({"target": {"kind": doc["kind"], "name": doc["metadata"]["name"]},
                            "patch": yaml.safe_dump(ops)})
    (out / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(base, out)], "patches": patches}, sort_keys=False))
    return ports


# ---------------------------------------------------------------------------------------------
# workloads

TPU = "google.com/tpu"
MOUNT = "/caches/jax"
# The start of the probes workload containers run (the accelnode image's python3): ``files``, the
# sha256 of every file under the mount argv[1], and ``read_only``, whether writing there is EROFS.
TREE_PROBE = r"""
import errno, glob, hashlib, json, os, sys
root = sys.argv[1]
files = {}
for d, _, names in os.walk(root):
    for n in names:
        p = os.path.join(d, n)
        files[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
try:
    open(os.path.join(root, "written-by-pod"), "w").close()
    read_only = False
except OSError as e:
    read_only = e.errno == errno.EROFS
"""
# What a workload got, as one JSON line; exit 1 when something is missing, so the pod Succeeds
# only when everything holds.
PROBE = TREE_PROBE + r"""
devices = sorted(p for p in glob.glob("/dev/vfio/*") + glob.glob("/dev/accel*"))
tpu = {k: v for k, v in os.environ.items() if k.startswith("TPU_")}
print(json.dumps({"devices": devices, "tpu_env": tpu, "files": files, "read_only": read_only}))
sys.exit(0 if devices and tpu and files and read_only else 1)
"""


def workload(name: str, ns: str, volume: dict, *, chips: int = 2, command: list[str] | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "tolerations": [{"key": TPU, "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "worker", "image": images.NAME, "imagePullPolicy": "Never",
                                     "command": command or ["python3", "-c", PROBE, MOUNT],
                                     "resources": {"limits": {TPU: str(chips)}},
                                     "volumeMounts": [{"name": "kernel-cache", "mountPath": MOUNT, "readOnly": True}]}],
                     "volumes": [{"name": "kernel-cache", **volume}]}}


def inline(cache: str, ns: str) -> dict:
    return {"csi": {"driver": "csi.gkm.io", "readOnly": True,
                    "volumeAttributes": {"csi.gkm.io/GKMCache": cache, "csi.gkm.io/namespace": ns}}}


