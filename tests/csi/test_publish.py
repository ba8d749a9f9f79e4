"""Kubelet-shaped NodePublish/NodeUnpublish with real read-only bind mounts and a real registry."""

from __future__ import annotations

import errno

import grpc
import pytest

from csi_driver import mounts
from csi_driver.api import csi

from .conftest import code_of, error_of, eventually, mount_count

Code = grpc.StatusCode


def assert_published(vol, expect_file: str = "io.jax.cache/xla/index.txt") -> None:
    assert mounts.is_mountpoint(vol.target)
    assert (vol.target / expect_file).exists()
    with pytest.raises(OSError) as info:  # read-only whatever the pod asked for
        (vol.target / "written-by-pod").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    with pytest.raises(OSError):
        (vol.target / expect_file).write_bytes(b"tampered")


def test_publish_twice_unpublish_twice(running_node, images):
    stub = running_node.node_stub()
    vol = running_node.volume(images.tpu)
    assert vol.volume_id.startswith("csi-") and len(vol.volume_id) == 68
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    assert_published(vol)
    stub.NodePublishVolume(vol.publish_request(), timeout=60)  # kubelet retries: same answer, one mount
    assert mount_count(vol.target) == 1
    assert running_node.references() == {vol.volume_id: images.tpu.rsplit("@", 1)[1]}

    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert not vol.target.exists() and vol.target.parent.exists()
    assert running_node.references() == {}
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)  # again: still success


def test_readonly_flag_does_not_matter(running_node, images):
    vol = running_node.volume(images.tpu)
    running_node.node_stub().NodePublishVolume(vol.publish_request(readonly=True), timeout=60)
    assert_published(vol)
    running_node.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=30)


def test_unpublish_of_unknown_target_succeeds(running_node, images):
    vol = running_node.volume(images.tpu)
    running_node.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert not vol.target.exists()


def test_same_volume_id_other_arguments(running_node, images):
    stub = running_node.node_stub()
    vol = running_node.volume(images.tpu)
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    moved = running_node.volume(images.tpu, pod_uid=vol.pod_uid, name=vol.name)
    other_target = vol.target.parent.parent / "elsewhere" / "mount"
    other_target.parent.mkdir(parents=True)
    err = error_of(stub.NodePublishVolume, moved.publish_request(target_path=str(other_target)))
    # CSI: a non-MULTI_NODE volume at a second target path is FAILED_PRECONDITION
    assert err.code() == Code.FAILED_PRECONDITION and vol.volume_id in err.details()
    assert not other_target.exists()
    other_cache = running_node.volume(images.cluster_tpu, pod_uid=vol.pod_uid, name=vol.name)
    assert code_of(stub.NodePublishVolume, other_cache.publish_request()) == Code.ALREADY_EXISTS
    assert_published(vol)  # the first publish is untouched
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)


def test_other_volume_on_a_published_target(running_node, images):
    stub = running_node.node_stub()
    vol = running_node.volume(images.tpu)
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    intruder = running_node.volume(images.tpu, name="other-volume")
    err = error_of(stub.NodePublishVolume, intruder.publish_request(target_path=str(vol.target)))
    assert err.code() == Code.ALREADY_EXISTS and "already published" in err.details()
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)


def test_persistent_volume_shared_by_two_pods(running_node, images):
    """A ReadOnlyMany PV: kubelet publishes one volume handle at each pod's target path."""
    stub = running_node.node_stub()
    handle = "gkmcache/team-a/kernels"
    pods = [running_node.volume(images.tpu, pod_name=f"worker-{i}") for i in range(2)]
    reqs = []
    for p in pods:
        req = p.publish_request(volume_id=handle)
        req.volume_capability.access_mode.mode = csi.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY
        req.volume_context["csi.storage.k8s.io/ephemeral"] = "false"
        stub.NodePublishVolume(req, timeout=60)
        reqs.append(req)
    stub.NodePublishVolume(reqs[0], timeout=60)  # still idempotent per target
    for p in pods:
        assert_published(p)
    stub.NodeUnpublishVolume(csi.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(pods[0].target)),
                             timeout=30)
    assert_published(pods[1])
    assert list(running_node.references()) == [handle]
    stub.NodeUnpublishVolume(csi.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(pods[1].target)),
                             timeout=30)
    assert running_node.references() == {}


def test_namespace_isolation(running_node, images):
    stub = running_node.node_stub()
    own = running_node.volume(images.tpu, pod_namespace="team-a", cache_namespace="team-a")
    stub.NodePublishVolume(own.publish_request(), timeout=60)
    assert_published(own)
    foreign = running_node.volume(images.tpu, pod_namespace="team-b", cache_namespace="team-a")
    err = error_of(stub.NodePublishVolume, foreign.publish_request())
    assert err.code() == Code.PERMISSION_DENIED and "team-b/worker-0" in err.details()
    assert not foreign.target.exists()
    shared = running_node.volume(images.cluster_tpu, pod_namespace="team-b", cache="shared", cache_namespace=None)
    stub.NodePublishVolume(shared.publish_request(), timeout=60)  # a ClusterGKMCache: any namespace
    assert_published(shared, "io.jax.cache/xla/module_0002.bin")
    for v in (own, shared):
        stub.NodeUnpublishVolume(v.unpublish_request(), timeout=30)


def test_two_pods_share_one_copy(running_node, images):
    stub = running_node.node_stub()
    a, b = running_node.volume(images.tpu), running_node.volume(images.tpu, pod_name="worker-1")
    for v in (a, b):
        stub.NodePublishVolume(v.publish_request(), timeout=60)
    assert mounts.same_directory(a.target, b.target)
    stub.NodeUnpublishVolume(a.unpublish_request(), timeout=30)
    assert_published(b)
    assert set(running_node.references()) == {b.volume_id}
    stub.NodeUnpublishVolume(b.unpublish_request(), timeout=30)


def test_incompatible_cache_is_never_mounted(running_node, images):
    vol = running_node.volume(images.gpu)
    err = error_of(running_node.node_stub().NodePublishVolume, vol.publish_request())
    assert err.code() == Code.FAILED_PRECONDITION
    assert "expected cuda/" in err.details() and "found tpu/v5e x4" in err.details()
    assert not vol.target.exists()
    assert running_node.references() == {}


def test_unknown_image_is_not_found(running_node, images):
    vol = running_node.volume(images.missing)
    err = error_of(running_node.node_stub().NodePublishVolume, vol.publish_request())
    assert err.code() == Code.NOT_FOUND and "GKMCache team-a/kernels" in err.details()
    assert not vol.target.exists()


def test_volume_stats(running_node, images):
    stub = running_node.node_stub()
    vol = running_node.volume(images.tpu)
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    stats = stub.NodeGetVolumeStats(csi.NodeGetVolumeStatsRequest(volume_id=vol.volume_id,
                                                                   volume_path=str(vol.target)), timeout=30)
    (usage,) = stats.usage
    assert usage.unit == csi.VolumeUsage.BYTES and usage.used == usage.total > 0
    assert not stats.volume_condition.abnormal
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert code_of(stub.NodeGetVolumeStats, csi.NodeGetVolumeStatsRequest(
        volume_id=vol.volume_id, volume_path=str(vol.target))) == Code.NOT_FOUND


def test_probe_follows_the_agent(running_node):
    ident = running_node.identity_stub()
    assert ident.Probe(csi.ProbeRequest(), timeout=10).ready.value is True
    running_node.agent.stop()
    assert ident.Probe(csi.ProbeRequest(), timeout=10).ready.value is False
    running_node.agent.start()
    assert eventually(lambda: ident.Probe(csi.ProbeRequest(), timeout=10).ready.value)


@pytest.mark.parametrize("digest, code", [
    ("sha256:" + "ab" * 32, Code.NOT_FOUND),  # well formed, not installed
    ("sha256:nothex", Code.INVALID_ARGUMENT),
    ("md5:" + "ab" * 16, Code.INVALID_ARGUMENT),
])
def test_agent_reference_to_a_digest_it_does_not_hold(running_node, digest, code):
    from accelnode.pb import agent_pb2

    req = agent_pb2.AcquireReferenceRequest(volume_id="csi-" + "0" * 64, digest=digest,
                                            target_path="/var/lib/kubelet/pods/u/volumes/x/mount")
    err = error_of(running_node.agent_stub().AcquireReference, req)
    assert err.code() == code, err.details()
    assert digest in err.details()
    assert running_node.agent_stub().ListCaches(agent_pb2.ListCachesRequest(), timeout=30).caches == []

