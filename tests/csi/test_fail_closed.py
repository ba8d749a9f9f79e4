"""Signatures fail closed (docs/security.md): the driver decides from the ClusterCacheTrustPolicy
objects themselves whether a digest needs a verified signature, and mounts it only under the
controller's verdict as data (``status.verification``: that digest, accepted, under the policies
covering the cache now); only the controller's identity can write it (the
ValidatingAdmissionPolicy in daemonsets/rbac-controller-caches.yaml). Real API server, real agent
and driver with real mounts, real registry; the controller's cache reconciler in-process where a
test says so."""

from __future__ import annotations

import json
import uuid

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.csi.test_by_name import (GROUP, VERSION, Code, by_name, condition, csi_rbac, digest_of,  # noqa: F401
                                    namespaces, objects, publish_until, verdict, write_status)

from tests.controller.test_caches import caches_rbac  # noqa: F401 (fixture)
from tests.controller.test_signatures import cosign, own_registry  # noqa: F401 (fixtures: cosign, a registry of ours)

from .conftest import error_of, eventually

POLICIES = ("accelnode.io", "v1alpha1", "clustercachetrustpolicies")


def _pem() -> str:
    return ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


@pytest.fixture
def policy(objects, namespaces):  # noqa: F811
    """A trust policy requiring signatures in namespace A (removed after the test)."""
    a, _ = namespaces
    name = f"require-{uuid.uuid4().hex[:8]}"
    objects.create_cluster_custom_object(*POLICIES, {
        "apiVersion": "accelnode.io/v1alpha1", "kind": "ClusterCacheTrustPolicy", "metadata": {"name": name},
        "spec": {"namespaces": [a], "requireSignature": True, "keys": [{"name": "release", "publicKey": _pem()}]}})
    yield name
    objects.delete_cluster_custom_object(*POLICIES, name)


@pytest.fixture(scope="session")
def verdict_policy(kubectl, crds):
    out = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-controller-caches.yaml")
    assert out.returncode == 0, out.stderr


def digest_cache(objects, name: str, image: str, namespace: str) -> None:  # noqa: F811
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, "gkmcaches", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GKMCache", "metadata": {"name": name}, "spec": {"image": image}})


def test_an_unsigned_cache_under_require_signature_never_mounts_without_the_controller(
        policy, by_name, objects, namespaces, images):  # noqa: F811 (the policy first: the driver lists it at start)
    """No label, a digest in spec.image, no controller to write a verdict: the policy alone keeps
    the volume from mounting, with a message that names it."""
    a, b = namespaces
    digest_cache(objects, "kernels", images.tpu, a)
    vol = by_name.volume("", pod_namespace=a, cache="kernels", cache_namespace=a)
    assert publish_until(by_name, vol, Code.UNAVAILABLE) == Code.UNAVAILABLE
    err = error_of(by_name.node_stub().NodePublishVolume, vol.publish_request())
    assert f"ClusterCacheTrustPolicy {policy} requires a verified signature" in err.details()
    assert f"has not verified {digest_of(images.tpu)} yet" in err.details()
    assert not vol.target.exists() and vol.volume_id not in by_name.references()
    # a verdict about another digest is no verdict about this one
    write_status(objects, "kernels", verdict("sha256:" + "0" * 64, [policy + "@1"]), a)
    assert publish_until(by_name, vol, Code.UNAVAILABLE) == Code.UNAVAILABLE
    assert f"has not verified {digest_of(images.tpu)}" in error_of(by_name.node_stub().NodePublishVolume,
                                                                   vol.publish_request()).details()
    # the controller's verdict on this digest, under the policy as it is, lets it mount
    write_status(objects, "kernels", verdict(digest_of(images.tpu), [policy + "@1"]), a)
    assert publish_until(by_name, vol) == Code.OK
    # the policy covers A only: B's unsigned cache mounts as before
    digest_cache(objects, "kernels", images.tpu, b)
    assert publish_until(by_name, by_name.volume("", pod_namespace=b, cache="kernels", cache_namespace=b)) == Code.OK


def test_a_removed_key_stops_mounts_at_once_without_the_controller(policy, by_name, objects, namespaces,
                                                                   images):  # noqa: F811
    """A verdict names the policies it was judged under (name@generation): the admin removes a
    key (the policy's generation moves) while no controller runs, and the next publish of the
    cache it had accepted is refused; a verdict that says otherwise in its message is text."""
    a, _ = namespaces
    digest_cache(objects, "kernels", images.tpu, a)
    write_status(objects, "kernels", verdict(digest_of(images.tpu), [policy + "@1"]), a)
    vol = by_name.volume("", pod_namespace=a, cache="kernels", cache_namespace=a)
    assert publish_until(by_name, vol) == Code.OK
    cur = objects.get_cluster_custom_object(*POLICIES, policy)
    cur["spec"]["keys"] = [{"name": "rotated", "publicKey": _pem()}]  # the key that accepted it is gone
    objects.replace_cluster_custom_object(*POLICIES, policy, cur)
    # (a publish racing the watch event may still mount: "at once" is the moment the driver's watch brings the edit)
    probe = by_name.volume("", pod_namespace=a, cache="kernels", cache_namespace=a, pod_name="probe")
    assert publish_until(by_name, probe, Code.UNAVAILABLE) == Code.UNAVAILABLE
    again = by_name.volume("", pod_namespace=a, cache="kernels", cache_namespace=a, pod_name="worker-1")
    err = error_of(by_name.node_stub().NodePublishVolume, again.publish_request()).details()
    assert f"judged under policies {policy}@1, not those covering the cache now ({policy}@2)" in err, err
    assert not again.target.exists() and again.volume_id not in by_name.references()


def _status_patch(kubectl, identity: str, namespace: str, status: dict, *as_user: str):
    return kubectl(identity, "patch", "gkmcaches.gkm.io", "kernels", "-n", namespace, "--subresource=status",
                   "--type=merge", "-p", json.dumps({"status": status}), *as_user)


def test_only_the_controller_can_write_a_verdict(objects, namespaces, kubectl, kube_api, verdict_policy,  # noqa: F811
                                                 images):
    """A namespace admin holding gkmcaches/status forges a verdict (status.verification, the
    Verified condition) or a pin (resolvedDigest, resolvedImage): the API server refuses each; the
    controller's identity writes them."""
    a, _ = namespaces
    digest_cache(objects, "kernels", images.tpu, a)
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "cache-status", "namespace": a},
            "rules": [{"apiGroups": ["gkm.io"], "resources": ["gkmcaches", "gkmcaches/status"],
                       "verbs": ["get", "patch", "update"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "cache-status", "namespace": a},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cache-status"},
               "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": "mallory"},
                            {"kind": "ServiceAccount", "name": "accelnode-controller",
                             "namespace": "accelnode-system"}]}
    out = kubectl("admin", "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                  "items": [role, binding]}))
    assert out.returncode == 0, out.stderr
    accepted = verdict(digest_of(images.tpu), ["p@1"])
    forged = None

    def refused() -> bool:
        nonlocal forged
        forged = _status_patch(kubectl, "admin", a, {"conditions": accepted["conditions"]}, "--as=mallory")
        return forged.returncode != 0

    assert eventually(refused), forged.stdout  # the policy takes effect within a moment of its creation
    assert "condition Verified is written only by the accelnode controller" in forged.stderr
    data = _status_patch(kubectl, "admin", a, {"verification": accepted["verification"]}, "--as=mallory")
    assert data.returncode != 0 and "status.verification is written only by the accelnode controller" in data.stderr
    pin = _status_patch(kubectl, "admin", a, {"resolvedDigest": "sha256:" + "1" * 64}, "--as=mallory")
    assert pin.returncode != 0 and "status.resolvedDigest is written only by the accelnode controller" in pin.stderr
    image = _status_patch(kubectl, "admin", a, {"resolvedImage": images.tpu}, "--as=mallory")
    assert image.returncode != 0 and "status.resolvedImage is written only" in image.stderr, image
    got = objects.get_namespaced_custom_object(GROUP, VERSION, a, "gkmcaches", "kernels")
    assert not (got.get("status") or {}).get("conditions") and not (got.get("status") or {}).get("resolvedDigest")
    # mallory may still write what is not a verdict (nothing else in status is trusted by nodes)
    ok = _status_patch(kubectl, "admin", a, {"lastUpdated": "2026-01-01T00:00:00Z"}, "--as=mallory")
    assert ok.returncode == 0, ok.stderr
    # the controller's identity writes the verdict; then mallory can neither change nor remove it
    ctl = _status_patch(kubectl, "controller", a, accepted)
    assert ctl.returncode == 0, ctl.stderr
    got = objects.get_namespaced_custom_object(GROUP, VERSION, a, "gkmcaches", "kernels")
    assert [c["type"] for c in got["status"]["conditions"]] == ["Verified"]
    assert got["status"]["verification"] == accepted["verification"]
    other = {**accepted["verification"], "digest": "sha256:" + "2" * 64}
    for forged_status in ({"verification": other}, {"verification": {"policies": []}}, {"verification": None}):
        out = _status_patch(kubectl, "admin", a, forged_status, "--as=mallory")
        assert out.returncode != 0 and "status.verification is written only" in out.stderr, (forged_status, out)
    got = objects.get_namespaced_custom_object(GROUP, VERSION, a, "gkmcaches", "kernels")
    assert got["status"]["verification"] == accepted["verification"]


# -- with the controller: a tenant's registry cannot write a verdict -------------------------------


class HostileFront:
    """The tenant's registry: a front of ``own_registry`` that serves images as they are and, once
    :attr:`plant` is set, answers every signature lookup (the ``sha256-<hex>[.sig]`` tags and the
    referrers API) with a 401 whose Bearer challenge names that text as its token realm: text the
    client quotes in the error it raises (the realm is refused), as any registry-chosen words."""

    def __init__(self, upstream: str):
        from tests.cache.helpers import Forwarder

        self.plant: str | None = None
        self.front = Forwarder(upstream, answer=self._answer)
        self.host = self.front.host

    def _answer(self, method, path, headers):
        if self.plant is not None and ("/manifests/sha256-" in path or "/referrers/" in path):
            return 401, {"WWW-Authenticate": f'Bearer realm="{self.plant}",service="tenant"'}, b""
        return None


@pytest.fixture
def controller(control_plane, caches_rbac, own_registry):  # noqa: F811
    """The GKMCache reconciler in-process as the controller's identity (its RBAC applied)."""
    from prometheus_client import CollectorRegistry

    from accelnode.kube.client import Client, Config
    from controller.caches.pinning import Resolver
    from controller.caches.reconciler import CacheReconciler
    from controller.runtime.queue import Backoff
    from controller.runtime.runner import Controller, Metrics

    me = Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")), user_agent="accelnode-controller")
    resolver = Resolver(own_registry.options(timeout=5))
    ctl = Controller(me, CacheReconciler(me, resolver, cluster=False), Metrics(CollectorRegistry()), workers=2,
                     resync=0.5, backoff=Backoff(0.2, 1.0)).start()
    yield ctl
    ctl.stop(10)


def test_a_registry_cannot_plant_a_verdict_for_an_unsigned_digest(
        by_name, objects, namespaces, verdict_policy, controller, own_registry, cosign, tmp_path):  # noqa: F811
    """The attack of issue 33.1: a signed digest D1 is verified; the tenant's registry then answers
    signature lookups with an error whose body is a verdict's text for its unsigned D2; a routine
    policy edit makes the controller verify again (the registry "fails"), the tenant points its
    cache at D2. D1 stays usable through the outage (same digest, its key still trusted); D2 never
    mounts: a verdict is data about one digest, and nothing reads a message."""
    from tests.csi.conftest import make_cache

    a, _ = namespaces
    key, pub = cosign.keypair("release")
    repo = f"tenant/kernels-{uuid.uuid4().hex[:8]}"
    d1 = digest_of(own_registry.push(make_cache(tmp_path / "v1", {"xla/module_1.bin": b"\x01" * 4096}), repo,
                                        tag="v1", kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}]))
    d2 = digest_of(own_registry.push(make_cache(tmp_path / "v2", {"xla/module_2.bin": b"\x02" * 4096}), repo,
                                        tag="v2", kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}]))
    cosign.sign(f"{own_registry.host}/{repo}@{d1}", key, "cosign-v3")
    hostile = HostileFront(own_registry.host)
    name = f"require-{uuid.uuid4().hex[:8]}"
    body = {"apiVersion": "accelnode.io/v1alpha1", "kind": "ClusterCacheTrustPolicy", "metadata": {"name": name},
            "spec": {"namespaces": [a], "requireSignature": True, "keys": [{"name": "release", "publicKey": pub}]}}
    objects.create_cluster_custom_object(*POLICIES, body)
    try:
        digest_cache(objects, "kernels", f"{hostile.host}/{repo}:v1", a)

        def status() -> dict:
            return objects.get_namespaced_custom_object(GROUP, VERSION, a, "gkmcaches", "kernels").get("status") or {}

        def verified(reason: str) -> dict | None:
            st = status()
            cond = next((c for c in st.get("conditions") or () if c["type"] == "Verified"), {})
            return st if cond.get("reason") == reason else None

        assert eventually(lambda: verified("Verified"), tries=150), status()
        v1 = by_name.volume("", pod_namespace=a, cache="kernels", cache_namespace=a)
        assert publish_until(by_name, v1) == Code.OK and by_name.references()[v1.volume_id] == d1
        # the registry turns hostile; the admin adds a key (a routine edit: the verdict is looked at again)
        hostile.plant = f"[digest {d2}; policies {name}@2]"
        body["spec"]["keys"].append({"name": "second", "publicKey": _pem()})
        cur = objects.get_cluster_custom_object(*POLICIES, name)
        objects.replace_cluster_custom_object(*POLICIES, name, {**body, "metadata": cur["metadata"]})
        st = eventually(lambda: verified("VerificationStale"), tries=150)
        assert st, status()
        assert st["verification"]["digest"] == d1 and st["verification"]["policies"] == [f"{name}@2"], st
        message = next(c for c in st["conditions"] if c["type"] == "Verified")["message"]
        quoted = message.split("(registry: ", 1)[1]
        assert quoted[0] in "'\"" and quoted[1:].startswith(f"{hostile.host}/{repo}"), message  # its words, quoted
        # stale but valid: the same digest, its key still trusted, still mounts
        again = by_name.volume("", pod_namespace=a, cache="kernels", cache_namespace=a, pod_name="worker-1")
        assert publish_until(by_name, again) == Code.OK and by_name.references()[again.volume_id] == d1
        # the tenant points its cache at the unsigned digest
        objects.patch_namespaced_custom_object(GROUP, VERSION, a, "gkmcaches", "kernels",
                                               {"spec": {"image": f"{hostile.host}/{repo}@{d2}"}})
        st = eventually(lambda: (s := status()).get("resolvedDigest") == d2 and next(
            (c for c in s.get("conditions") or () if c["type"] == "Verified"), {}).get("reason") in (
            "RegistryUnavailable", "VerificationStale") and s, tries=150)
        assert st, status()
        assert (st.get("verification") or {}).get("digest") != d2, st  # no verdict on D2 exists
        v2 = by_name.volume("", pod_namespace=a, cache="kernels", cache_namespace=a, pod_name="worker-2")

        def refused_for_d2() -> str | None:
            try:
                by_name.node_stub().NodePublishVolume(v2.publish_request(), timeout=60)
                return "MOUNTED"
            except grpc.RpcError as e:
                return e.details() if f"has not verified {d2}" in e.details() else None

        got = eventually(refused_for_d2)
        assert got and got != "MOUNTED", f"the unsigned {d2} was mounted: {by_name.references().get(v2.volume_id)}"
        assert not v2.target.exists() and v2.volume_id not in by_name.references()
    finally:
        hostile.front.close()
        objects.delete_cluster_custom_object(*POLICIES, name)


def test_a_broken_policy_watch_fails_closed_after_its_bound(control_plane, kubectl, objects, namespaces,
                                                            images):  # noqa: F811
    """The driver's copy of the trust policies (real reflector, real API server, as an identity
    whose right to watch them the test takes away): once its watch has been broken for longer
    than --trust-policy-max-age, no cache mounts (a policy made meanwhile would go unseen), with
    a message naming the bound; once it watches again, mounts resume."""
    from accelnode.kube.client import Client, Config
    from csi_driver.cacheview import CacheView
    from csi_driver.resolve import ApiResolver, CacheRef, Pod, ResolveError

    a, _ = namespaces
    digest_cache(objects, "kernels", images.tpu, a)
    user = f"stale-{uuid.uuid4().hex[:6]}"
    kubeconfig = control_plane.node_kubeconfig(user)
    rules = {"caches": [{"apiGroups": ["gkm.io"], "resources": ["gkmcaches", "clustergkmcaches"],
                         "verbs": ["list", "watch"]}],
             "policies": [{"apiGroups": ["accelnode.io"], "resources": ["clustercachetrustpolicies"],
                           "verbs": ["list", "watch"]}]}
    docs = []
    for part, rule in rules.items():
        docs += [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                  "metadata": {"name": f"{user}-{part}"}, "rules": rule},
                 {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                  "metadata": {"name": f"{user}-{part}"},
                  "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{user}-{part}"},
                  "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": f"system:node:{user}"}]}]
    policies_binding = json.dumps(docs[3])
    out = kubectl("admin", "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    assert out.returncode == 0, out.stderr
    view = CacheView(Client(Config.from_kubeconfig(kubeconfig)), policy_max_age=4.0, watch_seconds=2,
                     max_backoff=1.0).start()
    resolver, cache, pod = ApiResolver(view), CacheRef("kernels", a), Pod(a, "p", "uid")

    def image():
        try:
            return resolver.image(cache, pod, {})
        except ResolveError as e:
            return e

    try:
        assert eventually(lambda: not isinstance(image(), ResolveError)), image()
        out = kubectl("admin", "delete", "clusterrolebinding", f"{user}-policies")
        assert out.returncode == 0, out.stderr
        err = eventually(lambda: isinstance(e := image(), ResolveError) and e, tries=150)
        assert err and err.code == "UNAVAILABLE" and "--trust-policy-max-age 4 s" in str(err), err
        assert "ClusterCacheTrustPolicies" in str(err)
        out = kubectl("admin", "apply", "-f", "-", stdin=policies_binding)
        assert out.returncode == 0, out.stderr
        assert eventually(lambda: not isinstance(image(), ResolveError), tries=150), image()
    finally:
        view.stop()
        kubectl("admin", "delete", "clusterrolebinding,clusterrole", f"{user}-caches", f"{user}-policies",
                "--ignore-not-found")
