"""Prefetch: caches meant for this node are pulled before any pod asks for them."""

from __future__ import annotations

import uuid

from tests.agent.conftest import eventually
from tests.agent.test_prefetch_signatures import own_image
from tests.agent.test_status import digest_of, entry, entry_in


def test_node_selector_match_is_pulled_without_a_pod(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory().start()
    cluster.cache("for-tpus", images.tpu, namespace=ns,
                  node_selector={"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice"})
    e = entry_in("Extracted", cluster, node.name, ns, "for-tpus", digest_of(images.tpu))
    assert e is not None, cluster.node_status(node.name, ns)
    assert node.store.installed(digest_of(images.tpu)) is not None


def test_node_selector_mismatch_is_not_pulled(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory().start()
    cluster.cache("for-gpus", images.shared, namespace=ns, node_selector={"nvidia.com/gpu.present": "true"})
    cluster.cache("marker", images.tpu, namespace=ns, node_selector={"cloud.google.com/gke-tpu-topology": "2x2"})
    # the matching one is pulled; by then the reporter has judged both
    assert entry_in("Extracted", cluster, node.name, ns, "marker", digest_of(images.tpu))
    assert node.store.installed(digest_of(images.shared)) is None
    assert entry(cluster, node.name, ns, "for-gpus", digest_of(images.shared)) is None


def test_prefetch_annotation_pulls_only_what_fits(cluster, node_factory, images):
    node = node_factory().start()
    gpu = cluster.cache(f"gpu-{node.name}", images.gpu, annotations={"accelnode.io/prefetch": "true"})
    tpu = cluster.cache(f"tpu-{node.name}", images.shared, annotations={"accelnode.io/prefetch": "true"})
    assert entry_in("Extracted", cluster, node.name, None, tpu["metadata"]["name"], digest_of(images.shared))
    outcome = eventually(lambda: node.reporter.prefetcher.outcome(("", gpu["metadata"]["name"]), images.gpu))
    assert outcome is not None and not outcome.fits and outcome.failed is None
    assert node.store.installed(digest_of(images.gpu)) is None, "an image for other accelerators was pulled"
    assert gpu["metadata"]["name"] not in cluster.node_status(node.name)["caches"]


def test_tag_only_cache_waits_for_its_resolved_digest(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory().start()
    tag = images.tpu.rsplit("@", 1)[0] + ":v1"
    cluster.cache("tagged", tag, namespace=ns, node_selector={"cloud.google.com/gke-tpu-topology": "2x2"})
    # what the controller does once it resolved the tag
    cluster.objs.patch_namespaced_custom_object_status(
        "gkm.io", "v1alpha1", ns, "gkmcaches", "tagged", body={"status": {"resolvedDigest": digest_of(images.tpu)}})
    assert entry_in("Extracted", cluster, node.name, ns, "tagged", digest_of(images.tpu))


def test_prefetched_cache_removed_by_gc_is_pulled_again(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory().start()
    d = digest_of(images.tpu)
    cluster.cache("kept", images.tpu, namespace=ns, node_selector={"cloud.google.com/gke-tpu-topology": "2x2"})
    assert entry_in("Extracted", cluster, node.name, ns, "kept", d)
    assert node.store.gc() == [d]  # what `accelnode cache gc` does: nothing uses it
    node.reporter.poke()  # the CLI runs in another process; the agent sees it at its next look
    assert eventually(lambda: node.store.installed(d) is not None), "the gc'd prefetch was not pulled again"
    assert entry_in("Extracted", cluster, node.name, ns, "kept", d)


def test_only_the_controllers_pin_is_prefetched(cluster, node_factory, images, kube_namespace, registry, tmp_path):
    """A digest only ``spec.image`` names (the tenant wrote it; the controller has not pinned and
    checked it) is not pulled onto the node before any pod asks; the controller's pin is."""
    ns = kube_namespace
    label = {"pin-test": uuid.uuid4().hex[:8]}  # matches no other test's selector
    image = own_image(registry, tmp_path, "unpinned")
    node = node_factory(labels=label).start()
    cluster.cache("unpinned", image, namespace=ns, node_selector=label, pin=False)
    cluster.cache("marker", images.shared, namespace=ns, node_selector=label)
    assert entry_in("Extracted", cluster, node.name, ns, "marker", digest_of(images.shared))
    node.reporter.poke()
    assert entry_in("Extracted", cluster, node.name, ns, "marker", digest_of(images.shared))
    assert node.store.installed(digest_of(image)) is None, "a digest the controller never pinned was prefetched"
    assert entry(cluster, node.name, ns, "unpinned", digest_of(image)) is None
    cluster.pin(ns, "unpinned", digest_of(image))
    assert entry_in("Extracted", cluster, node.name, ns, "unpinned", digest_of(image))
