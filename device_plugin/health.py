"""Chip health, and the inventory of chips a host has right now (docs/device-plugin.md).

A chip is Unhealthy while its device node is missing, its PCI ``vendor`` is unreadable or
0xffff, no driver is bound, or its AER fatal count is above the lowest seen since it appeared;
Healthy again once none holds. sysfs attributes give no inotify events, so
:meth:`Inventory.scan` stays cheap enough to run every few tens of milliseconds: it skips
functions known not to be chips and reads only what a probe did not already read.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from accelnode.hw.tpu import (GENERATIONS, PCI_DEVICES, VENDOR_GOOGLE, Chip, aer_fatal_total, numbered, pci_addresses,
                              probe, read_hex)

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
        self._chips: dict[str, Chip] = {}  # bdf -> chip, for chips seen and still on the bus
        self._others: set[str] = set()  # PCI functions that are not TPU chips
        self._aer_floor: dict[str, int] = {}  # bdf -> lowest AER fatal total seen

    def scan(self) -> tuple[ChipState, ...]:
        """Current chips (PCI order) and their health."""
        present = pci_addresses(self.sysfs_root)
        on_bus = set(present)
        for gone in [b for b in self._chips if b not in on_bus]:
            del self._chips[gone]
            self._aer_floor.pop(gone, None)
        self._others &= on_bus
        probed = set()  # chips whose vendor just read as Google's
        for bdf in present:
            if bdf in self._others:
                continue
            chip = probe(self.sysfs_root, self.dev_root, bdf)
            if chip is not None:
                self._chips[bdf] = chip  # refreshed: device nodes follow group/driver changes
                probed.add(bdf)
            elif bdf not in self._chips and _not_a_chip(self.sysfs_root / PCI_DEVICES / bdf):
                self._others.add(bdf)
            # else: a known chip that no longer probes (vendor 0xffff), kept and unhealthy below,
            # or a function that can't be identified yet, probed again next scan
        chips = numbered(self._chips.values())
        return tuple(self._state(c, vendor_ok=c.bdf in probed) for c in chips)

    def _state(self, chip: Chip, vendor_ok: bool) -> ChipState:
        pci = self.sysfs_root / PCI_DEVICES / chip.bdf
        if not vendor_ok and (problem := _vendor_problem(pci)):
            return ChipState(chip, problem, off_bus=problem == OFF_BUS)
        return ChipState(chip, self._problem(chip, pci))

    def _problem(self, chip: Chip, pci: Path) -> str | None:
        if not os.path.lexists(pci / "driver"):
            return "no driver bound"
        if not chip.dev_paths:
            return "no device node found for the chip"
        for node in chip.dev_paths:
            try:
                mode = os.stat(node).st_mode
            except OSError:
                return f"device node {node} missing"
            if not stat.S_ISCHR(mode):
                return f"device node {node} is not a character device"
        return self._aer_problem(chip.bdf, pci)

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
