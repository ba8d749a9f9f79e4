"""One owner per node: ``accelnode dra`` never offers chips a device plugin offers (the Node's
``status.allocatable["google.com/tpu"]``, written by kubelet), against a real kube-apiserver."""

from __future__ import annotations

from accelnode import exitcodes
from tests.conftest import eventually
from tests.dra.conftest import node_slices


def offer(admin, node: str, chips: str) -> None:
    """What kubelet writes when a device plugin registers ``google.com/tpu`` (or loses it: "0")."""
    admin.request("PATCH", f"/api/v1/nodes/{node}/status", body={"status": {
        "capacity": {"google.com/tpu": "4"}, "allocatable": {"google.com/tpu": chips}}})


def test_the_dra_plugin_refuses_a_node_the_device_plugin_serves(control_plane, admin, node, tpu_host, dra):
    n = node("dra-excl-start")
    offer(admin, n, "4")
    d = dra(tpu_host("v5e-4"), n, control_plane.kubeconfig("admin"))
    p = d.start(wait=False)
    assert p.proc.wait(30) == exitcodes.PREREQUISITE, p.log()
    assert f"a device plugin offers 4 google.com/tpu on node {n}" in p.log()
    assert node_slices(admin, n) == []
    # the device plugin went away (kubelet: allocatable 0, capacity lingers): the DRA plugin serves
    offer(admin, n, "0")
    d.start()
    eventually(lambda: len(node_slices(admin, n)) == 2, "its slices published")


def test_the_dra_plugin_stands_down_when_a_device_plugin_appears(control_plane, admin, node, tpu_host, dra):
    n = node("dra-excl-later")
    d = dra(tpu_host("v5e-4"), n, control_plane.kubeconfig("admin"))
    p = d.start()
    eventually(lambda: len(node_slices(admin, n)) == 2, "its slices published")
    offer(admin, n, "4")
    assert p.proc.wait(30) == exitcodes.PREREQUISITE, p.log()
    assert "standing down" in p.log() and f"a device plugin offers 4 google.com/tpu on node {n}" in p.log()
    assert node_slices(admin, n) == []  # no new claim can get these chips through DRA
