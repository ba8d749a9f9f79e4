"""Restarts: the agent dying in the middle of a pull, the CSI driver restarted with volumes mounted."""

from __future__ import annotations

import signal

import grpc
import pytest

from csi_driver import mounts
from csi_driver.api import agent as agent_api

from .conftest import code_of, error_of, eventually, make_cache
from .test_publish import assert_published

Code = grpc.StatusCode


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_csi_restart_keeps_mounts_and_unpublishes(running_node, images, sig):
    stub = running_node.node_stub()
    vols = [running_node.volume(images.tpu, pod_name=f"worker-{i}") for i in range(2)]
    for v in vols:
        stub.NodePublishVolume(v.publish_request(), timeout=60)
    running_node.csi.stop(sig)
    for v in vols:
        assert_published(v)  # mounts belong to the pod, not to the driver process
    running_node.csi.start()
    stub = running_node.node_stub()
    stub.NodePublishVolume(vols[0].publish_request(), timeout=60)  # still idempotent after restart
    for v in vols:
        stub.NodeUnpublishVolume(v.unpublish_request(), timeout=30)
        assert not v.target.exists()
    assert running_node.references() == {}


def test_agent_restarted_mid_pull(node, registry, slow_registry, tmp_path):
    big = make_cache(tmp_path / "big", {f"xla/module_{i}.bin": bytes([i]) * (1 << 20) for i in range(8)})
    pushed = registry.push(big, "caches/jax-v5e-big", kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}],
                           compression="none")
    image = pushed.replace(registry.host, slow_registry.host)  # the same image through a slow link
    node.set_pull_wait(0)
    node.agent.start()
    node.csi.start()
    stub, agent = node.node_stub(), node.agent_stub()
    vol = node.volume(image)

    err = error_of(stub.NodePublishVolume, vol.publish_request())
    assert err.code() == Code.UNAVAILABLE and "still being pulled" in err.details()
    states = {c.digest: c.state for c in agent.ListCaches(agent_api.ListCachesRequest(), timeout=10).caches}
    assert states[image.rsplit("@", 1)[1]] == agent_api.CacheInfo.PULLING

    node.agent.stop(signal.SIGKILL)  # dies with a half-downloaded cache
    err = error_of(stub.NodePublishVolume, vol.publish_request())
    assert err.code() == Code.UNAVAILABLE and "node agent" in err.details()
    assert not vol.target.exists()

    slow_registry.rate = None
    node.agent.start()  # the store throws the interrupted pull away; kubelet's retries start a new one
    assert eventually(lambda: code_of(stub.NodePublishVolume, vol.publish_request()) == Code.OK, tries=150)
    assert_published(vol, "io.jax.cache/xla/module_7.bin")
    assert (vol.target / "io.jax.cache/xla/module_3.bin").read_bytes() == bytes([3]) * (1 << 20)
    listing = agent.ListCaches(agent_api.ListCachesRequest(), timeout=10)
    assert [(c.state, len(c.references)) for c in listing.caches] == [(agent_api.CacheInfo.INSTALLED, 1)]
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert not mounts.is_mountpoint(vol.target)
