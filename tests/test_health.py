"""accelnode.health behind the real HTTP endpoint: threads that beat, stall, die and recover."""

import threading

import pytest

from accelnode.health import Health
from accelnode.httpserve import MetricsServer
from prometheus_client import CollectorRegistry

from tests.conftest import eventually, http_get


def serve(health: Health, ready=lambda: (True, "")) -> MetricsServer:
    return MetricsServer("127.0.0.1:0", CollectorRegistry(), ready, health).start()


def looping(health: Health, name: str, within: float, gate: threading.Event, stop: threading.Event,
            boom: threading.Event | None = None) -> threading.Thread:
    """A thread that beats each time round its loop, waits on ``gate`` (clear it to stall the
    loop), raises once ``boom`` is set, and closes its heartbeat when ``stop`` is set."""
    hb = health.heartbeat(name, within)

    def run():
        while not stop.is_set():
            hb.beat(within)
            gate.wait()
            if boom is not None and boom.is_set():
                raise RuntimeError("injected failure")
            stop.wait(0.02)
        hb.close()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


def test_a_stalled_thread_turns_liveness_and_readiness_and_recovers():
    health, gate, stop = Health(), threading.Event(), threading.Event()
    gate.set()
    looping(health, "watcher", 0.3, gate, stop)
    http = serve(health, ready=lambda: (False, "not registered with kubelet"))
    try:
        assert http_get(http.port, "/healthz") == (200, "ok\n")
        assert http_get(http.port, "/readyz") == (503, "not ready: not registered with kubelet\n")
        gate.clear()  # the loop stalls inside one turn
        code, body = eventually(lambda: (r := http_get(http.port, "/healthz"))[0] == 503 and r, "liveness 503")
        assert body.startswith("not alive: watcher stuck: no beat for ") and "promised within 0.3s" in body
        code, body = http_get(http.port, "/readyz")
        assert code == 503 and "watcher stuck" in body
        gate.set()
        eventually(lambda: http_get(http.port, "/healthz") == (200, "ok\n"), "liveness back")
    finally:
        stop.set()
        gate.set()
        http.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected death
def test_a_dead_thread_is_named_and_a_closed_one_is_not_watched():
    health, gate, stop, boom = Health(), threading.Event(), threading.Event(), threading.Event()
    gate.set()
    dying = looping(health, "reflector", 60, gate, threading.Event(), boom)
    looping(health, "registrar", 60, gate, stop)
    http = serve(health)
    try:
        assert http_get(http.port, "/healthz")[0] == 200
        boom.set()
        dying.join(5)
        code, body = http_get(http.port, "/healthz")
        assert code == 503 and "reflector thread 'reflector' died" in body and "registrar" not in body
        stop.set()  # the registrar ends on purpose: not a problem
        problems = eventually(lambda: len(p := health.problems()) == 1 and p, "the registrar closed")
        assert "reflector thread 'reflector' died" in problems[0]
    finally:
        stop.set()
        http.stop()


def test_checks_and_bad_registrations():
    health = Health()
    state = {"problem": None}
    health.check("gRPC", lambda: state["problem"])
    health.check("broken", lambda: 1 / 0)
    ok, why = health.liveness()
    assert not ok and why == "broken check failed: ZeroDivisionError('division by zero')"
    health.check("broken", lambda: None)
    assert health.liveness() == (True, "")
    state["problem"] = "server on /x did not answer within 2s"
    assert health.liveness() == (False, "gRPC server on /x did not answer within 2s")
    health.heartbeat("a", 1)
    try:
        health.heartbeat("a", 1)
    except ValueError as e:
        assert "registered twice" in str(e)
    else:
        raise AssertionError("a duplicate heartbeat name was accepted")


def test_a_heartbeat_never_beaten_counts_from_registration():
    now = [100.0]
    health = Health(clock=lambda: now[0])
    health.heartbeat("prefetch", 10)
    now[0] = 109.0
    assert health.liveness() == (True, "")
    now[0] = 111.0
    assert health.liveness() == (False, "prefetch stuck: no beat for 11.0s (promised within 10.0s)")
