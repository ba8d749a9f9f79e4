"""Bad NodePublish/NodeUnpublish requests get precise errors and change nothing."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from csi_driver.api import csi

from tests.conftest import accelnode_cmd

from .conftest import error_of

IMAGE = "127.0.0.1:5000/caches/kernels@sha256:" + "ab" * 32
Code = grpc.StatusCode


@pytest.fixture
def csi_only(node):
    node.csi.start()  # validation happens before the agent is asked anything
    return node


@pytest.mark.parametrize("field,message", [
    ("volume_id", "volume_id is required"),
    ("target_path", "target_path is required"),
])
def test_publish_requires_ids(csi_only, field, message):
    vol = csi_only.volume(IMAGE)
    req = vol.publish_request()
    req.ClearField(field)
    err = error_of(csi_only.node_stub().NodePublishVolume, req)
    assert (err.code(), err.details()) == (Code.INVALID_ARGUMENT, message)
    assert not vol.target.exists()


def test_publish_requires_capability(csi_only):
    vol = csi_only.volume(IMAGE)
    req = vol.publish_request()
    req.ClearField("volume_capability")
    err = error_of(csi_only.node_stub().NodePublishVolume, req)
    assert (err.code(), err.details()) == (Code.INVALID_ARGUMENT, "volume_capability is required")


def test_block_access_refused(csi_only):
    vol = csi_only.volume(IMAGE)
    req = vol.publish_request(volume_capability=csi.VolumeCapability(block=csi.VolumeCapability.BlockVolume()))
    err = error_of(csi_only.node_stub().NodePublishVolume, req)
    assert err.code() == Code.INVALID_ARGUMENT and "block access is not supported" in err.details()


def test_cache_name_required(csi_only):
    vol = csi_only.volume(IMAGE)
    req = vol.publish_request()
    del req.volume_context["csi.gkm.io/GKMCache"]
    err = error_of(csi_only.node_stub().NodePublishVolume, req)
    assert err.code() == Code.INVALID_ARGUMENT and "csi.gkm.io/GKMCache" in err.details()


def test_image_must_be_digest_pinned(csi_only):
    vol = csi_only.volume("127.0.0.1:5000/caches/kernels:latest")
    err = error_of(csi_only.node_stub().NodePublishVolume, vol.publish_request())
    assert err.code() == Code.INVALID_ARGUMENT and "not digest-pinned" in err.details()
    assert not vol.target.exists()


def test_without_image_attribute_the_cache_is_unknown(csi_only):
    vol = csi_only.volume(IMAGE)
    req = vol.publish_request()
    del req.volume_context["csi.gkm.io/image"]
    err = error_of(csi_only.node_stub().NodePublishVolume, req)
    assert err.code() == Code.NOT_FOUND and "GKMCache team-a/kernels" in err.details()


def test_namespaced_cache_refused_to_other_namespace(csi_only):
    vol = csi_only.volume(IMAGE, pod_namespace="team-b", cache_namespace="team-a")
    err = error_of(csi_only.node_stub().NodePublishVolume, vol.publish_request())
    assert err.code() == Code.PERMISSION_DENIED
    assert err.details() == ("GKMCache team-a/kernels may only be mounted by pods in namespace team-a; "
                             "pod team-b/worker-0 is not")
    assert not vol.target.exists()


def test_namespaced_cache_needs_pod_info(csi_only):
    vol = csi_only.volume(IMAGE)
    req = vol.publish_request()
    del req.volume_context["csi.storage.k8s.io/pod.namespace"]
    err = error_of(csi_only.node_stub().NodePublishVolume, req)
    assert err.code() == Code.INVALID_ARGUMENT and "podInfoOnMount" in err.details()


@pytest.mark.parametrize("field", ["volume_id", "target_path"])
def test_unpublish_requires_ids(csi_only, field):
    req = csi_only.volume(IMAGE).unpublish_request()
    req.ClearField(field)
    err = error_of(csi_only.node_stub().NodeUnpublishVolume, req)
    assert (err.code(), err.details()) == (Code.INVALID_ARGUMENT, f"{field} is required")


def test_agent_down_is_unavailable(csi_only):
    err = error_of(csi_only.node_stub().NodePublishVolume, csi_only.volume(IMAGE).publish_request())
    assert err.code() == Code.UNAVAILABLE and "node agent" in err.details()


def test_identity_without_agent(csi_only):
    ident = csi_only.identity_stub()
    info = ident.GetPluginInfo(csi.GetPluginInfoRequest(), timeout=10)
    assert info.name == "csi.gkm.io" and info.vendor_version
    assert list(ident.GetPluginCapabilities(csi.GetPluginCapabilitiesRequest(), timeout=10).capabilities) == []
    assert ident.Probe(csi.ProbeRequest(), timeout=10).ready.value is False


def test_node_info_and_capabilities(csi_only):
    stub = csi_only.node_stub()
    assert stub.NodeGetInfo(csi.NodeGetInfoRequest(), timeout=10).node_id == "node-a"
    rpc = csi.NodeServiceCapability.RPC
    caps = {c.rpc.type for c in stub.NodeGetCapabilities(csi.NodeGetCapabilitiesRequest(), timeout=10).capabilities}
    assert caps == {rpc.GET_VOLUME_STATS, rpc.VOLUME_CONDITION}  # no staging: caches need none


def _with_capability(vol, mutate) -> csi.NodePublishVolumeRequest:
    req = vol.publish_request()
    mutate(req.volume_capability)
    return req


@pytest.mark.parametrize("mutate,message", [
    (lambda c: c.ClearField("mount"), "needs an access type: mount"),
    (lambda c: c.ClearField("access_mode"), "is not a known access mode"),
    (lambda c: setattr(c.access_mode, "mode", 42), "42 is not a known access mode"),
    (lambda c: c.mount.mount_flags.append("rw"), "mount flag 'rw' is not supported"),
    (lambda c: c.mount.mount_flags.append("exec"), "mount flag 'exec' is not supported"),
], ids=["no-access-type", "no-access-mode", "unknown-access-mode", "flag-rw", "flag-exec"])
def test_bad_volume_capability(csi_only, mutate, message):
    vol = csi_only.volume(IMAGE)
    err = error_of(csi_only.node_stub().NodePublishVolume, _with_capability(vol, mutate))
    assert err.code() == Code.INVALID_ARGUMENT and message in err.details()
    assert not vol.target.exists()


@pytest.mark.parametrize("target,message", [
    ("relative/mount", "is not an absolute path"),
    ("/", "is not where kubelet publishes a CSI volume"),
])
def test_bad_target_path(csi_only, target, message):
    err = error_of(csi_only.node_stub().NodePublishVolume, csi_only.volume(IMAGE).publish_request(target_path=target))
    assert err.code() == Code.INVALID_ARGUMENT and message in err.details()
    assert "<kubelet-dir>/pods/<pod-uid>/volumes/kubernetes.io~csi/<volume-name>/mount" in err.details()


def test_target_parent_must_exist(csi_only):
    """The CO makes the parent (kubelet does, 0750); the driver makes only the target itself."""
    vol = csi_only.volume(IMAGE)
    req = vol.publish_request()
    vol.target.parent.rmdir()
    err = error_of(csi_only.node_stub().NodePublishVolume, req)
    assert err.code() == Code.FAILED_PRECONDITION and "parent directory" in err.details()
    assert not vol.target.parent.exists()


@pytest.mark.parametrize("argv,message", [
    (["--node-id", ""], "argument --node-id: must not be empty"),
    (["--node-id", "n", "--pull-wait", "-1"], "'-1' is not a number of seconds >= 0"),
    (["--node-id", "n", "--pull-wait", "soon"], "'soon' is not a number of seconds >= 0"),
    (["--node-id", "n", "--kubelet-dir", "var/lib/kubelet"], "'var/lib/kubelet' is not an absolute path"),
    (["--node-id", "n", "--views-dir", "/var/lib/a,upperdir=/"], "cannot be an overlay layer"),
    (["--node-id", "n", "--views-dir", "views"], "cannot be an overlay layer"),
    (["--node-id", "n", "--writable-size", "lots"], "'lots' is not a Kubernetes quantity"),
    (["--node-id", "n", "--max-writable-size", "0"], "'0' must be more than 0"),
    (["--node-id", "n", "--writable-size", "2Gi", "--max-writable-size", "1Gi"],
     "--writable-size (2147483648 bytes) is more than --max-writable-size"),
])
def test_bad_flags_exit_with_usage(tmp_path, argv, message):
    proc = subprocess.run(accelnode_cmd() + ["csi", "--endpoint", f"unix://{tmp_path}/csi.sock",
                                             "--agent-socket", str(tmp_path / "agent.sock"), *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "csi.sock").exists()
