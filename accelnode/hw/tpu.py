"""Find TPU chips on a host from sysfs and /dev.

One code path for real and simulated hosts: everything is read below ``sysfs_root`` and
``dev_root``. A chip is a PCI function with vendor 0x1ae0 and a known device id. Chips are
ordered by PCI address (never by IOMMU group number) and numbered 0..n-1 in that order.

Device nodes: v4 chips have ``/dev/accelN`` (the ``accelN`` class device under the PCI
function's ``accel/`` directory names it); v5e and later are bound to vfio-pci and need
``/dev/vfio/<iommu group>`` plus the container node ``/dev/vfio/vfio``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

VENDOR_GOOGLE = 0x1AE0
# PCI device id -> generation
GENERATIONS = {0x005E: "v4", 0x0063: "v5e", 0x0062: "v5p", 0x006F: "v6e", 0x0076: "v7x"}
DEVICE_IDS = {gen: dev for dev, gen in GENERATIONS.items()}
VFIO_GENERATIONS = frozenset({"v5e", "v5p", "v6e", "v7x"})
PCI_DEVICES = "bus/pci/devices"


@dataclass(frozen=True)
class Chip:
    index: int  # position in PCI-address order, 0..n-1
    bdf: str  # PCI address, "0000:00:04.0"
    generation: str
    device_id: int
    numa_node: int | None  # None when the kernel reports -1 (unknown)
    dev_paths: tuple[str, ...]  # device nodes on this host (under dev_root), incl. vfio/vfio on VFIO generations
    iommu_group: str | None = None

    @property
    def id(self) -> str:
        """The kubelet device ID: stable across restarts and hotplug of other chips."""
        return f"tpu-{self.bdf}"


def pci_sort_key(bdf: str) -> tuple[int, ...]:
    """(domain, bus, device, function) of "DDDD:BB:dd.f", for ordering by PCI address."""
    dom, bus, rest = bdf.split(":")
    dev, fn = rest.split(".")
    return (int(dom, 16), int(bus, 16), int(dev, 16), int(fn, 16))


def read_hex(path: Path) -> int:
    """An integer sysfs attribute such as ``vendor`` ("0x1ae0\\n"); raises OSError/ValueError."""
    return int(path.read_text().strip(), 16)


def probe(sysfs_root: str | os.PathLike, dev_root: str | os.PathLike, bdf: str) -> Chip | None:
    """The chip at PCI address ``bdf`` (index 0), or None if it is not a readable TPU chip."""
    pci = Path(sysfs_root) / PCI_DEVICES / bdf
    try:
        if read_hex(pci / "vendor") != VENDOR_GOOGLE:
            return None
        device_id = read_hex(pci / "device")
    except (OSError, ValueError):
        return None
    generation = GENERATIONS.get(device_id)
    if generation is None:
        return None
    group = _iommu_group(pci)
    return Chip(
        index=0,
        bdf=bdf,
        generation=generation,
        device_id=device_id,
        numa_node=_numa_node(pci),
        dev_paths=_dev_paths(Path(dev_root), pci, generation, group),
        iommu_group=group,
    )


def pci_addresses(sysfs_root: str | os.PathLike) -> list[str]:
    """Every PCI function under the sysfs root, in PCI-address order."""
    try:
        names = os.listdir(Path(sysfs_root) / PCI_DEVICES)
    except FileNotFoundError:
        return []
    return sorted((n for n in names if n.count(":") == 2), key=pci_sort_key)


def numbered(chips) -> list[Chip]:
    """Chips sorted by PCI address with ``index`` set to their position."""
    ordered = sorted(chips, key=lambda c: pci_sort_key(c.bdf))
    return [c if c.index == i else replace(c, index=i) for i, c in enumerate(ordered)]


def discover(sysfs_root: str | os.PathLike = "/sys", dev_root: str | os.PathLike = "/dev") -> list[Chip]:
    """TPU chips present under ``sysfs_root``, sorted by PCI address."""
    chips = (probe(sysfs_root, dev_root, bdf) for bdf in pci_addresses(sysfs_root))
    return numbered(c for c in chips if c is not None)


def _numa_node(pci: Path) -> int | None:
    try:
        node = int((pci / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _iommu_group(pci: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(pci / "iommu_group"))
    except OSError:
        return None


def _dev_paths(dev: Path, pci: Path, generation: str, group: str | None) -> tuple[str, ...]:
    if generation in VFIO_GENERATIONS:
        if group is None:
            return ()
        return (str(dev / "vfio" / group), str(dev / "vfio" / "vfio"))
    try:
        names = sorted(n for n in os.listdir(pci / "accel") if n.startswith("accel"))
    except OSError:
        return ()
    return tuple(str(dev / n) for n in names)


def aer_fatal_total(text: str) -> int:
    """Total of an ``aer_dev_fatal`` file: its TOTAL_ERR_FATAL line, else the sum of the counters."""
    total = 0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == "TOTAL_ERR_FATAL":
            return int(value)
        if value.isdigit():
            total += int(value)
    return total
