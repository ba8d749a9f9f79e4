"""GPU names and architectures from PCI ids: the distribution's PCI ID database, our own table
for the data-centre parts it may lack, and the chip code name in the name.

* **The database**: ``pci.ids`` as Debian's ``pci.ids`` package installs it (``hwdata`` links
  it under ``/usr/share/hwdata``), or ``$ACCELNODE_PCI_IDS``. Only the NVIDIA and AMD sections
  are read. It names every part the distribution knew of when it was packaged (Debian 12's
  copy is from April 2023: no B200, L40S, H100 NVL or MI325X).
* **:data:`KNOWN`**: product names and architectures of the data-centre parts cache images are
  built for, so they are named and matched whatever the database's age; it wins over the
  database.
* **Code names**: pci.ids names a GPU by its chip (``GH100 [H100 SXM5 80GB]``,
  ``Aqua Vanjaram [Instinct MI300X]``); :func:`arch_from_name` maps the chip to the compute
  capability NVIDIA's CUDA GPU table gives it (``sm_90``) or to AMD's LLVM target (``gfx942``).
  A chip not in these rules stays unknown (``None``): such a part matches no image rather than a
  wrong one.

NVML and amdsmi, where present, report the architecture of the part itself and win over all of
this (:mod:`accelnode.hw.accelerators`).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

NVIDIA, AMD = 0x10DE, 0x1002
PATHS = ("/usr/share/hwdata/pci.ids", "/usr/share/misc/pci.ids", "/usr/share/pci.ids")
ENV = "ACCELNODE_PCI_IDS"

# (vendor, device) -> (product name, arch)
KNOWN = {
    (NVIDIA, 0x1EB8): ("Tesla T4", "sm_75"),
    (NVIDIA, 0x20B0): ("A100 SXM4 40GB", "sm_80"),
    (NVIDIA, 0x20B2): ("A100 SXM4 80GB", "sm_80"),
    (NVIDIA, 0x20B5): ("A100 PCIe 80GB", "sm_80"),
    (NVIDIA, 0x20F1): ("A100 PCIe 40GB", "sm_80"),
    (NVIDIA, 0x2236): ("A10", "sm_86"),
    (NVIDIA, 0x2237): ("A10G", "sm_86"),
    (NVIDIA, 0x27B8): ("L4", "sm_89"),
    (NVIDIA, 0x26B5): ("L40", "sm_89"),
    (NVIDIA, 0x26B9): ("L40S", "sm_89"),
    (NVIDIA, 0x2321): ("H100 NVL", "sm_90"),
    (NVIDIA, 0x2330): ("H100 SXM5 80GB", "sm_90"),
    (NVIDIA, 0x2331): ("H100 PCIe", "sm_90"),
    (NVIDIA, 0x2335): ("H200 SXM 141GB", "sm_90"),
    (NVIDIA, 0x233B): ("H200 NVL", "sm_90"),
    (NVIDIA, 0x2901): ("B200", "sm_100"),
    (NVIDIA, 0x2941): ("GB200", "sm_100"),
    (NVIDIA, 0x3182): ("B300 SXM6 AC", "sm_103"),
    (AMD, 0x738C): ("Instinct MI100", "gfx908"),
    (AMD, 0x740C): ("Instinct MI250X/MI250", "gfx90a"),
    (AMD, 0x740F): ("Instinct MI210", "gfx90a"),
    (AMD, 0x74A0): ("Instinct MI300A", "gfx942"),
    (AMD, 0x74A1): ("Instinct MI300X", "gfx942"),
    (AMD, 0x74A5): ("Instinct MI325X", "gfx942"),
    (AMD, 0x75A0): ("Instinct MI350X", "gfx950"),
    (AMD, 0x75A3): ("Instinct MI355X", "gfx950"),
}

# NVIDIA chip -> compute capability (NVIDIA's "CUDA GPUs" table, per chip): exact chips first,
# then families (the letters and the first digit of the number).
_NV_CHIP = {"GK110": "35", "GK110B": "35", "GK210": "37", "GP100": "60", "GP10B": "62", "GV100": "70",
            "GV10B": "72", "GA100": "80", "GA10B": "87", "GH100": "90", "GB100": "100", "GB102": "100",
            "GB110": "103", "GB10B": "110", "GB10": "121"}
_NV_FAMILY = {"GM1": "50", "GM2": "52", "GP1": "61", "TU1": "75", "GA1": "86", "AD1": "89", "GB2": "120"}
_NV_NAME = re.compile(r"^((?:GK|GM|GP|GV|TU|GA|AD|GH|GB)\d+[AB]?)(?:GL|M|L)?\b")
# AMD chip code name (as pci.ids spells it) -> LLVM target
_AMD_CHIP = {"Vega 10": "gfx900", "Vega 20": "gfx906", "Arcturus": "gfx908", "Aldebaran": "gfx90a",
             "Aqua Vanjaram": "gfx942", "Navi 21": "gfx1030", "Navi 22": "gfx1031", "Navi 23": "gfx1032",
             "Navi 24": "gfx1034", "Navi 31": "gfx1100", "Navi 32": "gfx1101", "Navi 33": "gfx1102",
             "Navi 44": "gfx1200", "Navi 48": "gfx1201"}
_AMD_NAME = re.compile(r"^(" + "|".join(re.escape(c) for c in _AMD_CHIP) + r")\b")


def database_path(environ=os.environ) -> Path | None:
    """The PCI ID database in use: ``$ACCELNODE_PCI_IDS``, else the first of :data:`PATHS` present."""
    for p in ([environ[ENV]] if environ.get(ENV) else PATHS):
        if Path(p).is_file():
            return Path(p)
    return None


@functools.lru_cache(maxsize=4)
def database(path: Path | None) -> dict[tuple[int, int], str]:
    """(vendor, device) -> name for the NVIDIA and AMD sections of a pci.ids file ({} for None)."""
    names: dict[tuple[int, int], str] = {}
    if path is None:
        return names
    vendor = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            if line.startswith("C "):  # the device classes follow the vendors
                break
            if not line.startswith("\t"):
                try:
                    vendor = int(line[:4], 16)
                except ValueError:
                    vendor = None
                vendor = vendor if vendor in (NVIDIA, AMD) else None
            elif vendor is not None and not line.startswith("\t\t"):
                dev, _, name = line.strip().partition(" ")
                try:
                    names[(vendor, int(dev, 16))] = name.strip()
                except ValueError:
                    continue
    return names


def arch_from_name(vendor: int, name: str) -> str | None:
    """``sm_NN`` or ``gfxNNN`` from a pci.ids name's chip code name; None when it is not one we know."""
    if vendor == NVIDIA and (m := _NV_NAME.match(name)):
        chip = m.group(1)
        cc = _NV_CHIP.get(chip) or _NV_FAMILY.get(chip[:3])
        return f"sm_{cc}" if cc else None
    if vendor == AMD and (m := _AMD_NAME.match(name)):
        return _AMD_CHIP[m.group(1)]
    return None


def product(name: str) -> str:
    """The product in a pci.ids name: ``GH100 [H100 SXM5 80GB]`` -> ``H100 SXM5 80GB``."""
    m = re.search(r"\[([^\]]+)\]\s*$", name)
    return m.group(1) if m else name


def identify(vendor: int, device: int, path: Path | None = None) -> tuple[str | None, str | None]:
    """(name, arch) of a PCI GPU: :data:`KNOWN`, else the database name and its code name's arch."""
    if (vendor, device) in KNOWN:
        return KNOWN[(vendor, device)]
    name = database(path).get((vendor, device))
    if name is None:
        return None, None
    return product(name), arch_from_name(vendor, name)
