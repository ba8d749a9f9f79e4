"""A forged AdmissionReview learns nothing a pod could not learn with its own credentials.

Any pod that reaches the controller's webhook port (the NetworkPolicy must admit the API server
from any address) can post an AdmissionReview naming any namespace, user and image: the server
cannot tell it from the API server's. Here the real ``accelnode controller`` process serves the
cache webhooks with credentials of its own (``--registry-config``) beside a namespace that lends
it a pull secret; a forger names that namespace's private image, and a cluster cache of the
controller's, and guesses a digest. The answers carry no digest, no size and the same verdict
whether the image exists or the guess is right; a public image is still pinned at admission
(docs/cache-webhooks.md, "Only what anyone may learn")."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import uuid

import pytest
from kubernetes import client

from accelnode.kube.pullsecrets import CONTROLLER, lending
from controller.caches.pinning import DIGEST_ANNOTATION as D
from controller.caches.pinning import SIZE_ANNOTATION as S
from controller.caches.webhooks import MUTATE_CLUSTERGKMCACHE, MUTATE_GKMCACHE, VALIDATE_GKMCACHE
from tests.agent.conftest import eventually, make_cache
from tests.controller.test_webhook_server import CA, review
from tests.csi.conftest import free_ports
from tests.csi.test_tenants import give_pull_secret

G, V = "gkm.io", "v1alpha1"


@pytest.fixture
def lent(kube_api, crds):
    """A namespace whose default ServiceAccount names a pull secret it lends the controller."""
    core = client.CoreV1Api(kube_api("admin"))
    rbac = client.RbacAuthorizationV1Api(kube_api("admin"))
    ns = f"forged-{uuid.uuid4().hex[:8]}"
    core.create_namespace(body={"metadata": {"name": ns}})
    yield core, rbac, ns
    core.delete_namespace(ns)


def cache(kind: str, image: str, annotations: dict | None = None) -> dict:
    meta = {"name": "c", **({"annotations": annotations} if annotations else {})}
    return {"apiVersion": f"{G}/{V}", "kind": kind, "metadata": meta, "spec": {"image": image}}


def test_a_forged_review_learns_no_digest_size_or_existence(lent, auth_registry, registry, controllers, fresh_lease,
                                                            tmp_path):
    core, rbac, ns = lent
    give_pull_secret(core, ns, auth_registry, grant=False)
    for obj in lending(ns, ["regcred"], (CONTROLLER,)):
        (rbac.create_namespaced_role if obj["kind"] == "Role" else rbac.create_namespaced_role_binding)(ns, obj)
    private = auth_registry.push(make_cache(tmp_path / "p", {"xla/p.bin": b"\x07" * 300}), f"team/p-{ns}", kind="jax")
    digest = private.split("@", 1)[1]
    tag = private.split("@", 1)[0] + ":latest"
    public = registry.push(make_cache(tmp_path / "q", {"xla/q.bin": b"\x08" * 300}), f"team/q-{ns}", kind="jax")
    ca = CA()
    cert, key, _ = ca.serving(tmp_path, "accelnode-controller")
    (port,) = free_ports(1)
    proc = controllers("forged", "--webhook-address", f"127.0.0.1:{port}", "--tls-cert-file", cert,
                       "--tls-key-file", key, "--plain-http", "--registry-timeout", "30",
                       "--registry-config", auth_registry.config_file)
    ctx = ssl.create_default_context(cadata=ca.pem.decode())

    def post(path: str, obj: dict, namespace: str | None) -> tuple[dict, str]:
        """The answer to a review a pod forged, and all of its text (patch decoded)."""
        body = review(obj=obj)
        body["request"].update(kind={"group": G, "version": V, "kind": obj["kind"]}, name="c",
                               namespace=namespace, userInfo={"username": f"system:serviceaccount:{ns}:default"})
        if namespace is None:
            del body["request"]["namespace"]
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=60)
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            answer = json.loads(resp.read())["response"]
        finally:
            conn.close()
        text = json.dumps(answer) + (base64.b64decode(answer["patch"]).decode() if answer.get("patch") else "")
        return answer, text

    def up():
        try:
            return post(MUTATE_GKMCACHE, cache("GKMCache", public), ns)
        except OSError:
            assert proc.proc.poll() is None, proc.log()
            return None
    answer, text = eventually(up, timeout=60)
    # the legitimate case: a public image is pinned at admission, as before
    assert public.split("@", 1)[1] in text and S in text, text

    # the namespace's private image (its lent pull secret), by tag and by digest
    for image in (tag, private):
        answer, text = post(MUTATE_GKMCACHE, cache("GKMCache", image), ns)
        assert answer["allowed"] and not answer.get("patch") and S not in text, text
        assert image == private or digest not in text, text
    # a cluster cache: the controller's own --registry-config
    answer, text = post(MUTATE_CLUSTERGKMCACHE, cache("ClusterGKMCache", tag), None)
    assert answer["allowed"] and digest not in text, text
    # a guess is no oracle: the right digest and a wrong one get the same verdict
    right, _ = post(VALIDATE_GKMCACHE, cache("GKMCache", tag, {D: digest}), ns)
    wrong, _ = post(VALIDATE_GKMCACHE, cache("GKMCache", tag, {D: "sha256:" + "e" * 64}), ns)
    assert right["allowed"] == wrong["allowed"] is False
    # nor is existence: an image the registry lacks answers as the one it holds
    missing, text = post(MUTATE_GKMCACHE, cache("GKMCache", tag.replace(":latest", ":nope")), ns)
    held, _ = post(MUTATE_GKMCACHE, cache("GKMCache", tag), ns)
    assert missing.get("warnings") == held.get("warnings") and missing.get("patch") == held.get("patch")
