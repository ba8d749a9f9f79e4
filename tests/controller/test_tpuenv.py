"""controller/tpuenv/patches.py and controller/tpuenv/webhooks.py without an API server: the upstream injector's
bugs as regressions, property-based checks over generated StatefulSets, Jobs and pods (every
patch applies with a JSON Patch library to the object it was computed from, and a second
admission patches nothing), and hostile AdmissionReviews over HTTPS (always a well-formed
answer: 200 with allowed true/false, or 400 for what is not a review; never a 500)."""

from __future__ import annotations

import base64
import copy
import json

import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.tpuenv import patches as t
from controller.webhooks.server import AdmissionServer
from controller.tpuenv.webhooks import MUTATE_JOB, MUTATE_POD, MUTATE_STATEFULSET, routes
from tests.controller.test_webhook_server import CA, post

OURS = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES",
        "MEGASCALE_SLICE_ID", "MEGASCALE_PORT", "TPU_WORKER_ID", "TPU_PROCESS_PORT")
OPT_IN = {t.INJECT_LABEL: t.INJECT_VALUE}
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HOOKS = routes()


def sts_obj(replicas=3, env=None, tpu=False, start=None, containers=1, accel=None) -> dict:
    cs = []
    for i in range(containers):
        c = {"name": f"c{i}", "image": "x"}
        if env is not None:
            c["env"] = copy.deepcopy(env)
        if tpu:
            c["resources"] = {"limits": {t.TPU_RESOURCE: "4"}}
        cs.append(c)
    spec = {"serviceName": "nginx", "replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web", **OPT_IN}}, "spec": {"containers": cs}}}
    if start is not None:
        spec["ordinals"] = {"start": start}
    if accel:
        spec["template"]["spec"]["nodeSelector"] = {t.ACCELERATOR_SELECTOR: accel}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web", "labels": dict(OPT_IN)},
            "spec": spec}


def apply(obj, ops):
    return jsonpatch.apply_patch(obj, ops) if ops else obj


def pod_from(sts_or_job: dict, index: int, label: str) -> dict:
    tpl = sts_or_job["spec"]["template"]
    meta = copy.deepcopy(tpl.get("metadata") or {})
    meta.setdefault("labels", {})[label] = str(index)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": copy.deepcopy(tpl["spec"])}


def env_map(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def review(kind, obj, op="CREATE", uid="u-1", old=None) -> dict:
    gvk = {"StatefulSet": ("apps", "v1"), "Job": ("batch", "v1"), "Pod": ("", "v1")}[kind]
    req = {"uid": uid, "kind": {"group": gvk[0], "version": gvk[1], "kind": kind}, "operation": op,
           "namespace": "ns", "name": "x", "object": obj}
    if old is not None:
        req["oldObject"] = old
    return req


# -- the upstream injector's bugs -------------------------------------------------------------------


def test_hostnames_follow_replicas_and_ordinals_start_and_never_duplicate():
    sts = sts_obj(env=[{"name": "FOO", "value": "bar"}], start=2)
    ops, warnings = t.statefulset_patch(sts)
    assert warnings == []
    once = apply(sts, ops)
    c = once["spec"]["template"]["spec"]["containers"][0]
    assert [e["name"] for e in c["env"]][:2] == ["FOO", "TPU_WORKER_HOSTNAMES"]
    assert env_map(c)["TPU_WORKER_HOSTNAMES"] == "web-2.nginx,web-3.nginx,web-4.nginx"
    assert t.statefulset_patch(once) == ([], [])  # a second admission / an UPDATE of the live object
    once["spec"]["replicas"] = 2
    twice = apply(once, t.statefulset_patch(once)[0])
    assert env_map(twice["spec"]["template"]["spec"]["containers"][0])["TPU_WORKER_HOSTNAMES"] == \
        "web-2.nginx,web-3.nginx"
    assert [e["name"] for e in twice["spec"]["template"]["spec"]["containers"][0]["env"]].count(
        "TPU_WORKER_HOSTNAMES") == 1


def test_a_users_own_value_is_never_overwritten_and_ours_goes_when_not_wanted():
    sts = sts_obj(env=[{"name": "TPU_WORKER_HOSTNAMES", "value": "mine"}])
    out = apply(sts, t.statefulset_patch(sts)[0])
    assert env_map(out["spec"]["template"]["spec"]["containers"][0])["TPU_WORKER_HOSTNAMES"] == "mine"
    # opting out on UPDATE removes what we set and our record, and nothing else
    out["metadata"]["labels"] = {}
    out = apply(out, t.statefulset_patch(out)[0])
    assert out["spec"]["template"]["spec"]["containers"][0]["env"] == [{"name": "TPU_WORKER_HOSTNAMES",
                                                                        "value": "mine"}]
    assert t.STATE_ANNOTATION not in out["spec"]["template"]["metadata"].get("annotations", {})


def test_only_tpu_containers_get_the_variables_and_all_when_none_asks():
    sts = sts_obj(containers=2)
    sts["spec"]["template"]["spec"]["containers"][1]["resources"] = {"requests": {t.TPU_RESOURCE: "4"}}
    out = apply(sts, t.statefulset_patch(sts)[0])
    c0, c1 = out["spec"]["template"]["spec"]["containers"]
    assert "env" not in c0 and "TPU_WORKER_HOSTNAMES" in env_map(c1)
    out = apply(sts_obj(containers=2), t.statefulset_patch(sts_obj(containers=2))[0])
    assert all("TPU_WORKER_HOSTNAMES" in env_map(c) for c in out["spec"]["template"]["spec"]["containers"])


def test_pod_without_owner_or_env_or_annotation():
    bare = {"metadata": {"name": "p", "labels": dict(OPT_IN)}, "spec": {"containers": [{"name": "c"}]}}
    assert t.pod_patch(bare) == []  # not from an annotated template: not ours
    sts = apply(sts_obj(), t.statefulset_patch(sts_obj())[0])
    pod = pod_from(sts, 1, t.POD_INDEX_LABEL)
    del pod["spec"]["containers"][0]["env"]  # a later webhook dropped it: env absent on the pod
    out = apply(pod, t.pod_patch(pod))
    assert out["spec"]["containers"][0]["env"] == [{"name": "TPU_WORKER_ID", "value": "1"}]
    assert t.pod_patch(out) == []


def test_pod_index_outside_the_template_is_denied_with_the_reason():
    sts = apply(sts_obj(replicas=2), t.statefulset_patch(sts_obj(replicas=2))[0])
    resp = HOOKS[MUTATE_POD](review("Pod", pod_from(sts, 2, t.POD_INDEX_LABEL)))
    assert not resp.allowed and resp.code == 422 and "outside the 2 TPU workers" in resp.message


def test_statefulset_without_service_name_is_denied():
    sts = sts_obj()
    del sts["spec"]["serviceName"]
    resp = HOOKS[MUTATE_STATEFULSET](review("StatefulSet", sts))
    assert not resp.allowed and "spec.serviceName" in resp.message


def test_tpu7x_process_addresses_ports_and_ids():
    sts = sts_obj(replicas=2, tpu=True, containers=2, accel="tpu7x-standard-4t")
    out = apply(sts, t.statefulset_patch(sts)[0])
    env = env_map(out["spec"]["template"]["spec"]["containers"][0])
    assert env["TPU_PROCESS_ADDRESSES"] == "web-0.nginx:8476,web-0.nginx:8477,web-1.nginx:8476,web-1.nginx:8477"
    pod = apply(pod_from(out, 1, t.POD_INDEX_LABEL), t.pod_patch(pod_from(out, 1, t.POD_INDEX_LABEL)))
    assert [(env_map(c)["TPU_WORKER_ID"], env_map(c)["TPU_PROCESS_PORT"]) for c in pod["spec"]["containers"]] == [
        ("2", "8476"), ("3", "8477")]


def test_job_rule_and_jobset_labels():
    job = {"metadata": {"name": "j"}, "spec": {"completionMode": "Indexed", "parallelism": 2, "completions": 3,
                                                "template": {"spec": {"subdomain": "s", "containers": [
                                                    {"name": "c", "resources": {"limits": {t.TPU_RESOURCE: 4}}}]}}}}
    ops, warnings = t.job_patch(job)
    assert env_map(apply(job, ops)["spec"]["template"]["spec"]["containers"][0])["TPU_WORKER_HOSTNAMES"] == \
        "j-0.s,j-1.s"
    assert "completions" in warnings[0]
    for change in ({"completionMode": "NonIndexed"}, {"parallelism": 1}):
        assert t.job_patch({**job, "spec": {**job["spec"], **change}}) == ([], [])
    job["metadata"]["labels"] = {t.JOBSET_NAME: "js", t.JOBSET_RJOB: "r", t.JOBSET_JOB_INDEX: "1",
                                 t.JOBSET_REPLICAS: "2"}
    env = env_map(apply(job, t.job_patch(job)[0])["spec"]["template"]["spec"]["containers"][0])
    assert (env["TPU_WORKER_HOSTNAMES"], env["MEGASCALE_COORDINATOR_ADDRESS"], env["MEGASCALE_SLICE_ID"],
            env["MEGASCALE_NUM_SLICES"]) == ("js-r-1-0.s,js-r-1-1.s", "js-r-0-0.s", "1", "2")


# -- properties over generated objects ---------------------------------------------------------------

names = st.sampled_from(OURS + ("FOO", "BAR", "PATH"))
values = st.text(max_size=12)
entry = st.one_of(st.fixed_dictionaries({"name": names, "value": values}),
                  st.fixed_dictionaries({"name": names, "valueFrom": st.just({"fieldRef": {"fieldPath": "metadata.name"}})}))
resources = st.one_of(st.none(), st.fixed_dictionaries({}, optional={
    "limits": st.dictionaries(st.sampled_from([t.TPU_RESOURCE, "cpu"]), st.sampled_from(["0", "1", "4", 8]), max_size=2),
    "requests": st.dictionaries(st.sampled_from([t.TPU_RESOURCE, "memory"]), st.sampled_from(["0", "4"]), max_size=2)}))


@st.composite
def container(draw, i):
    c = {"name": f"c{i}", "image": "x"}
    env = draw(st.one_of(st.just("absent"), st.none(), st.lists(entry, max_size=5)))
    if env != "absent":
        c["env"] = env
    res = draw(resources)
    if res is not None:
        c["resources"] = res
    return c


@st.composite
def pod_template(draw):
    n = draw(st.integers(1, 3))
    spec = {"containers": [draw(container(i)) for i in range(n)]}
    accel = draw(st.sampled_from([None, "tpu7x", "tpu7x-standard-4t", "tpu-v6e-slice"]))
    if accel:
        spec["nodeSelector"] = {t.ACCELERATOR_SELECTOR: accel}
    if draw(st.booleans()):
        spec["subdomain"] = draw(st.sampled_from(["svc", "js"]))
    meta = {"labels": dict(OPT_IN) if draw(st.booleans()) else {}}
    ann = draw(st.sampled_from([None, "garbage", "{}", json.dumps({"vars": {"TPU_WORKER_HOSTNAMES": "0" * 16}}),
                                json.dumps({"vars": {n: t.digest("x") for n in OURS}, "kind": "Job", "workers": 2})]))
    if ann is not None:
        meta["annotations"] = {t.STATE_ANNOTATION: ann}
    tpl = {"spec": spec}
    if draw(st.booleans()):
        tpl["metadata"] = meta
    return tpl


@st.composite
def statefulsets(draw):
    spec = {"serviceName": "nginx", "replicas": draw(st.integers(0, 6)), "template": draw(pod_template())}
    if draw(st.booleans()):
        spec["ordinals"] = {"start": draw(st.integers(0, 5))}
    labels = dict(OPT_IN) if draw(st.integers(0, 4)) else {}
    return {"metadata": {"name": draw(st.sampled_from(["web", "a-b"])), "labels": labels}, "spec": spec}


@st.composite
def jobs(draw):
    par = draw(st.integers(0, 5))
    spec = {"completionMode": draw(st.sampled_from(["Indexed", "Indexed", "NonIndexed"])), "parallelism": par,
            "completions": draw(st.sampled_from([par, par + 1])), "template": draw(pod_template())}
    if draw(st.integers(0, 4)):  # mostly TPU slices by GKE's rule: a subdomain, a TPU container
        spec["template"]["spec"]["subdomain"] = "svc"
        spec["template"]["spec"]["containers"][0]["resources"] = {"limits": {t.TPU_RESOURCE: "4"}}
    labels = {}
    if draw(st.booleans()):
        slices = draw(st.integers(1, 3))
        labels = {t.JOBSET_NAME: "js", t.JOBSET_RJOB: "r", t.JOBSET_REPLICAS: str(slices),
                  t.JOBSET_JOB_INDEX: str(draw(st.integers(0, slices - 1)))}
    return {"metadata": {"name": "j", "labels": labels}, "spec": spec}


def _user_entries(obj_containers) -> list:
    """The env entries no webhook of ours may touch: names we never set."""
    return [[e for e in (c.get("env") or []) if e["name"] not in OURS] for c in obj_containers]


def _check_workload(obj, plan, slice_of, index_label):
    """The workload's patch applies, agrees with our own application, is a no-op the second
    time and leaves the user's entries alone; then the same for the pod of every worker."""
    try:
        ops, _ = plan(obj)
    except t.Refused:
        return
    assert all(o["path"].startswith("/spec/template") for o in ops)
    once = apply(copy.deepcopy(obj), ops)  # applies cleanly to the object we were sent
    ours = copy.deepcopy(obj)
    t.apply_ops(ours, ops)  # the reconciler's own application agrees with the library's
    assert ours == once
    assert plan(once)[0] == []  # a second admission is a no-op
    before = _user_entries(obj["spec"]["template"]["spec"]["containers"])
    assert _user_entries(once["spec"]["template"]["spec"]["containers"]) == before
    sl, _ = slice_of(once)
    for i in range(len(sl.hosts) if sl else 0):
        pod = pod_from(once, sl.start + i, index_label)
        out = apply(copy.deepcopy(pod), t.pod_patch(pod))
        assert t.pod_patch(out) == []
        for c_before, c_after in zip(pod["spec"]["containers"], out["spec"]["containers"]):
            ids = [[e for e in c.get("env") or [] if e["name"] == "TPU_WORKER_ID"] for c in (c_before, c_after)]
            assert ids[1] == ids[0] or (not ids[0] and len(ids[1]) == 1)  # added once, or the user's kept


@SETTINGS
@given(statefulsets())
def test_statefulset_patches_apply_and_are_idempotent(sts):
    _check_workload(sts, t.statefulset_patch, t.statefulset_slice, t.POD_INDEX_LABEL)


@SETTINGS
@given(jobs())
def test_job_patches_apply_and_are_idempotent(job):
    _check_workload(job, t.job_patch, t.job_slice, t.COMPLETION_INDEX)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=20)


def _mangle(obj, draw):
    """``obj`` with one field somewhere replaced by an arbitrary JSON value."""
    obj = copy.deepcopy(obj)
    node, path = obj, []
    while isinstance(node, dict) and node and draw(st.integers(0, 3)):
        key = draw(st.sampled_from(sorted(node)))
        path.append(key)
        if not isinstance(node[key], (dict, list)) or not draw(st.booleans()):
            if draw(st.booleans()):
                node[key] = draw(json_values)
            else:
                del node[key]
            return obj
        node = node[key] if isinstance(node[key], dict) else (node[key][0] if node[key] and isinstance(
            node[key][0], dict) else node)
    return obj


@SETTINGS
@given(st.data())
def test_any_object_gets_an_answer_never_an_exception(data):
    """Missing fields, wrong types, wrong kinds: allowed (maybe with a patch that applies) or a
    422 denial naming the field; the handlers never raise."""
    kind = data.draw(st.sampled_from(["StatefulSet", "Job", "Pod"]))
    base = {"StatefulSet": sts_obj(tpu=True), "Job": {"metadata": {"name": "j"}, "spec": {
        "completionMode": "Indexed", "parallelism": 2, "template": {"spec": {"subdomain": "s", "containers": [
            {"name": "c", "resources": {"limits": {t.TPU_RESOURCE: "4"}}}]}}}},
        "Pod": pod_from(apply(sts_obj(), t.statefulset_patch(sts_obj())[0]), 1, t.POD_INDEX_LABEL)}[kind]
    obj = data.draw(st.one_of(json_values, st.builds(lambda d: _mangle(base, d.draw), st.data())))
    path = {"StatefulSet": MUTATE_STATEFULSET, "Job": MUTATE_JOB, "Pod": MUTATE_POD}[kind]
    resp = HOOKS[path](review(kind, obj))
    if resp.allowed:
        if resp.patch:
            apply(copy.deepcopy(obj), resp.patch)
    else:
        assert resp.code == 422 and resp.message


@pytest.mark.parametrize("template", [None, "absent", {}, {"metadata": None, "spec": None}])
def test_a_statefulset_without_a_usable_template_is_denied_or_patched_where_the_patch_applies(template):
    sts = sts_obj()
    if template == "absent":
        del sts["spec"]["template"]
    else:
        sts["spec"]["template"] = template
    resp = HOOKS[MUTATE_STATEFULSET](review("StatefulSet", sts))
    if resp.allowed:
        apply(copy.deepcopy(sts), resp.patch or [])
    else:
        assert resp.code == 422 and "spec.template" in resp.message


def test_wrong_kinds_versions_and_operations_pass_unchanged():
    sts = sts_obj()
    for path, req in ((MUTATE_STATEFULSET, {**review("StatefulSet", sts), "kind": {"group": "apps", "version": "v1beta2",
                                                                                  "kind": "StatefulSet"}}),
                      (MUTATE_STATEFULSET, review("StatefulSet", sts, op="DELETE")),
                      (MUTATE_JOB, review("StatefulSet", sts)),
                      (MUTATE_POD, {**review("Pod", sts), "kind": "Pod"})):
        resp = HOOKS[path](req)
        assert resp.allowed and not resp.patch


# -- over HTTPS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def https(tmp_path_factory):
    ca = CA()
    cert, key, _ = ca.serving(tmp_path_factory.mktemp("tpuenv"), "webhook")
    server = AdmissionServer("127.0.0.1:0", cert, key, routes(), max_body=2 * 1024 * 1024).start()
    yield server, ca
    server.stop()


def _body(kind, obj, **kw) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": review(kind, obj, **kw)}).encode()


def test_https_answer_echoes_uid_and_carries_the_patch(https):
    server, ca = https
    status, body = post(server, ca, MUTATE_STATEFULSET + "?timeout=5s", _body("StatefulSet", sts_obj(), uid="u-42"))
    doc = json.loads(body)
    assert status == 200 and (doc["apiVersion"], doc["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    resp = doc["response"]
    assert resp["uid"] == "u-42" and resp["allowed"] and resp["patchType"] == "JSONPatch"
    apply(sts_obj(), json.loads(base64.b64decode(resp["patch"])))


@SETTINGS
@given(st.data())
def test_https_truncated_and_random_bodies_get_a_well_formed_answer(https, data):
    server, ca = https
    good = _body("StatefulSet", sts_obj())
    body = data.draw(st.one_of(st.builds(lambda n: good[:n], st.integers(0, len(good))), st.binary(max_size=256),
                               st.builds(lambda v: json.dumps(v).encode(), json_values)))
    path = data.draw(st.sampled_from([MUTATE_STATEFULSET, MUTATE_JOB, MUTATE_POD]))
    status, out = post(server, ca, path, body)
    if status == 200:
        doc = json.loads(out)
        assert doc["kind"] == "AdmissionReview" and doc["response"]["allowed"] in (True, False)
        assert (doc["response"].get("status") or {}).get("code") != 500
    else:
        assert status == 400 and b"malformed AdmissionReview" in out


def test_https_huge_objects(https):
    server, ca = https
    big = sts_obj(containers=1)
    big["metadata"]["annotations"] = {"filler": "x" * (1024 * 1024)}  # under the body limit
    status, out = post(server, ca, MUTATE_STATEFULSET, _body("StatefulSet", big))
    assert status == 200 and json.loads(out)["response"]["allowed"]
    status, out = post(server, ca, MUTATE_STATEFULSET, _body("StatefulSet", sts_obj(replicas=t.MAX_WORKERS + 1)))
    resp = json.loads(out)["response"]
    assert status == 200 and not resp["allowed"] and resp["status"]["code"] == 422
    big["metadata"]["annotations"] = {"filler": "x" * (3 * 1024 * 1024)}  # over it
    status, out = post(server, ca, MUTATE_STATEFULSET, _body("StatefulSet", big))
    assert status == 413


# -- beside GKE, LeaderWorkerSet and KubeRay (docs/operations.md) ------------------------------------
# Who else sets these variables, with sources: ../shared/reference/gke.md section 3 (GKE's webhook
# for Indexed Jobs with a subdomain and TPU requests; LeaderWorkerSet's pkg/utils/accelerators/tpu.go;
# KubeRay's TPU webhook).


def gke_job(parallelism=4, labels=None, env=None) -> dict:
    c = {"name": "w", "image": "x", "resources": {"limits": {t.TPU_RESOURCE: "4"}}}
    if env is not None:
        c["env"] = env
    return {"metadata": {"name": "j", "labels": dict(labels or {})},
            "spec": {"completionMode": "Indexed", "parallelism": parallelism, "completions": parallelism,
                     "template": {"metadata": {"labels": dict(labels or {})},
                                  "spec": {"subdomain": "s", "containers": [c]}}}}


def test_on_gke_its_indexed_jobs_are_left_to_it_and_a_jobsets_one_host_slices_stay_ours():
    assert t.job_patch(gke_job())[0]  # off GKE: ours, as GKE would do it
    assert t.job_patch(gke_job(), platform_jobs=True) == ([], [])
    assert HOOKS[MUTATE_JOB](review("Job", gke_job())).patch
    assert not routes(platform_jobs=True)[MUTATE_JOB](review("Job", gke_job())).patch
    one_host = gke_job(parallelism=1, labels={t.JOBSET_NAME: "js", t.JOBSET_RJOB: "slice", t.JOBSET_JOB_INDEX: "1",
                                              t.JOBSET_REPLICAS: "2"})
    out = apply(one_host, t.job_patch(one_host, platform_jobs=True)[0])  # GKE's rule needs parallelism > 1
    assert env_map(out["spec"]["template"]["spec"]["containers"][0])["MEGASCALE_SLICE_ID"] == "1"


@pytest.mark.parametrize("label", t.OTHERS_LABELS)
def test_leaderworkerset_and_kuberay_workloads_and_pods_are_theirs(label):
    theirs = {label: "x"}
    sts = sts_obj()
    sts["metadata"]["labels"].update(theirs)
    assert t.statefulset_patch(sts) == ([], [])
    assert t.job_patch(gke_job(labels=theirs)) == ([], [])
    ours = apply(sts_obj(), t.statefulset_patch(sts_obj())[0])
    pod = pod_from(ours, 1, t.POD_INDEX_LABEL)
    assert t.pod_patch(pod)  # from our template: TPU_WORKER_ID
    pod["metadata"]["labels"].update(theirs)
    assert t.pod_patch(pod) == []


@pytest.mark.parametrize("var", t.WORKER_VARS)
def test_a_worker_variable_set_by_someone_else_leaves_the_whole_slice_to_them(var):
    """Not only that variable: none of ours is added beside it (a half-ours, half-theirs slice
    would disagree with itself), and what we had set before goes."""
    theirs = [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['x']"}}}]
    assert t.job_patch(gke_job(env=theirs)) == ([], [])
    sts = apply(sts_obj(), t.statefulset_patch(sts_obj())[0])
    assert t.statefulset_patch(sts) == ([], [])  # ours alone: nothing to do
    sts["spec"]["template"]["spec"]["containers"][0]["env"].insert(0, dict(theirs[0]))
    out = apply(sts, t.statefulset_patch(sts)[0])
    assert out["spec"]["template"]["spec"]["containers"][0]["env"] == theirs
    assert t.STATE_ANNOTATION not in (out["spec"]["template"]["metadata"].get("annotations") or {})


def test_gke_versions_are_told_from_others():
    from controller.cli import is_gke_version

    assert is_gke_version("v1.34.1-gke.1127000") and is_gke_version("v1.30.5-gke.1014001")
    assert not any(map(is_gke_version, ("v1.35.4", "v1.30.2-eks-1552ad0", "v1.29.0+k3s1", "", "v1.30.5-gke")))


def test_a_users_entry_equal_to_ours_in_a_container_without_tpus_is_never_removed():
    """Found by the property above: the state records values by name, not by container, so a
    container we give no env that holds the user's MEGASCALE_SLICE_ID=0 (the value we set on the
    TPU container) looked ours, and a second admission removed it."""
    job = {"metadata": {"name": "j", "labels": {}}, "spec": {
        "completionMode": "Indexed", "parallelism": 2, "completions": 2, "template": {"spec": {
            "subdomain": "svc", "containers": [
                {"name": "c0", "image": "x", "resources": {"limits": {"google.com/tpu": "4"}}},
                {"name": "c1", "image": "x", "env": [{"name": "MEGASCALE_SLICE_ID", "value": "0"}]}]}}}}
    _check_workload(job, t.job_patch, t.job_slice, t.COMPLETION_INDEX)
