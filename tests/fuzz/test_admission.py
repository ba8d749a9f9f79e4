"""Fuzz: every admission review the controller answers. Review bodies go through the server's
own parser (``parse_review``) and every route of the cache webhooks (GKMCache and
ClusterGKMCache, mutating and validating; pins resolved against the real test registry) and of
the TPU environment webhooks (StatefulSet, Job, Pod). Each must end with a Response that
serialises as an AdmissionReview answer, and an allowed patch must apply to the object it was
made for; a handler exception is a crash (the server would answer 500 and, failing closed, block
every write of that kind). Handlers write nothing: their only output is the answer."""

from __future__ import annotations

import json

import jsonpatch
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelnode.oci.registry import RegistryOptions
from controller.caches import webhooks as cachehooks
from controller.caches.pinning import Resolver
from controller.tpuenv import patches as tpuenv
from controller.tpuenv import webhooks as envhooks
from controller.webhooks.server import BadReview, Response, parse_review, review_response

from .fuzzing import fuzz_settings, json_values, shaped, text

CONTROLLER = "system:serviceaccount:accelnode-system:accelnode-controller"


@pytest.fixture(scope="module")
def routes(registry):
    hooks = cachehooks.CacheHooks(Resolver(RegistryOptions(plain_http=True, timeout=2.0)),
                                  cachehooks.ControllerIdentity.fixed(CONTROLLER), budget=0.2, max_lookups=4)
    registry.image = registry.push_raw("fuzz/cache", "v1")
    yield hooks.routes() | envhooks.routes()
    hooks.close()


def metadata(extra_labels=st.just({})) -> st.SearchStrategy:
    return shaped({"name": text, "namespace": text, "generation": st.integers(),
                   "labels": st.one_of(extra_labels, st.dictionaries(text, text, max_size=3)),
                   "annotations": st.dictionaries(st.one_of(st.sampled_from(
                       [cachehooks.DIGEST_ANNOTATION, cachehooks.SIZE_ANNOTATION, tpuenv.STATE_ANNOTATION]), text),
                       json_values, max_size=3)})


def cache_object(image: str) -> st.SearchStrategy:
    images = st.one_of(st.just(image), st.just(image.split("@")[0]), st.just(image.rsplit(":", 1)[0] + ":v1"), text)
    return shaped({"apiVersion": st.just("gkm.io/v1alpha1"), "kind": st.sampled_from(["GKMCache", "ClusterGKMCache"]),
                   "metadata": metadata(), "spec": shaped({"image": images, "workloadNamespaces": st.lists(text)}),
                   "status": shaped({"resolvedDigest": text})})


resources = shaped({"limits": st.dictionaries(st.one_of(st.just(tpuenv.TPU_RESOURCE), text),
                                              st.one_of(st.integers(-2, 9), text), max_size=2),
                    "requests": st.dictionaries(st.one_of(st.just(tpuenv.TPU_RESOURCE), text), json_values, max_size=2)})
container = shaped({"name": text, "resources": resources, "ports": st.lists(json_values, max_size=2),
                    "env": st.lists(shaped({"name": st.one_of(st.sampled_from(["TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES",
                                                                               "TPU_PROCESS_PORT"]), text),
                                            "value": text}), max_size=3)})
pod_spec = shaped({"containers": st.lists(container, max_size=2), "initContainers": st.lists(container, max_size=1),
                   "nodeSelector": st.dictionaries(st.one_of(st.sampled_from(
                       [tpuenv.ACCELERATOR_SELECTOR, "cloud.google.com/gke-tpu-topology"]), text),
                       st.one_of(st.sampled_from(["tpu-v5-lite-podslice", "tpu7x", "2x4", "4x4x4", "1x1"]), text),
                       max_size=2),
                   "subdomain": text, "hostname": text})
workload_labels = st.dictionaries(st.sampled_from([tpuenv.INJECT_LABEL, tpuenv.POD_INDEX_LABEL,
                                                   tpuenv.STS_POD_NAME_LABEL, tpuenv.COMPLETION_INDEX,
                                                   tpuenv.JOBSET_NAME, tpuenv.JOBSET_RJOB, tpuenv.JOBSET_JOB_INDEX,
                                                   tpuenv.JOBSET_REPLICAS]),
                                  st.one_of(st.just(tpuenv.INJECT_VALUE), st.integers(0, 9).map(str), text), max_size=4)
template = shaped({"metadata": metadata(workload_labels), "spec": pod_spec})
workloads = {
    ("", "v1", "Pod"): shaped({"metadata": metadata(workload_labels), "spec": pod_spec}),
    ("batch", "v1", "Job"): shaped({"metadata": metadata(workload_labels), "spec": shaped({
        "parallelism": st.integers(-1, 5000), "completions": st.integers(-1, 5000),
        "completionMode": st.sampled_from(["Indexed", "NonIndexed"]), "template": template})}),
    ("apps", "v1", "StatefulSet"): shaped({"metadata": metadata(workload_labels), "spec": shaped({
        "replicas": st.integers(-1, 5000), "serviceName": text, "template": template})}),
}


@st.composite
def review(draw, image: str) -> dict:
    path = draw(st.sampled_from([*cachehooks.CacheHooks(None, None).routes(), *envhooks.routes()]))
    if path in envhooks.routes():
        gvk = draw(st.sampled_from(list(workloads)))
        obj = draw(st.one_of(workloads[gvk], json_values))
    else:
        gvk = ("gkm.io", "v1alpha1", draw(st.sampled_from(["GKMCache", "ClusterGKMCache"])))
        obj = draw(st.one_of(cache_object(image), json_values))
    request = draw(shaped({
        "uid": st.uuids().map(str), "kind": st.just(dict(zip(("group", "version", "kind"), gvk))),
        "operation": st.sampled_from(["CREATE", "UPDATE", "DELETE", "CONNECT"]),
        "name": text, "namespace": text, "object": st.just(obj),
        "oldObject": st.one_of(st.just(obj), cache_object(image), json_values),
        "userInfo": shaped({"username": st.one_of(st.just(CONTROLLER), text), "groups": st.lists(text, max_size=2)}),
        "dryRun": st.booleans()}))
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    return path, draw(st.one_of(st.just(json.dumps(body).encode()), st.just(json.dumps(body)[:-3].encode()),
                                st.binary(max_size=40), json_values.map(lambda v: json.dumps(v).encode())))


@fuzz_settings(ci_examples=300)
@given(data=st.data())
def test_every_admission_route_answers_hostile_reviews(routes, registry, data):
    path, body = data.draw(review(registry.image))
    try:
        request = parse_review(body)
    except BadReview:
        return
    answer = routes[path](request)
    assert isinstance(answer, Response)
    json.dumps(review_response(request["uid"], answer))
    if answer.allowed and answer.patch:
        jsonpatch.apply_patch(request.get("object"), answer.patch)
