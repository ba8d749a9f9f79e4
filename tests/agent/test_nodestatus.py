"""The pure part of the agent's status reporter (agent/nodestatus.py, docs/agent-status.md):
caches and the node's own view in, the status of each node object out. No server, no files."""

from __future__ import annotations

import pytest

from accelnode.hw.accelerators import Accelerator
from agent.nodestatus import CLUSTER, FAILED, PULLING, Cache, Local, gpus, node_statuses, rolled_off, uses, wanted

REPO = "registry.example.com/caches/jax"
NODE = "node-1"
NOW, EARLIER = "2024-05-01T12:00:00Z", "2024-05-01T11:00:00Z"
TPU = Accelerator("tpu", "v5e", 4, "test")  # ids 0-3
H100 = Accelerator("cuda", "sm_90", 2, "test")  # ids 4-5 after the TPUs
V5E = [{"backend": "tpu", "arch": "v5e"}]
SM90 = [{"backend": "cuda", "arch": "sm_90"}]
ALL_TPUS = {"compatibleGPUs": [0, 1, 2, 3], "incompatibleGPUs": []}
NO_COUNTS = {"nodeCnt": 1, "nodeInUseCnt": 0, "nodeNotInUseCnt": 0, "nodeErrorCnt": 0,
             "podRunningCnt": 0, "podOutdatedCnt": 0, "podDeletingCnt": 0}


def sha(c: str) -> str:
    return "sha256:" + c * 64


D1, D2, D3, D4, INDEX = sha("1"), sha("2"), sha("3"), sha("4"), sha("a")


# ---------------------------------------------------------------------------------------------
# helpers


def cache(name="c1", namespace="ns", digest=D1, *, image=None, node_selector=None, prefetch=False,
          workload_namespaces=()) -> Cache:
    return Cache(namespace, name, image or f"{REPO}@{digest}", digest, dict(node_selector or {}), prefetch,
                 tuple(workload_namespaces))


def ref(pod, namespace="ns", cache_key=("ns", "c1"), volume=None) -> dict:
    return {"volume_id": volume or f"vol-{pod}", "namespace": namespace, "name": pod, "uid": f"uid-{pod}",
            "cache": cache_key}


def inst(*refs, size=1000, targets=V5E, image=None, digest=D1) -> dict:
    """One installed manifest: ``{digest: info}``, to merge into ``Local.installed``."""
    return {digest: {"image": image or f"{REPO}@{digest}", "size": size, "targets": targets, "refs": list(refs)}}


def proof(digest: str, creds: str = "tenant") -> tuple:
    """A proof as the agent keys them (registry, repository, digest, credentials key)."""
    return ("registry.example.com", "caches/jax", digest, creds)


def local(installed=None, pulling=(), failed=None, *, proven=None, prefetch_failed=None) -> Local:
    """The agent's view; by default every installed digest is proved (:func:`proof`), and
    ``pulling`` / ``failed`` (digest -> message) are the pulls of those proofs."""
    installed = dict(installed or {})
    pulls = {proof(d): (FAILED, m) for d, m in (failed or {}).items()}
    pulls.update({proof(d): (PULLING, "") for d in pulling})
    proven = {proof(i["image"].rsplit("@", 1)[1]) for i in installed.values()} if proven is None else set(proven)
    return Local(installed, set(pulling), proven, pulls, dict(prefetch_failed or {}))


def statuses(caches, view=None, *, wanted_keys=(), history=None, deleting=(), previous=None,
             accelerators=(TPU,), now=NOW, proofs=None) -> dict:
    """``proofs`` (cache key -> proof) replaces the default: each cache's digest under :func:`proof`."""
    proofs = {c.key: proof(c.digest) for c in caches if c.digest} if proofs is None else proofs
    return node_statuses(NODE, list(accelerators), list(caches), view or local(), set(wanted_keys),
                         {} if history is None else history, set(deleting), previous or {}, now, proofs)


def pod(name, namespace="ns", volume=None) -> dict:
    return {"podNamespace": namespace, "podName": name, "volumeId": volume or f"vol-{name}"}


# ---------------------------------------------------------------------------------------------
# Cache.from_object


def test_from_object_prefers_resolved_digest():
    obj = {"metadata": {"namespace": "ns", "name": "c1"}, "spec": {"image": f"{REPO}:v1@{D1}"},
           "status": {"resolvedDigest": D2}}
    c = Cache.from_object(obj)
    assert (c.key, c.image, c.digest) == (("ns", "c1"), f"{REPO}:v1@{D1}", D2)


def test_from_object_falls_back_to_digest_pinned_in_image():
    c = Cache.from_object({"metadata": {"namespace": "ns", "name": "c1"}, "spec": {"image": f"{REPO}:v1@{D1}"}})
    assert c.digest == D1


def test_from_object_tag_only_image_has_no_digest():
    c = Cache.from_object({"metadata": {"namespace": "ns", "name": "c1"}, "spec": {"image": f"{REPO}:v1"},
                           "status": {}})
    assert c.digest is None


def test_from_object_cluster_cache_fields():
    obj = {"metadata": {"name": "shared", "annotations": {"accelnode.io/prefetch": "true"}},
           "spec": {"image": f"{REPO}@{D1}", "workloadNamespaces": ["a", "b"],
                    "podTemplate": {"spec": {"nodeSelector": {"pool": "tpu"}}}}}
    assert Cache.from_object(obj) == Cache(CLUSTER, "shared", f"{REPO}@{D1}", D1, {"pool": "tpu"}, True, ("a", "b"))


@pytest.mark.parametrize("annotations, expected", [
    ({"accelnode.io/prefetch": "True"}, True),
    ({"accelnode.io/prefetch": "false"}, False),
    ({"accelnode.io/prefetch": "yes"}, False),
    ({"other": "true"}, False),
    (None, False),
])
def test_from_object_prefetch_annotation(annotations, expected):
    obj = {"metadata": {"name": "c", "annotations": annotations}, "spec": {"image": f"{REPO}@{D1}"}}
    assert Cache.from_object(obj).prefetch is expected


def test_from_object_of_an_empty_object():
    assert Cache.from_object({}) == Cache(CLUSTER, "", "", None, {}, False, ())


# ---------------------------------------------------------------------------------------------
# Cache.admits, Cache.pinned


def test_namespaced_cache_admits_only_its_namespace():
    c = cache(namespace="ns", workload_namespaces=["other"])  # ignored for a GKMCache
    assert (c.admits("ns"), c.admits("other")) == (True, False)


def test_cluster_cache_admits_its_workload_namespaces():
    c = cache(namespace=CLUSTER, workload_namespaces=["a", "b"])
    assert (c.admits("a"), c.admits("b"), c.admits("c")) == (True, True, False)


def test_cluster_cache_without_workload_namespaces_admits_any():
    assert cache(namespace=CLUSTER).admits("anything") is True


def test_pinned_replaces_tag_and_old_digest_with_current_digest():
    assert cache(image=f"{REPO}:v1@{D1}", digest=D2).pinned() == f"{REPO}@{D2}"


def test_pinned_is_none_without_digest():
    assert cache(image=f"{REPO}:v1", digest=None).pinned() is None


def test_pinned_is_none_for_an_unparseable_image():
    assert cache(image="jax:v1", digest=D1).pinned() is None  # no registry host


# ---------------------------------------------------------------------------------------------
# Local.manifest_of, wanted, uses, gpus


def test_manifest_of_installed_digest_is_itself():
    assert local(inst(digest=D1)).manifest_of(D1) == D1


def test_manifest_of_index_is_the_manifest_installed_for_it():
    view = local({**inst(digest=D2), **inst(digest=D1, image=f"{REPO}@{INDEX}")})
    assert view.manifest_of(INDEX) == D1


def test_manifest_of_missing_digest_is_none():
    assert local(inst(digest=D1)).manifest_of(D2) is None


def test_wanted_when_node_selector_matches_every_label():
    c = cache(node_selector={"pool": "tpu", "topology": "2x2"})
    assert wanted(c, {"pool": "tpu", "topology": "2x2", "extra": "x"}) is True


def test_not_wanted_when_one_selector_label_differs_even_with_prefetch():
    c = cache(node_selector={"pool": "tpu", "topology": "2x2"}, prefetch=True)
    assert wanted(c, {"pool": "tpu", "topology": "4x4"}) is False


def test_wanted_without_node_selector_is_the_prefetch_mark():
    assert (wanted(cache(prefetch=True), {}), wanted(cache(prefetch=False), {"pool": "tpu"})) == (True, False)


def test_uses_ref_naming_the_cache():
    assert uses(ref("p1", cache_key=("ns", "c1")), cache("c1", "ns")) is True


def test_uses_not_for_ref_naming_another_cache():
    # same namespace, so only the name in the reference tells them apart
    assert uses(ref("p1", cache_key=("ns", "c2")), cache("c1", "ns")) is False


def test_uses_ref_without_cache_follows_admits():
    shared = cache("shared", CLUSTER, workload_namespaces=["a"])
    assert (uses(ref("p1", "a", cache_key=None), shared), uses(ref("p1", "b", cache_key=None), shared)) == (True, False)


def test_gpus_numbers_devices_across_the_node_in_order():
    assert gpus([TPU, H100]) == [(TPU, [0, 1, 2, 3]), (H100, [4, 5])]


def test_gpus_of_a_node_without_accelerators():
    assert gpus([]) == []


# ---------------------------------------------------------------------------------------------
# node_statuses: one per-digest state each


def test_pending_when_wanted_and_not_started():
    out = statuses([cache()], wanted_keys={("ns", "c1")})
    assert out["ns"]["caches"] == {"c1": {D1: {"state": "Pending", "cacheDigest": D1, "lastUpdated": NOW}}}


def test_not_wanted_and_not_on_node_reports_nothing():
    out = statuses([cache()])
    assert "ns" not in out and out[CLUSTER]["caches"] == {}


def test_downloading():
    out = statuses([cache()], local(pulling={D1}), wanted_keys={("ns", "c1")})
    assert out["ns"]["caches"] == {"c1": {D1: {"state": "Downloading", "cacheDigest": D1, "lastUpdated": NOW}}}


def test_downloading_wins_over_an_earlier_failure():
    out = statuses([cache()], local(pulling={D1}, failed={D1: "boom"}))
    assert out["ns"]["caches"]["c1"][D1]["state"] == "Downloading"


def test_error_from_failed_pull():
    out = statuses([cache()], local(failed={D1: "pull failed: 404 manifest unknown"}), wanted_keys={("ns", "c1")})
    assert out["ns"]["caches"] == {"c1": {D1: {"state": "Error", "cacheDigest": D1,
                                               "message": "pull failed: 404 manifest unknown",
                                               "lastUpdated": NOW}}}


def test_extracted():
    out = statuses([cache()], local(inst(size=4096)))
    assert out["ns"]["caches"] == {"c1": {D1: {"state": "Extracted", "cacheDigest": D1, "volumeSize": 4096, **ALL_TPUS,
                                               "lastUpdated": NOW}}}


def test_installed_takes_precedence_over_pulling_and_failed():
    out = statuses([cache()], local(inst(), pulling={D1}, failed={D1: "old"}), wanted_keys={("ns", "c1")})
    assert out["ns"]["caches"]["c1"][D1]["state"] == "Extracted"


def test_accelerator_neutral_image_fits_every_device():
    out = statuses([cache()], local(inst(targets=[])), accelerators=[TPU, H100])
    entry = out["ns"]["caches"]["c1"][D1]
    assert (entry["state"], entry["compatibleGPUs"], entry["incompatibleGPUs"]) == ("Extracted", [0, 1, 2, 3, 4, 5], [])


def test_extracted_on_a_mixed_node_lists_which_devices_fit():
    out = statuses([cache()], local(inst(targets=SM90)), accelerators=[TPU, H100])
    entry = out["ns"]["caches"]["c1"][D1]
    assert (entry["state"], entry["compatibleGPUs"], entry["incompatibleGPUs"]) == ("Extracted", [4, 5], [0, 1, 2, 3])


def test_installed_through_an_index_is_keyed_by_the_manifest():
    out = statuses([cache(digest=INDEX)], local(inst(digest=D1, image=f"{REPO}@{INDEX}")))
    assert list(out["ns"]["caches"]["c1"]) == [D1]
    assert out["ns"]["caches"]["c1"][D1]["cacheDigest"] == INDEX  # what the controller compares with its pin


def test_running_lists_its_pods_sorted():
    view = local(inst(ref("p2", volume="v1"), ref("p1", volume="v9"), ref("p1", volume="v2")))
    out = statuses([cache()], view)
    assert out["ns"]["caches"] == {"c1": {D1: {
        "state": "Running", "cacheDigest": D1, "volumeSize": 1000, **ALL_TPUS,
        "pods": [pod("p1", volume="v2"), pod("p1", volume="v9"), pod("p2", volume="v1")], "lastUpdated": NOW}}}


def test_error_from_incompatible_content():
    out = statuses([cache()], local(inst(targets=SM90, size=77)))
    assert out["ns"]["caches"] == {"c1": {D1: {
        "state": "Error", "cacheDigest": D1, "volumeSize": 77, "compatibleGPUs": [], "incompatibleGPUs": [0, 1, 2, 3],
        "message": "incompatible: built for cuda/sm_90; this node has tpu/v5e x4", "lastUpdated": NOW}}}


def test_incompatible_content_in_use_stays_error_with_its_pods():
    out = statuses([cache()], local(inst(ref("p1"), targets=SM90)))
    entry = out["ns"]["caches"]["c1"][D1]
    assert (entry["state"], entry["pods"]) == ("Error", [pod("p1")])
    assert out["ns"]["counts"] == {**NO_COUNTS, "nodeErrorCnt": 1}  # an Error entry is not "in use"


def test_outdated_when_the_cache_moved_on_and_a_pod_holds_the_old_digest():
    history = {("ns", "c1"): {D1}}
    view = local({**inst(ref("p1"), digest=D1, size=10), **inst(digest=D2, size=20)})
    out = statuses([cache(digest=D2)], view, history=history)
    assert out["ns"]["caches"] == {"c1": {
        D2: {"state": "Extracted", "cacheDigest": D2, "volumeSize": 20, **ALL_TPUS, "lastUpdated": NOW},
        D1: {"state": "Outdated", "pods": [pod("p1")], "volumeSize": 10, "lastUpdated": NOW}}}
    assert history == {("ns", "c1"): {D1, D2}}


def test_deleting_when_the_cache_is_gone_and_a_pod_holds_it():
    history = {("ns", "gone"): {D1}}
    out = statuses([], local(inst(ref("p1", cache_key=("ns", "gone")), size=10)), history=history)
    assert out["ns"]["caches"] == {"gone": {D1: {"state": "Deleting", "pods": [pod("p1")], "volumeSize": 10,
                                                 "lastUpdated": NOW}}}
    assert history == {("ns", "gone"): {D1}}


def test_old_digest_nobody_holds_is_dropped_from_history():
    history = {("ns", "c1"): {D1}}
    out = statuses([cache(digest=D2)], local({**inst(digest=D1), **inst(digest=D2)}), history=history)
    assert list(out["ns"]["caches"]["c1"]) == [D2]
    assert history == {("ns", "c1"): {D2}}


def test_deleted_cache_nobody_holds_leaves_history_and_status():
    history = {("ns", "gone"): {D1, D2}}
    out = statuses([], local(inst(digest=D1)), history=history)  # D1 unused, D2 no longer on the node
    assert history == {}
    assert out == {CLUSTER: {"nodeName": NODE, "gpus": [{"gpuType": "tpu/v5e", "ids": [0, 1, 2, 3]}],
                             "counts": NO_COUNTS, "caches": {}}}


def test_history_records_every_reported_key():
    history = {}
    statuses([cache("c1"), cache("c2", digest=D2)], local(pulling={D2}), wanted_keys={("ns", "c1")}, history=history)
    assert history == {("ns", "c1"): {D1}, ("ns", "c2"): {D2}}


def test_cache_without_digest_reports_nothing():
    history = {}
    out = statuses([cache(image=f"{REPO}:v1", digest=None)], local(inst()), wanted_keys={("ns", "c1")},
                   history=history)
    assert (set(out), out[CLUSTER]["caches"], history) == ({CLUSTER}, {}, {})


# ---------------------------------------------------------------------------------------------
# node_statuses: objects, uses, counts, lastUpdated


def test_node_object_fields():
    unknown = Accelerator("cuda", None, 1, "pci 10de:ffff")
    out = statuses([], accelerators=[TPU, unknown])
    assert out == {CLUSTER: {"nodeName": NODE, "counts": NO_COUNTS, "caches": {},
                             "gpus": [{"gpuType": "tpu/v5e", "ids": [0, 1, 2, 3]},
                                      {"gpuType": "cuda/unknown", "ids": [4]}]}}


def test_namespaced_cache_under_its_namespace_cluster_cache_under_cluster_key():
    out = statuses([cache("c1", "team-a", D1), cache("shared", CLUSTER, D2)], local(pulling={D1, D2}))
    assert set(out) == {CLUSTER, "team-a"}
    assert out["team-a"]["caches"] == {"c1": {D1: {"state": "Downloading", "cacheDigest": D1, "lastUpdated": NOW}}}
    assert out[CLUSTER]["caches"] == {"shared": {D2: {"state": "Downloading", "cacheDigest": D2, "lastUpdated": NOW}}}


def test_ref_without_cache_counts_for_every_cache_of_the_digest_admitting_the_pod():
    view = local(inst(ref("p1", "ns", cache_key=None), ref("p2", "other", cache_key=None)))
    caches = [cache("c1", "ns"), cache("limited", CLUSTER, workload_namespaces=["ns"]), cache("open", CLUSTER)]
    out = statuses(caches, view)
    assert out["ns"]["caches"]["c1"][D1]["pods"] == [pod("p1")]
    assert out[CLUSTER]["caches"]["limited"][D1]["pods"] == [pod("p1")]
    assert out[CLUSTER]["caches"]["open"][D1]["pods"] == [pod("p1"), pod("p2", "other")]


def test_ref_naming_another_cache_is_not_a_use():
    view = local(inst(ref("p1", "ns", cache_key=(CLUSTER, "shared"))))
    out = statuses([cache("c1", "ns"), cache("shared", CLUSTER)], view)
    assert out["ns"]["caches"]["c1"][D1]["state"] == "Extracted"
    assert "pods" not in out["ns"]["caches"]["c1"][D1]
    assert out[CLUSTER]["caches"]["shared"][D1]["pods"] == [pod("p1")]


def test_counts_of_an_object_with_only_extracted_entries():
    out = statuses([cache()], local(inst()))
    assert out["ns"]["counts"] == {**NO_COUNTS, "nodeNotInUseCnt": 1}


def test_counts_with_every_state():
    history = {("ns", "c1"): {D1}, ("ns", "gone"): {D3}}
    view = local({
        **inst(ref("p3"), digest=D1),  # c1's old digest: Outdated
        **inst(ref("p1", volume="a"), ref("p1", volume="b"), ref("p2"), digest=D2),  # c1's current: Running
        **inst(ref("p4", cache_key=("ns", "gone")), digest=D3),  # gone: Deleting
    }, failed={D4: "boom"})  # c3: Error
    deleting = {("ns", "p2"), ("ns", "p4"), ("other", "unrelated")}
    out = statuses([cache("c1", digest=D2), cache("c3", digest=D4)], view, history=history, deleting=deleting)
    assert {n: {k: e["state"] for k, e in d.items()} for n, d in out["ns"]["caches"].items()} == {
        "c1": {D2: "Running", D1: "Outdated"}, "gone": {D3: "Deleting"}, "c3": {D4: "Error"}}
    assert out["ns"]["counts"] == {"nodeCnt": 1, "nodeInUseCnt": 1, "nodeNotInUseCnt": 0, "nodeErrorCnt": 1,
                                   "podRunningCnt": 2, "podOutdatedCnt": 1, "podDeletingCnt": 2}


def test_counts_are_per_object():
    view = local(inst(ref("p1", cache_key=(CLUSTER, "shared"))))
    out = statuses([cache("c1", "ns"), cache("shared", CLUSTER)], view, deleting={("ns", "p1")})
    assert out["ns"]["counts"] == {**NO_COUNTS, "nodeNotInUseCnt": 1}
    assert out[CLUSTER]["counts"] == {**NO_COUNTS, "nodeInUseCnt": 1, "podRunningCnt": 1, "podDeletingCnt": 1}


def test_last_updated_kept_when_the_entry_did_not_change():
    first = statuses([cache()], local(inst(ref("p1"))), now=EARLIER)
    again = statuses([cache()], local(inst(ref("p1"))), previous=first)
    assert again["ns"]["caches"]["c1"][D1]["lastUpdated"] == EARLIER
    assert again == first


def test_last_updated_is_now_when_the_entry_changed():
    first = statuses([cache()], local(inst(ref("p1"))), now=EARLIER)
    again = statuses([cache()], local(inst(ref("p1"), ref("p2"))), previous=first)
    assert again["ns"]["caches"]["c1"][D1]["lastUpdated"] == NOW


def test_last_updated_is_now_when_the_previous_entry_had_no_stamp():
    previous = {"ns": {"caches": {"c1": {D1: {"state": "Pending", "cacheDigest": D1}}}}}
    out = statuses([cache()], wanted_keys={("ns", "c1")}, previous=previous)
    assert out["ns"]["caches"]["c1"][D1] == {"state": "Pending", "cacheDigest": D1, "lastUpdated": NOW}


def test_last_updated_is_per_entry():
    previous = {"ns": {"caches": {"c1": {D1: {"state": "Pending", "cacheDigest": D1, "lastUpdated": EARLIER}},
                                  "c2": {D2: {"state": "Pending", "cacheDigest": D2, "lastUpdated": EARLIER}}}}}
    out = statuses([cache("c1"), cache("c2", digest=D2)], local(pulling={D2}), wanted_keys={("ns", "c1"), ("ns", "c2")},
                   previous=previous)
    assert out["ns"]["caches"] == {"c1": {D1: {"state": "Pending", "cacheDigest": D1, "lastUpdated": EARLIER}},
                                   "c2": {D2: {"state": "Downloading", "cacheDigest": D2, "lastUpdated": NOW}}}


def test_namespace_with_nothing_left_stays_listed_empty():
    first = statuses([cache("c1", "team-a")], local(inst()), now=EARLIER)
    out = statuses([], previous=first)
    assert out["team-a"] == {"nodeName": NODE, "gpus": [{"gpuType": "tpu/v5e", "ids": [0, 1, 2, 3]}],
                             "counts": NO_COUNTS, "caches": {}}


# ---------------------------------------------------------------------------------------------
# rolled_off: what a roll leaves behind


def test_rolled_off_is_an_unheld_digest_no_cache_names_any_more():
    view = local({**inst(digest=D1), **inst(digest=D2)})
    assert rolled_off(view, [cache(digest=D2)], seen={D1, D2}) == {D1}


def test_rolled_off_keeps_a_digest_a_pod_still_holds():
    view = local({**inst(ref("p0"), digest=D1), **inst(digest=D2)})
    assert rolled_off(view, [cache(digest=D2)], seen={D1, D2}) == set()


def test_rolled_off_keeps_what_no_cache_ever_named():
    """Pulled for a pod's own image attribute or by the operator: not the roll's to remove."""
    view = local({**inst(digest=D1), **inst(digest=D2)})
    assert rolled_off(view, [cache(digest=D2)], seen={D2}) == set()


def test_rolled_off_keeps_a_digest_another_cache_still_names():
    view = local({**inst(digest=D1), **inst(digest=D2)})
    caches = [cache("c1", digest=D2), cache("c2", namespace="other", digest=D1)]
    assert rolled_off(view, caches, seen={D1, D2}) == set()


def test_rolled_off_keeps_the_manifest_a_current_index_resolved_to():
    view = local(inst(image=f"{REPO}@{INDEX}", digest=D1))
    assert rolled_off(view, [cache(digest=INDEX)], seen={D1}) == set()


def test_rolled_off_of_a_deleted_cache_and_never_while_pulling():
    view = local({**inst(digest=D1), **inst(digest=D3)}, pulling={D3})
    assert rolled_off(view, [], seen={D1, D3}) == {D1}


# ---------------------------------------------------------------------------------------------
# what a cache's status may show: only what was proved for that cache


def test_a_digest_proved_for_another_cache_is_not_reported():
    """Tenant A's digest is installed and proved for A's credentials; tenant B's cache names it
    too: B's status shows nothing of it (no state, no size), A's shows it Extracted."""
    caches = [cache("a", "team-a"), cache("b", "team-b")]
    out = statuses(caches, local(inst(size=4096)), proofs={("team-a", "a"): proof(D1), ("team-b", "b"): proof(D1, "b")})
    assert out["team-a"]["caches"]["a"][D1]["volumeSize"] == 4096
    assert "team-b" not in out


def test_another_caches_pull_and_its_error_are_not_reported():
    caches = [cache("a", "team-a"), cache("b", "team-b")]
    view = local(failed={D1: "team-a's registry said: 401 for caches/private"})
    out = statuses(caches, view, proofs={("team-a", "a"): proof(D1), ("team-b", "b"): proof(D1, "b")},
                   wanted_keys={("team-b", "b")})
    assert out["team-a"]["caches"]["a"][D1]["state"] == "Error"
    assert out["team-b"]["caches"] == {"b": {D1: {"state": "Pending", "cacheDigest": D1, "lastUpdated": NOW}}}
    view = local(pulling={D1})
    out = statuses(caches, view, proofs={("team-a", "a"): proof(D1), ("team-b", "b"): proof(D1, "b")})
    assert "team-b" not in out and out["team-a"]["caches"]["a"][D1]["state"] == "Downloading"


def test_a_volume_naming_the_cache_proves_it_and_a_prefetch_failure_is_its_own():
    """After a restart the agent holds no proofs: a volume that names the cache was handed the
    digest after a proof, so it still counts; a prefetch failure shows for its cache only."""
    caches = [cache("a", "team-a"), cache("b", "team-b", digest=D2)]
    view = local(inst(ref("p1", "team-a", cache_key=("team-a", "a"))), proven=(),
                 prefetch_failed={("team-b", "b"): (D2, "denied (pulled with no credentials)")})
    out = statuses(caches, view, proofs={})
    assert out["team-a"]["caches"]["a"][D1]["state"] == "Running"
    assert out["team-b"]["caches"] == {"b": {D2: {"state": "Error", "cacheDigest": D2,
                                                  "message": "denied (pulled with no credentials)",
                                                  "lastUpdated": NOW}}}
    assert statuses([cache("a", "team-a")], local(inst(), proven=()), proofs={}) == statuses([], local())


@pytest.mark.parametrize("image, resolved, expected", [
    (f"{REPO}@{D1}", None, None),  # a digest only spec.image names: the controller has not pinned it
    (f"{REPO}:v1", None, None),  # a tag
    (f"{REPO}:v1", D1, f"{REPO}@{D1}"),
    (f"{REPO}@{D1}", D1, f"{REPO}@{D1}"),
    (f"{REPO}@{D2}", D1, None),  # the pin lags the spec
])
def test_only_the_controllers_pin_is_prefetchable(image, resolved, expected):
    obj = {"metadata": {"namespace": "ns", "name": "c1"}, "spec": {"image": image},
           "status": {"resolvedDigest": resolved} if resolved else {}}
    assert Cache.from_object(obj).prefetchable() == expected
