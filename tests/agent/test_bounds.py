"""Every per-request structure of the agent has a bound and an expiry (issue 33, 3): pulls
waiting for a slot, failed pulls kept for ListCaches and the node's status, volume references.
The bounds are lowered here so that a handful of real pulls (against the test registry) reach
them; the 5,000-pull attack over the real sockets is in tests/csi/test_node_state.py."""

from __future__ import annotations

import hashlib
import os

import pytest

from agent import core
from agent.store import CacheStore
from tests.agent.conftest import eventually
from tests.agent.test_capacity import agent_on
from tests.cache.helpers import FaultProxy
from tests.cache.test_store import _layer_digests, triton_tree

MiB = 1 << 20


def missing(registry, i: int) -> str:
    return f"{registry.host}/bounds/rotating@sha256:{hashlib.sha256(b'gone %d' % i).hexdigest()}"


def failed(agent: core.Agent) -> list[str]:
    return [c.image for c in agent.caches() if c.state == core.FAILED]


def test_failed_pulls_are_the_latest_few_and_expire(registry, tmp_path, monkeypatch):
    monkeypatch.setattr(core, "MAX_FAILED", 4)
    agent, _ = agent_on(CacheStore(tmp_path / "store", registry=registry.options()))
    for i in range(10):
        assert agent.ensure(missing(registry, i), 30).failure == core.NOT_FOUND
    assert failed(agent) == [missing(registry, i) for i in (9, 8, 7, 6)]  # latest first
    assert agent.ensure(missing(registry, 7), 30).failure == core.NOT_FOUND  # failed again: the latest now
    assert failed(agent) == [missing(registry, i) for i in (7, 9, 8, 6)]
    assert agent._pulls == {}  # nothing in flight keeps an entry

    monkeypatch.setattr(core, "FAILED_TTL", 0.0)
    assert failed(agent) == []  # every failure older than the TTL is forgotten
    assert agent._failed == {}


def test_pulls_beyond_the_queue_bound_are_refused(registry, tmp_path, monkeypatch):
    monkeypatch.setattr(core, "MAX_QUEUED", 1)
    stalled = registry.push(triton_tree(tmp_path / "s", nbytes=2 * MiB), "bounds/stalled")
    proxy = FaultProxy(registry.host, cut_after=100_000, cut_digest=_layer_digests(registry, stalled)[0], stall=True)
    agent, _ = agent_on(CacheStore(tmp_path / "store", registry=registry.options()), max_pulls=1)
    try:
        assert agent.ensure(stalled.replace(registry.host, proxy.host), 0).state == core.PULLING
        assert eventually(lambda: proxy.cuts == 1), "the first pull never reached the stalling blob"
        assert agent.ensure(missing(registry, 1), 0).state == core.PULLING  # queued
        with pytest.raises(core.Refused) as refused:
            agent.ensure(missing(registry, 2), 0)
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        assert "1 pulls are waiting for one of 1 pull slots" in refused.value.message
        assert agent.ensure_until_done(missing(registry, 3), 1) == (False, refused.value.message.replace(
            missing(registry, 2), missing(registry, 3)))  # the prefetcher hears it as a failure
    finally:
        proxy.close()
    assert eventually(lambda: agent._pulls == {} and not agent._queue)


def test_references_are_bounded(registry, tmp_path, monkeypatch):
    monkeypatch.setattr(core, "MAX_REFERENCES", 2)
    image = registry.push(triton_tree(tmp_path / "c"), "bounds/held")
    agent, _ = agent_on(CacheStore(tmp_path / "store", registry=registry.options()))
    digest = agent.ensure(image, 60).digest
    pod = {"namespace": "ns", "name": "p", "uid": "u"}

    def target(i: int) -> str:
        return f"/var/lib/kubelet/pods/p{i}/volumes/kubernetes.io~csi/c/mount"

    for i in range(2):
        agent.acquire(f"vol-{i}", target(i), digest, pod)
    with pytest.raises(core.Refused) as refused:
        agent.acquire("vol-2", target(2), digest, pod)
    assert refused.value.code == "RESOURCE_EXHAUSTED" and "2 volume references" in refused.value.message
    agent.acquire("vol-1", target(1), digest, pod)  # taken already: idempotent, not a new one
    assert agent.release("vol-0", target(0))
    agent.acquire("vol-2", target(2), digest, pod)
    held, shown = agent.at_targets([target(2), target(0)])
    assert [(m["volume_id"], inst.digest) for m, inst in held] == [("vol-2", digest)] and shown is None


def test_installed_caches_are_bounded_in_number(registry, tmp_path, monkeypatch):
    """ListCaches lists every installed cache: their number is bounded too. The least recently
    used idle one makes room; when none may go, the pull is refused and nothing is collected."""
    from agent import store as store_module
    from agent.store import Capacity

    monkeypatch.setattr(store_module, "MAX_CACHES", 2)
    store = CacheStore(tmp_path / "store", registry=registry.options(), capacity=Capacity(0, 99, 98))
    agent, metrics = agent_on(store)
    images = [registry.push(triton_tree(tmp_path / n, seed=n.encode()), f"bounds/count-{n}") for n in "abcd"]
    digests = [agent.ensure(i, 60).digest for i in images[:2]]
    os.utime(store._dir(digests[0]), (1, 1))  # a: the least recently used
    assert agent.ensure(images[2], 60).state == core.READY
    assert {i.digest for i in store.list()} == {digests[1], images[2].rsplit("@", 1)[1]}
    assert metrics.get_sample_value("accelnode_agent_gc_removed_total") == 1

    for i, inst in enumerate(store.list()):
        agent.acquire(f"vol-{i}", f"/var/lib/kubelet/pods/p{i}/volumes/kubernetes.io~csi/c/mount", inst.digest,
                      {"namespace": "ns", "name": f"p{i}", "uid": f"u{i}"})
    before = {i.digest for i in store.list()}
    answer = agent.ensure(images[3], 60)
    assert answer.failure == core.NO_SPACE and "the store holds 2 caches, the most it keeps (2)" in answer.message
    assert {i.digest for i in store.list()} == before


def test_reference_fields_longer_than_any_real_one_are_refused(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "c"), "bounds/fields")
    agent, _ = agent_on(CacheStore(tmp_path / "store", registry=registry.options()))
    digest = agent.ensure(image, 60).digest
    target = "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/c/mount"
    for kw, field in ((dict(volume_id="v" * 513), "volume_id"), (dict(pod={"name": "é" * 127}), "name"),
                      (dict(cache=("ns", "c" * 254)), "cache.name"), (dict(target_path="/" + "t" * 512), "target_path")):
        args = {"volume_id": "vol", "target_path": target, "digest": digest, "pod": {"uid": "u"}} | kw
        with pytest.raises(core.Refused) as refused:
            agent.acquire(args.pop("volume_id"), args.pop("target_path"), args.pop("digest"), args.pop("pod"), **args)
        assert refused.value.code == "INVALID_ARGUMENT" and refused.value.message.startswith(f"{field} is "), \
            refused.value.message
    assert agent.at_targets([target]) == ([], None) and agent.store.references() == {}
