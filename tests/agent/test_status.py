"""The agent reports its node's caches to the real API server: GKMCacheNode per (namespace,
node) and ClusterGKMCacheNode per node, through a publish/unpublish cycle as the CSI driver
drives it (EnsureCache, AcquireReference, ReleaseReference over the agent's gRPC API)."""

from __future__ import annotations

from agent.api import agent as agent_api
from tests.agent.conftest import eventually


def digest_of(image: str) -> str:
    return image.rsplit("@", 1)[1]


def entry(cluster, node, ns, cache, digest):
    st = cluster.node_status(node, ns) or {}
    return ((st.get("caches") or {}).get(cache) or {}).get(digest)


def entry_in(state, cluster, node, ns, cache, digest):
    """The entry once it reaches ``state`` (None if it never does within the bound)."""
    return eventually(lambda: (x := entry(cluster, node, ns, cache, digest)) and x["state"] == state and x) or None


def test_cluster_object_lists_the_nodes_accelerators(cluster, node_factory):
    node = node_factory(labels={}).start()  # matches no prefetch selector of other tests
    st = eventually(lambda: cluster.node_status(node.name))
    assert st["nodeName"] == node.name
    assert st["gpus"] == [{"gpuType": "tpu/v5e", "ids": [0, 1, 2, 3]}]
    assert st["caches"] == {}
    assert st["counts"]["nodeCnt"] == 1


def test_publish_cycle(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory(labels={}).start()  # matches no prefetch selector of other tests
    cluster.cache("kernels", images.tpu, namespace=ns)
    d1 = digest_of(images.tpu)
    eventually(lambda: cluster.node_status(node.name))
    assert cluster.node_status(node.name, ns) is None, "nothing on the node yet: no object for the namespace"

    # the CSI driver asks for the cache before the first publish: pulled, not used yet
    assert node.ensure(images.tpu, (ns, "kernels")).path
    e = entry_in("Extracted", cluster, node.name, ns, "kernels", d1)
    assert e["volumeSize"] == 4 * 2048
    assert (e["compatibleGPUs"], e["incompatibleGPUs"]) == ([0, 1, 2, 3], [])
    assert "pods" not in e
    counts = cluster.node_status(node.name, ns)["counts"]
    assert (counts["nodeNotInUseCnt"], counts["nodeInUseCnt"], counts["podRunningCnt"]) == (1, 0, 0)

    # a pod publishes it
    node.acquire("vol-1", d1, ns, "trainer-0")
    e = entry_in("Running", cluster, node.name, ns, "kernels", d1)
    assert e["pods"] == [{"podNamespace": ns, "podName": "trainer-0", "volumeId": "vol-1"}]
    counts = cluster.node_status(node.name, ns)["counts"]
    assert (counts["nodeInUseCnt"], counts["nodeNotInUseCnt"], counts["podRunningCnt"]) == (1, 0, 1)

    # the cache moves to a new build while the pod still runs the old one: Outdated
    cluster.set_image(ns, "kernels", images.tpu_v2)
    d2 = digest_of(images.tpu_v2)
    e = entry_in("Outdated", cluster, node.name, ns, "kernels", d1)
    assert e["pods"][0]["podName"] == "trainer-0"
    assert cluster.node_status(node.name, ns)["counts"]["podOutdatedCnt"] == 1
    node.ensure(images.tpu_v2, (ns, "kernels"))
    assert entry_in("Extracted", cluster, node.name, ns, "kernels", d2)

    # the old pod goes away: its digest is no longer reported
    node.release("vol-1")
    assert eventually(lambda: entry(cluster, node.name, ns, "kernels", d1) is None)
    st = cluster.node_status(node.name, ns)
    assert list(st["caches"]["kernels"]) == [d2]
    assert (st["counts"]["nodeInUseCnt"], st["counts"]["podOutdatedCnt"], st["counts"]["nodeNotInUseCnt"]) == (0, 0, 1)


def test_pods_count_only_for_caches_they_may_use(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory(labels={}).start()  # matches no prefetch selector of other tests
    cluster.cache("shared", images.shared, workload_namespaces=[ns])
    d = digest_of(images.shared)
    node.ensure(images.shared, ("", "shared"))
    node.acquire("vol-in", d, ns, "ok-pod")
    node.acquire("vol-out", d, "other-ns", "stranger")
    e = entry_in("Running", cluster, node.name, None, "shared", d)
    assert [p["podName"] for p in e["pods"]] == ["ok-pod"]


def test_incompatible_cache_is_an_error_with_a_reason(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory(labels={}).start()  # matches no prefetch selector of other tests
    cluster.cache("gpu-kernels", images.gpu, namespace=ns)
    node.ensure(images.gpu, (ns, "gpu-kernels"))
    e = entry_in("Error", cluster, node.name, ns, "gpu-kernels", digest_of(images.gpu))
    assert "built for cuda/90" in e["message"] and "tpu/v5e" in e["message"], e["message"]
    assert (e["compatibleGPUs"], e["incompatibleGPUs"]) == ([], [0, 1, 2, 3])
    assert cluster.node_status(node.name, ns)["counts"]["nodeErrorCnt"] == 1


def test_deleted_cache_still_mounted_is_deleting(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory(labels={}).start()  # matches no prefetch selector of other tests
    cluster.cache("doomed", images.tpu, namespace=ns)
    d = digest_of(images.tpu)
    node.ensure(images.tpu, (ns, "doomed"))
    node.acquire("vol-d", d, ns, "user-0")
    assert entry_in("Running", cluster, node.name, ns, "doomed", d)
    cluster.objs.delete_namespaced_custom_object("gkm.io", "v1alpha1", ns, "gkmcaches", "doomed")
    assert entry_in("Deleting", cluster, node.name, ns, "doomed", d)
    assert cluster.node_status(node.name, ns)["counts"]["podDeletingCnt"] == 1
    node.release("vol-d")
    assert eventually(lambda: cluster.node_status(node.name, ns)["caches"] == {})


def same_digest_caches(cluster, node_factory, images, ns):
    """A node with a GKMCache "local" of ``ns`` and a ClusterGKMCache (returned name) open to
    ``ns``, both on the same installed digest."""
    node = node_factory(labels={}).start()  # matches no prefetch selector of other tests
    cluster.cache("local", images.tpu, namespace=ns)
    shared = f"shared-{node.name}"
    cluster.cache(shared, images.tpu, workload_namespaces=[ns])
    node.ensure(images.tpu, (ns, "local"))
    node.ensure(images.tpu, ("", shared))
    return node, shared, digest_of(images.tpu)


def test_a_reference_counts_for_the_cache_its_volume_names(cluster, node_factory, images, kube_namespace):
    """A GKMCache and a ClusterGKMCache with the same digest, both usable from the pod's
    namespace: the pod counts only for the cache its volume names."""
    ns = kube_namespace
    node, shared, d = same_digest_caches(cluster, node_factory, images, ns)
    node.acquire("vol-c", d, ns, "uses-cluster-cache", cache=("", shared))

    e = entry_in("Running", cluster, node.name, None, shared, d)
    assert e["pods"] == [{"podNamespace": ns, "podName": "uses-cluster-cache", "volumeId": "vol-c"}]
    local = entry_in("Extracted", cluster, node.name, ns, "local", d)
    assert "pods" not in local
    assert cluster.node_status(node.name, ns)["counts"]["podRunningCnt"] == 0
    listing = node.stub().ListCaches(agent_api.ListCachesRequest(), timeout=30)
    ref = next(r for c in listing.caches for r in c.references if r.volume_id == "vol-c")
    assert (ref.cache.namespace, ref.cache.name) == ("", shared)

    # the other way round, on another volume: the namespaced cache counts it, the cluster one does not
    node.acquire("vol-n", d, ns, "uses-local-cache", cache=(ns, "local"))
    e = entry_in("Running", cluster, node.name, ns, "local", d)
    assert [p["podName"] for p in e["pods"]] == ["uses-local-cache"]
    assert [p["podName"] for p in entry(cluster, node.name, None, shared, d)["pods"]] == ["uses-cluster-cache"]


def test_a_reference_without_a_cache_falls_back_to_the_namespace(cluster, node_factory, images, kube_namespace):
    """References taken before the driver named the cache: every cache of that digest the pod's
    namespace may use counts the pod (the old inference)."""
    ns = kube_namespace
    node, shared, d = same_digest_caches(cluster, node_factory, images, ns)
    node.acquire("vol-old", d, ns, "old-driver-pod")
    assert entry_in("Running", cluster, node.name, None, shared, d)
    assert entry_in("Running", cluster, node.name, ns, "local", d)


def test_a_roll_removes_the_old_digest_from_the_node_once_its_last_pod_is_gone(cluster, node_factory, registry,
                                                                                 tmp_path, kube_namespace):
    """Rolled caches do not pile up on nodes: the old digest stays while a pod runs on it
    (Outdated), and goes from the store when that pod is gone; the new one stays."""
    from tests.agent.conftest import make_cache

    ns = kube_namespace
    v5e = [{"backend": "tpu", "arch": "v5e"}]
    old, new = (registry.push(make_cache(tmp_path / v, {"xla/m.bin": v.encode() * 3000}), f"roll/{ns}", tag=v,
                              kind="jax", targets=v5e) for v in ("v1", "v2"))
    node = node_factory(labels={}).start()  # matches no prefetch selector of other tests
    cluster.cache("rolling", old, namespace=ns)
    d1, d2 = digest_of(old), digest_of(new)
    node.ensure(old, (ns, "rolling"))
    node.acquire("vol-r", d1, ns, "runner-0")
    assert entry_in("Running", cluster, node.name, ns, "rolling", d1)

    cluster.set_image(ns, "rolling", new)
    assert entry_in("Outdated", cluster, node.name, ns, "rolling", d1)
    node.ensure(new, (ns, "rolling"))
    assert entry_in("Extracted", cluster, node.name, ns, "rolling", d2)
    assert node.store.installed(d1) is not None, "a pod still runs on the old digest"

    node.release("vol-r")
    assert eventually(lambda: node.store.installed(d1) is None)
    assert node.store.installed(d2) is not None
    assert eventually(lambda: list(cluster.node_status(node.name, ns)["caches"]["rolling"]) == [d2])


def test_a_digest_no_cache_named_is_never_collected(cluster, node_factory, registry, tmp_path, kube_namespace):
    """What a pod's own image attribute or the operator brought is not a roll's leftover."""
    from tests.agent.conftest import make_cache

    ns = kube_namespace
    v5e = [{"backend": "tpu", "arch": "v5e"}]
    named, stray = (registry.push(make_cache(tmp_path / v, {"xla/m.bin": v.encode() * 3000}), f"stray/{ns}",
                                  tag=v, kind="jax", targets=v5e) for v in ("named", "stray"))
    node = node_factory(labels={}).start()
    cluster.cache("named", named, namespace=ns)
    node.ensure(stray)
    node.ensure(named, (ns, "named"))
    assert entry_in("Extracted", cluster, node.name, ns, "named", digest_of(named))
    cluster.objs.delete_namespaced_custom_object("gkm.io", "v1alpha1", ns, "gkmcaches", "named")
    assert eventually(lambda: node.store.installed(digest_of(named)) is None)  # a deleted cache's digest goes
    assert node.store.installed(digest_of(stray)) is not None
