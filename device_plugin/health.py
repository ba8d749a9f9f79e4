"""Chip health, and the inventory of chips a host has right now (docs/device-plugin.md).

A chip is Unhealthy while any of its PCI functions (two on TPU7x, one elsewhere) has a device
node missing, a ``vendor`` that is unreadable or 0xffff, no driver bound, or an AER fatal count
above the lowest seen since it appeared, or while it has fewer functions than its generation's
chips have; Healthy again once none holds. A function that leaves the bus while the other
function of its chip stays keeps the chip listed, off the bus. sysfs attributes give no inotify
events, so
:meth:`Inventory.scan` stays cheap enough to run every few tens of milliseconds: it skips
functions known not to be chips and reads only what a probe did not already read.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from accelnode.hw.tpu import (GENERATIONS, PCI_DEVICES, VENDOR_GOOGLE, Chip, Function, aer_fatal_total, chip,
                              chips_of, numbered, pci_addresses, probe, read_hex)

OFF_BUS = "vendor reads 0xffff (chip fell off the bus)"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class ChipState:
    chip: Chip
    problem: str | None = None  # why the chip is unhealthy; None when healthy
    off_bus: bool = False  # the chip left the PCI bus (vendor reads 0xffff, or its function is gone)

    @property
    def health(self) -> str:
        return HEALTHY if self.problem is None else UNHEALTHY


def _not_a_chip(pci: Path) -> bool:
    """True when the function reads as something other than a TPU chip (so it never becomes one
    while it stays on the bus); False while its ids can't be read or read 0xffff."""
    try:
        vendor = read_hex(pci / "vendor")
        if vendor == 0xFFFF:
            return False
        return vendor != VENDOR_GOOGLE or read_hex(pci / "device") not in GENERATIONS
    except (OSError, ValueError):
        return False


def _vendor_problem(pci: Path) -> str | None:
    try:
        vendor = (pci / "vendor").read_text().strip()
    except OSError as e:
        return f"vendor attribute unreadable: {e.strerror}"
    if vendor.lower() == "0xffff":
        return OFF_BUS
    if vendor.lower() != f"0x{VENDOR_GOOGLE:04x}":
        return f"vendor reads {vendor!r}, expected 0x{VENDOR_GOOGLE:04x}"
    return None


class Inventory:
    """The chips under one sysfs/dev root and their health, updated by :meth:`scan`."""

    def __init__(self, sysfs_root: str | os.PathLike, dev_root: str | os.PathLike):
        self.sysfs_root = Path(sysfs_root)
        self.dev_root = Path(dev_root)
        self._functions: dict[str, Function] = {}  # bdf -> TPU function seen and still on the bus (or its chip is)
        self._gone: set[str] = set()  # functions that left sysfs while another function of their chip stayed
        self._chip_of: dict[str, tuple[str, ...]] = {}  # bdf -> its chip's functions, as of the last scan
        self._others: set[str] = set()  # PCI functions that are not TPU functions
        self._aer_floor: dict[str, int] = {}  # bdf -> lowest AER fatal total seen

    def scan(self) -> tuple[ChipState, ...]:
        """Current chips (PCI order) and their health."""
        present = pci_addresses(self.sysfs_root)
        on_bus = set(present)
        for gone in [b for b in self._functions if b not in on_bus]:
            if any(p in on_bus for p in self._chip_of.get(gone, ())):
                self._gone.add(gone)  # its chip is still here: listed, off the bus
                continue
            del self._functions[gone]
            self._gone.discard(gone)
            self._aer_floor.pop(gone, None)
        self._gone -= on_bus
        self._others &= on_bus
        probed = set()  # functions whose vendor just read as Google's
        for bdf in present:
            if bdf in self._others:
                continue
            function = probe(self.sysfs_root, self.dev_root, bdf)
            if function is not None:
                self._functions[bdf] = function  # refreshed: device nodes follow group/driver changes
                probed.add(bdf)
            elif bdf not in self._functions and _not_a_chip(self.sysfs_root / PCI_DEVICES / bdf):
                self._others.add(bdf)
            # else: a known function that no longer probes (vendor 0xffff), kept and unhealthy below,
            # or a function that can't be identified yet, probed again next scan
        groups = chips_of(self._functions.values())
        self._chip_of = {f.bdf: tuple(g.bdf for g in group) for group in groups for f in group}
        functions = {f.bdf: f for group in groups for f in group}
        chips = numbered(chip(group, self.dev_root) for group in groups)
        return tuple(self._state(c, [functions[b] for b in c.functions], probed) for c in chips)

    def _state(self, c: Chip, functions: list[Function], probed: set[str]) -> ChipState:
        named = (lambda f, why: f"PCI function {f.bdf}: {why}") if c.expected_functions > 1 else (lambda f, why: why)
        for f in functions:
            if f.bdf in self._gone:
                return ChipState(c, named(f, "left the bus"), off_bus=True)
            if f.bdf not in probed and (problem := _vendor_problem(self.sysfs_root / PCI_DEVICES / f.bdf)):
                return ChipState(c, named(f, problem), off_bus=problem == OFF_BUS)
        if len(functions) < c.expected_functions:
            return ChipState(c, f"{len(functions)} of the {c.expected_functions} PCI functions of a "
                                f"{c.generation} chip found")
        for f in functions:
            if problem := self._problem(f):
                return ChipState(c, named(f, problem))
        for node in c.dev_paths:  # the VFIO container node the chip's functions share
            if problem := _node_problem(node):
                return ChipState(c, problem)
        for f in functions:
            if problem := self._aer_problem(f.bdf, self.sysfs_root / PCI_DEVICES / f.bdf):
                return ChipState(c, named(f, problem))
        return ChipState(c)

    def _problem(self, f: Function) -> str | None:
        if not os.path.lexists(self.sysfs_root / PCI_DEVICES / f.bdf / "driver"):
            return "no driver bound"
        if not f.nodes:
            return "no device node found for the chip"
        for node in f.nodes:
            if problem := _node_problem(node):
                return problem
        return None

    def _aer_problem(self, bdf: str, pci: Path) -> str | None:
        try:
            total = aer_fatal_total((pci / "aer_dev_fatal").read_text())
        except (OSError, ValueError):
            return None  # no AER capability: nothing to watch
        floor = min(total, self._aer_floor.get(bdf, total))
        self._aer_floor[bdf] = floor
        if total > floor:
            return f"AER fatal errors rose from {floor} to {total}"
        return None


def _node_problem(node: str) -> str | None:
    try:
        mode = os.stat(node).st_mode
    except OSError:
        return f"device node {node} missing"
    if not stat.S_ISCHR(mode):
        return f"device node {node} is not a character device"
    return None
