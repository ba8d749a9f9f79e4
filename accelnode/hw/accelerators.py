"""This node's accelerators, as cache images describe their targets (backend + arch).

* TPUs come from the TPU discovery in :mod:`accelnode.hw.tpu` (the generation is the arch: ``v5e``...).
* NVIDIA GPUs come from NVML when ``pynvml`` and the driver are present (arch ``sm_<major><minor>``
  from the device's CUDA compute capability), AMD GPUs from amdsmi when it is present (arch: the
  device's ``target_graphics_version``, ``gfx942``).
* Otherwise GPUs are recognised by their PCI ids in sysfs and named from the PCI ID database
  (:mod:`accelnode.hw.pciids`); the arch comes from our table of data-centre parts or the chip's
  code name, and is left unknown (``None``) otherwise: such a GPU then matches no image.
* :func:`declared` replaces all of this with what the operator states (``--accelerator``).

Everything reads below ``sysfs_root``/``dev_root`` so tests run against simulated hosts.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from accelnode.log import kv

from . import pciids
from .pciids import AMD, NVIDIA

log = logging.getLogger("accelnode.hw")

BACKEND_BY_VENDOR = {NVIDIA: "cuda", AMD: "hip"}
# PCI class prefixes of GPUs and compute accelerators: display controllers, processing accelerators.
GPU_CLASSES = (0x03, 0x12)

@dataclass(frozen=True)
class Accelerator:
    backend: str  # "tpu" | "cuda" | "hip"
    arch: str | None  # "v5e", "sm_90", "gfx942"; None when it cannot be told
    count: int
    source: str  # how it was found: "tpu-discovery", "nvml", "amdsmi", "pci 10de:2330", "declared"
    name: str | None = field(default=None, compare=False)  # "H100 SXM5 80GB", "Instinct MI325X"

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
    gpus = (_nvml_gpus() + _amdsmi_gpus()) if Path(sysfs_root) == Path("/sys") else []
    # NVML sees NVIDIA parts only, amdsmi AMD ones; PCI ids cover a vendor whose library is missing.
    seen = {a.backend for a in gpus}
    pci = [a for a in _pci_gpus(sysfs_root) if a.backend not in seen]
    found = _tpus(sysfs_root, dev_root) + gpus + pci
    log.info("accelerators detected", extra=kv(accelerators=[str(a) for a in found],
                                               names=[a.name for a in found if a.name],
                                               pci_ids=str(pciids.database_path() or "none")))
    return found


TPU_ARCHS = ("v4", "v5e", "v5p", "v6e", "v7x")
_DECLARED = re.compile(r"^(tpu|cuda|hip)/([A-Za-z0-9_]+)(?::([1-9][0-9]{0,3}))?$")


def declared(specs: list[str]) -> list[Accelerator]:
    """The node's accelerators as the operator states them: ``BACKEND/ARCH[:COUNT]`` each, e.g.
    ``cuda/sm_90:8``, ``hip/gfx942:8``, ``tpu/v5e:4``. Raises ValueError naming a bad one."""
    out = []
    for spec in specs:
        m = _DECLARED.match(spec.strip())
        if not m:
            raise ValueError(f"{spec!r} is not BACKEND/ARCH[:COUNT] with BACKEND tpu, cuda or hip "
                             "(e.g. cuda/sm_90:8, hip/gfx942:8, tpu/v5e:4)")
        backend, arch, count = m.group(1), m.group(2), int(m.group(3) or 1)
        if backend == "cuda":
            arch = "sm_" + arch.removeprefix("sm_")
            ok = re.fullmatch(r"sm_[1-9][0-9]{1,2}[af]?", arch)
        elif backend == "hip":
            ok = re.fullmatch(r"gfx[0-9a-f]{3,4}", arch)
        else:
            ok = arch in TPU_ARCHS
        if not ok:
            raise ValueError(f"{spec!r}: {arch!r} is not a {backend} architecture (cuda: sm_90, hip: gfx942, "
                             f"tpu: {', '.join(TPU_ARCHS)})")
        out.append(Accelerator(backend, arch, count, "declared"))
    return out


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
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            archs[(f"sm_{major}{minor}", name.decode() if isinstance(name, bytes) else name)] += 1
    finally:
        pynvml.nvmlShutdown()
    return [Accelerator("cuda", a, n, "nvml", name) for (a, name), n in sorted(archs.items())]


def _amdsmi_gpus() -> list[Accelerator]:
    """AMD GPUs through amdsmi (ROCm's library), or [] when it or the driver is absent."""
    try:
        import amdsmi  # optional: only on AMD GPU nodes
    except ImportError:
        return []
    try:
        amdsmi.amdsmi_init()
    except Exception as e:  # AmdSmiException: no driver / no device
        log.debug("amdsmi unavailable", extra=kv(error=str(e)))
        return []
    try:
        archs = Counter()
        for handle in amdsmi.amdsmi_get_processor_handles():
            info = amdsmi.amdsmi_get_gpu_asic_info(handle)
            archs[(str(info.get("target_graphics_version") or "") or None, info.get("market_name"))] += 1
    finally:
        amdsmi.amdsmi_shut_down()
    return [Accelerator("hip", a, n, "amdsmi", name) for (a, name), n in sorted(archs.items(), key=str)]


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
    db = pciids.database_path()
    out = []
    for (v, d), n in sorted(kinds.items()):
        name, arch = pciids.identify(v, d, db)
        out.append(Accelerator(BACKEND_BY_VENDOR[v], arch, n, f"pci {v:04x}:{d:04x}", name))
    return out
