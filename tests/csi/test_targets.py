"""Target paths as real nodes have them: kubelet's root behind a symlink, odd characters, things
already at the target, mounts that went away, and calls racing on one target."""

from __future__ import annotations

import threading

import grpc

from csi_driver import mounts
from csi_driver.api import csi

from .conftest import code_of, error_of, mount_count
from .test_publish import assert_published

Code = grpc.StatusCode


def test_kubelet_root_behind_a_symlink_with_odd_characters(node, images):
    """/var/lib/kubelet is a symlink on some distributions (--kubelet-dir names the link; targets
    are compared by real path); the mount table shows resolved paths, octal-escaping spaces and
    backslashes."""
    real = node.root / "real disk\\kubelet"
    real.mkdir()
    node.set_kubelet_dir(node.root / "kubelet-link")
    node.kubelet_dir.symlink_to(real)
    node.agent.start()
    node.csi.start()
    stub = node.node_stub()
    vol = node.volume(images.tpu, name="cache vol")
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    stub.NodePublishVolume(vol.publish_request(), timeout=60)  # recognised as ours: no second mount
    assert mount_count(vol.target) == 1 and mounts.is_mountpoint(vol.target)
    assert_published(vol)
    stats = stub.NodeGetVolumeStats(csi.NodeGetVolumeStatsRequest(volume_id=vol.volume_id,
                                                                   volume_path=str(vol.target)), timeout=30)
    assert not stats.volume_condition.abnormal, stats.volume_condition.message
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert mount_count(vol.target) == 0 and not vol.target.exists()
    assert node.references() == {}


def test_something_already_at_the_target(running_node, images):
    stub = running_node.node_stub()
    vol = running_node.volume(images.tpu)
    vol.target.parent.mkdir(parents=True)
    vol.target.write_bytes(b"a file")
    err = error_of(stub.NodePublishVolume, vol.publish_request())
    assert err.code() == Code.FAILED_PRECONDITION and "not an empty directory" in err.details()
    assert vol.target.read_bytes() == b"a file"
    vol.target.unlink()
    vol.target.mkdir()
    (vol.target / "kept").write_bytes(b"x")
    assert code_of(stub.NodePublishVolume, vol.publish_request()) == Code.FAILED_PRECONDITION  # never hidden under a mount
    assert (vol.target / "kept").exists() and mount_count(vol.target) == 0
    (vol.target / "kept").unlink()
    vol.target.rmdir()
    vol.target.symlink_to(running_node.root)
    err = error_of(stub.NodePublishVolume, vol.publish_request())
    assert err.code() == Code.FAILED_PRECONDITION and "symlink" in err.details()
    assert mount_count(running_node.root) == 0
    assert running_node.references() == {}  # no reference taken by any refused publish


def test_mount_removed_behind_the_drivers_back(running_node, images):
    stub = running_node.node_stub()
    vol = running_node.volume(images.tpu)
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    mounts.unmount(vol.target)
    stats = stub.NodeGetVolumeStats(csi.NodeGetVolumeStatsRequest(volume_id=vol.volume_id,
                                                                   volume_path=str(vol.target)), timeout=30)
    assert stats.volume_condition.abnormal and "no longer a mount point" in stats.volume_condition.message
    stub.NodePublishVolume(vol.publish_request(), timeout=60)  # kubelet's retry mounts it again
    assert_published(vol)
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)


def test_mount_flags_noexec_applied(running_node, images):
    vol = running_node.volume(images.tpu)
    req = vol.publish_request()
    req.volume_capability.mount.mount_flags.extend(["ro", "noexec"])
    req.volume_capability.mount.fs_type = "ext4"  # a PV's default: meaningless for a bind mount, ignored
    running_node.node_stub().NodePublishVolume(req, timeout=60)
    assert {"ro", "nosuid", "nodev", "noexec"} <= mounts.top_mount(vol.target).options
    plain = vol.publish_request()  # the same volume without noexec: not what is mounted there
    assert error_of(running_node.node_stub().NodePublishVolume, plain).code() == Code.ALREADY_EXISTS
    running_node.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=30)


def test_writer_access_mode_still_mounts_read_only(running_node, images):
    """Kubelet asks SINGLE_NODE_WRITER for every inline volume; a RWX PV asks MULTI_NODE_MULTI_WRITER."""
    vol = running_node.volume(images.tpu)
    req = vol.publish_request()
    req.volume_capability.access_mode.mode = csi.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER
    running_node.node_stub().NodePublishVolume(req, timeout=60)
    assert_published(vol)
    running_node.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=30)


def test_racing_calls_on_one_target(running_node, images):
    """Kubelet losing state may send the same publish (then unpublish) several times at once:
    each call succeeds or is ABORTED, and the result is one mount, then none."""
    stub = running_node.node_stub()
    vol, warm = running_node.volume(images.tpu), running_node.volume(images.tpu, pod_name="warm")
    stub.NodePublishVolume(warm.publish_request(), timeout=60)  # installed: the race is on the target alone

    def race(call, request) -> set[grpc.StatusCode]:
        start, codes = threading.Barrier(8), []

        def one():
            start.wait()
            try:
                call(request, timeout=60)
                codes.append(Code.OK)
            except grpc.RpcError as e:
                codes.append(e.code())

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return set(codes)

    assert race(stub.NodePublishVolume, vol.publish_request()) <= {Code.OK, Code.ABORTED}
    stub.NodePublishVolume(vol.publish_request(), timeout=60)  # whatever was aborted, it is published now
    assert mount_count(vol.target) == 1
    assert vol.volume_id in running_node.references()
    assert race(stub.NodeUnpublishVolume, vol.unpublish_request()) <= {Code.OK, Code.ABORTED}
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert mount_count(vol.target) == 0 and not vol.target.exists()
    assert vol.volume_id not in running_node.references()
    stub.NodeUnpublishVolume(warm.unpublish_request(), timeout=30)
