"""Node state is bounded (issue 33, 3), over the real driver's and agent's sockets: failed pulls
do not pile up until unpublish stops working, and a full store file system is bad input with a
status of its own, never a crash or a leftover file."""

from __future__ import annotations

import hashlib
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc

from accelnode import grpcutil
from csi_driver import mounts
from csi_driver.api import agent as agent_api
from csi_driver.api import agent_grpc

from tests.conftest import fill

from .conftest import error_of

GRPC_CAP = 4 << 20  # gRPC's default receive limit: what the driver's channel to the agent takes
FAILED_PULLS = 5000


def listing_bytes(node) -> int:
    """The size of the agent's ListCaches answer, read over a channel that takes any size."""
    with grpcutil.unix_channel(node.agent_socket, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        return len(agent_grpc.AgentStub(ch).ListCaches(agent_api.ListCachesRequest(), timeout=60).SerializeToString())


def test_unpublish_works_after_5000_failed_pulls(running_node, images, registry):
    """The attack: a tenant rotates digests that never exist (a prefetched cache's spec.image, a
    pod's volume), under names as long as references allow. On main every failure stayed
    in ListCaches forever; past 4 MiB the driver's unpublish, which listed every cache, failed,
    and pods stayed Terminating."""
    node, stub = running_node, running_node.node_stub()
    vol = node.volume(images.tpu)
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    agent = node.agent_stub()
    repo = "tenant-b/rotating/" + "r" * (254 - len(registry.host) - 18)  # names as long as a registry takes
    tag = "t" * 128

    def fail(i: int) -> int:
        image = f"{registry.host}/{repo}:{tag}@sha256:{hashlib.sha256(b'rotated %d' % i).hexdigest()}"
        for _ in range(100):  # a refusal (RESOURCE_EXHAUSTED: too many queued) is retried, as kubelet does
            try:
                return agent.EnsureCache(agent_api.EnsureCacheRequest(image=image, wait_seconds=60), timeout=90).state
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        raise AssertionError(f"{image}: never taken")

    with ThreadPoolExecutor(8) as pool:
        states = set(pool.map(fail, range(FAILED_PULLS)))
    assert states == {agent_api.EnsureCacheResponse.FAILED}
    size = listing_bytes(node)
    print(f"ListCaches answer after {FAILED_PULLS} failed pulls: {size} bytes")

    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=60)
    assert not vol.target.exists() and not mounts.is_mountpoint(vol.target)
    assert node.references() == {}
    assert size < GRPC_CAP // 16, f"ListCaches answer after {FAILED_PULLS} failed pulls: {size} bytes"
    failed = [c for c in agent.ListCaches(agent_api.ListCachesRequest(), timeout=60).caches
              if c.state == agent_api.CacheInfo.FAILED]
    assert 0 < len(failed) <= 128 and all(repo in c.image for c in failed)


def test_publish_on_a_full_store_file_system_is_resource_exhausted(node, images):
    """The attack: the store's file system fills up (a pod's view, another writer). On main
    publishing an installed cache failed with UNKNOWN "Exception calling application: [Errno 28]"
    and left refs/.<ref>.json.<pid>.<tid>.tmp behind on every try, which nothing removed."""
    node.store.mkdir()  # the fixture's cleanup detaches this mount with the rest
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(node.store)], check=True)
    node.set_agent_flags("--pull-headroom", "0")
    node.agent.start()
    node.csi.start()
    stub = node.node_stub()
    first = node.volume(images.tpu)
    stub.NodePublishVolume(first.publish_request(), timeout=60)
    fill(node.store)

    second = node.volume(images.tpu, pod_name="worker-1")
    for _ in range(3):  # each retry answers the same and leaves nothing behind
        err = error_of(stub.NodePublishVolume, second.publish_request())
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
        assert f"no space left on device in the store's file system ({node.store})" in err.details(), err.details()
        assert [n for n in os.listdir(node.store / "refs") if n.endswith(".tmp")] == []
    assert not mounts.is_mountpoint(second.target)
    assert set(node.references()) == {first.volume_id}

    # what a writer killed half-way leaves is gone at the agent's next start
    os.unlink(node.store / "filler")
    stale = node.store / "refs" / f".{'0' * 40}.json.4242.4242.tmp"
    stale.write_text("{")
    node.agent.restart()
    assert not stale.exists()
    stub.NodePublishVolume(second.publish_request(), timeout=60)  # room again: it works
    for vol in (first, second):
        stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=60)
    assert node.references() == {}
