"""Confined mounts: the driver mounts only where kubelet publishes a CSI volume, and takes away
only mounts of the store's caches (real driver and agent, real mounts)."""

from __future__ import annotations

import ctypes
import os
import uuid
from pathlib import Path

import grpc
import pytest

from csi_driver import confine, mounts
from csi_driver.api import agent as agent_api
from csi_driver.api import csi

from .conftest import MNT_DETACH, error_of, mount_count
from .test_publish import assert_published

Code = grpc.StatusCode
CSI = "kubernetes.io~csi"


def _umount(path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.umount2(os.fsencode(path), MNT_DETACH) == 0, os.strerror(ctypes.get_errno())


def _tmpfs(path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    path.mkdir(parents=True, exist_ok=True)
    assert libc.mount(b"foreign", os.fsencode(path), b"tmpfs", 0, b"size=64k") == 0, os.strerror(ctypes.get_errno())


def _bind(source: Path, path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    path.mkdir(parents=True, exist_ok=True)
    assert libc.mount(os.fsencode(source), os.fsencode(path), None, mounts.MS_BIND, None) == 0, \
        os.strerror(ctypes.get_errno())


def _outside(node, vol) -> str:
    other = node.root / "outside" / "pods" / vol.pod_uid / "volumes" / CSI / vol.name
    other.mkdir(parents=True)
    return str(other / "mount")


def _dotdot(node, vol) -> str:
    _outside(node, vol)
    return f"{node.kubelet_dir}/pods/../../outside/pods/{vol.pod_uid}/volumes/{CSI}/{vol.name}/mount"


def _volume_dir_symlink(node, vol) -> str:
    (node.root / "elsewhere").mkdir()
    vol.target.parent.parent.mkdir(parents=True)
    vol.target.parent.symlink_to(node.root / "elsewhere")
    return str(vol.target)


def _pod_dir_symlink(node, vol) -> str:
    fake = node.root / "fake-pod"
    (fake / "volumes" / CSI / vol.name).mkdir(parents=True)
    (node.kubelet_dir / "pods").mkdir(parents=True)
    (node.kubelet_dir / "pods" / vol.pod_uid).symlink_to(fake)
    return str(vol.target)


def _in_kubelet(*parts: str):
    def make(node, vol) -> str:
        path = node.kubelet_dir.joinpath("pods", *parts[:-1])
        path.mkdir(parents=True, exist_ok=True)
        return str(path / parts[-1])
    return make


UID = str(uuid.uuid4())
REFUSED = {
    "outside-kubelet-dir": (_outside, "not into"),
    "dotdot": (_dotdot, "'..'"),
    "volume-dir-symlink-escapes": (_volume_dir_symlink, "not into"),
    "pod-dir-symlink-escapes": (_pod_dir_symlink, "not into"),
    "other-plugin": (_in_kubelet(UID, "volumes", "kubernetes.io~secret", "v", "mount"), "not where kubelet"),
    "not-a-pod-uid": (_in_kubelet("pod-a", "volumes", CSI, "v", "mount"), "not where kubelet"),
    "not-mount": (_in_kubelet(UID, "volumes", CSI, "v", "target"), "not where kubelet"),
    "too-short": (_in_kubelet(UID, "volumes", CSI, "mount"), "not where kubelet"),
    "too-deep": (_in_kubelet(UID, "volumes", CSI, "v", "mount", "mount"), "not where kubelet"),
    "plugins-dir": (lambda n, v: str(n.kubelet_dir / "plugins" / "csi.gkm.io" / "mount"), "not where kubelet"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_targets_outside_kubelets_shape_are_refused(running_node, images, case):
    make, why = REFUSED[case]
    vol = running_node.volume(images.tpu)
    target = make(running_node, vol)
    before = mounts.mount_points()
    stub = running_node.node_stub()
    err = error_of(stub.NodePublishVolume, vol.publish_request(target_path=target))
    assert err.code() == Code.INVALID_ARGUMENT, err.details()
    assert why in err.details() and confine.SHAPE in err.details() and "--kubelet-dir" in err.details()
    assert mounts.mount_points() == before
    assert not os.path.lexists(os.path.realpath(os.path.dirname(target)) + "/" + os.path.basename(target))
    assert running_node.references() == {}
    err = error_of(stub.NodeUnpublishVolume, csi.NodeUnpublishVolumeRequest(volume_id=vol.volume_id,
                                                                             target_path=target))
    assert err.code() == Code.INVALID_ARGUMENT and confine.SHAPE in err.details()


def test_unpublish_outside_leaves_the_mount_there(running_node, images):
    """A mount at a path of the wrong shape stays, whatever is mounted: the driver never looks."""
    vol = running_node.volume(images.tpu)
    outside = Path(_outside(running_node, vol))
    _tmpfs(outside)
    try:
        err = error_of(running_node.node_stub().NodeUnpublishVolume, csi.NodeUnpublishVolumeRequest(
            volume_id=vol.volume_id, target_path=str(outside)))
        assert err.code() == Code.INVALID_ARGUMENT
        assert mount_count(outside) == 1
    finally:
        _umount(outside)


def _cache_dir(node) -> Path:
    (cache,) = node.agent_stub().ListCaches(agent_api.ListCachesRequest(), timeout=10).caches
    return Path(cache.path)


def test_foreign_mounts_at_a_valid_target_stay(running_node, images):
    """A tmpfs, a bind of a directory on the store's own filesystem, and a bind of the store
    directory around a cache are not caches: unpublish answers FAILED_PRECONDITION naming what is
    there and leaves it; publish will not cover it (ALREADY_EXISTS)."""
    stub = running_node.node_stub()
    other = running_node.volume(images.tpu, pod_name="other")
    stub.NodePublishVolume(other.publish_request(), timeout=60)  # installs the cache
    cache = _cache_dir(running_node)
    plain = running_node.root / "plain"
    plain.mkdir()
    foreign = [("tmpfs", _tmpfs), ("plain", lambda p: _bind(plain, p)), ("store", lambda p: _bind(cache.parent, p))]
    for what, mount in foreign:
        vol = running_node.volume(images.tpu, pod_name=f"victim-{what}")
        vol.publish_request()  # kubelet makes the parent
        mount(vol.target)
        try:
            err = error_of(stub.NodeUnpublishVolume, vol.unpublish_request())
            assert err.code() == Code.FAILED_PRECONDITION, err.details()
            assert "not a cache of this node's store" in err.details()
            named = {"tmpfs": "tmpfs foreign", "plain": "/plain", "store": cache.parent.name}[what]
            assert named in err.details(), err.details()
            assert mount_count(vol.target) == 1
            assert error_of(stub.NodePublishVolume, vol.publish_request()).code() == Code.ALREADY_EXISTS
            assert mount_count(vol.target) == 1
        finally:
            _umount(vol.target)
        stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)  # nothing mounted now: success
        assert not vol.target.exists()
    assert set(running_node.references()) == {other.volume_id}
    stub.NodeUnpublishVolume(other.unpublish_request(), timeout=30)


def test_stacked_mounts(running_node, images):
    stub = running_node.node_stub()
    vol = running_node.volume(images.tpu)
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    cache = _cache_dir(running_node)

    # ours twice: both taken away
    mounts.bind_readonly(cache, vol.target)
    assert mount_count(vol.target) == 2
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert mount_count(vol.target) == 0 and not vol.target.exists()
    assert running_node.references() == {}

    # a foreign mount on top of ours: nothing taken, the reference kept, until it is gone
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    _tmpfs(vol.target)
    err = error_of(stub.NodeUnpublishVolume, vol.unpublish_request())
    assert err.code() == Code.FAILED_PRECONDITION and "tmpfs" in err.details()
    assert mount_count(vol.target) == 2 and vol.volume_id in running_node.references()
    _umount(vol.target)
    assert_published(vol)
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert mount_count(vol.target) == 0 and running_node.references() == {}

    # ours on top of a foreign mount: ours taken, the foreign one refused
    _tmpfs(vol.target)
    mounts.bind_readonly(cache, vol.target)
    err = error_of(stub.NodeUnpublishVolume, vol.unpublish_request())
    assert err.code() == Code.FAILED_PRECONDITION and "tmpfs" in err.details()
    assert mount_count(vol.target) == 1 and not mounts.same_directory(vol.target, cache)
    _umount(vol.target)
    stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert not vol.target.exists()


def test_unpublish_is_idempotent(running_node, images):
    stub = running_node.node_stub()
    vol = running_node.volume(images.tpu)
    stub.NodePublishVolume(vol.publish_request(), timeout=60)
    for _ in range(3):
        stub.NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
        assert mount_count(vol.target) == 0 and not vol.target.exists()
    assert running_node.references() == {}


# -- the shape alone (no processes) --------------------------------------------------------------


@pytest.mark.parametrize("uid", [str(uuid.uuid4()), "0123456789abcdef0123456789abcdef"], ids=["uuid", "static-pod"])
def test_kubelet_shaped_targets_resolve(tmp_path, uid):
    kubelet = tmp_path.resolve() / "kubelet"
    target = kubelet / "pods" / uid / "volumes" / CSI / "pvc-3f1e.cache" / "mount"
    assert confine.target(str(target), str(kubelet)) == str(target)
    link = tmp_path / "link"
    link.symlink_to(kubelet)  # kubelet's root through a symlink, either side
    assert confine.target(str(link / target.relative_to(kubelet)), str(kubelet)) == str(target)
    assert confine.target(str(target), str(link)) == str(target)


@pytest.mark.parametrize("path", [
    "pods/{uid}/volumes/kubernetes.io~csi/v/mount",  # relative
    "{k}//pods/{uid}/volumes/kubernetes.io~csi/v/mount",
    "{k}/pods/{uid}/volumes/kubernetes.io~csi/v/./mount",
    "{k}/pods/{uid}/volumes/kubernetes.io~csi/../mount",
    "{k}/pods/{upper}/volumes/kubernetes.io~csi/v/mount",
    "{k}/pods/{uid}/volumes/kubernetes.io~csi/v/mount/",
    "{k}/pods/{uid}/volumes/kubernetes.io~empty-dir/v/mount",
    "{k}/plugins/{uid}/volumes/kubernetes.io~csi/v/mount",
    "{k}-other/pods/{uid}/volumes/kubernetes.io~csi/v/mount",
])
def test_other_targets_are_refused(tmp_path, path):
    uid = str(uuid.uuid4())
    with pytest.raises(confine.OutsideKubelet, match="expected <kubelet-dir>/pods/"):
        confine.target(path.format(k=tmp_path / "kubelet", uid=uid, upper=uid.upper()), str(tmp_path / "kubelet"))
