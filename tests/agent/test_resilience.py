"""Write discipline and staying up: one write per change, none when nothing changed, watches
that resume or re-list, and an API server that goes away and comes back."""

from __future__ import annotations

import threading

from agent.kube import Client, Config, Reflector, custom_path
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


def test_one_write_per_state_change_and_none_when_idle(cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory().start()
    cluster.cache("kernels", images.tpu, namespace=ns)
    d = digest_of(images.tpu)
    node.ensure(images.tpu)
    assert entry_in("Extracted", cluster, node.name, ns, "kernels", d)
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
    cluster.cache("kernels", images.tpu, namespace=ns)
    d = digest_of(images.tpu)
    node.ensure(images.tpu)
    assert entry_in("Extracted", cluster, node.name, ns, "kernels", d)

    control_plane.stop_apiserver()
    try:
        node.acquire("vol-r", d, ns, "pod-during-outage")  # the node keeps serving pods meanwhile
        node.reporter.poke()
        assert eventually(lambda: node.reporter.writes.failures > 0), "the reporter never tried while the API was down"
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
    stop = threading.Event()
    t = threading.Thread(target=r.run, args=(stop,), daemon=True)
    t.start()
    try:
        assert eventually(lambda: r.synced.is_set()), "the reflector never re-listed"
        assert r.relists == 1
        assert f"{kube_namespace}/seen" in r.items
    finally:
        stop.set()
        r.interrupt()
        t.join(10)
    assert not t.is_alive()
