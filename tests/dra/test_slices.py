"""The DRA plugin's ResourceSlice devices and per-claim CDI specs, from a simulated host (no API)."""

from pathlib import Path

from device_plugin.dra import slices
from device_plugin.dra.claims import Claims
from device_plugin.health import Inventory
from device_plugin.topology import NodeConfig

# Google's TPU DRA driver: attribute -> value type (docs/dra.md); claims written for it must work here
GOOGLE = {"index": "int", "uuid": "string", "tpuGen": "string", "brand": "string", "chipCount": "int"}


def test_one_device_per_ici_block_with_googles_attributes_and_ours(tpu_host):
    host = tpu_host("v5e-4")
    states = Inventory(host.sysfs_root, host.dev_root).scan()
    config = NodeConfig(accelerator="tpu-v5-lite-podslice", topology="2x2")
    devs = slices.devices(states, config, host.sysfs_root)
    # every chip, pair and the whole host, each consuming exactly its chips' counters
    assert [d["name"] for d in devs] == ["tpu-0", "tpu-1", "tpu-2", "tpu-3", "tpu-0-1", "tpu-2-3", "tpu-0-3"]
    assert [sorted(d["consumesCounters"][0]["counters"]) for d in devs] == [
        ["chip-0"], ["chip-1"], ["chip-2"], ["chip-3"], ["chip-0", "chip-1"], ["chip-2", "chip-3"],
        ["chip-0", "chip-1", "chip-2", "chip-3"]]
    assert {d["consumesCounters"][0]["counterSet"] for d in devs} == {"chips"}
    assert slices.counter_sets(states) == [{"name": "chips", "counters": {f"chip-{i}": {"value": "1"}
                                                                          for i in range(4)}}]
    for d in devs:
        a = d["attributes"]
        assert {k: next(iter(a[k])) for k in GOOGLE} == GOOGLE
        assert (a["tpuGen"], a["brand"], a["chipCount"]) == ({"string": "v5litepod"}, {"string": "Google"}, {"int": 4})
        assert a["accelerator"] == {"string": "tpu-v5-lite-podslice"} and a["topology"] == {"string": "2x2"}
        assert a["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
        assert a["numaNode"] == {"int": 0} and a["healthy"] == {"bool": True}
        assert len(a) <= 32  # the API's limit of attributes + capacities per device
        assert slices.device_chips(d["name"]) == tuple(int(c[5:]) for c in d["consumesCounters"][0]["counters"])
    for i, d in enumerate(devs[:4]):
        a = d["attributes"]
        assert (a["index"], a["chips"], a["iciShape"]) == ({"int": i}, {"int": 1}, {"string": "1x1"})
        assert a["uuid"]["string"] == states[i].chip.id and a["pciAddress"]["string"] == states[i].chip.bdf
    assert [(d["attributes"]["chips"]["int"], d["attributes"]["iciShape"]["string"], d["attributes"]["index"]["int"])
            for d in devs[4:]] == [(2, "1x2", 0), (2, "1x2", 2), (4, "2x2", 0)]
    assert devs[6]["attributes"]["uuid"]["string"] == states[0].chip.id + "-x4"
    # ICI: the pairs {0,1} {2,3} share iciBlock2, all four iciBlock4; coordinates as the device plugin's
    assert [d["attributes"]["iciBlock2"]["int"] for d in devs[:4]] == [0, 0, 1, 1]
    assert {d["attributes"]["iciBlock4"]["int"] for d in devs[:4]} == {0}
    assert [(d["attributes"]["iciX"]["int"], d["attributes"]["iciY"]["int"]) for d in devs[:4]] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    # no slice facts: no accelerator/topology attributes (as Google's driver: only when known)
    bare = slices.devices(states, NodeConfig(), host.sysfs_root)[0]["attributes"]
    assert "topology" not in bare and "accelerator" not in bare


def test_the_blocks_of_each_host_shape():
    assert slices.blocks(1) == [(0,)]
    assert slices.blocks(2) == [(0,), (1,), (0, 1)]
    eight = slices.blocks(8)
    assert len(eight) == 15 and eight[-1] == tuple(range(8)) and (4, 5, 6, 7) in eight and (2, 3, 4, 5) not in eight
    # names map back to their chips; anything else (unaligned, not a block) is not ours
    assert [slices.device_chips(n) for n in ("tpu-3", "tpu-4-5", "tpu-0-7")] == [(3,), (4, 5), tuple(range(8))]
    assert [slices.device_chips(n) for n in ("tpu-1-2", "tpu-0-2", "tpu-01", "gpu-0", "tpu-2-1")] == [None] * 5


def test_an_unhealthy_chip_taints_its_devices_instead_of_leaving_the_slice(tpu_host):
    host = tpu_host("v6e-8")
    inv = Inventory(host.sysfs_root, host.dev_root)
    inv.scan()
    host.bump_aer_fatal(host.chips()[1])
    states = inv.scan()
    devs = slices.devices(states, NodeConfig(), host.sysfs_root, "tpu.google.com")
    assert len(devs) == 15  # every device stays: names valid for running claims and kubelet's health
    tainted = {d["name"]: d["taints"] for d in devs if "taints" in d}
    # chip 1 and every block holding it: NoSchedule, new claims avoid them
    assert tainted == {n: [{"key": "tpu.google.com/unhealthy", "value": "failing", "effect": "NoSchedule"}]
                       for n in ("tpu-1", "tpu-0-1", "tpu-0-3", "tpu-0-7")}
    assert [d["name"] for d in devs if d["attributes"]["healthy"] == {"bool": False}] == list(tainted)
    assert devs[0]["attributes"]["chipCount"] == {"int": 8}  # the host still has eight chips
    assert len(slices.counter_sets(states)[0]["counters"]) == 8  # and eight counters
    # kubelet's health list names the same devices, the reason with them
    health = dict(slices.health(states))
    assert list(health) == [d["name"] for d in devs] and {n for n, why in health.items() if why} == set(tainted)
    assert "AER fatal errors rose" in health["tpu-1"] and health["tpu-0-1"].startswith(f"chip 1 ({host.chips()[1]}): AER")
    # a chip reading vendor 0xffff left the bus: NoExecute on it and its blocks (their pods are evicted)
    host.set_vendor(host.chips()[6], 0xFFFF)
    devs = slices.devices(inv.scan(), NodeConfig(), host.sysfs_root, "tpu.google.com")
    effects = {d["name"]: d["taints"][0]["effect"] for d in devs if "taints" in d}
    assert effects == {"tpu-1": "NoSchedule", "tpu-0-1": "NoSchedule", "tpu-0-3": "NoSchedule", "tpu-6": "NoExecute",
                       "tpu-6-7": "NoExecute", "tpu-4-7": "NoExecute", "tpu-0-7": "NoExecute"}


def test_numa_of_a_v7x_host(tpu_host):
    host = tpu_host("v7x-4")  # 8 VFIO functions, 4 chips: the devices are the 4-chip host's 7 blocks
    devs = slices.devices(Inventory(host.sysfs_root, host.dev_root).scan(), NodeConfig(), host.sysfs_root)
    numa = {d["name"]: d["attributes"].get("numaNode", {}).get("int") for d in devs}
    # a pair sits on one NUMA node; the whole host spans two, so it names none
    assert numa == {"tpu-0": 0, "tpu-1": 0, "tpu-2": 1, "tpu-3": 1, "tpu-0-1": 0, "tpu-2-3": 1, "tpu-0-3": None}
    assert devs[0]["attributes"]["tpuGen"] == {"string": "v7x"}


def test_the_cdi_spec_of_a_claim_holds_its_chips_env_and_log_mount(tpu_host, tmp_path):
    host = tpu_host("v5e-4")
    states = Inventory(host.sysfs_root, host.dev_root).scan()
    claims = Claims(client=None, driver="tpu.google.com", node="n", cdi_dir=tmp_path / "cdi",
                    state_dir=tmp_path / "state", dev_root=host.dev_root, states=lambda: states,
                    config=lambda: NodeConfig(accelerator="tpu-v5-lite-podslice", topology="2x2"),
                    log_size=64 << 20)
    uid = "0f0e0d0c-0000-4000-8000-000000000001"
    spec = claims.spec(uid, {"tpu-2": [states[2].chip], "tpu-3": [states[3].chip]}, 4)
    assert spec["kind"] == "k8s.tpu.google.com/tpu" and spec["cdiVersion"] == "0.6.0"
    assert claims.spec_path(uid).name == f"k8s.tpu.google.com-tpu_{uid}.json"
    assert [d["name"] for d in spec["devices"]] == [f"{uid}-tpu-2", f"{uid}-tpu-3"]
    # the same chips as one ICI block: one CDI device with both chips' nodes, the same env
    block = claims.spec(uid, {"tpu-2-3": [states[2].chip, states[3].chip]}, 4)
    (bdev,) = block["devices"]
    assert bdev["name"] == f"{uid}-tpu-2-3" and block["containerEdits"] == spec["containerEdits"]
    assert bdev["containerEdits"]["deviceNodes"] == [n for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    nodes = [n for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    assert [n["hostPath"] for n in nodes] == [p for s in states[2:] for p in s.chip.dev_paths if "vfio/vfio" not in p]
    assert all(n["path"] == "/dev/" + str(Path(n["hostPath"]).relative_to(host.dev_root)) for n in nodes)
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == ["/dev/vfio/vfio"]  # once per container
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    # the device plugin's table for two chips of a 2x2 v5e host (tests/device_plugin/test_node_facts.py)
    assert (env["TPU_TOPOLOGY"], env["TPU_CHIPS_PER_HOST_BOUNDS"], env["TPU_HOST_BOUNDS"]) == ("2x2", "1,2,1", "2,1,1")
    assert env["TPU_ACCELERATOR_TYPE"] == "v5litepod-4" and env["TPU_WORKER_ID"] == "0"
    # libtpu's logs: a tmpfs of the container's own, bounded in bytes and files, writable by any
    # user (main bind-mounted a root-owned 0755 host directory, never removed, unbounded)
    (mount,) = spec["containerEdits"]["mounts"]
    assert (mount["type"], mount["hostPath"], mount["containerPath"]) == ("tmpfs", "tmpfs", "/tmp/tpu_logs")
    assert {"nosuid", "nodev", "noexec", f"size={64 << 20}", "nr_inodes=4096", "mode=1777"} == set(mount["options"])
    assert not (tmp_path / "logs").exists()


def test_claim_state_is_bounded_and_swept_at_start(tpu_host, tmp_path):
    """Issue 33, 3: the per-claim locks live only while a call on that claim does (on main one
    stayed for every claim ever seen), and a write killed half-way leaves nothing after a start."""
    host = tpu_host("v5e-4")
    states = Inventory(host.sysfs_root, host.dev_root).scan()
    cdi, state = tmp_path / "cdi", tmp_path / "state"
    cdi.mkdir()
    state.mkdir()
    leftovers = [state / ".0f0e.json.7.8.tmp", cdi / ".k8s.tpu.google.com-tpu_0f0e.json.7.8.tmp"]
    foreign = cdi / ".vendor.example-gpu_1.json.7.8.tmp"  # another CDI producer's: not ours to remove
    for p in leftovers + [foreign]:
        p.write_text("{")
    claims = Claims(client=None, driver="tpu.google.com", node="n", cdi_dir=cdi, state_dir=state,
                    dev_root=host.dev_root, states=lambda: states,
                    config=lambda: NodeConfig(accelerator="tpu-v5-lite-podslice", topology="2x2"), log_size=0)
    assert [p.exists() for p in leftovers] == [False, False] and foreign.exists()
    for i in range(1000):
        claims.unprepare(f"0f0e0d0c-0000-4000-8000-{i:012d}")
    assert claims._locks == {}
