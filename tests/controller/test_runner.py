"""The reconciler core (controller/runtime/runner.py): watch-driven and periodic reconciles against the real
kube-apiserver, results and backoff, clean shutdown, and writes only on change."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry

from accelnode.kube.client import Client, KubeError, custom_path
from controller.runtime.runner import Controller, Metrics
from controller.runtime.queue import Backoff
from controller.runtime.reconciler import Reconciler, Result, Watch, object_key, split_key
from controller.runtime.writes import update_if_changed, update_status
from tests.agent.conftest import eventually

COUNT = "test.accelnode.io/configmaps"

OURS = "accelnode-test=counted"


class ConfigMapCounter(Reconciler):
    """Counts the ConfigMaps of one namespace into an annotation of its ``summary`` ConfigMap,
    writing only when the count changed."""

    name = "configmap-counter"

    def __init__(self, client: Client, namespace: str):
        self.client = client
        self.path = f"/api/v1/namespaces/{namespace}/configmaps"
        # only the test's own ConfigMaps: kube-controller-manager adds kube-root-ca.crt to every namespace
        self.watches = [Watch(self.path, query={"labelSelector": OURS}, keys=lambda obj: [f"{namespace}/summary"])]
        self.writes = 0
        self.calls = 0

    def reconcile(self, key):
        self.calls += 1
        summary = self.cache.get(self.path, key)
        if summary is None:
            return None
        n = sum(1 for o in self.cache.list(self.path) if o["metadata"]["name"] != "summary")

        def count(obj):
            obj["metadata"].setdefault("annotations", {})[COUNT] = str(n)

        if update_if_changed(self.client, f"{self.path}/{split_key(key)[1]}", summary, count) is not None:
            self.writes += 1
        return None


def sample(registry, name, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def make_cm(admin, ns, name):
    admin.request("POST", f"/api/v1/namespaces/{ns}/configmaps",
                  body={"metadata": {"name": name, "labels": {"accelnode-test": "counted"}}, "data": {}})


def test_watch_driven_reconcile_writes_only_when_something_changed(admin, kube_namespace):
    ns = kube_namespace
    for name in ("summary", "a", "b", "c"):
        make_cm(admin, ns, name)
    registry = CollectorRegistry()
    rec = ConfigMapCounter(admin, ns)
    ctl = Controller(admin, rec, Metrics(registry), workers=3, resync=0.2).start()
    summary_path = f"/api/v1/namespaces/{ns}/configmaps/summary"

    def count():
        return (admin.request("GET", summary_path)["metadata"].get("annotations") or {}).get(COUNT)

    try:
        assert eventually(lambda: count() == "3"), count()
        rv = admin.request("GET", summary_path)["metadata"]["resourceVersion"]
        writes = rec.writes
        # steady state: many resyncs reconcile the key, none writes
        base = sample(registry, "accelnode_controller_reconciles_total", reconciler=rec.name, result="success")
        assert eventually(lambda: sample(registry, "accelnode_controller_reconciles_total", reconciler=rec.name,
                                         result="success") >= base + 10)
        assert admin.request("GET", summary_path)["metadata"]["resourceVersion"] == rv
        assert rec.writes == writes
        # a change in the world: one more ConfigMap, one more write; a deletion likewise
        make_cm(admin, ns, "d")
        assert eventually(lambda: count() == "4"), count()
        admin.request("DELETE", f"/api/v1/namespaces/{ns}/configmaps/a")
        assert eventually(lambda: count() == "3"), count()
        assert sample(registry, "accelnode_controller_reconcile_seconds_count", reconciler=rec.name) >= 10
        assert sample(registry, "accelnode_controller_queue_depth", reconciler=rec.name) >= 0
    finally:
        ctl.stop()


def test_update_status_writes_only_a_different_status(admin, crds, kube_namespace):
    path = custom_path("gkm.io", "v1alpha1", "gkmcaches", kube_namespace)
    obj = admin.request("POST", path, body={
        "apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": "c"},
        "spec": {"image": "quay.io/gkm/cache-examples:vector-add-cache-rocm-v2"}})
    path += "/c"
    written = update_status(admin, path, obj, {"pvcOwner": "Operator"})
    assert written is not None and written["status"] == {"pvcOwner": "Operator"}
    again = admin.request("GET", path)
    assert update_status(admin, path, again, {"pvcOwner": "Operator"}) is None
    assert admin.request("GET", path)["metadata"]["resourceVersion"] == again["metadata"]["resourceVersion"]
    with pytest.raises(KubeError) as err:  # a stale read never overwrites a newer object
        update_status(admin, path, obj, {"pvcOwner": "Agent"})
    assert err.value.code == 409


class Scripted(Reconciler):
    """Answers each call for a key with the next scripted outcome (an exception is raised)."""

    name = "scripted"

    def __init__(self, script):
        self.script = list(script)
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def reconcile(self, key):
        with self.lock:
            self.calls.append(key)
            step = self.script.pop(0) if self.script else None
        if isinstance(step, Exception):
            raise step
        return step


def test_errors_retry_with_backoff_and_success_resets_it():
    registry = CollectorRegistry()
    rec = Scripted([RuntimeError("one"), RuntimeError("two"), RuntimeError("three"), None])
    ctl = Controller(None, rec, Metrics(registry), workers=2, backoff=Backoff(base=0.01, cap=0.05, jitter=0.0))
    ctl.start()
    try:
        ctl.enqueue("ns/k")
        assert eventually(lambda: len(rec.calls) == 4), rec.calls
        assert eventually(lambda: sample(registry, "accelnode_controller_reconciles_total", reconciler="scripted",
                                         result="success") == 1)
        assert sample(registry, "accelnode_controller_reconciles_total", reconciler="scripted", result="error") == 3
        assert ctl.queue.backoff.failures("ns/k") == 0  # the success reset it
    finally:
        ctl.stop()


def test_requeue_after_and_requeue_come_back():
    registry = CollectorRegistry()
    rec = Scripted([Result(requeue_after=0.01), Result(requeue=True), Result(requeue_after=0.01), Result()])
    ctl = Controller(None, rec, Metrics(registry), backoff=Backoff(base=0.01, cap=0.05, jitter=0.0)).start()
    try:
        ctl.enqueue("k")
        assert eventually(lambda: len(rec.calls) == 4), rec.calls
        outcome = {r: sample(registry, "accelnode_controller_reconciles_total", reconciler="scripted", result=r)
                   for r in ("requeue_after", "requeue", "success", "error")}
        assert eventually(lambda: sample(registry, "accelnode_controller_reconciles_total", reconciler="scripted",
                                         result="success") == 1)
        assert outcome["requeue_after"] == 2 and outcome["requeue"] == 1 and outcome["error"] == 0
        assert ctl.queue.backoff.failures("k") == 0
    finally:
        ctl.stop()


def test_stop_waits_for_the_reconcile_in_hand_and_starts_no_other():
    entered, release = threading.Event(), threading.Event()
    calls = []

    class Slow(Reconciler):
        name = "slow"

        def reconcile(self, key):
            calls.append(key)
            entered.set()
            release.wait(30)

    ctl = Controller(None, Slow(), Metrics(CollectorRegistry()), workers=1).start()
    ctl.enqueue("a")
    assert entered.wait(30)
    ctl.enqueue("b")
    stopper = threading.Thread(target=ctl.stop)
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # still waiting for "a"
    release.set()
    stopper.join(30)
    assert not stopper.is_alive()
    assert calls == ["a"]


def test_keys():
    assert object_key({"metadata": {"namespace": "ns", "name": "n"}}) == "ns/n"
    assert object_key({"metadata": {"name": "node-1"}}) == "node-1"
    assert split_key("ns/n") == ("ns", "n") and split_key("node-1") == (None, "node-1")
    assert list(Watch("/api/v1/pods").keys({"metadata": {"namespace": "ns", "name": "p"}})) == ["ns/p"]


def test_a_reconciler_needs_a_name():
    with pytest.raises(ValueError):
        Controller(None, Reconciler(), Metrics(CollectorRegistry()))
