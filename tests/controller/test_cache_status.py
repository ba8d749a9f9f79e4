"""The cache reconciler's pure parts (controller/caches/status.py, controller/caches.Mentions):
which pin a cache has without asking a registry, the annotations that mirror it, the sum of the
agents' per-node entries and the condition that summarises it."""

from __future__ import annotations

import pytest

from accelnode.oci import errors
from accelnode.oci.refusal import Verdict
from controller.caches import status as cs
from controller.caches.reconciler import Mentions, trim_node
from controller.caches.pinning import DIGEST_ANNOTATION, SIZE_ANNOTATION, Pin

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
IMAGE = "quay.io/gkm/cache:v1"
NOW, EARLIER = "2030-01-01T00:00:10Z", "2030-01-01T00:00:00Z"


def cache(image=IMAGE, *, status=None, annotations=None, generation=1):
    return {"metadata": {"name": "c", "namespace": "ns", "generation": generation,
                         "annotations": dict(annotations or {})},
            "spec": {"image": image}, "status": status or {}}


def resolved_status(image, digest):
    return {"resolvedDigest": digest, "resolvedImage": image,
            "conditions": [{"type": "Resolved", "status": "True", "reason": "Resolved",
                            "message": cs.pinned_message(image, digest), "lastTransitionTime": EARLIER}]}


# -- the pin ----------------------------------------------------------------------------------


def test_a_digest_in_the_image_is_pinned_once_the_registry_agreed():
    # naming a digest is no proof that the repository holds it: the registry is asked
    assert cs.known_pin(cache(f"quay.io/gkm/cache:v1@{D1}")) is None
    # the registry's answer, at admission (the annotation) or at a reconcile (status), stands
    pinned = cache(f"quay.io/gkm/cache@{D1}", annotations={DIGEST_ANNOTATION: D1, SIZE_ANNOTATION: "42"})
    assert cs.known_pin(pinned) == Pin(f"quay.io/gkm/cache@{D1}", D1, 42)
    recorded = cache(f"quay.io/gkm/cache@{D1}", status=resolved_status(f"quay.io/gkm/cache@{D1}", D1))
    assert cs.known_pin(recorded) == Pin(f"quay.io/gkm/cache@{D1}", D1, None)
    # an answer about another digest is none about this one
    other = cache(f"quay.io/gkm/cache@{D1}", annotations={DIGEST_ANNOTATION: D2, SIZE_ANNOTATION: "42"})
    assert cs.known_pin(other) is None


def test_the_recorded_pin_is_kept_while_the_image_is_the_same():
    obj = cache(status=resolved_status(IMAGE, D1), annotations={DIGEST_ANNOTATION: D1, SIZE_ANNOTATION: "7"})
    assert cs.known_pin(obj) == Pin(IMAGE, D1, 7)


def test_a_changed_image_is_resolved_again():
    assert cs.known_pin(cache("quay.io/gkm/cache:v2", status=resolved_status(IMAGE, D1))) is None
    # a digest recorded without the image it was pinned for is not trusted either, nor is a
    # message: the Resolved condition's text says nothing the controller reads
    assert cs.known_pin(cache(status={"resolvedDigest": D1})) is None
    assert cs.known_pin(cache("quay.io/gkm/cache:v2", status={
        **resolved_status(IMAGE, D1), "conditions": resolved_status("quay.io/gkm/cache:v2", D1)["conditions"]})) is None


def test_the_admission_annotation_pins_a_cache_without_status():
    obj = cache(annotations={DIGEST_ANNOTATION: D2, SIZE_ANNOTATION: "100"})
    assert cs.known_pin(obj) == Pin(IMAGE, D2, 100)
    assert cs.known_pin(cache(annotations={DIGEST_ANNOTATION: "sha256:nothex"})) is None
    assert cs.known_pin(cache()) is None


def test_an_image_we_cannot_pull_is_an_invalid_reference():
    with pytest.raises(errors.InvalidReference):
        cs.known_pin(cache("no-registry-host"))


@pytest.mark.parametrize("err, reason", [
    (errors.ImageNotFound("x"), "ImageNotFound"),
    (errors.RegistryUnavailable("x"), "RegistryUnavailable"),
    (errors.IntegrityError("x"), "RegistryUnavailable"),
    (errors.AuthError("x"), "AuthFailed"),
    (errors.InvalidReference("x"), "InvalidImage"),
    (errors.HostileContent("x"), "InvalidImage"),
])
def test_registry_errors_map_to_the_contracts_reasons(err, reason):
    assert cs.failure(err) == reason


def test_annotations_mirror_the_pin():
    assert cs.wanted_annotations({"a": "b"}, Pin(IMAGE, D1, 5)) == {"a": "b", DIGEST_ANNOTATION: D1,
                                                                    SIZE_ANNOTATION: "5"}
    # no size known: kept beside its own digest, dropped when the digest moves
    same = {DIGEST_ANNOTATION: D1, SIZE_ANNOTATION: "5"}
    assert cs.wanted_annotations(same, Pin(IMAGE, D1, None)) == same
    assert cs.wanted_annotations(same, Pin(IMAGE, D2, None)) == {DIGEST_ANNOTATION: D2}
    assert cs.wanted_annotations({"a": "b", **same}, None) == {"a": "b"}


# -- the agents' reports ----------------------------------------------------------------------


def pods(*names):
    return [{"podNamespace": "ns", "podName": n, "volumeId": f"v-{n}"} for n in names]


REPORTS = {
    "n1": {D1: {"state": "Running", "pods": pods("a", "b")}},
    "n2": {D1: {"state": "Extracted"}},
    "n3": {D1: {"state": "Running", "pods": pods("c")}, D2: {"state": "Outdated", "pods": pods("d", "d")}},
    "n4": {D1: {"state": "Error", "message": "pull failed: 500"}},
    "n5": {D1: {"state": "Downloading"}},
    "n6": {D1: {"state": "Pending"}},
    "n7": {},  # names the cache with nothing left: not a node of it
}


def test_counts_follow_the_agents_rules_per_cache():
    agg = cs.aggregate(REPORTS, D1)
    assert agg.counts == {"nodeCnt": 6, "nodeInUseCnt": 2, "nodeNotInUseCnt": 1, "nodeErrorCnt": 1,
                          "podRunningCnt": 3, "podOutdatedCnt": 1, "podDeletingCnt": 0}
    assert (agg.held, agg.downloading, agg.pending) == (3, 1, 1)
    assert agg.errors == [("n4", "pull failed: 500")]
    assert cs.aggregate({}, D1).counts == dict.fromkeys(cs.COUNTS, 0)


D3 = "sha256:" + "3" * 64  # a platform manifest of the index D2


def test_a_node_still_on_the_old_digest_does_not_hold_the_new_pin():
    # the cache was just re-pinned D1 -> D2; the agents have not seen it, so to them D1 is still
    # current: Extracted / Running for D1 (with cacheDigest D1) is no node holding D2
    stale = {"n1": {D1: {"state": "Extracted", "cacheDigest": D1}},
             "n2": {D1: {"state": "Running", "cacheDigest": D1, "pods": pods("a")}}}
    agg = cs.aggregate(stale, D2)
    assert agg.held == 0
    assert agg.counts == {"nodeCnt": 2, "nodeInUseCnt": 1, "nodeNotInUseCnt": 0, "nodeErrorCnt": 0,
                          "podRunningCnt": 0, "podOutdatedCnt": 1, "podDeletingCnt": 0}
    assert cs.summary(Pin(IMAGE, D2, None), "", agg) == (
        "Outdated", f"0 of 2 nodes hold {D2}; 1 pod still on an older digest")
    assert cs.summary(Pin(IMAGE, D2, None), "", cs.aggregate({"n1": stale["n1"]}, D2)) == (
        "Resolved", f"0 of 1 node hold {D2}")
    # once an agent sees D2 and holds it, that node counts
    rolled = {**stale, "n1": {D2: {"state": "Extracted", "cacheDigest": D2}}}
    assert cs.aggregate(rolled, D2).held == 1
    assert cs.aggregate(stale, D1).held == 2  # and before the roll, both held D1


def test_an_index_pin_is_held_through_the_platform_manifest_picked():
    # the key is the manifest installed (D3), the pin the index (D2): cacheDigest ties them
    reports = {"n1": {D3: {"state": "Extracted", "cacheDigest": D2}},
               "n2": {D3: {"state": "Running", "cacheDigest": D2, "pods": pods("a")}},
               "n3": {D3: {"state": "Extracted", "cacheDigest": D1}}}  # D3 as picked from another index
    agg = cs.aggregate(reports, D2)
    assert (agg.held, agg.counts["nodeNotInUseCnt"], agg.counts["podRunningCnt"]) == (2, 1, 1)


def test_an_older_agent_counts_only_entries_keyed_by_the_pin():
    # no cacheDigest: the key alone decides (an index pin is not counted held by such an agent)
    assert cs.aggregate({"n1": {D2: {"state": "Extracted"}}}, D2).held == 1
    assert cs.aggregate({"n1": {D1: {"state": "Extracted"}}}, D2).held == 0
    assert cs.aggregate({"n1": {D3: {"state": "Extracted"}}}, D2).held == 0
    assert cs.aggregate({"n1": {D2: {"state": "Extracted"}}}, None).held == 0  # no pin, nothing held


def only(*nodes):
    return cs.aggregate({n: REPORTS[n] for n in nodes}, D1)


@pytest.mark.parametrize("nodes, reason", [
    (("n1", "n2", "n3", "n4"), "Error"),
    (("n1", "n3", "n5"), "Outdated"),
    (("n1", "n2", "n5"), "Running"),
    (("n2", "n5", "n6"), "Extracted"),
    (("n5", "n6"), "Downloading"),
    (("n6",), "Pending"),
    ((), "Resolved"),
])
def test_the_summary_is_the_most_telling_state(nodes, reason):
    assert cs.summary(Pin(IMAGE, D1, None), "", only(*nodes))[0] == reason


def test_the_summary_message_says_how_many_nodes_hold_what():
    reason, message = cs.summary(Pin(IMAGE, D1, None), "", cs.aggregate(REPORTS, D1))
    assert reason == "Error"
    assert message == (f"3 of 6 nodes hold {D1}; 3 pods running; 1 downloading; 1 pending; "
                       "1 pod still on an older digest; 1 node failed (n4: 'pull failed: 500')")
    assert cs.summary(Pin(IMAGE, D1, None), "", only())[1] == f"pinned to {D1}; no node holds it yet"
    assert cs.summary(None, "registry down", only("n1")) == ("Unresolved", "registry down")


# -- the status written -----------------------------------------------------------------------


def test_status_keeps_what_others_wrote_and_puts_the_summary_first():
    verified = {"type": "Verified", "status": "True", "reason": "Verified", "message": "ok",
                "lastTransitionTime": EARLIER, "observedGeneration": 1}
    obj = cache(status={"pvcStatus": {"ns": {"pvcName": "c"}}, "conditions": [verified]})
    pin = Pin(IMAGE, D1, None)
    v = ("True", "Verified", "ok")
    data = Verdict(D1, ("p@1",), True, "Verified", EARLIER)
    st = cs.cache_status(obj, pin, ("Resolved", cs.pinned_message(IMAGE, D1)), only("n1"), NOW, verified=v,
                         verification=data)
    assert st["resolvedDigest"] == D1 and st["resolvedImage"] == IMAGE and Verdict.of(st) == data
    assert st["pvcStatus"] == {"ns": {"pvcName": "c"}}
    assert [c["type"] for c in st["conditions"]] == ["Ready", "Resolved", "Verified"]
    assert st["conditions"][0]["reason"] == "Running" and st["conditions"][0]["status"] == "True"
    assert st["conditions"][1]["observedGeneration"] == 1
    assert st["conditions"][2] == verified
    assert st["lastUpdated"] == NOW

    # the same world a moment later: exactly the same status (no write)
    again = cs.cache_status({**obj, "status": st}, pin, ("Resolved", cs.pinned_message(IMAGE, D1)), only("n1"),
                            "2030-01-01T00:05:00Z", verified=v, verification=data)
    assert again == st
    # a verdict never outlives its digest: a new pin drops it, whatever is passed along
    rolled = cs.cache_status({**obj, "status": st}, Pin(IMAGE, D2, None), ("Resolved", cs.pinned_message(IMAGE, D2)),
                             only("n1"), NOW, verified=("Unknown", "RegistryUnavailable", "x"), verification=data)
    assert "verification" not in rolled and rolled["resolvedDigest"] == D2
    # no signature needed any more (label removed, policy gone): the controller's Verified goes, and the data
    plain = cs.cache_status({**obj, "status": st}, pin, ("Resolved", cs.pinned_message(IMAGE, D1)), only("n1"), NOW)
    assert [c["type"] for c in plain["conditions"]] == ["Ready", "Resolved"] and "verification" not in plain
    # a refused signature: Ready=False, Unverified, the reason in the STATUS message
    refused = cs.cache_status(obj, pin, ("Resolved", cs.pinned_message(IMAGE, D1)), only("n1"), NOW,
                              verified=("False", "WrongKey", "not ours"))
    assert refused["conditions"][0]["reason"] == "Unverified" and refused["conditions"][0]["status"] == "False"
    assert "WrongKey" in refused["conditions"][0]["message"]


def test_times_move_only_with_what_they_describe():
    pin = Pin(IMAGE, D1, None)
    st = cs.cache_status(cache(), pin, ("Resolved", cs.pinned_message(IMAGE, D1)), only("n5"), EARLIER)
    later = cs.cache_status({**cache(), "status": st}, pin, ("Resolved", cs.pinned_message(IMAGE, D1)),
                            only("n5", "n2"), NOW)
    assert later["lastUpdated"] == NOW
    ready, resolved = later["conditions"][:2]
    assert (ready["reason"], ready["lastTransitionTime"]) == ("Extracted", NOW)
    assert resolved["lastTransitionTime"] == EARLIER


def test_an_unresolved_cache_has_no_digest_and_says_why():
    obj = cache(status=resolved_status("quay.io/gkm/cache:v0", D1))
    st = cs.cache_status(obj, None, ("RegistryUnavailable", "quay.io: connection refused"), only(), NOW)
    assert "resolvedDigest" not in st
    ready, resolved = st["conditions"]
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "Unresolved",
                                                                    "quay.io: connection refused")
    assert (resolved["status"], resolved["reason"]) == ("False", "RegistryUnavailable")


# -- which node objects name which caches ------------------------------------------------------


def test_mentions_report_old_and_new_names_and_index_the_reverse():
    m = Mentions()
    assert m.set("ns/n1", frozenset({"ns/a", "ns/b"})) == {"ns/a", "ns/b"}
    assert m.set("ns/n2", frozenset({"ns/a"})) == {"ns/a"}
    assert m.nodes_of("ns/a") == ["ns/n1", "ns/n2"]
    assert m.set("ns/n1", frozenset({"ns/c"})) == {"ns/a", "ns/b", "ns/c"}  # b and a lost n1
    assert (m.nodes_of("ns/a"), m.nodes_of("ns/b"), m.nodes_of("ns/c")) == (["ns/n2"], [], ["ns/n1"])
    assert m.set("ns/n2", frozenset()) == {"ns/a"}  # deleted, or names nothing
    assert m.nodes_of("ns/a") == []


def test_node_objects_are_stored_trimmed():
    obj = {"metadata": {"name": "n1", "namespace": "ns", "resourceVersion": "5", "uid": "u", "labels": {"x": "y"}},
           "status": {"nodeName": "n1", "gpus": [{"gpuType": "tpu/v5e", "ids": [0]}], "counts": {},
                      "caches": {"c": {D1: {"state": "Running", "pods": pods("a"), "volumeSize": 9,
                                            "lastUpdated": NOW, "compatibleGPUs": [0]}}}}}
    assert trim_node(obj) == {"metadata": {"name": "n1", "namespace": "ns", "resourceVersion": "5"},
                              "status": {"caches": {"c": {D1: {"state": "Running", "pods": pods("a")}}}}}


def test_the_status_write_interval_grows_with_the_nodes_counted():
    """max(1 s, nodes / fan-out): a cache's writes send at most about fan-out watch events a
    second to the agents, whatever the fleet's size; bad fan-outs are refused."""
    assert [cs.write_interval(n) for n in (0, 20, 1000, 2000, 5000)] == [1.0, 1.0, 1.0, 2.0, 5.0]
    assert cs.write_interval(40, 10.0) == 4.0 and cs.write_interval(5000, 5000.0) == 1.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="fan-out"):
            cs.write_interval(10, bad)
