"""Signatures fail closed (docs/security.md): the driver decides from the ClusterCacheTrustPolicy
objects themselves whether a digest needs a verified signature, and mounts it only under a
``Verified`` condition that names it; only the controller's identity can write that condition
(the ValidatingAdmissionPolicy in daemonsets/rbac-controller-caches.yaml). No controller runs
here: real API server, real agent and driver with real mounts, real registry."""

from __future__ import annotations

import json
import uuid

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from accelnode.oci.refusal import stamp
from tests.csi.test_by_name import (GROUP, VERSION, Code, by_name, condition, csi_rbac, digest_of,  # noqa: F401
                                    namespaces, objects, publish_until, write_status)

from .conftest import error_of, eventually

POLICIES = ("accelnode.io", "v1alpha1", "clustercachetrustpolicies")


@pytest.fixture
def policy(objects, namespaces):  # noqa: F811
    """A trust policy requiring signatures in namespace A (removed after the test)."""
    a, _ = namespaces
    pem = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    name = f"require-{uuid.uuid4().hex[:8]}"
    objects.create_cluster_custom_object(*POLICIES, {
        "apiVersion": "accelnode.io/v1alpha1", "kind": "ClusterCacheTrustPolicy", "metadata": {"name": name},
        "spec": {"namespaces": [a], "requireSignature": True, "keys": [{"name": "release", "publicKey": pem}]}})
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
        by_name, objects, namespaces, policy, images):  # noqa: F811
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
    other = "sha256:" + "0" * 64
    write_status(objects, "kernels", {"conditions": [
        condition("Verified", "True", "Verified", f"signed by trusted key release {stamp(other, [policy + '@1'])}")]}, a)
    assert publish_until(by_name, vol, Code.UNAVAILABLE) == Code.UNAVAILABLE
    assert "is not about" in error_of(by_name.node_stub().NodePublishVolume, vol.publish_request()).details()
    # the controller's verdict on this digest lets it mount
    write_status(objects, "kernels", {"conditions": [condition(
        "Verified", "True", "Verified", f"signed by trusted key release {stamp(digest_of(images.tpu), [policy + '@1'])}")]},
        a)
    assert publish_until(by_name, vol) == Code.OK
    # the policy covers A only: B's unsigned cache mounts as before
    digest_cache(objects, "kernels", images.tpu, b)
    assert publish_until(by_name, by_name.volume("", pod_namespace=b, cache="kernels", cache_namespace=b)) == Code.OK


def _status_patch(kubectl, identity: str, namespace: str, status: dict, *as_user: str):
    return kubectl(identity, "patch", "gkmcaches.gkm.io", "kernels", "-n", namespace, "--subresource=status",
                   "--type=merge", "-p", json.dumps({"status": status}), *as_user)


def test_only_the_controller_can_write_a_verdict(objects, namespaces, kubectl, kube_api, verdict_policy,  # noqa: F811
                                                 images):
    """A namespace admin holding gkmcaches/status forges Verified=True (and a pin): the API server
    refuses both; the controller's identity writes them."""
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
    verdict = condition("Verified", "True", "Verified",
                        f"signed by trusted key release {stamp(digest_of(images.tpu), ['p@1'])}")
    forged = None

    def refused() -> bool:
        nonlocal forged
        forged = _status_patch(kubectl, "admin", a, {"conditions": [verdict]}, "--as=mallory")
        return forged.returncode != 0

    assert eventually(refused), forged.stdout  # the policy takes effect within a moment of its creation
    assert "condition Verified is written only by the accelnode controller" in forged.stderr
    pin = _status_patch(kubectl, "admin", a, {"resolvedDigest": "sha256:" + "1" * 64}, "--as=mallory")
    assert pin.returncode != 0 and "status.resolvedDigest is written only by the accelnode controller" in pin.stderr
    got = objects.get_namespaced_custom_object(GROUP, VERSION, a, "gkmcaches", "kernels")
    assert not (got.get("status") or {}).get("conditions") and not (got.get("status") or {}).get("resolvedDigest")
    # mallory may still write what is not a verdict (nothing else in status is trusted by nodes)
    ok = _status_patch(kubectl, "admin", a, {"lastUpdated": "2026-01-01T00:00:00Z"}, "--as=mallory")
    assert ok.returncode == 0, ok.stderr
    # the controller's identity writes the verdict
    ctl = _status_patch(kubectl, "controller", a, {"conditions": [verdict]})
    assert ctl.returncode == 0, ctl.stderr
    got = objects.get_namespaced_custom_object(GROUP, VERSION, a, "gkmcaches", "kernels")
    assert [c["type"] for c in got["status"]["conditions"]] == ["Verified"]
