"""A pod bound to the node starts its caches' pulls at once, before kubelet's NodePublishVolume
asks (agent/reporter.py ``Reporter._pod_event``), under the rules a publish applies: only
caches the pod's namespace may use, only the controller's pin."""

from __future__ import annotations

from agent import core, reporter
from csi_driver import resolve
from tests.agent.conftest import eventually


def pod(name: str, node: str, *volumes: dict) -> dict:
    return {"metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "registry.example.com/app:1"}],
                     "volumes": [{"name": f"v{i}", "csi": {"driver": "csi.gkm.io", "volumeAttributes": attrs}}
                                 for i, attrs in enumerate(volumes)]}}


def pulled_or_pulling(node, image: str) -> bool:
    digest = image.rsplit("@", 1)[1]
    return any(c.digest == digest and c.state in (core.INSTALLED, core.PULLING) for c in node.agent.caches())


def test_the_attribute_names_are_the_drivers():
    assert (reporter.CACHE_ATTR, reporter.NAMESPACE_ATTR, reporter.IMAGE_ATTR) == (
        resolve.CACHE_KEY, resolve.NAMESPACE_KEY, resolve.IMAGE_KEY)


def test_a_bound_pod_pulls_its_cache_before_any_publish(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory(labels={}).start()  # matches no prefetch selector of other tests
    cluster.cache("kernels", images.tpu, namespace=ns)
    shared = f"shared-{ns}"
    cluster.cache(shared, images.shared, workload_namespaces=[ns])
    eventually(lambda: cluster.node_status(node.name))
    assert not pulled_or_pulling(node, images.tpu)
    cluster.core.create_namespaced_pod(ns, pod("trainer", node.name, {resolve.CACHE_KEY: "kernels",
                                                                      resolve.NAMESPACE_KEY: ns},
                                               {resolve.CACHE_KEY: shared}))
    # no EnsureCache was asked: the pod watch alone started the pulls, as the caches' own requests
    for image in (images.tpu, images.shared):
        assert eventually(lambda: node.store.installed(image.rsplit("@", 1)[1]) is not None), image
    assert node.agent.proof_of(images.tpu, (ns, "kernels")) in node.agent.proven()


def test_a_bound_pod_pulls_nothing_its_namespace_may_not_use(cluster, node_factory, images, kube_namespace,
                                                             kube_api):
    from kubernetes import client

    ns = kube_namespace
    other = f"{ns}-o"
    client.CoreV1Api(kube_api("admin")).create_namespace(body={"metadata": {"name": other}})
    node = node_factory(labels={}).start()  # matches no prefetch selector of other tests
    cluster.cache("theirs", images.tpu_v2, namespace=other)  # another namespace's cache
    cluster.cache("fenced", images.gpu, workload_namespaces=[other])  # a cluster cache for another namespace
    cluster.cache("mine", images.tpu, namespace=ns)
    eventually(lambda: cluster.node_status(node.name))
    cluster.core.create_namespaced_pod(ns, pod("intruder", node.name,
                                               {resolve.CACHE_KEY: "theirs", resolve.NAMESPACE_KEY: other},
                                               {resolve.CACHE_KEY: "fenced"}))
    # the pod's own cache, asked after: once it is on the node, the others were judged long before
    cluster.core.create_namespaced_pod(ns, pod("worker", node.name, {resolve.CACHE_KEY: "mine",
                                                                     resolve.NAMESPACE_KEY: ns}))
    assert eventually(lambda: node.store.installed(images.tpu.rsplit("@", 1)[1]) is not None)
    assert not pulled_or_pulling(node, images.tpu_v2)
    assert not pulled_or_pulling(node, images.gpu)
