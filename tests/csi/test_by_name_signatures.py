"""The driver and signatures (docs/signatures.md): a cache labelled gkm.io/signature-format with
no verdict yet is UNAVAILABLE at publish (kubelet retries), a refused one FAILED_PRECONDITION
naming the reason, and once the controller's verdict (status.verification) accepts its digest it
mounts. Real agent, driver and API server."""

from __future__ import annotations

from tests.csi.test_by_name import (GROUP, VERSION, Code, by_name, condition, csi_rbac, digest_of,  # noqa: F401
                                    namespaces, objects, publish_until, repo_of, verdict, write_status)

from .conftest import error_of, eventually


def test_signature_required_until_verified(by_name, objects, namespaces, images):  # noqa: F811
    a, _ = namespaces
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GKMCache",
            "metadata": {"name": "signed", "labels": {"gkm.io/signature-format": "cosign-v2"}},
            "spec": {"image": repo_of(images.tpu) + ":latest"}}
    objects.create_namespaced_custom_object(GROUP, VERSION, a, "gkmcaches", body=body)
    resolved = condition("Resolved", "True", "Resolved", "pinned")
    write_status(objects, "signed", {"resolvedDigest": digest_of(images.tpu), "conditions": [resolved]}, a)
    vol = by_name.volume("", pod_namespace=a, cache="signed", cache_namespace=a)
    assert publish_until(by_name, vol, Code.UNAVAILABLE) == Code.UNAVAILABLE
    # (once the driver's view has the pin: before, the cache is UNAVAILABLE as not pinned yet)
    assert eventually(lambda: "has not verified" in error_of(by_name.node_stub().NodePublishVolume,
                                                             vol.publish_request()).details())
    refused = verdict(digest_of(images.tpu), [], False, "DigestMismatch")
    write_status(objects, "signed", {**refused, "conditions": [resolved, *refused["conditions"]]}, a)
    assert publish_until(by_name, vol, Code.FAILED_PRECONDITION) == Code.FAILED_PRECONDITION
    err = error_of(by_name.node_stub().NodePublishVolume, vol.publish_request())
    assert "failed verification: DigestMismatch" in err.details()
    assert not vol.target.exists() and vol.volume_id not in by_name.references()
    ok = verdict(digest_of(images.tpu), [])  # as the controller writes it (no policy covers namespace A)
    write_status(objects, "signed", {**ok, "conditions": [resolved, *ok["conditions"]]}, a)
    assert publish_until(by_name, vol) == Code.OK
