"""NodeUnpublishVolume takes away only the volume it names (issue 23, 6b): over the driver's real
gRPC socket, with real bind mounts and the real agent's references."""

from __future__ import annotations

import grpc

from csi_driver import mounts
from csi_driver.api import csi

from .conftest import error_of, mount_count


def test_unpublish_with_another_volume_id_refuses(running_node, images):
    """The attack: a caller names volume B's id with volume A's target. On main the driver
    unmounted A (a mount of the store's cache, so "ours") and released B's reference."""
    stub = running_node.node_stub()
    a = running_node.volume(images.tpu)
    b = running_node.volume(images.cluster_tpu, pod_name="worker-1")
    stub.NodePublishVolume(a.publish_request(), timeout=60)
    stub.NodePublishVolume(b.publish_request(), timeout=60)
    before = running_node.references()

    err = error_of(stub.NodeUnpublishVolume, csi.NodeUnpublishVolumeRequest(volume_id=b.volume_id,
                                                                           target_path=str(a.target)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"holds volume {a.volume_id}, not {b.volume_id}" in err.details()
    assert mount_count(a.target) == 1 and (a.target / "io.jax.cache/xla/index.txt").exists()
    assert mounts.is_mountpoint(b.target)
    assert running_node.references() == before  # neither reference released

    err = error_of(stub.NodeUnpublishVolume, csi.NodeUnpublishVolumeRequest(volume_id="csi-made-up",
                                                                           target_path=str(a.target)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and mount_count(a.target) == 1

    for vol in (a, b):  # each with its own id: taken away
        stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
        assert not vol.target.exists()
    assert running_node.references() == {}
