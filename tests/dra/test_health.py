"""Chip health as the scheduler and kubelet see it: device taints on the slice, judged by the real
kube-scheduler 1.37 (DRADeviceTaints is GA there, on by default), and the DRAResourceHealth
stream kubelet reads (here a client of our own speaking its v1 and v1alpha1 APIs; the real
kubelet: tests/dra_node/test_dra.py).

A chip failing on the simulated host stays in the slice with its blocks, tainted NoSchedule: new
claims get other chips. A chip leaving the PCI bus (vendor 0xffff, or its function gone) taints
NoExecute."""

from __future__ import annotations

import threading

import grpc

from accelnode import grpcutil
from device_plugin.dra import api as dra_api
from tests.conftest import eventually
from tests.dra.conftest import DRIVER, claim_path
from tests.dra.test_partitions import (allocated, api, block_claim, claim, ns, pod, pool_devices,  # noqa: F401
                                       sched, tpu_node, unschedulable)

KEY = f"{DRIVER}/unhealthy"


def taints(api, node: str) -> dict[str, list[tuple[str, str]]]:
    """device -> [(value, effect)] of the tainted devices in the node's pool."""
    return {n: [(t.get("value"), t["effect"]) for t in d["taints"]]
            for n, d in pool_devices(api, node).items() if d.get("taints")}


def test_a_failing_chip_is_tainted_and_new_claims_avoid_it(api, ns, tpu_node):
    node = "sick-v5e-4"
    d = tpu_node(node, "v5e-4")
    host = d.host
    assert taints(api, node) == {}
    host.bump_aer_fatal(host.chips()[1])
    failing = {n: [("failing", "NoSchedule")] for n in ("tpu-1", "tpu-0-1", "tpu-0-3")}
    eventually(lambda: taints(api, node) == failing, "chip 1 and its blocks tainted NoSchedule", timeout=15)
    pool = pool_devices(api, node)
    assert len(pool) == 7 and pool["tpu-1"]["attributes"]["healthy"] == {"bool": False}
    (t,) = pool["tpu-1"]["taints"]
    assert t["key"] == KEY and t["timeAdded"]
    # a pair: 0-1 holds the sick chip, so 2-3; then no pair is left
    block_claim(api, ns, "pair", 2)
    pod(api, ns, "pair", node, claim_name="pair")
    assert allocated(api, ns, "pair") == ["tpu-2-3"]
    block_claim(api, ns, "pair2", 2)
    pod(api, ns, "pair2", node, claim_name="pair2")
    assert "cannot allocate all claims" in unschedulable(api, ns, "pair2")
    # chips counted (Google's form): the one healthy chip left is 0, and a second is refused
    claim(api, ns, "one", {"deviceClassName": DRIVER, "count": 1})
    pod(api, ns, "one", node, claim_name="one")
    assert allocated(api, ns, "one") == ["tpu-0"]
    uid = api.request("GET", claim_path(ns, "pair"))["metadata"]["uid"]
    assert d.prepare(ns, "pair", uid).error == ""
    # a timeAdded survives republishing (an unchanged taint keeps its time; NoExecute tolerations count from it)
    host.bump_aer_fatal(host.chips()[0])
    eventually(lambda: "tpu-0" in taints(api, node), "chip 0 tainted too", timeout=15)
    assert [x for x in pool_devices(api, node)["tpu-1"]["taints"]] == [t]
    # chip 3 falls off the bus (vendor 0xffff): NoExecute on it and the blocks holding it
    host.set_vendor(host.chips()[3], 0xFFFF)
    eventually(lambda: taints(api, node).get("tpu-2-3") == [("off-bus", "NoExecute")], "2-3 tainted NoExecute",
               timeout=15)
    assert taints(api, node)["tpu-3"] == [("off-bus", "NoExecute")] and "tpu-2" not in taints(api, node)
    # and kube-controller-manager's device-taint eviction takes the pod holding 2-3 off its gone chip
    eventually(lambda: _evicted(api, ns, "pair"), "pod pair evicted", timeout=30)
    # chip 2's function leaves the bus altogether: its devices stay, NoExecute, and chip 3 keeps its name
    host.remove_chip(host.chips()[2])
    eventually(lambda: taints(api, node).get("tpu-2") == [("off-bus", "NoExecute")], "a gone chip tainted NoExecute",
               timeout=15)
    assert len(pool_devices(api, node)) == 7
    assert pool_devices(api, node)["tpu-3"]["attributes"]["pciAddress"]["string"] == host.chips()[2]
    # recovery lifts a chip's taint; a block keeps it while another of its chips is sick
    host.reset_aer(host.chips()[1])
    eventually(lambda: "tpu-1" not in taints(api, node), "chip 1's taint lifted", timeout=15)
    assert taints(api, node)["tpu-0-1"] == [("failing", "NoSchedule")]


def _evicted(api, ns: str, name: str) -> bool:
    from accelnode.kube.client import KubeError, is_not_found

    try:
        p = api.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
    except KubeError as e:
        return is_not_found(e)
    return any(c["type"] == "DisruptionTarget" and c["status"] == "True" for c in p["status"].get("conditions") or [])


def _stream(endpoint, version: str, seen: list, stop: threading.Event):
    pb, pb_grpc = dra_api.HEALTH_SERVICES[version]
    ch = grpcutil.unix_channel(endpoint)
    call = pb_grpc.DRAResourceHealthStub(ch).NodeWatchResources(pb.NodeWatchResourcesRequest())

    def run():
        try:
            for msg in call:
                seen.append({d.device.device_name: (pb.HealthStatus.Name(d.health), d.message, d.device.pool_name,
                                                     d.health_check_timeout_seconds, d.last_updated_time)
                             for d in msg.devices})
                if stop.is_set():
                    return
        except grpc.RpcError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return call, ch, t


def test_the_health_stream_sends_every_device_on_each_change(api, tpu_node):
    """kubelet's DRAResourceHealth, both versions it speaks: the full list (chips and blocks, pool
    = node), UNHEALTHY with the reason as soon as a chip fails, HEALTHY when it recovers."""
    node = "stream-v5e-4"
    d = tpu_node(node, "v5e-4")
    host = d.host
    with grpcutil.unix_channel(d.reg_socket) as ch:
        info = dra_api.RegistrationStub(ch).GetInfo(dra_api.InfoRequest(), timeout=5)
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
                                             "v1alpha1.DRAResourceHealth"]
    stop = threading.Event()
    streams = {v: ([],) for v in dra_api.HEALTH_SERVICES}
    calls = []
    for v, (seen,) in streams.items():
        calls.append(_stream(d.endpoint, v, seen, stop))
    names = ["tpu-0", "tpu-1", "tpu-2", "tpu-3", "tpu-0-1", "tpu-2-3", "tpu-0-3"]
    for v, (seen,) in streams.items():
        first = eventually(lambda: seen and seen[0], f"the first {v} report")
        assert list(first) == names
        assert {h for h, *_ in first.values()} == {"HEALTHY"}
        assert {(p, t) for _, _, p, t, _ in first.values()} == {(node, 30)}
    host.remove_dev_node(host.chips()[2])
    for v, (seen,) in streams.items():
        last = eventually(lambda: seen and seen[-1]["tpu-2"][0] == "UNHEALTHY" and seen[-1], f"{v}: chip 2 UNHEALTHY")
        assert list(last) == names  # the full list, never a delta
        assert {n for n, (h, *_) in last.items() if h == "UNHEALTHY"} == {"tpu-2", "tpu-2-3", "tpu-0-3"}
        assert "missing" in last["tpu-2"][1] and last["tpu-2-3"][1].startswith(f"chip 2 ({host.chips()[2]}): ")
    host.restore_dev_node(host.chips()[2])
    for v, (seen,) in streams.items():
        eventually(lambda: seen[-1]["tpu-2"][0] == "HEALTHY", f"{v}: chip 2 HEALTHY again")
    # with nothing changing, the heartbeat: the same list again, reported anew (kubelet's 30 s timeout)
    (seen,) = streams["v1.DRAResourceHealth"]
    n, stamp = len(seen), seen[-1]["tpu-0"][4]
    beat = eventually(lambda: len(seen) > n and seen[-1], "a heartbeat report", timeout=15)
    assert {k: v[:4] for k, v in beat.items()} == {k: v[:4] for k, v in seen[n - 1].items()}
    assert beat["tpu-0"][4] >= stamp
    stop.set()
    for call, ch, t in calls:
        call.cancel()
        ch.close()
        t.join(10)
