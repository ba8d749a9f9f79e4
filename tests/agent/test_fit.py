"""This node's accelerators (from simulated hosts) against cache image targets."""

from __future__ import annotations

import pytest

from accelnode.hw import accelerators
from accelnode.hw.accelerators import Accelerator
from agent import fit
from tests.conftest import require_root

V5E = Accelerator("tpu", "v5e", 4, "tpu-discovery")
H100 = Accelerator("cuda", "sm_90", 8, "nvml")
MI250 = Accelerator("hip", "gfx90a", 2, "pci 1002:740c")
RDNA3 = Accelerator("hip", "gfx1100", 1, "pci 1002:744c")


@pytest.fixture
def host(tmp_path):
    from tests.rigs.simhost import SimHost

    require_root()
    return SimHost(tmp_path / "host")


def test_tpu_generation_from_discovery(host):
    for _ in range(4):
        host.add_chip("v5e")
    assert accelerators.detect(host.sysfs_root, host.dev_root) == [V5E]


def test_gpus_from_pci_ids(host):
    host.add_pci_device("0000:00:05.0", vendor=0x10DE, device=0x2330)
    host.add_pci_device("0000:00:06.0", vendor=0x10DE, device=0x2330)
    host.add_pci_device("0000:00:07.0", vendor=0x1002, device=0x9999)  # an AMD part we cannot name
    host.add_pci_device("0000:00:08.0", vendor=0x8086, device=0x1234)  # not an accelerator vendor
    found = accelerators.detect(host.sysfs_root, host.dev_root)
    assert found == [Accelerator("hip", None, 1, "pci 1002:9999"), Accelerator("cuda", "sm_90", 2, "pci 10de:2330")]
    assert [str(a) for a in found] == ["hip/unknown-arch x1", "cuda/sm_90 x2"]


def test_plain_cpu_node(host):
    assert accelerators.detect(host.sysfs_root, host.dev_root) == []


@pytest.mark.parametrize("targets,node", [
    ([{"backend": "tpu", "arch": "v5e"}], [V5E]),
    ([{"backend": "TPU", "arch": "v5litepod"}], [V5E]),  # aliases normalise
    ([{"backend": "cuda", "arch": "90", "warp_size": 32}], [H100]),  # sm_ prefix or not
    ([{"backend": "cuda", "arch": 90}], [H100]),  # Triton writes the CUDA arch as a number
    ([{"backend": "cuda", "arch": "9.0"}], [H100]),  # compute capability spelling
    ([{"backend": "cuda", "arch": "sm90a"}], [H100]),  # arch-specific variant of 9.0
    ([{"backend": "cuda", "arch": "compute_90"}], [H100]),
    ([{"backend": "cuda", "arch": "10.0"}], [Accelerator("cuda", "sm_100", 1, "nvml")]),
    ([{"backend": "rocm", "arch": "gfx90a:sramecc+:xnack-", "warp_size": 64}], [MI250]),  # target features
    ([{"backend": "hip", "arch": "gfx942"}, {"backend": "tpu", "arch": "v5e"}], [V5E]),  # any target
    ([], []),  # accelerator-neutral
])
def test_fits(targets, node):
    assert fit.check(targets, node) is None


def test_mismatch_names_expected_and_found():
    m = fit.check([{"backend": "cuda", "arch": "sm_90"}, {"backend": "hip", "arch": "gfx942"}], [V5E])
    assert (m.expected, m.found) == ("cuda/sm_90, hip/gfx942", "tpu/v5e x4")
    assert str(m) == "built for cuda/sm_90, hip/gfx942; this node has tpu/v5e x4"


def test_unknown_arch_fits_nothing():
    unknown = Accelerator("hip", None, 1, "pci 1002:9999")
    m = fit.check([{"backend": "hip", "arch": "gfx942"}], [unknown])
    assert m is not None and m.found == "hip/unknown-arch x1"
    assert fit.check([{"backend": "tpu", "arch": "v5e"}], []).found == "no accelerators"


@pytest.mark.parametrize("targets,node", [
    ([{"backend": "cuda", "arch": "8.0"}], [H100]),  # 8.0 is not 9.0
    ([{"backend": "cuda", "arch": "sm_100"}], [H100]),
    ([{"backend": "hip", "arch": "gfx1100", "warp_size": 64}], [RDNA3]),  # RDNA runs wave32
    ([{"backend": "hip", "arch": "gfx90a", "warp_size": 32}], [MI250]),  # CDNA runs wave64
])
def test_does_not_fit(targets, node):
    assert fit.check(targets, node) is not None


def test_warp_size_mismatch_names_both_sizes():
    m = fit.check([{"backend": "hip", "arch": "gfx1100", "warp_size": 64}], [RDNA3])
    assert (m.expected, m.found) == ("hip/gfx1100 (warp 64)", "hip/gfx1100 x1 (warp 32)")


def test_accelerator_targets_carry_warp_size():
    assert [a.target() for a in (H100, MI250, RDNA3, V5E)] == [
        {"backend": "cuda", "arch": "sm_90", "warp_size": 32}, {"backend": "hip", "arch": "gfx90a", "warp_size": 64},
        {"backend": "hip", "arch": "gfx1100", "warp_size": 32}, {"backend": "tpu", "arch": "v5e"}]
