"""Prefetch and signatures (docs/signatures.md): the agent never pulls a digest whose cache's
signature was refused (condition Verified False), nor one that needs a signature and has no
verdict yet; it pulls it once the controller says Verified True."""

from __future__ import annotations

from tests.agent.conftest import eventually
from tests.agent.test_status import digest_of, entry_in

SELECT = {"cloud.google.com/gke-tpu-topology": "2x2"}


def _verified(cluster, ns, name, status, reason):
    cluster.objs.patch_namespaced_custom_object_status("gkm.io", "v1alpha1", ns, "gkmcaches", name, body={"status": {
        "conditions": [{"type": "Verified", "status": status, "reason": reason, "message": "by the test",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})


def test_refused_or_unverified_caches_are_never_prefetched(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory().start()
    cluster.cache("refused", images.tpu, namespace=ns, node_selector=SELECT)
    _verified(cluster, ns, "refused", "False", "WrongKey")
    body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache",
            "metadata": {"name": "labelled", "labels": {"gkm.io/signature-format": "cosign-v3"}},
            "spec": {"image": images.gpu, "podTemplate": {"spec": {"nodeSelector": SELECT}}}}
    cluster.objs.create_namespaced_custom_object("gkm.io", "v1alpha1", ns, "gkmcaches", body=body)
    # a third cache, pulled: by then the reporter has judged all three
    cluster.cache("marker", images.shared, namespace=ns, node_selector=SELECT)
    assert entry_in("Extracted", cluster, node.name, ns, "marker", digest_of(images.shared))
    assert node.store.installed(digest_of(images.tpu)) is None, "a refused signature was pulled"
    assert node.store.installed(digest_of(images.gpu)) is None, "a cache without a verdict was pulled"
    assert node.reporter.prefetcher.outcome(images.tpu) is None
    # the controller accepts the signature: now it is pulled
    _verified(cluster, ns, "refused", "True", "Verified")
    assert eventually(lambda: node.store.installed(digest_of(images.tpu)) is not None), "not pulled once verified"
