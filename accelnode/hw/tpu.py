"""Find TPU chips on a host from sysfs and /dev.

One code path for real and simulated hosts: everything is read below ``sysfs_root`` and
``dev_root``. A TPU function is a PCI function with vendor 0x1ae0 and a known device id. A chip
is one function, except on TPU7x, whose chips expose two ("chiplets", each its own VFIO device;
``google.com/tpu`` counts chips): :func:`chips_of` owns how functions pair into chips. Chips are
ordered by the PCI address of their first function (never by IOMMU group number) and numbered
0..n-1 in that order.

Device nodes: v4 chips have ``/dev/accelN`` (the ``accelN`` class device under the PCI
function's ``accel/`` directory names it); v5e and later are bound to vfio-pci and need
``/dev/vfio/<iommu group>`` of each of the chip's functions plus the container node
``/dev/vfio/vfio``.
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
# PCI functions (VFIO devices) one chip exposes, where more than one: TPU7x chips are two chiplets
FUNCTIONS_PER_CHIP = {"v7x": 2}
PCI_DEVICES = "bus/pci/devices"
VFIO_CONTAINER = "vfio/vfio"


@dataclass(frozen=True)
class Function:
    """One TPU PCI function as sysfs shows it."""

    bdf: str
    generation: str
    device_id: int
    numa_node: int | None
    nodes: tuple[str, ...]  # its own device nodes: /dev/vfio/<group> or /dev/accelN (not vfio/vfio)
    iommu_group: str | None = None


@dataclass(frozen=True)
class Chip:
    index: int  # position in PCI-address order, 0..n-1
    bdf: str  # PCI address of its first function, "0000:00:04.0": the chip's identity
    generation: str
    device_id: int
    numa_node: int | None  # None when the kernel reports -1 (unknown)
    dev_paths: tuple[str, ...]  # device nodes on this host (under dev_root), incl. vfio/vfio on VFIO generations
    iommu_groups: tuple[str, ...] = ()  # one per function that has one
    functions: tuple[str, ...] = ()  # PCI addresses of its functions, PCI order; () is (bdf,)

    def __post_init__(self):
        if not self.functions:
            object.__setattr__(self, "functions", (self.bdf,))

    @property
    def id(self) -> str:
        """The kubelet device ID: stable across restarts and hotplug of other chips."""
        return f"tpu-{self.bdf}"

    @property
    def expected_functions(self) -> int:
        return FUNCTIONS_PER_CHIP.get(self.generation, 1)


def pci_sort_key(bdf: str) -> tuple[int, ...]:
    """(domain, bus, device, function) of "DDDD:BB:dd.f", for ordering by PCI address."""
    dom, bus, rest = bdf.split(":")
    dev, fn = rest.split(".")
    return (int(dom, 16), int(bus, 16), int(dev, 16), int(fn, 16))


def read_hex(path: Path) -> int:
    """An integer sysfs attribute such as ``vendor`` ("0x1ae0\\n"); raises OSError/ValueError."""
    return int(path.read_text().strip(), 16)


def probe(sysfs_root: str | os.PathLike, dev_root: str | os.PathLike, bdf: str) -> Function | None:
    """The TPU function at PCI address ``bdf``, or None if it is not a readable TPU function."""
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
    return Function(bdf=bdf, generation=generation, device_id=device_id, numa_node=_numa_node(pci),
                    nodes=_nodes(Path(dev_root), pci, generation, group), iommu_group=group)


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


def slot(bdf: str) -> str:
    """The PCI slot ("DDDD:BB:dd") of a function address."""
    return bdf.rpartition(".")[0]


def chips_of(functions) -> list[tuple[Function, ...]]:
    """TPU functions grouped into chips, each group in PCI order, groups ordered by first function.

    A generation with one function per chip: each function is a chip. TPU7x (two per chip): the
    functions of one PCI slot (function 0 and 1 of one device) are one chip; where every slot of
    the generation holds a single function, consecutive functions in PCI order pair up (the
    mapping Ray uses, device index // 2). A slot with fewer functions than its chip needs is still
    a chip: the caller sees it short of a function."""
    ordered = sorted(functions, key=lambda f: pci_sort_key(f.bdf))
    groups: list[tuple[Function, ...]] = []
    for gen in dict.fromkeys(f.generation for f in ordered):
        mine = [f for f in ordered if f.generation == gen]
        per_chip = FUNCTIONS_PER_CHIP.get(gen, 1)
        if per_chip == 1:
            groups += [(f,) for f in mine]
            continue
        slots: dict[str, list[Function]] = {}
        for f in mine:
            slots.setdefault(slot(f.bdf), []).append(f)
        if all(len(v) == 1 for v in slots.values()):
            groups += [tuple(mine[i:i + per_chip]) for i in range(0, len(mine), per_chip)]
        else:
            groups += [tuple(v) for v in slots.values()]
    return sorted(groups, key=lambda g: pci_sort_key(g[0].bdf))


def chip(functions: tuple[Function, ...], dev_root: str | os.PathLike) -> Chip:
    """The chip made of ``functions`` (index 0): its nodes are every function's, then vfio/vfio."""
    first = functions[0]
    nodes = tuple(n for f in functions for n in f.nodes)
    if first.generation in VFIO_GENERATIONS and nodes:
        nodes += (str(Path(dev_root) / VFIO_CONTAINER),)
    numa = [f.numa_node for f in functions if f.numa_node is not None]
    return Chip(index=0, bdf=first.bdf, generation=first.generation, device_id=first.device_id,
                numa_node=numa[0] if numa else None, dev_paths=nodes,
                iommu_groups=tuple(f.iommu_group for f in functions if f.iommu_group is not None),
                functions=tuple(f.bdf for f in functions))


def discover(sysfs_root: str | os.PathLike = "/sys", dev_root: str | os.PathLike = "/dev") -> list[Chip]:
    """TPU chips present under ``sysfs_root``, sorted by PCI address."""
    found = (probe(sysfs_root, dev_root, bdf) for bdf in pci_addresses(sysfs_root))
    return numbered(chip(g, dev_root) for g in chips_of(f for f in found if f is not None))


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


def _nodes(dev: Path, pci: Path, generation: str, group: str | None) -> tuple[str, ...]:
    if generation in VFIO_GENERATIONS:
        return () if group is None else (str(dev / "vfio" / group),)
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
