"""Write discipline and staying up: one write per change, none when nothing changed, watches
that resume or re-list, and an API server that goes away and comes back."""

from __future__ import annotations

import threading
import uuid

from accelnode.kube.client import Client, Config, custom_path
from accelnode.kube.reflector import Reflector
from tests.agent.conftest import eventually
from tests.agent.test_status import digest_of, entry_in


def status_writes(cluster, node: str) -> list[dict]:
    return [e for e in cluster.agent_writes() if (e.get("objectRef") or {}).get("name") == node]


def settle(node) -> int:
    """Make the reporter look again and wait until it has (passes are counted, not timed)."""
    before = node.reporter.writes.passes
    node.reporter.poke()
    eventually(lambda: node.reporter.writes.passes > before)
    node.reporter.poke()
    eventually(lambda: node.reporter.writes.passes > before + 1)
    return node.reporter.writes.passes


def extracted_cache(cluster, node, image, ns: str) -> str:
    """A GKMCache ``kernels`` in ``ns`` whose image the node holds, reported Extracted; its digest."""
    cluster.cache("kernels", image, namespace=ns)
    d = digest_of(image)
    node.ensure(image, (ns, "kernels"))
    assert entry_in("Extracted", cluster, node.name, ns, "kernels", d)
    return d


def test_one_write_per_state_change_and_none_when_idle(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory().start()
    d = extracted_cache(cluster, node, images.tpu, ns)
    settle(node)
    before = status_writes(cluster, node.name)

    node.acquire("vol-w", d, ns, "pod-w")
    assert entry_in("Running", cluster, node.name, ns, "kernels", d)
    settle(node)
    change = status_writes(cluster, node.name)[len(before):]
    assert [(e["verb"], e["objectRef"]["subresource"], e["objectRef"].get("namespace")) for e in change] == [
        ("update", "status", ns)], change

    # idle: the reporter runs again and again (cues, watch events of unrelated objects), writes nothing
    cluster.cache("unrelated", images.gpu, namespace=cluster.core.list_namespace().items[0].metadata.name)
    for _ in range(5):
        settle(node)
    assert status_writes(cluster, node.name)[len(before) + 1:] == []


def test_survives_an_api_server_restart(control_plane, cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory().start()
    d = extracted_cache(cluster, node, images.tpu, ns)

    control_plane.stop_apiserver()
    try:
        node.acquire("vol-r", d, ns, "pod-during-outage")  # the node keeps serving pods meanwhile
        node.reporter.poke()
        assert eventually(lambda: node.reporter.writes.failures > 0), "the reporter never tried while the API was down"
        # it backs off (cues meanwhile do not cut the wait short), and so do the watches
        for _ in range(20):
            node.reporter.poke()
        assert eventually(lambda: node.reporter.retry_in >= 2), node.reporter.retry_in
        assert eventually(lambda: node.reporter.pods.retry_in >= 2), node.reporter.pods.retry_in
    finally:
        control_plane.start_apiserver()
    e = entry_in("Running", cluster, node.name, ns, "kernels", d)
    assert e and e["pods"][0]["podName"] == "pod-during-outage"
    # the watches came back too: a cache created after the restart is seen and prefetched
    cluster.cache("after", images.shared, namespace=ns, node_selector={"cloud.google.com/gke-tpu-topology": "2x2"})
    assert entry_in("Extracted", cluster, node.name, ns, "after", digest_of(images.shared))


def test_watch_relists_when_its_resource_version_expired(control_plane, cluster, images, kube_namespace):
    cluster.cache("seen", images.tpu, namespace=kube_namespace)
    client = Client(Config.from_kubeconfig(control_plane.kubeconfig("agent")))
    changes = []
    r = Reflector(client, custom_path("gkm.io", "v1alpha1", "gkmcaches"), on_change=lambda: changes.append(1),
                  watch_seconds=5)
    r.resource_version = "1"  # long compacted: the API server answers 410 Gone
    halt = run_reflector(r)
    try:
        assert eventually(lambda: r.synced.is_set()), "the reflector never re-listed"
        assert r.relists == 1
        assert (kube_namespace, "seen") in {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in r.snapshot()}
    finally:
        assert halt(), "the reflector did not stop"


def run_reflector(r: Reflector):
    stop = threading.Event()
    t = threading.Thread(target=r.run, args=(stop,), daemon=True)
    t.start()

    def halt() -> bool:
        stop.set()
        r.interrupt()
        t.join(10)
        return not t.is_alive()

    return halt


def test_watch_of_a_kind_not_installed_yet_waits_for_its_crd(control_plane, kube_api):
    """Agent first, CRDs later: the reflector retries (no crash) and syncs once the kind is served."""
    from kubernetes import client as k8s

    group = f"g{uuid.uuid4().hex[:8]}.accelnode.io"
    agent = Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")))
    r = Reflector(agent, custom_path(group, "v1", "widgets"), on_change=lambda: None, max_backoff=2)
    halt = run_reflector(r)
    try:
        assert eventually(lambda: r.retry_in > 0), "no retry while the kind is not served"
        assert not r.synced.is_set()
        k8s.ApiextensionsV1Api(kube_api("admin")).create_custom_resource_definition(body={
            "metadata": {"name": f"widgets.{group}"},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                         "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}})
        assert eventually(lambda: r.synced.is_set(), timeout=90), "never synced after the CRD was installed"
        assert eventually(lambda: r.retry_in == 0)
    finally:
        assert halt(), "the reflector did not stop"


def test_conflict_rereads_and_writes_over_the_version_it_saw(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory(labels={}).start()
    d = extracted_cache(cluster, node, images.tpu, ns)
    # someone else writes the status: the agent's resourceVersion is stale now
    cluster.objs.patch_namespaced_custom_object_status("gkm.io", "v1alpha1", ns, "gkmcachenodes", node.name,
                                                       body={"status": {"counts": {"nodeCnt": 7}}})
    node.acquire("vol-c", d, ns, "pod-c", cache=(ns, "kernels"))
    e = entry_in("Running", cluster, node.name, ns, "kernels", d)
    assert e["pods"][0]["podName"] == "pod-c"
    assert node.reporter.writes.conflicts >= 1
    assert cluster.node_status(node.name, ns)["counts"]["nodeCnt"] == 1


def test_node_objects_are_owned_by_the_node(cluster, node_factory, images, kube_namespace):
    """So the garbage collector removes them with the Node (the agent never deletes)."""
    ns = kube_namespace
    node = node_factory(labels={}).start()
    extracted_cache(cluster, node, images.tpu, ns)
    uid = cluster.core.read_node(node.name).metadata.uid
    want = [{"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": uid}]
    objs = [cluster.objs.get_cluster_custom_object("gkm.io", "v1alpha1", "clustergkmcachenodes", node.name),
            cluster.objs.get_namespaced_custom_object("gkm.io", "v1alpha1", ns, "gkmcachenodes", node.name)]
    for obj in objs:
        assert obj["metadata"]["ownerReferences"] == want, obj["metadata"]


def test_stop_ends_every_thread_promptly(node_factory):
    node = node_factory(labels={}).start()
    assert eventually(lambda: node.reporter.writes.passes > 0)
    node.reporter.stop(timeout=10)
    alive = [t.name for t in node.reporter._threads if t.is_alive()]
    assert alive == [], alive
