"""Bounded work in the agent, for real: pulls beyond ``--max-pulls`` queue (a real ``accelnode
agent`` process behind a stalling registry proxy), and a size-limited tmpfs as the store's file
system for the free-space check, a disk that fills up mid-extraction, and watermark collection
(least recently used first, never a referenced cache)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry

from accelnode.hw.accelerators import Accelerator
from agent import core
from agent.store import CacheStore, Capacity
from tests.agent.conftest import eventually
from tests.cache.helpers import GZ, tar
from tests.cache.test_store import _layer_digests, triton_tree
from tests.conftest import http_get

MiB = 1 << 20


def agent_on(store: CacheStore, **kw) -> tuple[core.Agent, CollectorRegistry]:
    reg = CollectorRegistry()
    return core.Agent(store, [Accelerator("cuda", "sm_90", 1, "test")], core.Metrics(reg), **kw), reg


def leftovers(root) -> list[str]:
    return sorted(os.listdir(root / "tmp")) + sorted(os.listdir(root / "caches"))


def test_a_pull_that_cannot_fit_is_refused_before_any_download(registry, tmpfs, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src", nbytes=20 * MiB), "capacity/too-big")
    agent, _ = agent_on(CacheStore(tmpfs / "store", registry=registry.options(), capacity=Capacity(MiB, 85, 70)))
    answer = agent.ensure(image, 30)
    assert answer.state == core.FAILED and answer.failure == core.NO_SPACE, answer
    assert "no space left on device for this image: it declares 20.0 MiB" in answer.message, answer.message
    assert "(--pull-headroom)" in answer.message
    assert registry.blob_gets(_layer_digests(registry, image)[0]) == 0  # refused from the manifest alone
    assert leftovers(tmpfs / "store") == []


def test_a_disk_that_fills_up_mid_extraction_leaves_nothing(registry, tmpfs):
    # the image under-states itself: 4 MiB of layer, 28 MiB once unpacked, a label saying 1000 bytes
    layer = tar(("io.triton.cache/k/kernel.bin", "file", os.urandom(4 * MiB) + bytes(24 * MiB)))
    labels = {"cache.triton.image/summary": '{"targets": []}', "cache.triton.image/cache-size-bytes": "1000"}
    image = registry.push_raw("capacity/liar", "v1", layers=[(GZ, layer)], config={"config": {"Labels": labels}})
    store = CacheStore(tmpfs / "store", registry=registry.options(), capacity=Capacity(0, 85, 70))
    agent, _ = agent_on(store)
    answer = agent.ensure(image, 60)
    assert answer.state == core.FAILED and answer.failure == core.NO_SPACE, answer
    assert "no space left on device in the store's file system" in answer.message, answer.message
    assert "nothing of it was kept" in answer.message
    assert leftovers(tmpfs / "store") == []
    used, _, _ = store.usage()
    assert used < MiB, f"{used} bytes still used after the failed pull"
    # the disk is usable again: a pull that fits goes through
    fits = registry.push_raw("capacity/fits", "v1", layers=[(GZ, tar(("io.triton.cache/k/kernel.bin", "file",
                                                                      os.urandom(MiB))))],
                             config={"config": {"Labels": {"cache.triton.image/summary": '{"targets": []}'}}})
    assert agent.ensure(fits, 60).state == core.READY


def test_watermark_collection_frees_least_recently_used_unreferenced_caches(registry, tmpfs, tmp_path):
    store = CacheStore(tmpfs / "store", registry=registry.options())  # no watermarks while filling
    agent, metrics = agent_on(store)
    images = {n: registry.push(triton_tree(tmp_path / n, nbytes=2 * MiB, seed=n.encode()), f"capacity/lru-{n.lower()}")
              for n in "ABCDEF"}
    digests = {n: i.rsplit("@", 1)[1] for n, i in images.items()}
    for n in "ABCDE":
        assert agent.ensure(images[n], 60).state == core.READY
    os.utime(store._dir(digests["C"]), (1, 1))  # the order of last use: C, D, E, then A (asked again)
    os.utime(store._dir(digests["D"]), (2, 2))
    os.utime(store._dir(digests["E"]), (3, 3))
    for n in "AB":
        os.utime(store._dir(digests[n]), (0, 0))
    assert agent.ensure(images["A"], 1).state == core.READY  # a hand-out is a use
    agent.acquire("vol-b", "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/b/mount", digests["B"],
                  {"namespace": "ns", "name": "p", "uid": "u"})  # B: oldest after C..E, but referenced
    os.utime(store._dir(digests["B"]), (0, 0))
    used, total, _ = store.usage()
    assert 0.55 < used / total < 0.7, used / total

    # low watermark 0: collect every unreferenced cache but those used in the last 10 minutes
    store.capacity = Capacity(0, 70, 0, min_idle_seconds=600)
    assert agent.collect_to_watermark() == []  # under the high watermark: the periodic check does nothing
    assert metrics.get_sample_value("accelnode_agent_gc_runs_total") in (None, 0.0)

    # a 2 MiB pull would take it past 70%: collect first, least recently used first; A was just
    # handed out (its volume is about to reference it) and stays
    assert agent.ensure(images["F"], 60).state == core.READY
    left = {i.digest for i in store.list()}
    assert left == {digests[n] for n in "ABF"}, sorted(n for n, d in digests.items() if d in left)
    assert metrics.get_sample_value("accelnode_agent_gc_runs_total") == 1
    assert metrics.get_sample_value("accelnode_agent_gc_removed_total") == 3
    assert metrics.get_sample_value("accelnode_agent_gc_freed_bytes_total") >= 6 * MiB

    # everything left referenced and the disk past the watermark: nothing goes, the pull is refused
    agent.acquire("vol-a", "/var/lib/kubelet/pods/q/volumes/kubernetes.io~csi/a/mount", digests["A"],
                  {"namespace": "ns", "name": "q", "uid": "v"})
    agent.acquire("vol-f", "/var/lib/kubelet/pods/r/volumes/kubernetes.io~csi/f/mount", digests["F"],
                  {"namespace": "ns", "name": "r", "uid": "w"})
    big = registry.push(triton_tree(tmp_path / "big", nbytes=10 * MiB), "capacity/big")
    answer = agent.ensure(big, 60)
    assert answer.state == core.FAILED and "would free 0.0 MiB more, so nothing was collected" in answer.message, answer
    assert {i.digest for i in store.list()} == {digests[n] for n in "ABF"}
    assert metrics.get_sample_value("accelnode_agent_gc_runs_total") == 1  # no collection that could not help


def test_pulls_beyond_the_cap_queue_in_order_and_answer_pulling(registry, tmp_path):
    """A real agent with --max-pulls 1: one pull stalls at the registry, the next ones queue; the
    CSI driver's EnsureCache gets PULLING (its UNAVAILABLE, retried) with the place in the queue."""
    from accelnode import grpcutil
    from agent.api import agent as api
    from agent.api import agent_grpc
    from tests.cache.helpers import FaultProxy
    from tests.csi.conftest import Daemon, free_ports

    stalled = registry.push(triton_tree(tmp_path / "s", nbytes=2 * MiB), "capacity/stalled")
    proxy = FaultProxy(registry.host, cut_after=100_000, cut_digest=_layer_digests(registry, stalled)[0], stall=True)
    waiting = [registry.push(triton_tree(tmp_path / n, nbytes=100_000, seed=n.encode()), f"capacity/q{n}")
               for n in "12"]
    port = free_ports(1)[0]
    sock = tmp_path / "agent.sock"
    daemon = Daemon("agent", ["agent", "--store", str(tmp_path / "store"), "--socket", str(sock), "--plain-http",
                              "--registry-timeout", "5", "--max-pulls", "1", "--metrics-address", f"127.0.0.1:{port}",
                              "--log-format", "text"], sock, tmp_path).start()
    channel = grpcutil.unix_channel(sock)
    stub = agent_grpc.AgentStub(channel)

    def ensure(image, wait=0.0):
        return stub.EnsureCache(api.EnsureCacheRequest(image=image, wait_seconds=wait), timeout=wait + 30)

    try:
        first = ensure(stalled.replace(registry.host, proxy.host))
        assert first.state == api.EnsureCacheResponse.PULLING
        assert eventually(lambda: proxy.cuts == 1), "the first pull never reached the stalling blob"
        answers = [ensure(i) for i in waiting]
        assert [a.state for a in answers] == [api.EnsureCacheResponse.PULLING] * 2
        assert "queued (0 ahead; at most 1 pulls at once)" in answers[0].message, answers[0].message
        assert "queued (1 ahead" in answers[1].message, answers[1].message
        listed = {c.image: c for c in stub.ListCaches(api.ListCachesRequest(), timeout=30).caches}
        assert [listed[i].state for i in waiting] == [api.CacheInfo.PULLING] * 2
        assert listed[waiting[1]].message.startswith("queued (1 ahead"), listed[waiting[1]].message
        metrics = http_get(port, "/metrics")[1]
        assert "accelnode_agent_pulls_queued 2.0" in metrics and "accelnode_agent_pulls_in_flight 1.0" in metrics
    finally:
        proxy.close()  # the stalled pull resumes (or fails) and ends; the queue moves on
    try:
        done = api.EnsureCacheResponse.INCOMPATIBLE  # installed: the host has no accelerators, the caches target CUDA
        assert ensure(waiting[1], 60).state == done, daemon.log()
        assert ensure(waiting[0], 0).state == done
        log = daemon.log()
        order = [line for line in log.splitlines() if "pull started" in line]
        assert [i for line in order for i in waiting if i in line] == waiting, order  # FIFO
        assert "accelnode_agent_pulls_queued 0.0" in http_get(port, "/metrics")[1]
    finally:
        channel.close()
        assert daemon.stop() == 0, daemon.log()


def test_a_declared_size_beyond_the_store_evicts_nothing(registry, tmpfs, tmp_path):
    """The attack (issue 33, 3): an image whose cache-size-bytes label says 10^18, or 8x the
    store's file system. On main the pull first collected every idle cache of the node (other
    tenants' too), then was refused, again on every retry."""
    store = CacheStore(tmpfs / "store", registry=registry.options(), capacity=Capacity(0, 85, 70))
    agent, metrics = agent_on(store)
    idle = [registry.push(triton_tree(tmp_path / n, nbytes=2 * MiB, seed=n.encode()), f"capacity/idle-{n}")
            for n in ("a", "b", "c")]
    for image in idle:
        assert agent.ensure(image, 60).state == core.READY
    before = {i.digest for i in store.list()}
    _, total, _ = store.usage()
    for declared in (10 ** 18, 8 * total):
        labels = {"cache.triton.image/summary": '{"targets": []}',
                  "cache.triton.image/cache-size-bytes": str(declared)}
        liar = registry.push_raw("capacity/declares-too-much", str(declared), config={"config": {"Labels": labels}},
                                 layers=[(GZ, tar(("io.triton.cache/k/kernel.bin", "file", b"\1" * 1000)))])
        for _ in range(2):  # a retry changes nothing either
            answer = agent.ensure(liar, 60)
            assert {i.digest for i in store.list()} == before, answer
            assert answer.state == core.FAILED and answer.failure == core.NO_SPACE, answer
            assert "nothing was collected" in answer.message, answer.message
    assert metrics.get_sample_value("accelnode_agent_gc_runs_total") in (None, 0.0)
    assert leftovers(tmpfs / "store") == sorted(os.listdir(tmpfs / "store" / "caches"))  # no staging left
