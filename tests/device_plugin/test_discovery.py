"""Discovery, health and the simulated host, in process (the plugin tests use them via the CLI)."""

import os
import stat

import pytest

from accelnode.hw.tpu import discover
from accelnode.hw.tpu import aer_fatal_total
from device_plugin.health import Inventory
from tests.rigs.simhost import SimHost
from tests.conftest import require_root


@pytest.fixture
def host(tmp_path):
    require_root()
    return SimHost.preset(tmp_path, "v5e-4")


def test_chips_in_pci_order_with_vfio_nodes(host):
    chips = discover(host.sysfs_root, host.dev_root)
    assert [c.bdf for c in chips] == ["0000:00:04.0", "0000:00:05.0", "0000:00:06.0", "0000:00:07.0"]
    assert [c.index for c in chips] == [0, 1, 2, 3]
    # groups were handed out in reverse: the order must come from the PCI address, not the group
    assert [c.iommu_groups for c in chips] == [("3",), ("2",), ("1",), ("0",)]
    assert chips[0].dev_paths == (str(host.dev_root / "vfio/3"), str(host.dev_root / "vfio/vfio"))
    assert {c.generation for c in chips} == {"v5e"} and {c.device_id for c in chips} == {0x0063}
    assert chips[0].id == "tpu-0000:00:04.0"
    for p in chips[0].dev_paths:
        assert stat.S_ISCHR(os.stat(p).st_mode)


def test_non_tpu_devices_are_ignored_and_numa_minus_one_is_none(host):
    host.add_pci_device("0000:00:10.0", vendor=0x1AE0, device=0x0027)  # a v2/v3 chip: not ours
    bdf = host.add_chip("v6e", numa_node=-1)
    chips = discover(host.sysfs_root, host.dev_root)
    assert [c.bdf for c in chips][-1] == bdf and len(chips) == 5
    assert chips[-1].numa_node is None and chips[-1].generation == "v6e"


@pytest.mark.parametrize("preset,gen,paths", [
    ("v4-4", "v4", lambda i: (f"accel{i}",)),
    ("v5p-4", "v5p", lambda i: (f"vfio/{3 - i}", "vfio/vfio")),
    ("v7x-4", "v7x", lambda i: (f"vfio/{7 - 2 * i}", f"vfio/{6 - 2 * i}", "vfio/vfio")),  # two functions a chip
])
def test_generations(tmp_path, preset, gen, paths):
    require_root()
    h = SimHost.preset(tmp_path, preset)
    chips = discover(h.sysfs_root, h.dev_root)
    assert [c.generation for c in chips] == [gen] * 4
    assert [c.dev_paths for c in chips] == [tuple(str(h.dev_root / p) for p in paths(i)) for i in range(4)]
    numa = [c.numa_node for c in chips]
    assert numa == ([0, 0, 1, 1] if gen == "v7x" else [0, 0, 0, 0])


def test_each_health_knob_flips_and_recovers(host):
    inv = Inventory(host.sysfs_root, host.dev_root)
    bdf = host.chips()[2]
    knobs = [
        (lambda: host.set_vendor(bdf, 0xFFFF), lambda: host.set_vendor(bdf, 0x1AE0), "0xffff"),
        (lambda: host.unbind_driver(bdf), lambda: host.bind_driver(bdf), "no driver bound"),
        (lambda: host.bump_aer_fatal(bdf), lambda: host.reset_aer(bdf), "AER fatal errors rose from 0 to 1"),
        (lambda: host.remove_dev_node(bdf), lambda: host.restore_dev_node(bdf), "vfio/1 missing"),
    ]
    assert [s.problem for s in inv.scan()] == [None] * 4
    for breaks, heals, reason in knobs:
        breaks()
        states = inv.scan()
        assert [s.health for s in states] == ["Healthy", "Healthy", "Unhealthy", "Healthy"]
        assert reason in states[2].problem
        heals()
        assert [s.problem for s in inv.scan()] == [None] * 4


def test_hotplug_renumbers_and_keeps_a_dead_chip(host):
    inv = Inventory(host.sysfs_root, host.dev_root)
    inv.scan()
    host.set_vendor(host.chips()[3], 0xFFFF)  # dead chips no longer probe as TPUs, yet stay listed
    host.remove_chip(host.chips()[0])
    states = inv.scan()
    assert [(s.chip.index, s.chip.bdf, s.health) for s in states] == [
        (0, "0000:00:05.0", "Healthy"), (1, "0000:00:06.0", "Healthy"), (2, "0000:00:07.0", "Unhealthy")]
    host.add_chip("v5e", bdf="0000:00:04.0", iommu_group=9)
    assert [s.chip.bdf for s in inv.scan()][0] == "0000:00:04.0"


def test_a_v7x_chip_is_its_two_functions(tmp_path):
    require_root()
    h = SimHost.preset(tmp_path, "v7x-4")  # tpu7x-standard-4t: 4 chips, 8 VFIO functions
    chips = discover(h.sysfs_root, h.dev_root)
    assert len(list((h.dev_root / "vfio").iterdir())) == 9  # 8 groups and the container node
    assert [c.functions for c in chips] == [(f"0000:00:{4 + i:02x}.0", f"0000:00:{4 + i:02x}.1") for i in range(4)]
    assert [c.bdf for c in chips] == h.chips() and [c.index for c in chips] == [0, 1, 2, 3]
    assert [c.iommu_groups for c in chips] == [("7", "6"), ("5", "4"), ("3", "2"), ("1", "0")]


def test_v7x_functions_in_slots_of_their_own_pair_in_pci_order(tmp_path):
    """Where each function of a v7x host sits in a slot of its own, consecutive functions pair."""
    require_root()
    h = SimHost(tmp_path)
    for i in range(4):
        h.add_pci_device(f"0000:00:{4 + i:02x}.0", vendor=0x1AE0, device=0x0076)
    chips = discover(h.sysfs_root, h.dev_root)
    assert [c.functions for c in chips] == [("0000:00:04.0", "0000:00:05.0"), ("0000:00:06.0", "0000:00:07.0")]


def test_a_v7x_chip_is_unhealthy_when_either_function_is(tmp_path):
    require_root()
    h = SimHost.preset(tmp_path, "v7x-4")
    inv = Inventory(h.sysfs_root, h.dev_root)
    assert [s.problem for s in inv.scan()] == [None] * 4
    second = h.functions(h.chips()[1])[1]  # chip 1's second function
    knobs = [
        (lambda: h.set_vendor(second, 0xFFFF), lambda: h.set_vendor(second, 0x1AE0), "0xffff"),
        (lambda: h.unbind_driver(second), lambda: h.bind_driver(second), "no driver bound"),
        (lambda: h.bump_aer_fatal(second), lambda: h.reset_aer(second), "AER fatal errors rose from 0 to 1"),
        (lambda: h.remove_dev_node(second), lambda: h.restore_dev_node(second), "vfio/4 missing"),
    ]
    for breaks, heals, reason in knobs:
        breaks()
        states = inv.scan()
        assert [s.health for s in states] == ["Healthy", "Unhealthy", "Healthy", "Healthy"]
        assert states[1].problem.startswith(f"PCI function {second}: ") and reason in states[1].problem
        heals()
        assert [s.problem for s in inv.scan()] == [None] * 4
    # one function leaves the bus: the chip stays, off the bus, and the others keep their numbers
    h.remove_function(second)
    states = inv.scan()
    assert [(s.chip.index, s.chip.bdf) for s in states] == [(i, b) for i, b in enumerate(h.chips())]
    assert states[1].off_bus and states[1].problem == f"PCI function {second}: left the bus"
    # the other one goes too: the chip is gone
    h.remove_chip(h.chips()[1])
    assert [s.chip.bdf for s in inv.scan()] == h.chips() and len(h.chips()) == 3


def test_a_v7x_chip_short_of_a_function_is_unhealthy(tmp_path):
    require_root()
    h = SimHost.preset(tmp_path, "v7x-1")
    h.add_pci_device("0000:00:05.1", vendor=0x1AE0, device=0x0076)  # a slot showing only function 1
    h.add_pci_device("0000:00:05.2", vendor=0x1AF4, device=0x1000)
    states = Inventory(h.sysfs_root, h.dev_root).scan()
    assert [s.chip.functions for s in states] == [("0000:00:04.0", "0000:00:04.1"), ("0000:00:05.1",)]
    assert states[0].problem is None
    assert states[1].problem == "1 of the 2 PCI functions of a v7x chip found"


def test_aer_total_parses_kernel_format():
    assert aer_fatal_total("Undefined 0\nDLP 2\nTOTAL_ERR_FATAL 2\n") == 2
    assert aer_fatal_total("DLP 1\nTLP 3\n") == 4  # older kernels: no total line


def test_simhost_rejects_bad_input(tmp_path):
    require_root()
    with pytest.raises(ValueError, match="unknown preset"):
        SimHost.preset(tmp_path / "a", "v9-4")
    h = SimHost(tmp_path / "b")
    with pytest.raises(ValueError, match="unknown TPU generation"):
        h.add_chip("v3")
    h.add_chip("v5e", bdf="0000:00:04.0", iommu_group=1)
    with pytest.raises(FileExistsError):
        h.add_chip("v5e", bdf="0000:00:04.0")
    with pytest.raises(FileExistsError, match="IOMMU group 1"):
        h.add_chip("v5e", iommu_group=1)
    with pytest.raises(KeyError):
        h.remove_chip("0000:00:09.0")
    assert h.chips() == ["0000:00:04.0"]
