"""Leader election with real ``accelnode controller`` processes on the real kube-apiserver, as the
controller identity (daemonsets/rbac-controller.yaml). Deadlines are generous bounds, never
measurements."""

from __future__ import annotations

import signal

from accelnode.kube.client import Client
from controller.runtime.leader import micro_time
from tests.agent.conftest import eventually
from tests.conftest import http_get
from tests.controller.conftest import LEASE_PATH, lease_spec

# leader election alone: no webhooks, so no webhook certificate (its RBAC is not applied here)
FAST = ("--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "1", "--disable-webhooks")
SLOW_LEASE = ("--lease-duration", "60", "--renew-deadline", "10", "--retry-period", "1", "--disable-webhooks")


def holder(admin: Client) -> str | None:
    return lease_spec(admin).get("holderIdentity")


def leader_gauge(proc) -> str:
    _, text = http_get(proc.metrics_port, "/metrics")
    return next((line.split()[-1] for line in text.splitlines() if line.startswith("accelnode_controller_leader ")),
                "")


def test_a_standby_takes_over_when_the_leader_is_killed(fresh_lease, admin, controllers):
    a = controllers("a", *FAST)
    assert eventually(lambda: holder(admin) == "a", 60), a.log()
    b = controllers("b", *FAST)
    # b is a healthy standby: ready, not leading, and the Lease stays a's
    assert eventually(lambda: http_get(b.metrics_port, "/readyz")[0] == 200, 60), b.log()
    assert leader_gauge(b) == "0.0" and leader_gauge(a) == "1.0"
    assert holder(admin) == "a"
    a.signal(signal.SIGKILL)
    a.wait()
    assert eventually(lambda: holder(admin) == "b", 60), b.log()
    spec = lease_spec(admin)
    assert spec["leaseTransitions"] == 1 and spec["leaseDurationSeconds"] == 4
    assert eventually(lambda: leader_gauge(b) == "1.0", 30)
    assert b.proc.poll() is None


def test_sigterm_releases_the_lease(fresh_lease, admin, controllers):
    a = controllers("a", *SLOW_LEASE)
    assert eventually(lambda: holder(admin) == "a", 60), a.log()
    a.signal(signal.SIGTERM)
    assert a.wait() == 0, a.log()
    spec = lease_spec(admin)
    assert spec["holderIdentity"] == "" and spec["leaseDurationSeconds"] == 1, spec
    assert any(r.get("msg") == "released the lease" for r in a.records()), a.log()


def test_on_sigterm_a_standby_takes_over_before_the_lease_would_expire(fresh_lease, admin, controllers):
    a = controllers("a", *SLOW_LEASE)
    assert eventually(lambda: holder(admin) == "a", 60), a.log()
    b = controllers("b", *SLOW_LEASE)
    assert eventually(lambda: http_get(b.metrics_port, "/readyz")[0] == 200, 60), b.log()
    a.signal(signal.SIGTERM)
    assert a.wait() == 0, a.log()
    # a's lease was 60 s long: b holding it well within that is the release at work
    assert eventually(lambda: holder(admin) == "b", 30), b.log()


def test_a_leader_that_cannot_renew_stops_and_exits_non_zero(fresh_lease, admin, controllers):
    a = controllers("a", *FAST)
    assert eventually(lambda: holder(admin) == "a", 60), a.log()
    lease = admin.request("GET", LEASE_PATH)
    lease["spec"].update(holderIdentity="intruder", leaseDurationSeconds=600, renewTime=micro_time())
    admin.request("PUT", LEASE_PATH, body=lease)
    assert a.wait(60) == 1, a.log()
    assert any(r.get("msg") == "leadership lost: no renewal within the renew deadline" for r in a.records()), a.log()
    assert "lost the leader Lease accelnode-system/accelnode-controller" in a.log()
    assert holder(admin) == "intruder"


def test_a_standby_that_cannot_read_the_lease_is_not_ready(controller_rbac, controllers):
    # the controller identity may read only the Lease named accelnode-controller
    c = controllers("c", "--lease-name", "someone-elses", *FAST)
    assert eventually(lambda: http_get(c.metrics_port, "/readyz")[0] == 503, 60), c.log()
    status, text = http_get(c.metrics_port, "/readyz")
    assert "cannot read Lease accelnode-system/someone-elses" in text and "403" in text, text
    assert http_get(c.metrics_port, "/healthz")[0] == 200


def test_the_leader_renews_without_reading_the_lease_and_reads_it_after_a_conflict(fresh_lease, admin, control_plane):
    """Each renewal is one PUT of the Lease the leader last wrote (its resourceVersion), no GET
    (client-go's optimistic update); when someone else wrote the Lease meanwhile the PUT conflicts,
    and the leader reads the Lease and renews from it, still leading."""
    import threading

    from accelnode.kube.client import Config
    from controller.runtime.leader import LeaderElector, Timing
    from tests.controller.conftest import LEASE, NAMESPACE

    asked: list[str] = []

    class Counting(Client):
        def _open(self, method, path, *args, **kwargs):
            asked.append(method)
            return super()._open(method, path, *args, **kwargs)

    e = LeaderElector(Counting(Config.from_kubeconfig(control_plane.kubeconfig("controller"))), NAMESPACE, LEASE,
                      "optimist", Timing(lease_duration=6, renew_deadline=4, retry_period=0.3))
    stop = threading.Event()
    t = threading.Thread(target=e.run, args=(stop,), daemon=True)
    t.start()
    try:
        assert eventually(e.leading.is_set), "never led"
        start = len(asked)
        assert eventually(lambda: asked[start:].count("PUT") >= 4)
        assert "GET" not in asked[start:], asked[start:]
        admin.request("PATCH", LEASE_PATH, body={"metadata": {"labels": {"touched": "yes"}}})
        mark = len(asked)
        assert eventually(lambda: asked[mark:].count("PUT") >= 3)
        assert asked[mark:].count("GET") == 1 and e.leading.is_set(), asked[mark:]
        assert holder(admin) == "optimist"
    finally:
        stop.set()
        t.join(10)
    assert e.release()
