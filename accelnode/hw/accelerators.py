"""This node's accelerators, as cache images describe their targets (backend + arch).

* TPUs come from the TPU discovery in :mod:`accelnode.hw.tpu` (the generation is the arch: ``v5e``...).
* NVIDIA GPUs come from NVML when ``pynvml`` and the driver are present (arch ``sm_<major><minor>``).
* Otherwise GPUs are recognised by their PCI ids in sysfs; the arch is known for the parts in
  :data:`PCI_ARCH` and left unknown (``None``) for others, which then match no image.

Everything reads below ``sysfs_root``/``dev_root`` so tests run against simulated hosts.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from accelnode.log import kv

log = logging.getLogger("accelnode.hw")

NVIDIA, AMD = 0x10DE, 0x1002
BACKEND_BY_VENDOR = {NVIDIA: "cuda", AMD: "hip"}
# PCI class prefixes of GPUs and compute accelerators: display controllers, processing accelerators.
GPU_CLASSES = (0x03, 0x12)
# (vendor, device) -> arch for parts whose arch the PCI id settles.
PCI_ARCH = {
    (NVIDIA, 0x1EB8): "sm_75",  # T4
    (NVIDIA, 0x20B0): "sm_80",  # A100 SXM4 40GB
    (NVIDIA, 0x20B2): "sm_80",  # A100 SXM4 80GB
    (NVIDIA, 0x20B5): "sm_80",  # A100 PCIe 80GB
    (NVIDIA, 0x20F1): "sm_80",  # A100 PCIe 40GB
    (NVIDIA, 0x27B8): "sm_89",  # L4
    (NVIDIA, 0x2330): "sm_90",  # H100 SXM5
    (NVIDIA, 0x2331): "sm_90",  # H100 PCIe
    (NVIDIA, 0x2335): "sm_90",  # H200
    (AMD, 0x738C): "gfx908",  # MI100
    (AMD, 0x740C): "gfx90a",  # MI250X/MI250
    (AMD, 0x740F): "gfx90a",  # MI210
    (AMD, 0x74A1): "gfx942",  # MI300X
}


@dataclass(frozen=True)
class Accelerator:
    backend: str  # "tpu" | "cuda" | "hip"
    arch: str | None  # "v5e", "sm_90", "gfx942"; None when it cannot be told
    count: int
    source: str  # how it was found: "tpu-discovery", "nvml", "pci 10de:2330"

    @property
    def warp_size(self) -> int | None:
        """Threads per warp/wavefront: 32 on NVIDIA; 64 on AMD GCN/CDNA (gfx9*), 32 on RDNA."""
        if self.backend == "cuda":
            return 32
        if self.backend == "hip" and self.arch:
            return 64 if self.arch.startswith("gfx9") else 32
        return None

    def target(self) -> dict:
        t = {"backend": self.backend, "arch": self.arch}
        if self.warp_size:
            t["warp_size"] = self.warp_size
        return t

    def __str__(self) -> str:
        return f"{self.backend}/{self.arch or 'unknown-arch'} x{self.count}"


def detect(sysfs_root: str | Path = "/sys", dev_root: str | Path = "/dev") -> list[Accelerator]:
    """Every accelerator kind on this node, TPUs first; empty on a plain CPU node.

    NVML describes the real host only, so it is asked only when ``sysfs_root`` is ``/sys``.
    """
    gpus = _nvml_gpus() if Path(sysfs_root) == Path("/sys") else []
    # NVML sees NVIDIA parts only; PCI ids cover AMD, and NVIDIA when NVML is missing.
    pci = [a for a in _pci_gpus(sysfs_root) if not (gpus and a.backend == "cuda")]
    found = _tpus(sysfs_root, dev_root) + gpus + pci
    log.info("accelerators detected", extra=kv(accelerators=[str(a) for a in found]))
    return found


def _tpus(sysfs_root, dev_root) -> list[Accelerator]:
    from .tpu import discover

    gens = Counter(c.generation for c in discover(sysfs_root=str(sysfs_root), dev_root=str(dev_root)))
    return [Accelerator("tpu", g, n, "tpu-discovery") for g, n in sorted(gens.items())]


def _nvml_gpus() -> list[Accelerator]:
    """NVIDIA GPUs through NVML, or [] when pynvml or the driver is absent."""
    try:
        import pynvml  # optional: only on GPU nodes
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError: no driver / no device
        log.debug("NVML unavailable", extra=kv(error=str(e)))
        return []
    try:
        archs = Counter()
        for i in range(pynvml.nvmlDeviceGetCount()):
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i))
            archs[f"sm_{major}{minor}"] += 1
    finally:
        pynvml.nvmlShutdown()
    return [Accelerator("cuda", a, n, "nvml") for a, n in sorted(archs.items())]


def _pci_gpus(sysfs_root) -> list[Accelerator]:
    kinds: Counter = Counter()
    for dev in sorted((Path(sysfs_root) / "bus" / "pci" / "devices").glob("*")):
        try:
            vendor = int((dev / "vendor").read_text(), 16)
            device = int((dev / "device").read_text(), 16)
            klass = int((dev / "class").read_text(), 16)
        except (OSError, ValueError):
            continue
        if vendor in BACKEND_BY_VENDOR and (klass >> 16) in GPU_CLASSES:
            kinds[(vendor, device)] += 1
    return [
        Accelerator(BACKEND_BY_VENDOR[v], PCI_ARCH.get((v, d)), n, f"pci {v:04x}:{d:04x}")
        for (v, d), n in sorted(kinds.items())
    ]
