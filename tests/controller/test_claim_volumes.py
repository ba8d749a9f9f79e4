"""The claims reconciler's pure parts (controller/caches/volumes.py): the names, the PV and PVC it
makes (the shared contract, and what the CSI driver reads), capacities, and the status entries."""

from __future__ import annotations

import hashlib

import pytest

from controller.caches import volumes as co
from controller.caches.pinning import SIZE_ANNOTATION
from csi_driver import resolve

NS_CACHE = co.CacheId(False, "team-a", "kernels", "uid-1")
CL_CACHE = co.CacheId(True, None, "shared", "uid-2")
NOW, EARLIER = "2030-01-01T00:00:10Z", "2030-01-01T00:00:00Z"


def test_names_follow_the_contract():
    assert co.pv_name(NS_CACHE, "team-a") == \
        "gkmcache-" + hashlib.sha256(b"team-a/kernels/team-a").hexdigest()[:16]
    assert co.pv_name(CL_CACHE, "team-b") == "gkmcache-" + hashlib.sha256(b"/shared/team-b").hexdigest()[:16]
    assert co.volume_handle(NS_CACHE, "team-a") == "gkmcache:team-a/kernels:team-a"
    assert co.volume_handle(CL_CACHE, "team-b") == "gkmcache:shared:team-b"
    assert (NS_CACHE.key, CL_CACHE.key) == ("team-a/kernels", "shared")
    # one cache name, one namespace, two kinds: two volumes
    assert co.pv_name(co.CacheId(True, None, "kernels"), "team-a") != co.pv_name(NS_CACHE, "team-a")


def test_volume_attributes_are_what_the_csi_driver_reads():
    assert (co.CACHE_ATTRIBUTE, co.NAMESPACE_ATTRIBUTE) == (resolve.CACHE_KEY, resolve.NAMESPACE_KEY)
    assert co.volume_attributes(NS_CACHE) == {resolve.CACHE_KEY: "kernels", resolve.NAMESPACE_KEY: "team-a"}
    assert co.volume_attributes(CL_CACHE) == {resolve.CACHE_KEY: "shared"}
    # and the driver resolves them to the cache they name
    assert resolve.cache_ref(co.volume_attributes(NS_CACHE)) == resolve.CacheRef("kernels", "team-a")
    assert resolve.cache_ref(co.volume_attributes(CL_CACHE)) == resolve.CacheRef("shared", None)


def test_the_pv_is_a_read_only_csi_volume_pre_bound_to_the_claim():
    pv = co.pv_body(NS_CACHE, "team-a", "pvc-uid", 3000)
    spec = pv["spec"]
    assert pv["metadata"]["name"] == co.pv_name(NS_CACHE, "team-a")
    assert spec["csi"] == {"driver": "csi.gkm.io", "volumeHandle": "gkmcache:team-a/kernels:team-a",
                           "volumeAttributes": {resolve.CACHE_KEY: "kernels", resolve.NAMESPACE_KEY: "team-a"}}
    assert spec["accessModes"] == ["ReadOnlyMany"]
    assert spec["storageClassName"] == ""
    assert spec["persistentVolumeReclaimPolicy"] == "Retain"
    assert spec["claimRef"] == {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": "team-a",
                                "name": "kernels", "uid": "pvc-uid"}
    assert spec["capacity"] == {"storage": "3000"}
    # a namespaced cache cannot own a cluster-scoped volume; a ClusterGKMCache can
    assert "ownerReferences" not in pv["metadata"]
    owners = co.pv_body(CL_CACHE, "team-b", "u", 1)["metadata"]["ownerReferences"]
    assert owners == [{"apiVersion": "gkm.io/v1alpha1", "kind": "ClusterGKMCache", "name": "shared", "uid": "uid-2"}]
    assert pv["metadata"]["labels"] == {co.KIND_LABEL: "GKMCache", co.NAME_LABEL: "kernels",
                                        co.NAMESPACE_LABEL: "team-a", co.WORKLOAD_LABEL: "team-a"}
    assert pv["metadata"]["annotations"] == {co.CACHE_ANNOTATION: "team-a/kernels"}


def test_the_claim_names_its_volume_and_is_owned_by_the_cache():
    pvc = co.pvc_body(CL_CACHE, "team-b", 5 << 30)
    assert (pvc["metadata"]["name"], pvc["metadata"]["namespace"]) == ("shared", "team-b")
    assert pvc["spec"]["volumeName"] == co.pv_name(CL_CACHE, "team-b")
    assert pvc["spec"]["storageClassName"] == ""
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pvc["spec"]["resources"] == {"requests": {"storage": str(1 << 20)}}  # at most 1Mi
    assert co.pvc_body(CL_CACHE, "team-b", 3000)["spec"]["resources"]["requests"]["storage"] == "3000"
    assert pvc["metadata"]["ownerReferences"][0]["kind"] == "ClusterGKMCache"
    assert pvc["metadata"]["labels"] == {co.KIND_LABEL: "ClusterGKMCache", co.NAME_LABEL: "shared"}
    assert co.pvc_body(NS_CACHE, "team-a", 1)["metadata"]["ownerReferences"] == [
        {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "name": "kernels", "uid": "uid-1"}]


def test_a_long_cache_name_is_carried_by_the_annotation_only():
    long = co.CacheId(True, None, "k" * 100)
    body = co.pvc_body(long, "ns", 1)
    assert co.NAME_LABEL not in body["metadata"]["labels"]
    assert co.cache_key_of(body) == "k" * 100
    assert co.is_ours(body, long)


def test_ours_means_this_kind_and_this_cache():
    body = co.pvc_body(NS_CACHE, "team-a", 1)
    assert co.is_ours(body, NS_CACHE)
    assert not co.is_ours(body, co.CacheId(True, None, "kernels"))  # a ClusterGKMCache of that name
    assert not co.is_ours(body, co.CacheId(False, "team-b", "kernels"))
    assert not co.is_ours({"metadata": {"name": "kernels", "namespace": "team-a"}}, NS_CACHE)  # a user's
    assert not co.is_ours(None, NS_CACHE)
    assert co.made_for(body) == "GKMCache team-a/kernels"
    assert co.made_for({"metadata": {}}) is None


def test_workload_namespaces():
    assert co.workload_namespaces({"metadata": {"name": "c", "namespace": "a"},
                                   "spec": {"workloadNamespaces": ["x"]}}, cluster=False) == ["a"]
    assert co.workload_namespaces({"metadata": {"name": "c"}, "spec": {"workloadNamespaces": ["b", "a", "b"]}},
                                  cluster=True) == ["a", "b"]
    assert co.workload_namespaces({"metadata": {"name": "c"}, "spec": {}}, cluster=True) == []


@pytest.mark.parametrize("raw, want", [("3000", 3000), ("0", co.PLACEHOLDER_BYTES), ("", co.PLACEHOLDER_BYTES),
                                       ("-5", co.PLACEHOLDER_BYTES), ("12abc", co.PLACEHOLDER_BYTES)])
def test_capacity_comes_from_the_size_annotation(raw, want):
    assert co.capacity_bytes({SIZE_ANNOTATION: raw}) == want
    assert co.capacity_bytes({}) == co.PLACEHOLDER_BYTES


@pytest.mark.parametrize("quantity, want", [("3k", 3000), ("1Mi", 1 << 20), ("1048576", 1 << 20), ("5Gi", 5 << 30),
                                            ("1e3", 1000), ("1.5Ki", 1536), ("0.5", 1), ("", None), ("1Q", None),
                                            (None, None)])
def test_quantities_are_compared_by_value(quantity, want):
    assert co.quantity_bytes(quantity) == want


def stored_pv(capacity="3k", uid="pvc-uid"):
    """A PV as the API server returns it: canonical quantity, claimRef completed by the binder."""
    pv = co.pv_body(NS_CACHE, "team-a", uid, 3000)
    pv["spec"]["capacity"] = {"storage": capacity}
    pv["spec"]["claimRef"]["resourceVersion"] = "17"
    pv["metadata"]["resourceVersion"] = "20"
    pv["status"] = {"phase": "Bound"}
    return pv


def test_a_pv_as_wanted_needs_no_update():
    assert co.pv_wants_update(stored_pv(), NS_CACHE, "team-a", "pvc-uid", 3000) is None


def test_a_pv_follows_the_size_and_a_new_claim():
    grown = co.pv_wants_update(stored_pv(), NS_CACHE, "team-a", "pvc-uid", 5000)
    assert grown["spec"]["capacity"] == {"storage": "5000"}
    assert grown["metadata"]["resourceVersion"] == "20"  # the update carries what was read
    rebound = co.pv_wants_update(stored_pv(), NS_CACHE, "team-a", "new-uid", 3000)
    assert rebound["spec"]["claimRef"] == co.claim_ref(NS_CACHE, "team-a", "new-uid")  # no stale resourceVersion
    assert rebound["spec"]["csi"] == stored_pv()["spec"]["csi"]


def test_entries_and_their_transitions():
    bound = co.entry(None, NS_CACHE, "team-a", co.REASON_BOUND, "bound", EARLIER)
    assert bound == {"pvName": co.pv_name(NS_CACHE, "team-a"), "pvcName": "kernels", "pvcOwner": "Operator",
                     "conditions": [{"type": "Bound", "status": "True", "reason": "Bound", "message": "bound",
                                     "lastTransitionTime": EARLIER}]}
    # the same reason later: the transition time stays (no write from the clock alone)
    assert co.entry(bound, NS_CACHE, "team-a", co.REASON_BOUND, "bound", NOW) == bound
    deleting = co.entry(bound, NS_CACHE, "team-a", co.REASON_DELETING, "going", NOW)
    assert deleting["conditions"][0] == {"type": "Bound", "status": "False", "reason": "Deleting",
                                          "message": "going", "lastTransitionTime": NOW}


def test_binding_reads_both_phases():
    pv, pvc = stored_pv(), {"metadata": {"name": "kernels", "namespace": "team-a"}, "status": {"phase": "Bound"}}
    assert co.binding(pv, pvc)[0] == co.REASON_BOUND
    reason, message = co.binding({**pv, "status": {"phase": "Available"}}, {**pvc, "status": {"phase": "Pending"}})
    assert reason == co.REASON_PENDING and "Pending" in message and "Available" in message


def test_the_claims_status_keeps_everything_else():
    old = {"resolvedDigest": "sha256:" + "1" * 64, "counts": {"nodeCnt": 2},
           "conditions": [{"type": "Ready"}], "lastUpdated": EARLIER,
           "pvcStatus": {"gone": {"pvName": "x"}}, "pvcOwner": "Operator"}
    e = {"team-a": co.entry(None, NS_CACHE, "team-a", co.REASON_BOUND, "bound", NOW)}
    new = co.claims_status(old, e)
    assert new == {**old, "pvcStatus": e, "pvcOwner": "Operator"}
    cleared = co.claims_status(old, {})
    assert "pvcStatus" not in cleared and "pvcOwner" not in cleared
    assert cleared["resolvedDigest"] == old["resolvedDigest"] and cleared["lastUpdated"] == EARLIER


def test_the_claim_example_names_what_the_controller_makes():
    from tests.conftest import ROOT

    text = (ROOT / "examples/pod-claim-cache.yaml").read_text()
    assert co.pv_name(co.CacheId(False, "tpu-inference", "jax-kernels-v5e"), "tpu-inference") in text
    assert "claimName: jax-kernels-v5e" in text
