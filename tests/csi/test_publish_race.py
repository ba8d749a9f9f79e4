"""NodePublishVolume mounts onto the directory it checked, never through a symlink put in its
place afterwards (issue 23, 6c). The race is made deterministic: the test runs the driver's
NodeServer in its own process (a real gRPC server on a unix socket, the real agent daemon, real
mounts) and swaps the target for a symlink to a host directory right after the checks, while the
driver asks the agent for its reference, the step between the checks and the mount.

The driver checks its own mounts after making them and undoes one that is not where it should
be, so a mount through the symlink lives only for a few system calls: the test looks at the host
directory each time the driver asks whether anything is a mount point or undoes a mount."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from accelnode import grpcutil
from csi_driver import mounts, node as csi_node, resolve, views
from csi_driver.api import csi_grpc

from .conftest import error_of


@pytest.fixture
def in_process_driver(node, tmp_path):
    """The CSI node service in this process, on a real socket, against the real agent."""
    node.agent.start()
    view_store = views.Views(str(node.views_dir))
    view_store.start()
    agent_channel = grpcutil.unix_channel(node.agent_socket)
    server_obj = csi_node.NodeServer("node-a", csi_node.AgentClient(agent_channel, str(node.agent_socket)),
                                     resolve.VolumeResolver(None, trust_image_attribute=True),
                                     kubelet_dir=str(node.kubelet_dir), view_store=view_store)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    csi_grpc.add_NodeServicer_to_server(server_obj, server)
    sock = tmp_path / "race.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        yield csi_grpc.NodeStub(node.channel(sock))
    finally:
        server.stop(None)
        agent_channel.close()


@pytest.mark.parametrize("view", ["read-only", "copy-on-write"])
@pytest.mark.parametrize("existing", [False, True], ids=["target-absent", "target-empty-dir"])
def test_symlink_swapped_in_after_the_checks_is_not_followed(node, in_process_driver, images, tmp_path,
                                                              monkeypatch, view, existing):
    host_dir = tmp_path / "host-etc"  # stands for any host directory, /etc say
    host_dir.mkdir()
    (host_dir / "passwd").write_text("root:x:0:0\n")
    vol = node.volume(images.tpu)
    req = vol.publish_request()
    req.volume_context["accelnode.io/view"] = view
    if existing:
        vol.target.mkdir()
    acquire = csi_node.NodeServer._acquire

    def acquire_then_swap(self, *args, **kw):
        acquire(self, *args, **kw)
        if vol.target.exists():
            vol.target.rename(vol.target.with_name("moved-away"))
        vol.target.symlink_to(host_dir)

    monkeypatch.setattr(csi_node.NodeServer, "_acquire", acquire_then_swap)
    host_mounted = []  # was the host directory a mount point, each time the driver looked
    for name in ("mounted_root", "undo"):
        real = getattr(mounts, name)
        monkeypatch.setattr(mounts, name, lambda *a, _real=real, **kw: (
            host_mounted.append(mounts.top_mount(host_dir) is not None), _real(*a, **kw))[1])
    err = error_of(in_process_driver.NodePublishVolume, req)
    assert err.code() == grpc.StatusCode.INTERNAL and "cannot mount" in err.details()
    # nothing mounted on the host directory nor anywhere below the test's root
    assert not any(host_mounted) and not mounts.is_mountpoint(host_dir)
    assert sorted(p.name for p in host_dir.iterdir()) == ["passwd"]
    assert [m.point for m in mounts.mounts() if m.point.startswith(str(tmp_path) + "/")] == []
    assert vol.target.is_symlink()  # what replaced the target is left alone
    assert node.references() == {}  # the failed publish released its reference
