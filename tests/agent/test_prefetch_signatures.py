"""Prefetch and signatures (docs/signatures.md): the agent never pulls a digest whose cache's
signature was refused (condition Verified False), nor one that needs a signature and has no
verdict yet; it pulls it once the controller says Verified True."""

from __future__ import annotations

import os
import uuid

from accelnode.oci.refusal import Verdict
from tests.agent.conftest import eventually, make_cache
from tests.agent.test_status import digest_of, entry_in

SELECT = {"cloud.google.com/gke-tpu-topology": "2x2"}


def _verified(cluster, ns, name, image, status, reason):
    """The controller's verdict on ``image``'s digest (``status.verification``) and its condition."""
    v = Verdict(digest_of(image), (), status == "True", reason, "2026-01-01T00:00:00Z")
    cluster.objs.patch_namespaced_custom_object_status("gkm.io", "v1alpha1", ns, "gkmcaches", name, body={"status": {
        "verification": v.to_status(),
        "conditions": [{"type": "Verified", "status": status, "reason": reason, "message": "by the test",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})


def own_image(registry, root, name: str) -> str:
    """A v5e cache no other test names (the control plane is shared: another test's cache of the
    same digest, prefetched to this node for its own sake, would be a legitimate pull)."""
    tag = uuid.uuid4().hex[:12]
    return registry.push(make_cache(root / name, {"xla/m.bin": os.urandom(4096)}), f"signatures/{name}", tag=tag,
                         kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}])


def test_refused_or_unverified_caches_are_never_prefetched(cluster, node_factory, images, kube_namespace,
                                                            registry, tmp_path):
    ns = kube_namespace
    refused, unverdicted = own_image(registry, tmp_path, "refused"), own_image(registry, tmp_path, "unverdicted")
    node = node_factory().start()
    # pinned only once refused: a pin without a verdict on an unlabelled cache no policy covers is prefetched
    cluster.cache("refused", refused, namespace=ns, node_selector=SELECT, pin=False)
    _verified(cluster, ns, "refused", refused, "False", "WrongKey")
    cluster.pin(ns, "refused", digest_of(refused))
    body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache",
            "metadata": {"name": "labelled", "labels": {"gkm.io/signature-format": "cosign-v3"}},
            "spec": {"image": unverdicted, "podTemplate": {"spec": {"nodeSelector": SELECT}}}}
    cluster.objs.create_namespaced_custom_object("gkm.io", "v1alpha1", ns, "gkmcaches", body=body)
    cluster.pin(ns, "labelled", digest_of(unverdicted))  # pinned: only the signature rule holds it back
    # a third cache, pulled: by then the reporter has judged all three
    cluster.cache("marker", images.shared, namespace=ns, node_selector=SELECT)
    assert entry_in("Extracted", cluster, node.name, ns, "marker", digest_of(images.shared))
    assert node.store.installed(digest_of(refused)) is None, "a refused signature was pulled"
    assert node.store.installed(digest_of(unverdicted)) is None, "a cache without a verdict was pulled"
    assert node.reporter.prefetcher.outcome((ns, "refused"), refused) is None
    # the controller accepts the signature: now it is pulled
    _verified(cluster, ns, "refused", refused, "True", "Verified")
    assert eventually(lambda: node.store.installed(digest_of(refused)) is not None), "not pulled once verified"
