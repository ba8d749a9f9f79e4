"""accelnode_controller_conditions: counted from the reconcilers' watched objects at scrape time."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from controller.runtime.conditions import ConditionsCollector
from controller.runtime.reconciler import Watch


class Copy:  # the part of a Reflector the collector reads
    def __init__(self, objs):
        self.objs = objs

    def snapshot(self):
        return list(self.objs)


def cache(name, *conds):
    return {"metadata": {"name": name}, "status": {"conditions": [
        {"type": t, "status": s, "reason": r} for t, s, r in conds]}}


def controller(path, objs, extra=()):
    watches = [Watch(path), *(Watch(p) for p in extra)]
    return SimpleNamespace(reconciler=SimpleNamespace(watches=watches),
                           reflectors={w.path: Copy(objs if w.path == path else [{"status": "junk"}])
                                       for w in watches})


def test_counts_by_resource_type_status_reason_once_per_kind():
    caches = [cache("a", ("Resolved", "True", "Resolved"), ("Verified", "False", "WrongKey")),
              cache("b", ("Resolved", "False", "RegistryUnavailable")),
              cache("c", ("Resolved", "True", "Resolved")),
              {"metadata": {"name": "no-status"}},
              {"metadata": {"name": "odd"}, "status": {"conditions": "not a list"}}]
    path = "/apis/gkm.io/v1alpha1/gkmcaches"
    registry = CollectorRegistry()
    # the pinning and the claims reconcilers both watch the caches first: counted once
    registry.register(ConditionsCollector([controller(path, caches, extra=["/api/v1/nodes"]),
                                           controller(path, caches),
                                           controller("/apis/apps/v1/statefulsets", [{"metadata": {"name": "s"}}])]))

    def value(t, s, r):
        return registry.get_sample_value("accelnode_controller_conditions",
                                         {"resource": "gkmcaches", "type": t, "status": s, "reason": r})
    assert value("Resolved", "True", "Resolved") == 2
    assert value("Resolved", "False", "RegistryUnavailable") == 1
    assert value("Verified", "False", "WrongKey") == 1
    samples = [s for m in registry.collect() for s in m.samples]
    assert len(samples) == 3  # nothing for the statefulsets, the junk or the second watch
