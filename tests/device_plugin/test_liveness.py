"""Events are the primary path (a long tick cannot be what saw a change), and the plugin's
/healthz and /readyz turn when its watcher, registrar or gRPC server dies or stalls."""

import re
import threading

import pytest

from accelnode.health import Health
from accelnode.httpserve import MetricsServer
from device_plugin import server as dpserver
from device_plugin.metrics import Metrics
from device_plugin.topology import NodeConfig
from tests.conftest import eventually, health_turned, http_get
from tests.fixtures.device_plugin import free_port

HOUR = "3600"


def scans(port: int) -> dict[str, float]:
    text = http_get(port, "/metrics")[1]
    return {c: float(v) for c, v in re.findall(r'accelnode_device_plugin_scans_total\{cause="(\w+)"\} (\S+)', text)}


def test_vanished_and_returned_chips_are_seen_from_their_events(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    port = free_port()
    run_plugin(host, "--health-interval", HOUR, "--metrics-address", f"127.0.0.1:{port}")
    kubelet.wait(lambda k: len(k.devices()) == 4, what="4 chips")
    bdf = host.chips()[2]
    host.remove_dev_node(bdf)  # the chip's /dev/vfio node vanishes
    kubelet.wait(lambda k: k.devices()[f"tpu-{bdf}"].health == "Unhealthy", what="vanished node seen")
    host.restore_dev_node(bdf)
    kubelet.wait(lambda k: k.devices()[f"tpu-{bdf}"].health == "Healthy", what="returned node seen")
    new = host.add_chip("v5e", iommu_group=9)  # hot-plug: the new node's event lists it
    kubelet.wait(lambda k: f"tpu-{new}" in k.devices(), what="hot-added chip")
    host.remove_chip(bdf)  # hot-unplug: node first, then the PCI function (the follow-up scan sees it)
    kubelet.wait(lambda k: f"tpu-{bdf}" not in k.devices() and len(k.devices()) == 4, what="unplugged chip gone")
    got = scans(port)
    assert got.get("tick", 0) == 0 and got["event"] >= 4, got  # the hour-long tick never ran


def test_sysfs_attributes_are_seen_on_the_tick(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    port = free_port()
    run_plugin(host, "--health-interval", "0.3", "--metrics-address", f"127.0.0.1:{port}")
    kubelet.wait(lambda k: len(k.devices()) == 4, what="4 chips")
    bdf = host.chips()[0]
    host.bump_aer_fatal(bdf)  # no event: only the tick can see it
    kubelet.wait(lambda k: k.devices()[f"tpu-{bdf}"].health == "Unhealthy", what="AER error seen")
    assert scans(port)["tick"] >= 1


@pytest.fixture
def plugin(tpu_host, kubelet, monkeypatch):
    """The plugin in-process (so a test can stall or kill its threads), with short wake-ups and
    grace, its /healthz on a free port; yields (plugin, port)."""
    monkeypatch.setattr(dpserver, "REGISTRAR_WAKE", 0.2)
    host = tpu_host("v5e-4")
    health = Health()
    p = dpserver.Plugin(sysfs_root=host.sysfs_root, dev_root=host.dev_root, kubelet_dir=kubelet.dir,
                        config=NodeConfig(), metrics=Metrics(), resource="google.com/tpu",
                        socket_name="accelnode-tpu.sock", tick=0.2, health=health, grace=0.5)
    http = MetricsServer("127.0.0.1:0", p.metrics.registry, p.ready, health).start()
    p.start()
    kubelet.wait(lambda k: len(k.devices()) == 4, what="4 chips")
    eventually(lambda: http_get(http.port, "/readyz") == (200, "ok\n"), "ready")
    yield p, http.port
    p.stop()
    http.stop()


def test_stalled_watcher_turns_liveness_and_recovers(plugin, monkeypatch):
    p, port = plugin
    gate = threading.Event()
    scan = p.watcher.inventory.scan
    monkeypatch.setattr(p.watcher.inventory, "scan", lambda: gate.wait() and scan())
    try:
        body = health_turned(port, "device watcher stuck: no beat for")
        assert body.startswith("not alive: ")
    finally:
        gate.set()
    eventually(lambda: http_get(port, "/healthz") == (200, "ok\n"), "watcher beating again")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_watcher_and_registrar_are_named(plugin, monkeypatch):
    p, port = plugin

    def die(*_):
        raise SystemExit("injected")  # not an Exception: the loops' own handlers let it through

    monkeypatch.setattr(p.watcher.inventory, "scan", die)
    assert "thread 'watcher' died" in health_turned(port, "device watcher thread")
    monkeypatch.setattr(p, "_reconcile", die)
    p._kick.set()
    assert "thread 'registrar' died" in health_turned(port, "registrar thread")


def test_stalled_registrar_turns_liveness(plugin, monkeypatch):
    p, port = plugin
    gate = threading.Event()
    reconcile = p._reconcile
    monkeypatch.setattr(p, "_reconcile", lambda: gate.wait() and reconcile())
    try:
        health_turned(port, "registrar stuck")
    finally:
        gate.set()
    eventually(lambda: http_get(port, "/healthz") == (200, "ok\n"), "registrar beating again")


def test_grpc_server_gone_turns_liveness_and_recovers(plugin, monkeypatch):
    p, port = plugin
    monkeypatch.setattr(p, "_reconcile", lambda: True)  # the registrar beats but does not serve again yet
    p._server.stop(grace=0).wait()
    health_turned(port, "device plugin gRPC server")
    monkeypatch.undo()  # the registrar sees its socket gone and serves again
    p._kick.set()
    eventually(lambda: http_get(port, "/healthz") == (200, "ok\n"), "serving again")
