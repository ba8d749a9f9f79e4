"""GPUs named and their architecture known from PCI ids (issue 24.7): the distribution's PCI ID
database, our table of data-centre parts, chip code names; and the operator's declaration."""

from __future__ import annotations

import subprocess
import time

import pytest

from accelnode.hw import accelerators, pciids
from accelnode.hw.accelerators import Accelerator
from tests.conftest import ROOT, accelnode_cmd, require, require_root

DEBIAN_PCI_IDS = "/usr/share/misc/pci.ids"  # Debian's pci.ids package (tools/apt/base.txt)

# A pci.ids in the database's own format: vendors, devices (one tab), subsystems (two), classes.
SNIPPET = """\
# sample
10de  NVIDIA Corporation
\t2684  AD102 [GeForce RTX 4090]
\t\t10de 167c  AD102 [GeForce RTX 4090 Founders Edition]
\t2b85  GB202 [GeForce RTX 5090]
\t20b7  GA100GL [A30 PCIe]
\t1db4  GV100GL [Tesla V100 PCIe 16GB]
\t1234  GF100 [Quadro 4000]
1002  Advanced Micro Devices, Inc. [AMD/ATI]
\t744c  Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]
\t74a9  Aqua Vanjaram [Instinct MI300X HF]
8086  Intel Corporation
\t2684  Not a GPU vendor of ours
C 03  Display controller
\t00  VGA compatible controller
"""


@pytest.fixture
def host(tmp_path):
    from tests.rigs.simhost import SimHost

    require_root()
    return SimHost(tmp_path / "host")


def on_host(host, *ids):
    for i, (vendor, device) in enumerate(ids):
        host.add_pci_device(f"0000:00:{5 + i:02x}.0", vendor=vendor, device=device)
    return accelerators.detect(host.sysfs_root, host.dev_root)


@pytest.mark.parametrize("vendor,device,name,arch", [
    (0x10DE, 0x2901, "B200", "sm_100"),
    (0x10DE, 0x26B9, "L40S", "sm_89"),
    (0x10DE, 0x2237, "A10G", "sm_86"),
    (0x10DE, 0x2321, "H100 NVL", "sm_90"),
    (0x1002, 0x74A5, "Instinct MI325X", "gfx942"),
    (0x10DE, 0x3182, "B300 SXM6 AC", "sm_103"),
])
def test_data_centre_parts_are_named_with_or_without_a_database(host, monkeypatch, tmp_path, vendor, device, name,
                                                                arch):
    monkeypatch.setenv(pciids.ENV, str(tmp_path / "no-such-pci.ids"))
    (got,) = on_host(host, (vendor, device), (vendor, device))
    assert (got.name, got.arch, got.count, got.source) == (name, arch, 2, f"pci {vendor:04x}:{device:04x}")
    assert got.target()["arch"] == arch


def test_any_gpu_in_the_database_is_named_and_its_arch_follows_its_chip(host, monkeypatch, tmp_path):
    db = tmp_path / "pci.ids"
    db.write_text(SNIPPET)
    monkeypatch.setenv(pciids.ENV, str(db))
    found = {a.source: a for a in on_host(host, (0x10DE, 0x2684), (0x10DE, 0x2B85), (0x10DE, 0x20B7),
                                          (0x10DE, 0x1DB4), (0x10DE, 0x1234), (0x1002, 0x744C), (0x1002, 0x74A9),
                                          (0x10DE, 0x9999))}
    assert {s: (a.name, a.arch) for s, a in found.items()} == {
        "pci 10de:2684": ("GeForce RTX 4090", "sm_89"),
        "pci 10de:2b85": ("GeForce RTX 5090", "sm_120"),
        "pci 10de:20b7": ("A30 PCIe", "sm_80"),
        "pci 10de:1db4": ("Tesla V100 PCIe 16GB", "sm_70"),
        "pci 10de:1234": ("Quadro 4000", None),  # Fermi: no rule, matches no image rather than a wrong one
        "pci 1002:744c": ("Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M", "gfx1100"),
        "pci 1002:74a9": ("Instinct MI300X HF", "gfx942"),
        "pci 10de:9999": (None, None),  # in no database: unknown, still counted
    }
    assert found["pci 1002:744c"].warp_size == 32 and found["pci 1002:74a9"].warp_size == 64


def test_the_distributions_database():
    """Debian's pci.ids as installed: parsed, and the parts it names get an arch from their chip."""
    require(pciids.database_path({}) is not None, f"a PCI ID database ({DEBIAN_PCI_IDS}; Debian package pci.ids)")
    names = pciids.database(pciids.database_path({}))
    assert len([k for k in names if k[0] == pciids.NVIDIA]) > 500 and len(names) > 1000
    assert names[(0x10DE, 0x1EB8)].endswith("[Tesla T4]")
    assert pciids.identify(0x10DE, 0x20B5, pciids.database_path({})) == ("A100 PCIe 80GB", "sm_80")
    assert pciids.arch_from_name(0x10DE, names[(0x10DE, 0x2230)]) == "sm_86"  # GA102GL [RTX A6000]: not in KNOWN


@pytest.mark.parametrize("spec,want", [
    ("cuda/sm_90:8", Accelerator("cuda", "sm_90", 8, "declared")),
    ("cuda/100", Accelerator("cuda", "sm_100", 1, "declared")),
    ("hip/gfx942:8", Accelerator("hip", "gfx942", 8, "declared")),
    ("tpu/v5e:4", Accelerator("tpu", "v5e", 4, "declared")),
])
def test_declared(spec, want):
    assert accelerators.declared([spec]) == [want]


@pytest.mark.parametrize("spec,why", [
    ("nvidia/sm_90", "BACKEND/ARCH"), ("cuda/gfx942", "not a cuda architecture"), ("tpu/v9", "not a tpu"),
    ("cuda/sm_90:0", "BACKEND/ARCH"), ("hip/sm_90", "not a hip"),
])
def test_declared_refuses(spec, why):
    with pytest.raises(ValueError, match=why):
        accelerators.declared([spec])


def test_agent_flag_refuses_a_bad_declaration_and_creates_nothing(tmp_path):
    store = tmp_path / "store"
    out = subprocess.run(accelnode_cmd() + ["agent", "--store", str(store), "--socket", str(tmp_path / "a.sock"),
                                            "--accelerator", "cuda/sm_90:8", "--accelerator", "nvidia/h100"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "--accelerator 'nvidia/h100' is not BACKEND/ARCH[:COUNT]" in out.stderr
    assert not store.exists()


def test_the_agent_serves_the_declared_accelerators(tmp_path):
    """A real ``accelnode agent``: what ``--accelerator`` declares is what it reports (and fits images by)."""
    from accelnode import grpcutil
    from csi_driver.api import agent as agent_api, agent_grpc
    from tests.fixtures.device_plugin import free_port

    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(accelnode_cmd() + ["agent", "--store", str(tmp_path / "store"), "--socket", str(sock),
                                               "--metrics-address", f"127.0.0.1:{free_port()}",
                                               "--accelerator", "hip/gfx942:8", "--accelerator", "cuda/90"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for _ in range(300):
            if sock.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()
        with grpcutil.unix_channel(sock) as ch:
            listing = agent_grpc.AgentStub(ch).ListCaches(agent_api.ListCachesRequest(), timeout=30)
        assert list(listing.accelerators) == ["hip/gfx942 x8", "cuda/sm_90 x1"]
    finally:
        proc.terminate()
        proc.wait(10)
