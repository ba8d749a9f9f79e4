"""Events on the objects users own (issue 24.6), on the real API server: written as the
controller's identity with daemonsets/rbac-controller-events.yaml, shown by the real
``kubectl describe``; a repeat counted on one Event, a loop of different messages aggregated and
spam-filtered; a real ``accelnode controller`` records a cache's transitions."""

from __future__ import annotations

import json
import time

import pytest

from accelnode.kube.client import Client, Config
from controller.runtime import events
from tests.conftest import ROOT
from tests.csi.conftest import make_cache

GKM = "gkm.io/v1alpha1"


def eventually(fn, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (v := fn()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return v


@pytest.fixture(scope="module")
def events_rbac(kubectl, crds):
    out = kubectl("admin", "apply", *(a for f in ("namespace.yaml", "rbac-controller.yaml",
                                                   "rbac-controller-caches.yaml", "rbac-controller-events.yaml")
                                       for a in ("-f", str(ROOT / "daemonsets" / f))))
    assert out.returncode == 0, out.stderr


@pytest.fixture
def recorder(control_plane, events_rbac):
    r = events.Recorder(Client(Config.from_kubeconfig(control_plane.kubeconfig("controller"))),
                        instance="test").start()
    yield r
    r.stop()


def config_map(kubectl, ns: str, name: str) -> dict:
    out = kubectl("admin", "create", "configmap", name, "-n", ns, "-o", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def events_of(kubectl, obj: dict) -> list[dict]:
    out = kubectl("admin", "get", "events", "-A", "-o", "json",
                  "--field-selector", f"involvedObject.uid={obj['metadata']['uid']}")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["items"]


def test_a_repeat_is_one_event_counted_and_kubectl_describe_shows_it(kubectl, kube_namespace, recorder):
    cm = config_map(kubectl, kube_namespace, "cm")
    for _ in range(5):
        recorder.record(cm, events.WARNING, "PullRefused", "image x: signature required, none found")
    assert recorder.flush()
    (ev,) = events_of(kubectl, cm)
    assert (ev["count"], ev["type"], ev["reason"], ev["source"]["component"]) == \
        (5, "Warning", "PullRefused", "accelnode-controller")
    out = kubectl("admin", "describe", "configmap", "cm", "-n", kube_namespace)
    assert "Events:" in out.stdout and "PullRefused" in out.stdout and "(x5 over" in out.stdout, out.stdout
    assert "image x: signature required, none found" in out.stdout
    # an expired (deleted) event is made anew on the next repeat
    assert kubectl("admin", "delete", "event", ev["metadata"]["name"], "-n", kube_namespace).returncode == 0
    recorder.record(cm, events.WARNING, "PullRefused", "image x: signature required, none found")
    assert recorder.flush()
    (again,) = events_of(kubectl, cm)
    assert again["count"] == 1 and again["metadata"]["name"] != ev["metadata"]["name"]


def test_a_failing_loop_does_not_flood(kubectl, kube_namespace, recorder):
    cm = config_map(kubectl, kube_namespace, "loop")
    for i in range(200):  # a reconcile loop failing with a new message each time
        recorder.record(cm, events.WARNING, "VerificationFailed", f"attempt {i}: signature does not verify")
    assert recorder.flush()
    evs = events_of(kubectl, cm)
    assert sum(e["count"] for e in evs) == events.BURST  # the spam filter's burst, the rest dropped
    assert len(evs) == events.AGGREGATE_AFTER + 1  # ten messages, then one combined event
    (combined,) = [e for e in evs if e["message"].startswith("(combined from similar events): ")]
    assert combined["count"] == events.BURST - events.AGGREGATE_AFTER
    assert recorder.dropped == 200 - events.BURST


def test_cluster_scoped_objects_get_their_events_in_default(kubectl, recorder):
    ns = json.loads(kubectl("admin", "get", "namespace", "kube-public", "-o", "json").stdout)
    recorder.record(ns, events.NORMAL, "Checked", "an event about a cluster-scoped object")
    assert recorder.flush()
    (ev,) = [e for e in events_of(kubectl, ns) if e["reason"] == "Checked"]
    assert ev["metadata"]["namespace"] == "default"


def test_transitions_make_events_only_for_changes(kubectl, kube_namespace, recorder):
    cm = config_map(kubectl, kube_namespace, "transitions")
    events.install(recorder)
    try:
        def conds(*cs):
            return {"conditions": [{"type": t, "status": s, "reason": r, "message": m} for t, s, r, m in cs]}

        before = {**cm, "status": conds(("Ready", "True", "Running", "in use"), ("Resolved", "True", "Resolved", "p"))}
        events.transitions(before, conds(("Ready", "True", "Extracted", "idle"), ("Resolved", "True", "Resolved", "p")),
                           quiet=("Ready",))  # routine: nothing
        events.transitions(before, conds(("Ready", "False", "Error", "node n1: pull refused: no signature"),
                                         ("Resolved", "True", "Resolved", "p"),
                                         ("Verified", "False", "SignatureMissing", "no signature")), quiet=("Ready",))
        events.transitions({**cm, "status": {}}, conds(("Ready", "False", "Downloading", "1 node pulling")),
                           progress=("Downloading",))
        assert recorder.flush()
    finally:
        events.install(None)
    got = sorted((e["type"], e["reason"], e["message"]) for e in events_of(kubectl, cm))
    assert got == [("Normal", "Downloading", "1 node pulling"),
                   ("Warning", "Error", "node n1: pull refused: no signature"),
                   ("Warning", "SignatureMissing", "no signature")]


def test_the_controller_records_a_caches_transitions(kubectl, kube_namespace, events_rbac, controllers, registry,
                                                     tmp_path):
    """A real ``accelnode controller``: the cache's image unreachable (Warning), then pinned (Normal);
    the retries in between add nothing."""
    c = controllers("events-a", "--disable-webhooks", "--plain-http")
    cache = {"apiVersion": GKM, "kind": "GKMCache", "metadata": {"name": "kernels", "namespace": kube_namespace},
             "spec": {"image": "127.0.0.1:9/k/kernels:v1"}}
    assert kubectl("admin", "create", "-f", "-", stdin=json.dumps(cache)).returncode == 0

    def describe() -> str:
        return kubectl("admin", "describe", "gkmcache", "kernels", "-n", kube_namespace).stdout

    # the condition is written before its Event is sent: wait for the Event itself
    out = eventually(lambda: "RegistryUnavailable" in (d := describe()).split("Events:")[-1] and d,
                     "the Warning event", timeout=60)
    assert "Warning" in out and "127.0.0.1:9" in out, out
    image = registry.push(make_cache(tmp_path / "src", {"xla/a.bin": b"\x01" * 100}), "events/k", tag="v1",
                          kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}])
    patch = json.dumps({"spec": {"image": f"{registry.host}/events/k:v1"}})
    assert kubectl("admin", "patch", "gkmcache", "kernels", "-n", kube_namespace, "--type=merge",
                   "-p", patch).returncode == 0
    out = eventually(lambda: "Normal" in (d := describe()) and "Resolved" in d.split("Events:")[-1] and d,
                     "the Normal Resolved event", timeout=60)
    assert image.rsplit("@", 1)[1] in out.split("Events:")[-1], out
    cache_obj = json.loads(kubectl("admin", "get", "gkmcache", "kernels", "-n", kube_namespace, "-o", "json").stdout)
    unavailable = [e for e in events_of(kubectl, cache_obj) if e["reason"] == "RegistryUnavailable"]
    assert len(unavailable) == 1 and unavailable[0]["count"] == 1, unavailable  # retries are no news
    assert c.proc.poll() is None
