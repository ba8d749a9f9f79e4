"""Registration with kubelet through the plugin-registration socket, against a kubelet-like watcher.

The watcher does what kubelet's plugin watcher and CSI plugin handler do: find the socket in
plugins_registry, GetInfo, validate type, name and versions, dial the advertised endpoint and
ask NodeGetInfo, then report the outcome with NotifyRegistrationStatus.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

from accelnode import grpcutil
from csi_driver.api import csi, csi_grpc, reg, reg_grpc


class PluginWatcher:
    def __init__(self, registry_dir: Path):
        self.registry_dir = registry_dir

    def find_socket(self, timeout: float = 10.0) -> Path:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            socks = sorted(p for p in self.registry_dir.iterdir() if p.is_socket())
            if socks:
                return socks[0]
            time.sleep(0.05)
        raise AssertionError(f"no registration socket appeared in {self.registry_dir}")

    def register(self, sock: Path, *, supported=("1.",)) -> tuple[reg.PluginInfo, str]:
        """Returns the plugin's info and the error reported to it ('' when registered)."""
        with grpcutil.unix_channel(sock) as ch:
            stub = reg_grpc.RegistrationStub(ch)
            info = stub.GetInfo(reg.InfoRequest(), timeout=10)
            error = self.validate(info, supported)
            stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=not error, error=error), timeout=10)
        return info, error

    def validate(self, info: reg.PluginInfo, supported) -> str:
        if info.type != "CSIPlugin":
            return f"unsupported plugin type {info.type!r}"
        if not info.name:
            return "empty plugin name"
        if not any(v.startswith(supported) for v in info.supported_versions):
            return f"none of the versions {list(info.supported_versions)} is supported"
        with grpcutil.unix_channel(info.endpoint) as ch:
            node_id = csi_grpc.NodeStub(ch).NodeGetInfo(csi.NodeGetInfoRequest(), timeout=10).node_id
        return "" if node_id else "NodeGetInfo returned no node id"


def readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def metric(port: int, name: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return next(line for line in r.read().decode().splitlines() if line.startswith(name + " "))


def test_handshake_with_plugin_watcher(node):
    node.csi.start()
    watcher = PluginWatcher(node.registry_dir)
    sock = watcher.find_socket()
    assert sock.name == "csi.gkm.io-reg.sock"
    assert readyz(node.csi_metrics_port) == 503  # not registered yet
    info, error = watcher.register(sock)
    assert error == ""
    assert (info.type, info.name, info.endpoint) == ("CSIPlugin", "csi.gkm.io", str(node.csi_socket))
    assert readyz(node.csi_metrics_port) == 200
    assert metric(node.csi_metrics_port, "accelnode_csi_registered") == "accelnode_csi_registered 1.0"
    node.csi.stop()
    assert not sock.exists()  # kubelet sees the socket go and deregisters the driver


def test_refused_registration_keeps_driver_unready(node):
    node.csi.start()
    watcher = PluginWatcher(node.registry_dir)
    _, error = watcher.register(watcher.find_socket(), supported=("2.",))
    assert "is supported" in error
    assert readyz(node.csi_metrics_port) == 503
    assert "kubelet refused the registration" in node.csi.log()


def test_registration_socket_served_again_when_removed(node):
    """kubelet's plugin watcher only notices new sockets: a wiped one is made again and the
    driver is unready until kubelet confirms the new registration."""
    node.csi.start()
    watcher = PluginWatcher(node.registry_dir)
    sock = watcher.find_socket()
    watcher.register(sock)
    assert readyz(node.csi_metrics_port) == 200
    sock.unlink()
    again = watcher.find_socket(timeout=30)  # only the driver makes it again
    assert again == sock
    assert readyz(node.csi_metrics_port) == 503  # marked unregistered before the new socket appeared
    _, error = watcher.register(again)
    assert error == "" and readyz(node.csi_metrics_port) == 200
    assert "registration socket is gone" in node.csi.log()
