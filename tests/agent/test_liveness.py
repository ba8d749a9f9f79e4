"""The agent's /healthz and /readyz: its gRPC server, its watches, the status writer and the
prefetch loop; a loop that hangs or dies turns them, naming it."""

from __future__ import annotations

import subprocess
import threading

import pytest
from prometheus_client import CollectorRegistry

from accelnode.health import Health
from accelnode.httpserve import MetricsServer
from accelnode.kube.client import Client, Config
from agent import reporter as status_reporter
from agent.nodestatus import Local
from tests.conftest import accelnode_cmd, eventually, health_turned, http_get, require_root
from tests.fixtures.device_plugin import free_port

from .conftest import TPU_LABELS

GRACE = 0.5


def test_agent_process_health_and_readiness(tmp_path, control_plane, cluster):
    """The real agent: alive and ready once its watches listed; its gRPC server gone (the socket
    removed under it) turns /healthz."""
    require_root()
    node = cluster.make_node(TPU_LABELS)
    port = free_port()
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(accelnode_cmd() + [
        "agent", "--store", str(tmp_path / "store"), "--socket", str(sock), "--metrics-address", f"127.0.0.1:{port}",
        "--node-name", node, "--kubeconfig", str(control_plane.kubeconfig("agent")), "--log-level", "warning"])
    try:
        eventually(lambda: http_get(port, "/readyz") == (200, "ok\n"), "agent ready")
        assert http_get(port, "/healthz") == (200, "ok\n")
        sock.unlink()  # nothing answers where the CSI driver looks for the agent
        code, body = eventually(lambda: (r := http_get(port, "/healthz"))[0] == 503 and r, "liveness 503")
        assert body == f"not alive: agent gRPC server: no socket at {sock}\n"
        assert http_get(port, "/readyz")[0] == 503
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture
def reporter(control_plane, cluster):
    """A reporter in-process (so a test can hang its loops) with short bounds; yields
    (reporter, port, gates) where gates["view"] and gates["prefetch"] block those calls while clear."""
    gates = {"view": threading.Event(), "prefetch": threading.Event()}
    for g in gates.values():
        g.set()
    node = cluster.make_node(TPU_LABELS)
    health = Health()

    def view():
        gates["view"].wait()
        return Local({}, set())

    def prefetch(cache, image):
        gates["prefetch"].wait()
        return False, "not pulled (test)"

    client = Client(Config.from_kubeconfig(str(control_plane.kubeconfig("agent"))), timeout=1.0)
    r = status_reporter.Reporter(client, node, [], view, prefetch, resync=0.5, health=health, grace=GRACE,
                                 prefetch_bound=2.0)
    http = MetricsServer("127.0.0.1:0", CollectorRegistry(), r.ready, health).start()
    r.start()
    eventually(lambda: http_get(http.port, "/readyz") == (200, "ok\n"), "reporter ready")
    yield r, http.port, gates
    for g in gates.values():
        g.set()
    r.stop()
    http.stop()


def test_hung_status_writer_turns_liveness_and_recovers(reporter):
    r, port, gates = reporter
    gates["view"].clear()
    r.poke()
    assert "status writer stuck: no beat for" in health_turned(port, "status writer")
    gates["view"].set()
    eventually(lambda: http_get(port, "/healthz") == (200, "ok\n"), "status writer beating again")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_status_writer_is_named(reporter, monkeypatch):
    r, port, _ = reporter

    def die():
        raise SystemExit("injected")

    monkeypatch.setattr(r, "reconcile", die)
    r.poke()
    assert "status writer thread" in health_turned(port, "status writer thread")


def test_hung_prefetch_turns_liveness_and_recovers(reporter, cluster, images):
    r, port, gates = reporter
    gates["prefetch"].clear()
    r.prefetcher._queue.put(((("", "shared"), images.shared), False))  # what reconcile queues for a wanted cache
    assert "prefetch stuck" in health_turned(port, "prefetch")
    gates["prefetch"].set()
    eventually(lambda: http_get(port, "/healthz") == (200, "ok\n"), "prefetch beating again")
