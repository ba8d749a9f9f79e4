"""Fuzz: every CRD object the controller, the agent's CSI side and the claims reconciler parse,
drawn from the CRDs' own schemas (daemonsets/crds/), so each is an object the API server could
hold: caches (GKMCache, ClusterGKMCache), their per-node reports (GKMCacheNode,
ClusterGKMCacheNode), trust policies (ClusterCacheTrustPolicy), TPU node groups (TPUNodeGroup)
and the claims a cache gets (its ``status.pvcStatus``, its PV and PVC). Each parser ends with its
answer or its own refusal; any other exception is a crash (a reconciler that raises on an object
retries it forever, a CSI call answers UNKNOWN)."""

from __future__ import annotations

import glob
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelnode.oci.errors import InvalidReference
from controller.caches import reconciler, status, volumes
from controller.caches import signatures as policies
from controller.caches import webhooks as cachehooks
from controller.nodegroups import generations
from accelnode.gce.metadata import kube_labels
from csi_driver import resolve

from .fuzzing import crd_objects, fuzz_settings, json_values, text

CRDS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "daemonsets", "crds", "*.yaml")))
caches = st.one_of(crd_objects(CRDS, "GKMCache"), crd_objects(CRDS, "ClusterGKMCache"))
policy_objects = crd_objects(CRDS, "ClusterCacheTrustPolicy")


class View:
    """The CSI driver's view of the API server, holding one object (what its informer would)."""

    def __init__(self, obj, policies=()):
        self.obj, self._policies = obj, list(policies)

    def synced(self, cache):
        return True

    def get(self, cache):
        return self.obj

    def policies(self):
        return self._policies

    def policies_stale(self):
        return None


@fuzz_settings(ci_examples=300)
@given(obj=caches)
def test_the_agent_keeps_of_a_cache_only_what_it_reads(obj):
    """Issue 33: the agent's copy of a cache object is what it reads (its image, workload
    namespaces, node selector, pin and verdict), nothing a tenant may pad (a pod template's
    affinity preserves unknown fields), and reads the same."""
    from agent.nodestatus import Cache
    from agent.reporter import _trim_cache

    kept = _trim_cache(obj)
    assert Cache.from_object(kept) == Cache.from_object(obj)
    assert set(kept["spec"]) <= {"image", "workloadNamespaces", "podTemplate"}
    assert set((kept["spec"].get("podTemplate") or {}).get("spec") or {}) <= {"nodeSelector"}


@fuzz_settings(ci_examples=300)
@given(obj=caches, policy=policy_objects, namespace=st.one_of(st.none(), text))
def test_cache_objects(obj, policy, namespace):
    cluster = obj["kind"] == "ClusterGKMCache"
    try:
        status.known_pin(obj)
    except InvalidReference:
        pass
    volumes.workload_namespaces(obj, cluster)
    volumes.CacheId.of(obj, cluster)
    reconciler.trim_cache(obj)
    try:
        cachehooks.image_of(obj), cachehooks.pin_of(obj)
    except cachehooks.BadCache:
        pass
    cachehooks.status_digest(obj), cachehooks.same_image(obj, obj)
    policies.requirement(namespace, obj["metadata"].get("labels") or {}, [policies.parse_policy(policy)])
    policies.Verdict.of(obj.get("status"))
    pod = resolve.Pod(namespace or "team", "worker-0", "uid")
    ref = resolve.CacheRef(obj["metadata"]["name"], None if cluster else (namespace or "team"))
    try:
        resolve.ApiResolver(View(obj, [policy])).image(ref, pod, {})
    except resolve.ResolveError:
        pass
    for ns, entry in ((obj.get("status") or {}).get("pvcStatus") or {}).items():  # the claims' status
        volumes.condition(entry, "True", volumes.REASON_BOUND, "bound", "2026-01-01T00:00:00Z")
    volumes.claims_status(obj.get("status") or {}, {})


@fuzz_settings(ci_examples=200)
@given(nodes=st.lists(st.one_of(crd_objects(CRDS, "GKMCacheNode"), crd_objects(CRDS, "ClusterGKMCacheNode")),
                      max_size=3), digest=st.one_of(st.none(), text))
def test_cache_node_reports(nodes, digest):
    trimmed = [reconciler.trim_node(n) for n in nodes]
    names = {name for t in trimmed for name in t["status"]["caches"]}
    for name in names:
        status.aggregate({t["metadata"].get("name", ""): t["status"]["caches"].get(name) for t in trimmed}, digest)


@fuzz_settings(ci_examples=300)
@given(policy=policy_objects, namespace=st.one_of(st.none(), text))
def test_trust_policies(policy, namespace):
    parsed = policies.parse_policy(policy)
    parsed.covers(namespace)
    assert parsed.error is None or isinstance(parsed.error, str)


@fuzz_settings(ci_examples=300)
@given(group=crd_objects(CRDS, "TPUNodeGroup"), labels=st.one_of(text, st.just("a=b,c,=d,e=")))
def test_node_groups(group, labels):
    spec = group["spec"]
    machine = (spec.get("instanceConfig") or {}).get("machineType")
    if machine:
        assert all(isinstance(m, str) for m in generations.check(machine, spec["topology"], int(spec["nodeCount"])))
    kube_labels(labels)


def core_object(phase) -> st.SearchStrategy:
    """A PV or PVC as the API server returns one, reduced to the fields the claims code reads."""
    return st.fixed_dictionaries({"metadata": st.fixed_dictionaries({"name": text}, optional={
        "namespace": text, "uid": st.uuids().map(str),
        "labels": st.dictionaries(st.one_of(st.just(volumes.KIND_LABEL), text), text, max_size=2),
        "annotations": st.dictionaries(st.one_of(st.just(volumes.CACHE_ANNOTATION), text), text, max_size=2)})},
        optional={"spec": st.fixed_dictionaries({}, optional={
            "capacity": st.dictionaries(st.just("storage"), st.one_of(text, st.sampled_from(["1Mi", "3k", "1e3"]))),
            "claimRef": st.fixed_dictionaries({}, optional={"namespace": text, "name": text, "uid": text})}),
            "status": st.fixed_dictionaries({}, optional={"phase": phase})})


@fuzz_settings(ci_examples=300)
@given(pv=st.one_of(st.none(), core_object(st.sampled_from(["Bound", "Released", "Available"]))),
       pvc=st.one_of(st.none(), core_object(st.sampled_from(["Bound", "Pending", "Lost"]))), obj=caches,
       quantity=st.one_of(text, json_values))
def test_claims(pv, pvc, obj, quantity):
    cache = volumes.CacheId.of(obj, obj["kind"] == "ClusterGKMCache")
    volumes.binding(pv, pvc)
    volumes.quantity_bytes(quantity)
    for o in (pv, pvc):
        volumes.cache_key_of(o), volumes.is_ours(o, cache)
        if o is not None:
            volumes.made_for(o)
    if pv is not None:
        volumes.pv_wants_update(pv, cache, "team", "uid", volumes.capacity_bytes((obj["metadata"].get("annotations"))))
