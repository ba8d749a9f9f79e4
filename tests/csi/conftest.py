"""Fixtures for the CSI driver tests: the real ``accelnode agent`` and ``accelnode csi`` processes
on a simulated TPU host, kubelet-shaped requests, and mounts that are always cleaned up."""

from __future__ import annotations

import collections
import ctypes
import hashlib
import os
import re
import signal
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from accelnode import grpcutil
from csi_driver import mounts
from csi_driver.api import agent as agent_api
from csi_driver.api import agent_grpc, csi, csi_grpc
from tests.conftest import accelnode_cmd, require_root

MNT_DETACH = 2


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Daemon:
    """One ``accelnode`` subcommand as a real process; its log goes to a file next to it."""

    def __init__(self, name: str, argv: list[str], socket_path: Path, log_dir: Path):
        self.name, self.argv, self.socket = name, argv, socket_path
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Daemon":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(accelnode_cmd() + self.argv, stdout=log, stderr=log)
        try:
            grpcutil.wait_listening(self.socket, timeout=30)
        except TimeoutError:
            self.stop()
            raise AssertionError(f"{self.name} did not start:\n{self.log()}")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)
        finally:
            self.proc = None

    def restart(self) -> "Daemon":
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def unmount_below(root: Path) -> None:
    """Detach every mount under ``root``, deepest first (cleanup, whatever the test left)."""
    libc = ctypes.CDLL(None, use_errno=True)
    prefix = str(root) + "/"
    for mp in sorted((m.point for m in mounts.mounts() if m.point.startswith(prefix)), key=len, reverse=True):
        libc.umount2(os.fsencode(mp), MNT_DETACH)  # stacked mounts appear once each


@dataclass
class Volume:
    """One pod's inline ``csi:`` volume, as kubelet would publish it."""

    kubelet_dir: Path
    pod_namespace: str
    cache: str
    image: str
    cache_namespace: str | None = None
    pod_name: str = "worker-0"
    pod_uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    name: str = "kernel-cache"

    @property
    def volume_id(self) -> str:  # kubelet's makeVolumeHandle: sha256 of pod uid + volume name
        return "csi-" + hashlib.sha256((self.pod_uid + self.name).encode()).hexdigest()

    @property
    def target(self) -> Path:
        return self.kubelet_dir / "pods" / self.pod_uid / "volumes" / "kubernetes.io~csi" / self.name / "mount"

    def context(self) -> dict[str, str]:
        ctx = {"csi.gkm.io/GKMCache": self.cache,
               "csi.storage.k8s.io/pod.name": self.pod_name, "csi.storage.k8s.io/pod.namespace": self.pod_namespace,
               "csi.storage.k8s.io/pod.uid": self.pod_uid, "csi.storage.k8s.io/serviceAccount.name": "default",
               "csi.storage.k8s.io/ephemeral": "true"}
        if self.image:  # "": the volume names the cache only (the driver looks it up)
            ctx["csi.gkm.io/image"] = self.image
        if self.cache_namespace:
            ctx["csi.gkm.io/namespace"] = self.cache_namespace
        return ctx

    def publish_request(self, **overrides) -> csi.NodePublishVolumeRequest:
        self.target.parent.mkdir(mode=0o750, parents=True, exist_ok=True)  # kubelet makes the parent only
        req = csi.NodePublishVolumeRequest(
            volume_id=self.volume_id, target_path=str(self.target), readonly=False,
            volume_capability=csi.VolumeCapability(
                mount=csi.VolumeCapability.MountVolume(),
                access_mode=csi.VolumeCapability.AccessMode(mode=csi.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)),
            volume_context=self.context())
        for k, v in overrides.items():
            if isinstance(v, (str, bool)):
                setattr(req, k, v)
            else:
                getattr(req, k).CopyFrom(v)
        return req

    def unpublish_request(self) -> csi.NodeUnpublishVolumeRequest:
        return csi.NodeUnpublishVolumeRequest(volume_id=self.volume_id, target_path=str(self.target))


class Node:
    """A node: simulated v5e-4 host, cache store, agent and CSI driver processes, kubelet dirs."""

    def __init__(self, root: Path):
        from tests.rigs.simhost import SimHost

        self.root = root
        self.host = SimHost.preset(root / "host", "v5e-4")
        self.kubelet_dir = root / "kubelet"
        self.registry_dir = self.kubelet_dir / "plugins_registry"
        self.registry_dir.mkdir(parents=True)
        self.store = root / "store"
        self.agent_socket = root / "run" / "agent.sock"
        self.csi_socket = root / "plugins" / "csi.gkm.io" / "csi.sock"
        self.agent_socket.parent.mkdir(parents=True)
        self.csi_metrics_port, self.agent_metrics_port = free_ports(2)
        self.agent = Daemon("agent", [
            "agent", "--store", str(self.store), "--socket", str(self.agent_socket), "--plain-http",
            "--sysfs-root", str(self.host.sysfs_root), "--dev-root", str(self.host.dev_root),
            "--metrics-address", f"127.0.0.1:{self.agent_metrics_port}", "--log-format", "text"],
            self.agent_socket, root)
        self.pull_wait = 20.0
        self.views_dir = root / "views"
        # No API server by default: volumes name their image (csi.gkm.io/image), which the driver
        # accepts only when told to trust pod authors. use_api() looks caches up instead.
        self.csi_flags = ["--trust-pod-image-attribute"]
        self.csi = Daemon("csi", self.csi_argv(), self.csi_socket, root)
        self._channels: list[grpc.Channel] = []

    def csi_argv(self) -> list[str]:
        return ["csi", "--endpoint", f"unix://{self.csi_socket}", "--node-id", "node-a",
                "--agent-socket", str(self.agent_socket), "--plugins-registry", str(self.registry_dir),
                "--kubelet-dir", str(self.kubelet_dir), "--pull-wait", str(self.pull_wait), "--metrics-address", f"127.0.0.1:{self.csi_metrics_port}",
                "--views-dir", str(self.views_dir), "--log-format", "text", *self.csi_flags]

    def set_pull_wait(self, seconds: float) -> None:
        self.pull_wait = seconds
        self.csi.argv = self.csi_argv()

    def set_kubelet_dir(self, path: Path) -> None:
        """Kubelet's root directory, for the driver (before it starts) and the volumes made after."""
        self.kubelet_dir = path
        self.csi.argv = self.csi_argv()

    def set_csi_flags(self, *flags: str) -> None:
        """The driver's flags beyond the fixed ones (before it starts)."""
        self.csi_flags = list(flags)
        self.csi.argv = self.csi_argv()

    def set_agent_flags(self, *flags: str) -> None:
        self.agent.argv = self.agent.argv + list(flags)

    def channel(self, path: Path) -> grpc.Channel:
        ch = grpcutil.unix_channel(path, options=[("grpc.max_reconnect_backoff_ms", 500)])
        self._channels.append(ch)
        return ch

    def node_stub(self) -> csi_grpc.NodeStub:
        return csi_grpc.NodeStub(self.channel(self.csi_socket))

    def identity_stub(self) -> csi_grpc.IdentityStub:
        return csi_grpc.IdentityStub(self.channel(self.csi_socket))

    def agent_stub(self) -> agent_grpc.AgentStub:
        return agent_grpc.AgentStub(self.channel(self.agent_socket))

    def volume(self, image: str, *, pod_namespace: str = "team-a", cache: str = "kernels",
               cache_namespace: str | None = "team-a", **kw) -> Volume:
        return Volume(self.kubelet_dir, pod_namespace, cache, image, cache_namespace, **kw)

    def references(self) -> dict[str, str]:
        """volume id -> digest, from the agent."""
        listing = self.agent_stub().ListCaches(agent_api.ListCachesRequest(), timeout=10)
        return {r.volume_id: c.digest for c in listing.caches for r in c.references}

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self.csi.stop()
        self.agent.stop()
        unmount_below(self.root)


@pytest.fixture
def node(tmp_path):
    """A node with agent and CSI driver NOT yet started (``node.agent.start()``)."""
    require_root()
    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.close()
        assert not [m for m in mounts.mount_points() if m.startswith(str(tmp_path) + "/")], "mounts left behind"


@pytest.fixture
def running_node(node):
    node.agent.start()
    node.csi.start()
    return node


def mount_count(path: Path) -> int:
    """How many mounts are stacked at ``path`` (the mount table lists each one)."""
    return [m.point for m in mounts.mounts()].count(mounts.resolve(path))


def code_of(call, *args, **kw) -> grpc.StatusCode:
    """The status code a unary call ends with (OK when it succeeds)."""
    try:
        call(*args, timeout=60, **kw)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def error_of(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=60, **kw)
    return info.value


@dataclass(frozen=True)
class Images:
    tpu: str  # a JAX cache for tpu/v5e: fits the simulated v5e-4 host
    cluster_tpu: str  # another v5e cache, used as a ClusterGKMCache
    gpu: str  # a Triton cache for cuda/sm_90: does not fit
    missing: str  # pinned to a digest the registry does not have


def make_cache(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture(scope="session")
def images(registry, tmp_path_factory):
    d = tmp_path_factory.mktemp("caches")
    tpu = registry.push(make_cache(d / "tpu", {"xla/module_0001.bin": b"\x7fXLA" * 4096, "xla/index.txt": b"m1\n"}),
                        "caches/jax-v5e", kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}])
    cluster = registry.push(make_cache(d / "tpu2", {"xla/module_0002.bin": b"\x00" * 1024}),
                            "caches/jax-v5e-shared", kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}])
    gpu = registry.push(make_cache(d / "gpu", {"ab12/kernel.cubin": b"\x01" * 2048}), "caches/triton-h100",
                        kind="triton", targets=[{"backend": "cuda", "arch": "sm_90", "warp_size": 32}])
    missing = f"{registry.host}/caches/jax-v5e@sha256:{hashlib.sha256(b'never pushed').hexdigest()}"
    return Images(tpu, cluster, gpu, missing)


class SlowProxy:
    """A TCP proxy to the registry that passes registry -> client bytes at ``rate`` bytes/s
    (None: full speed), so a pull can be caught in the middle. Stops with the test."""

    def __init__(self, upstream: str, rate: float | None):
        import threading

        self.upstream = upstream.split(":")
        self.rate = rate
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.host = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._closing = False
        self.blob_gets: collections.Counter = collections.Counter()  # blob digest -> GETs through the proxy
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import threading

        while not self._closing:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection((self.upstream[0], int(self.upstream[1])))
            self._conns += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        import time

        try:
            while True:
                data = src.recv(16384 if not (throttled and self.rate) else 4096)
                if not data:
                    break
                if not throttled:
                    self.blob_gets.update(re.findall(rb"GET /v2/\S+/blobs/(sha256:[0-9a-f]{64})", data))
                dst.sendall(data)
                if throttled and self.rate:
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closing = True
        self.sock.close()
        for s in self._conns:
            s.close()


@pytest.fixture
def slow_registry(registry):
    proxy = SlowProxy(registry.host, rate=512 * 1024)
    yield proxy
    proxy.close()


def eventually(check, tries: int = 100, interval: float = 0.2):
    """The first truthy result of ``check()`` within a bounded number of tries (else the last)."""
    import time

    result = None
    for _ in range(tries):
        result = check()
        if result:
            return result
        time.sleep(interval)
    return result
