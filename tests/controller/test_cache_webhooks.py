"""The cache webhooks as the real kube-apiserver calls them: our AdmissionServer on 127.0.0.1 over
HTTPS (a test CA), Mutating/ValidatingWebhookConfigurations pointing at it (scoped to this
module's namespace and labelled cluster objects, deleted afterwards), the real local registry
behind the Resolver, the controller's identity learned by a real SelfSubjectReview, and the
official client as the admin (a non-controller user) and as the controller."""

from __future__ import annotations

import base64
import copy
import json
import time
import uuid

import pytest

from accelnode.kube.client import Client, Config
from controller.webhooks.server import AdmissionServer, allow
from controller.caches.webhooks import (MUTATE_CLUSTERGKMCACHE, MUTATE_GKMCACHE, VALIDATE_CLUSTERGKMCACHE,
                                   VALIDATE_GKMCACHE, CacheHooks, ControllerIdentity, whoami)
from controller.caches.pinning import DIGEST_ANNOTATION as D
from controller.caches.pinning import SIZE_ANNOTATION as S
from controller.caches.pinning import Resolver
from tests.cache.test_store import triton_tree
from tests.controller.test_webhook_server import CA
from tests.csi.conftest import free_ports

G, V = "gkm.io", "v1alpha1"
CONTROLLER_USER = "system:serviceaccount:accelnode-system:accelnode-controller"
SKIP = "hooks.test.accelnode.io/skip-mutation"  # objects the test mutating webhooks leave alone
TOUCH = "hooks.test.accelnode.io/touch"  # objects a second mutating webhook labels (reinvocation)
RUN = "hooks.test.accelnode.io/run"  # cluster-scoped objects of this module
FAKE = "sha256:" + "f" * 64


class Env:
    """What the module's tests share."""

    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.calls: list[tuple[str, dict, object]] = []  # (path, request, response) of every admission

    def mutate_calls(self, name: str) -> list:
        return [(req, resp) for path, req, resp in self.calls
                if path == MUTATE_GKMCACHE and req.get("name") == name]


def _recorded(env: Env, path: str, handler):
    def call(request):
        resp = handler(request)
        env.calls.append((path, request, resp))
        return resp
    return call


def _touch(request):
    labels = (request.get("object") or {}).get("metadata", {}).get("labels") or {}
    if labels.get("touched") == "yes":
        return allow()
    return allow([{"op": "add", "path": "/metadata/labels/touched", "value": "yes"}])


def _webhook(name, url_path, port, ca_pem, resources, scope, *, namespace=None, run=None, mutating=False,
             reinvoke=False, object_selector=None):
    hook = {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Fail",  # in tests a handler bug must show, never be skipped
            "timeoutSeconds": 15,
            "clientConfig": {"url": f"https://127.0.0.1:{port}{url_path}",
                             "caBundle": base64.b64encode(ca_pem).decode()},
            "rules": [{"apiGroups": [G], "apiVersions": [V], "operations": ["CREATE", "UPDATE"],
                       "resources": resources, "scope": scope}]}
    exprs = list(object_selector or [])
    if namespace:
        hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    if run:
        exprs.append({"key": RUN, "operator": "In", "values": [run]})
    if mutating:
        hook["reinvocationPolicy"] = "IfNeeded" if reinvoke else "Never"
    if exprs:
        hook["objectSelector"] = {"matchExpressions": exprs}
    return hook


@pytest.fixture(scope="module")
def env(control_plane, kube_api, crds, registry, tmp_path_factory):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    admin = kube_api("admin")
    run = uuid.uuid4().hex[:8]
    ns = f"hooks-{run}"
    tmp = tmp_path_factory.mktemp("cachehooks")
    ca = CA()
    cert, key, _ = ca.serving(tmp, "accelnode-controller")
    resolver = Resolver(registry.options())
    ident = ControllerIdentity.of(Client(Config.from_kubeconfig(control_plane.kubeconfig("controller"))))
    hooks = CacheHooks(resolver, ident, budget=8)
    e = Env(ns=ns, run=run, resolver=resolver, hooks=hooks, registry=registry, tmp=tmp, ca=ca,
            admin=client.CustomObjectsApi(admin), controller=client.CustomObjectsApi(kube_api("controller")))
    routes = {p: _recorded(e, p, h) for p, h in hooks.routes().items()}
    routes["/test-touch"] = _recorded(e, "/test-touch", _touch)
    server = AdmissionServer("127.0.0.1:0", cert, key, routes).start()

    core, rbac = client.CoreV1Api(admin), client.RbacAuthorizationV1Api(admin)
    reg = client.AdmissionregistrationV1Api(admin)
    core.create_namespace(body={"metadata": {"name": ns}})
    # the controller identity may write caches and their status (the reconciler's RBAC, not ours)
    role = f"test-cachehooks-{run}"
    rbac.create_cluster_role(body={"metadata": {"name": role}, "rules": [
        {"apiGroups": [G], "resources": ["gkmcaches", "gkmcaches/status", "clustergkmcaches",
                                         "clustergkmcaches/status"], "verbs": ["get", "update", "patch"]}]})
    rbac.create_cluster_role_binding(body={
        "metadata": {"name": role}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                               "name": role},
        "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": CONTROLLER_USER}]})
    skip = [{"key": SKIP, "operator": "DoesNotExist"}]
    port = server.port
    reg.create_mutating_webhook_configuration(body={"metadata": {"name": role}, "webhooks": [
        _webhook("m-ns.cachehooks.test.accelnode.io", MUTATE_GKMCACHE, port, ca.pem, ["gkmcaches"], "Namespaced",
                 namespace=ns, mutating=True, reinvoke=True, object_selector=skip),
        _webhook("m-cluster.cachehooks.test.accelnode.io", MUTATE_CLUSTERGKMCACHE, port, ca.pem,
                 ["clustergkmcaches"], "Cluster", run=run, mutating=True, reinvoke=True, object_selector=skip),
        _webhook("touch.cachehooks.test.accelnode.io", "/test-touch", port, ca.pem, ["gkmcaches"], "Namespaced",
                 namespace=ns, mutating=True, object_selector=[{"key": TOUCH, "operator": "Exists"}]),
    ]})
    reg.create_validating_webhook_configuration(body={"metadata": {"name": role}, "webhooks": [
        _webhook("v-ns.cachehooks.test.accelnode.io", VALIDATE_GKMCACHE, port, ca.pem,
                 ["gkmcaches", "gkmcaches/status"], "Namespaced", namespace=ns),
        _webhook("v-cluster.cachehooks.test.accelnode.io", VALIDATE_CLUSTERGKMCACHE, port, ca.pem,
                 ["clustergkmcaches", "clustergkmcaches/status"], "Cluster", run=run),
    ]})
    try:
        _wait_active(e)
        yield e
    finally:
        for delete in (lambda: reg.delete_mutating_webhook_configuration(role),
                       lambda: reg.delete_validating_webhook_configuration(role),
                       lambda: rbac.delete_cluster_role_binding(role), lambda: rbac.delete_cluster_role(role)):
            try:
                delete()
            except ApiException as exc:
                if exc.status != 404:
                    raise
        for item in e.admin.list_cluster_custom_object(G, V, "clustergkmcaches",
                                                       label_selector=f"{RUN}={run}")["items"]:
            e.admin.delete_cluster_custom_object(G, V, "clustergkmcaches", item["metadata"]["name"])
        server.stop()
        hooks.close()


def _wait_active(e: Env) -> None:
    """The API server picks webhook configurations up asynchronously: dry-run probes until all
    four webhooks answer (bounded)."""
    from kubernetes.client.rest import ApiException

    pinned = e.registry.push_raw("hooks/probe", "v1")  # a digest the registry holds: pinned at admission
    pending = {"m-ns", "m-cluster", "v-ns", "v-cluster"}
    deadline = time.monotonic() + 60
    while pending and time.monotonic() < deadline:
        if "m-ns" in pending:
            out = e.admin.create_namespaced_custom_object(G, V, e.ns, "gkmcaches", gkmcache("probe", pinned),
                                                          dry_run="All")
            if D in (out["metadata"].get("annotations") or {}):
                pending.discard("m-ns")
        if "m-cluster" in pending:
            out = e.admin.create_cluster_custom_object(G, V, "clustergkmcaches",
                                                       clustergkmcache(e, "probe", pinned), dry_run="All")
            if D in (out["metadata"].get("annotations") or {}):
                pending.discard("m-cluster")
        for key, create in (("v-ns", lambda: e.admin.create_namespaced_custom_object(
                G, V, e.ns, "gkmcaches", gkmcache("probe", "probe/x:v1", labels={SKIP: "1"}), dry_run="All")),
                            ("v-cluster", lambda: e.admin.create_cluster_custom_object(
                G, V, "clustergkmcaches", clustergkmcache(e, "probe", "probe/x:v1", labels={SKIP: "1"}),
                dry_run="All"))):
            if key in pending:
                try:
                    create()
                except ApiException as exc:
                    if "not an image reference" in exc.body:
                        pending.discard(key)
        if pending:
            time.sleep(0.2)
    assert not pending, f"webhooks not called by the API server within 60s: {sorted(pending)}"


def gkmcache(name, image, annotations=None, labels=None) -> dict:
    meta = {"name": name}
    if annotations:
        meta["annotations"] = annotations
    if labels:
        meta["labels"] = labels
    return {"apiVersion": f"{G}/{V}", "kind": "GKMCache", "metadata": meta, "spec": {"image": image}}


def post_review(port: int, ctx, path: str, user: str, obj: dict, timeout: float = 30) -> dict:
    """The ``response`` of a GKMCache AdmissionReview by ``user`` posted to a webhook server on
    127.0.0.1 (``ctx``: TLS trusting its CA)."""
    import http.client

    from tests.controller.test_webhook_server import review

    body = review(obj=obj)
    body["request"].update(kind={"group": G, "version": V, "kind": "GKMCache"}, name=obj["metadata"]["name"],
                           userInfo={"username": user})
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return json.loads(resp.read())["response"]
    finally:
        conn.close()


def clustergkmcache(e: Env, name, image, annotations=None, labels=None) -> dict:
    obj = gkmcache(f"{name}-{e.run}", image, annotations, {RUN: e.run, **(labels or {})})
    obj["kind"] = "ClusterGKMCache"
    obj["spec"]["workloadNamespaces"] = [e.ns]
    return obj


def push(e: Env, repo: str, tag: str, seed: bytes) -> tuple[str, str]:
    """Push a small kernel cache as ``repo:tag``; (tag reference, digest)."""
    src = e.tmp / f"{repo.replace('/', '_')}-{tag}-{uuid.uuid4().hex[:6]}"
    pinned = e.registry.push(triton_tree(src, seed=seed, nbytes=2000), repo, tag=tag)
    return f"{e.registry.host}/{repo}:{tag}", pinned.split("@", 1)[1]


def denial(exc) -> tuple[int, str]:
    return exc.status, json.loads(exc.body)["message"]


def annotations(obj) -> dict:
    return obj["metadata"].get("annotations") or {}


def create(e: Env, body: dict) -> dict:
    return e.admin.create_namespaced_custom_object(G, V, e.ns, "gkmcaches", body)


def get(e: Env, name: str) -> dict:
    return e.admin.get_namespaced_custom_object(G, V, e.ns, "gkmcaches", name)


def replace(api, e: Env, obj: dict) -> dict:
    return api.replace_namespaced_custom_object(G, V, e.ns, "gkmcaches", obj["metadata"]["name"], obj)


# -- tests -------------------------------------------------------------------------------------------


def test_the_controller_identity_comes_from_a_self_subject_review(control_plane, env):
    assert whoami(Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")))) == CONTROLLER_USER
    assert env.hooks.identity.username() == CONTROLLER_USER


def test_a_cache_by_tag_is_pinned_at_admission(env):
    image, digest = push(env, "hooks/pin", "v1", b"pin")
    obj = create(env, gkmcache("pinned", image))
    ann = annotations(obj)
    assert ann[D] == digest
    assert int(ann[S]) > 0  # the kernel-cache image declares its size
    assert obj["spec"]["image"] == image  # the spec is the user's: the pin lives beside it


def test_a_cluster_cache_is_pinned_too(env):
    image, digest = push(env, "hooks/cluster", "v1", b"cluster")
    obj = env.admin.create_cluster_custom_object(G, V, "clustergkmcaches", clustergkmcache(env, "pinned", image))
    assert annotations(obj)[D] == digest


def test_a_forged_digest_is_overwritten_by_the_mutating_webhook(env):
    image, digest = push(env, "hooks/forged", "v1", b"forged")
    obj = create(env, gkmcache("forged", image, annotations={D: FAKE, S: "1"}))
    assert annotations(obj)[D] == digest and annotations(obj)[S] != "1"
    # and on update: the pin goes back to what it was
    obj["metadata"]["annotations"][D] = FAKE
    obj = replace(env.admin, env, obj)
    assert annotations(obj)[D] == digest


def test_a_forged_digest_is_refused_when_the_mutating_webhook_is_skipped(env):
    from kubernetes.client.rest import ApiException

    image, digest = push(env, "hooks/skipped", "v1", b"skipped")
    with pytest.raises(ApiException) as exc:
        create(env, gkmcache("skipped", image, annotations={D: FAKE}, labels={SKIP: "1"}))
    code, message = denial(exc.value)
    assert code == 403 and D in message and "is not what spec.image" in message
    # the true digest, or no pin at all, is admitted
    true_pin = create(env, gkmcache("skipped", image, annotations={D: digest}, labels={SKIP: "1"}))
    assert annotations(true_pin)[D] == digest
    assert D not in annotations(create(env, gkmcache("skipped-2", image, labels={SKIP: "1"})))


def test_status_digest_is_written_by_the_controller_only(env):
    from kubernetes.client.rest import ApiException

    image, digest = push(env, "hooks/status", "v1", b"status")
    obj = create(env, gkmcache("status", image))
    forged = copy.deepcopy(obj)
    forged["status"] = {"resolvedDigest": FAKE}
    with pytest.raises(ApiException) as exc:
        env.admin.replace_namespaced_custom_object_status(G, V, env.ns, "gkmcaches", "status", forged)
    code, message = denial(exc.value)
    assert code == 403 and "status.resolvedDigest is written only by the accelnode controller" in message
    assert "status" not in get(env, "status") or not get(env, "status")["status"].get("resolvedDigest")

    mine = copy.deepcopy(obj)
    mine["status"] = {"resolvedDigest": digest}
    out = env.controller.replace_namespaced_custom_object_status(G, V, env.ns, "gkmcaches", "status", mine)
    assert out["status"]["resolvedDigest"] == digest

    # anyone may still write the rest of the status; the digest stays
    out["status"]["counts"] = {"nodeCnt": 1}
    out = env.admin.replace_namespaced_custom_object_status(G, V, env.ns, "gkmcaches", "status", out)
    assert out["status"] == {"resolvedDigest": digest, "counts": {"nodeCnt": 1}}
    # and changing it back is refused again
    out["status"]["resolvedDigest"] = FAKE
    with pytest.raises(ApiException) as exc:
        env.admin.replace_namespaced_custom_object_status(G, V, env.ns, "gkmcaches", "status", out)
    assert exc.value.status == 403


def test_the_status_digest_of_a_cluster_cache_too(env):
    from kubernetes.client.rest import ApiException

    image, digest = push(env, "hooks/cluster-status", "v1", b"cs")
    obj = env.admin.create_cluster_custom_object(G, V, "clustergkmcaches", clustergkmcache(env, "status", image))
    name = obj["metadata"]["name"]
    obj["status"] = {"resolvedDigest": FAKE}
    with pytest.raises(ApiException) as exc:
        env.admin.replace_cluster_custom_object_status(G, V, "clustergkmcaches", name, obj)
    assert exc.value.status == 403 and "status.resolvedDigest" in denial(exc.value)[1]
    obj["status"] = {"resolvedDigest": digest}
    assert env.controller.replace_cluster_custom_object_status(
        G, V, "clustergkmcaches", name, obj)["status"]["resolvedDigest"] == digest


def test_the_controllers_own_writes_pass_untouched(env):
    image, digest = push(env, "hooks/mirror", "v1", b"mirror")
    obj = create(env, gkmcache("mirror", image))
    calls = len(env.calls)
    obj["metadata"]["annotations"][D] = FAKE  # what only the controller may do (say, mirroring its status)
    obj["metadata"]["finalizers"] = ["gkm.io/cache"]
    out = replace(env.controller, env, obj)
    assert annotations(out)[D] == FAKE and out["metadata"]["finalizers"] == ["gkm.io/cache"]
    mine = [resp for _, req, resp in env.calls[calls:] if req.get("name") == "mirror"]
    assert mine and all(r.allowed and not r.patch for r in mine)
    out["metadata"]["finalizers"] = []
    replace(env.controller, env, out)


def test_registry_down_admits_unpinned_with_a_warning(env):
    (dead,) = free_ports(1)
    image = f"127.0.0.1:{dead}/hooks/down:v1"
    obj, status, headers = env.admin.create_namespaced_custom_object_with_http_info(
        G, V, env.ns, "gkmcaches", gkmcache("down", image, annotations={D: FAKE}))
    assert status == 201
    assert D not in annotations(obj)  # the forged pin is dropped, not kept
    warning = headers.get("Warning") or ""
    assert "not set: the registry is unreachable" in warning and "when the registry answers" in warning, headers


def test_an_image_not_in_the_registry_is_admitted_unpinned(env):
    obj, _, headers = env.admin.create_namespaced_custom_object_with_http_info(
        G, V, env.ns, "gkmcaches", gkmcache("missing", f"{env.registry.host}/hooks/nothing-here:v1"))
    assert D not in annotations(obj)
    assert "the registry has no such image" in (headers.get("Warning") or "")


@pytest.mark.parametrize("image", ["cache/app:v1", "nginx"])
def test_an_image_without_a_registry_host_is_denied(env, image):
    from kubernetes.client.rest import ApiException

    with pytest.raises(ApiException) as exc:
        create(env, gkmcache("invalid", image))
    code, message = denial(exc.value)
    assert code == 422 and f"spec.image {image!r} is not an image reference" in message, message
    assert "registry host" in message


def test_reinvocation_and_identical_updates_change_nothing(env):
    image, digest = push(env, "hooks/reinvoke", "v1", b"reinvoke")
    obj = create(env, gkmcache("reinvoke", image, labels={TOUCH: "1"}))
    assert obj["metadata"]["labels"]["touched"] == "yes" and annotations(obj)[D] == digest
    calls = env.mutate_calls("reinvoke")
    assert len(calls) == 2, "the API server re-invokes our webhook after the second one changed the object"
    assert calls[0][1].patch and calls[1][1].patch is None
    # an update that changes nothing: no patch, no write
    out = replace(env.admin, env, copy.deepcopy(obj))
    assert out["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]
    assert env.mutate_calls("reinvoke")[-1][1].patch is None


def test_a_moved_tag_does_not_move_a_pinned_cache(env):
    image, first = push(env, "hooks/moved", "v1", b"one")
    obj = create(env, gkmcache("moved", image))
    assert annotations(obj)[D] == first
    _, second = push(env, "hooks/moved", "v1", b"two")
    assert second != first
    env.resolver.forget(image)  # the Resolver would otherwise still remember the first answer
    obj["metadata"].setdefault("labels", {})["edited"] = "yes"
    out = replace(env.admin, env, obj)
    assert annotations(out)[D] == first and out["metadata"]["labels"]["edited"] == "yes"
    # the tag does name the new image: a new cache of that tag pins it
    assert annotations(create(env, gkmcache("moved-new", image)))[D] == second
    # rolling is changing spec.image
    image2, third = push(env, "hooks/moved", "v2", b"three")
    out["spec"]["image"] = image2
    assert annotations(replace(env.admin, env, out))[D] == third


# -- wired into `accelnode controller` ----------------------------------------------------------------


def test_accelnode_controller_serves_the_cache_webhooks(env, controllers, fresh_lease, tmp_path):
    """The routes, the registry flags and the SelfSubjectReview as `accelnode controller` wires
    them (AdmissionReviews posted straight to the process)."""
    import ssl

    image, digest = push(env, "hooks/cli", "v1", b"cli")
    cert, key, _ = env.ca.serving(tmp_path, "accelnode-controller")
    (port,) = free_ports(1)
    proc = controllers("hooks-cli", "--webhook-address", f"127.0.0.1:{port}", "--tls-cert-file", cert,
                       "--tls-key-file", key, "--plain-http", "--registry-timeout", "30")
    ctx = ssl.create_default_context(cadata=env.ca.pem.decode())

    def post(path: str, user: str, obj: dict) -> dict:
        return post_review(port, ctx, path, user, obj)

    deadline = time.monotonic() + 30
    while True:
        try:
            first = post(MUTATE_GKMCACHE, "alice", gkmcache("c", image))
            break
        except (ConnectionError, OSError):
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
            time.sleep(0.1)
    (op,) = json.loads(base64.b64decode(first["patch"]))
    assert (op["op"], op["path"], op["value"][D]) == ("add", "/metadata/annotations", digest)
    assert op["value"][S].isdigit()
    assert not post(VALIDATE_GKMCACHE, "alice", gkmcache("c", "nginx"))["allowed"]
    forged = gkmcache("c", "nginx", annotations={D: FAKE})
    assert post(VALIDATE_GKMCACHE, CONTROLLER_USER, forged)["allowed"]
    assert post(MUTATE_CLUSTERGKMCACHE, CONTROLLER_USER, forged) == {"uid": first["uid"], "allowed": True}
    assert not post(VALIDATE_CLUSTERGKMCACHE, "alice", forged)["allowed"]
