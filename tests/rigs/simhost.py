"""A simulated TPU host: a sysfs-shaped tree and real character device nodes under one root.

Used by the tests, the demo and other components' tests. Building one needs root (mknod).
The layout is the kernel's: ``sys/devices/pci0000:00/<bdf>/`` holds the PCI attributes,
``sys/bus/pci/devices/<bdf>`` links to it, ``iommu_group`` and ``driver`` are symlinks, and
``dev/vfio/<group>`` (v5e+) or ``dev/accelN`` (v4) are character devices. A TPU7x chip is two
PCI functions (``.0`` and ``.1`` of one slot), each in its own IOMMU group with its own VFIO node.
Attribute writes are atomic (write to a temporary name, then rename), like sysfs reads are.

The device numbers are from the "local/experimental" range (major 240-254), so a stray open
of a simulated node never reaches real hardware.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

from accelnode.hw.tpu import DEVICE_IDS, FUNCTIONS_PER_CHIP, VENDOR_GOOGLE, VFIO_GENERATIONS, aer_fatal_total, pci_sort_key

SIM_MAJOR_VFIO_GROUP = 240
SIM_MAJOR_ACCEL = 241
SIM_MAJOR_VFIO_CONTAINER = 242
DRIVER = {True: "vfio-pci", False: "tpu-accel"}  # by "is a VFIO generation"
# AER counters as the kernel prints them in aer_dev_fatal: one "NAME count" per line.
AER_FATAL_NAMES = ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt",
                   "RxOF", "MalfTLP", "ECRC", "UnsupReq", "ACSViol")
_PRESET = re.compile(r"^(v4|v5e|v5p|v6e|v7x)-(1|2|4|8)$")


class SimHost:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        for d in ("sys/devices/pci0000:00", "sys/bus/pci/devices", "sys/kernel/iommu_groups", "dev/vfio"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        for drv in DRIVER.values():
            (self.root / "sys/bus/pci/drivers" / drv).mkdir(parents=True, exist_ok=True)
        self._generation: dict[str, str] = {}  # bdf -> generation of simulated TPU functions
        self._functions: dict[str, list[str]] = {}  # chip (its first function's bdf) -> its functions
        self._removed_nodes: dict[str, tuple[str, int, int]] = {}  # bdf -> (path, major, minor)

    @classmethod
    def preset(cls, root: str | os.PathLike, name: str) -> "SimHost":
        """A host like a TPU VM: ``"<generation>-<chips>"`` (e.g. ``"v5e-4"``, ``"v7x-4"``).

        Chips sit at 0000:00:04.0 onwards (a v7x chip's second function at .1) with IOMMU groups
        numbered in reverse, so anything that orders chips by group number shows up wrong. Hosts with 4 or more chips split their
        chips over two NUMA nodes for v7x and 8-chip hosts (v7x pairs one NUMA half with 2 chips),
        else NUMA node 0. A non-TPU NIC (virtio, 0000:00:03.0) sits on the bus too.
        """
        m = _PRESET.match(name)
        if not m:
            raise ValueError(f"unknown preset {name!r}: expected <v4|v5e|v5p|v6e|v7x>-<1|2|4|8>, e.g. v5e-4")
        gen, n = m.group(1), int(m.group(2))
        host = cls(root)
        host.add_pci_device("0000:00:03.0", vendor=0x1AF4, device=0x1000)
        split = n >= 4 and (gen == "v7x" or n == 8)
        per_chip = FUNCTIONS_PER_CHIP.get(gen, 1)
        for i in range(n):
            numa = (i * 2 // n) if split else 0
            groups = [str(per_chip * (n - i) - 1 - k) for k in range(per_chip)]
            host.add_chip(gen, bdf=f"0000:00:{4 + i:02x}.0", numa_node=numa, iommu_group=groups)
        return host

    @property
    def sysfs_root(self) -> Path:
        return self.root / "sys"

    @property
    def dev_root(self) -> Path:
        return self.root / "dev"

    def chips(self) -> list[str]:
        """PCI addresses of the simulated TPU chips (their first functions), in PCI order."""
        return sorted(self._functions, key=pci_sort_key)

    def functions(self, bdf: str) -> list[str]:
        """The PCI functions of the chip at ``bdf``, in PCI order (two on v7x)."""
        if bdf not in self._functions:
            raise KeyError(f"no simulated TPU chip at {bdf}")
        return list(self._functions[bdf])

    # -- building --------------------------------------------------------------------------

    def add_pci_device(self, bdf: str, *, vendor: int, device: int, numa_node: int = 0) -> Path:
        pci_sort_key(bdf)  # validates the address shape
        d = self.sysfs_root / "devices/pci0000:00" / bdf
        if d.exists():
            raise FileExistsError(f"PCI device {bdf} already exists on the simulated host")
        d.mkdir(parents=True)
        for name, value in (("vendor", f"0x{vendor:04x}"), ("device", f"0x{device:04x}"),
                            ("subsystem_vendor", f"0x{vendor:04x}"), ("subsystem_device", "0x0000"),
                            ("class", "0x120000"), ("numa_node", str(numa_node))):
            self._write(d / name, value + "\n")
        self._write(d / "aer_dev_fatal", _aer_text(0))
        (self.sysfs_root / "bus/pci/devices" / bdf).symlink_to(f"../../../devices/pci0000:00/{bdf}")
        return d

    def remove_pci_device(self, bdf: str) -> None:
        """Undo :meth:`add_pci_device` for a device that is not a TPU chip (those: :meth:`remove_chip`)."""
        if bdf in self._generation:
            raise ValueError(f"{bdf} is a function of a simulated TPU chip: use remove_chip")
        (self.sysfs_root / "bus/pci/devices" / bdf).unlink()
        shutil.rmtree(self.sysfs_root / "devices/pci0000:00" / bdf)

    def add_chip(self, generation: str, *, bdf: str | None = None, numa_node: int = 0,
                 iommu_group: str | int | list | None = None) -> str:
        """Add a TPU chip with its function(s) and device node(s); returns its PCI address (its
        first function's). ``iommu_group``: one per function (a list on v7x) or the first's."""
        if generation not in DEVICE_IDS:
            raise ValueError(f"unknown TPU generation {generation!r}; known: {', '.join(DEVICE_IDS)}")
        per_chip = FUNCTIONS_PER_CHIP.get(generation, 1)
        bdf = bdf or self._free_bdf()
        addresses = [f"{bdf.rpartition('.')[0]}.{k}" for k in range(per_chip)] if per_chip > 1 else [bdf]
        vfio = generation in VFIO_GENERATIONS
        groups: list[str] = []
        if vfio:
            wanted = iommu_group if isinstance(iommu_group, list) else [iommu_group]
            for k in range(per_chip):
                g = wanted[k] if k < len(wanted) and wanted[k] is not None else self._free_group(exclude=groups)
                if (self.sysfs_root / "kernel/iommu_groups" / str(g)).exists() or str(g) in groups:
                    raise FileExistsError(f"IOMMU group {g} is already in use on the simulated host")
                groups.append(str(g))
        for a in addresses:
            if (self.sysfs_root / "devices/pci0000:00" / a).exists():
                raise FileExistsError(f"PCI device {a} already exists on the simulated host")
        for k, a in enumerate(addresses):
            self._add_function(generation, a, numa_node, groups[k] if vfio else None)
        self._functions[addresses[0]] = addresses
        return addresses[0]

    def _add_function(self, generation: str, bdf: str, numa_node: int, group: str | None) -> None:
        d = self.add_pci_device(bdf, vendor=VENDOR_GOOGLE, device=DEVICE_IDS[generation], numa_node=numa_node)
        self._generation[bdf] = generation
        vfio = group is not None
        (d / "driver").symlink_to(f"../../../bus/pci/drivers/{DRIVER[vfio]}")
        if vfio:
            gdir = self.sysfs_root / "kernel/iommu_groups" / group / "devices"
            gdir.mkdir(parents=True)
            (gdir / bdf).symlink_to(f"../../../../devices/pci0000:00/{bdf}")
            (d / "iommu_group").symlink_to(f"../../../kernel/iommu_groups/{group}")
            self._mknod(self.dev_root / "vfio/vfio", SIM_MAJOR_VFIO_CONTAINER, 0)
            self._mknod(self.dev_root / "vfio" / group, SIM_MAJOR_VFIO_GROUP, int(group))
        else:
            n = self._free_accel()
            (d / "accel" / f"accel{n}").mkdir(parents=True)
            self._write(d / "accel" / f"accel{n}" / "dev", f"{SIM_MAJOR_ACCEL}:{n}\n")
            self._mknod(self.dev_root / f"accel{n}", SIM_MAJOR_ACCEL, n)

    def remove_chip(self, bdf: str) -> None:
        """Hot-unplug a chip: each of its functions as :meth:`remove_function` does."""
        for f in self.functions(bdf):
            self.remove_function(f)

    def remove_function(self, bdf: str) -> None:
        """Hot-unplug one function: the device node goes first, then the sysfs entries (as the
        kernel does). The chip is forgotten with its last function."""
        d = self._chip_dir(bdf)
        node = self._node_path(bdf)
        if node.exists():
            node.unlink()
        (self.sysfs_root / "bus/pci/devices" / bdf).unlink()
        group = d / "iommu_group"
        if group.is_symlink():
            gdir = self.sysfs_root / "kernel/iommu_groups" / os.path.basename(os.readlink(group))
            (gdir / "devices" / bdf).unlink()
            (gdir / "devices").rmdir()
            gdir.rmdir()
        shutil.rmtree(d)
        del self._generation[bdf]
        self._removed_nodes.pop(bdf, None)
        for first, fs in list(self._functions.items()):
            if bdf in fs:
                fs.remove(bdf)
                if not fs:
                    del self._functions[first]
        if not any(g in VFIO_GENERATIONS for g in self._generation.values()):
            (self.dev_root / "vfio/vfio").unlink(missing_ok=True)

    # -- health knobs ----------------------------------------------------------------------

    def set_vendor(self, bdf: str, vendor: int) -> None:
        """0xffff is what a chip that fell off the bus reads as."""
        self._write(self._chip_dir(bdf) / "vendor", f"0x{vendor:04x}\n")

    def unbind_driver(self, bdf: str) -> None:
        (self._chip_dir(bdf) / "driver").unlink()

    def bind_driver(self, bdf: str) -> None:
        drv = DRIVER[self._generation[bdf] in VFIO_GENERATIONS]
        link = self._chip_dir(bdf) / "driver"
        if not link.is_symlink():
            link.symlink_to(f"../../../bus/pci/drivers/{drv}")

    def bump_aer_fatal(self, bdf: str) -> None:
        """One more fatal uncorrectable error (counted as a TLP error)."""
        p = self._chip_dir(bdf) / "aer_dev_fatal"
        self._write(p, _aer_text(aer_fatal_total(p.read_text()) + 1))

    def reset_aer(self, bdf: str) -> None:
        """What a function reset does to the counters: back to zero."""
        self._write(self._chip_dir(bdf) / "aer_dev_fatal", _aer_text(0))

    def remove_dev_node(self, bdf: str) -> None:
        node = self._node_path(bdf)
        st = node.stat()
        self._removed_nodes[bdf] = (str(node), os.major(st.st_rdev), os.minor(st.st_rdev))
        node.unlink()

    def restore_dev_node(self, bdf: str) -> None:
        path, major, minor = self._removed_nodes.pop(bdf)
        self._mknod(Path(path), major, minor)

    # -- internals -------------------------------------------------------------------------

    def _chip_dir(self, bdf: str) -> Path:
        """The sysfs directory of a TPU function (a chip's address is its first function's)."""
        if bdf not in self._generation:
            raise KeyError(f"no simulated TPU chip or function at {bdf}")
        return self.sysfs_root / "devices/pci0000:00" / bdf

    def _node_path(self, bdf: str) -> Path:
        d = self._chip_dir(bdf)
        if (d / "iommu_group").is_symlink():
            return self.dev_root / "vfio" / os.path.basename(os.readlink(d / "iommu_group"))
        return self.dev_root / next(iter(os.listdir(d / "accel")))

    def _free_bdf(self) -> str:
        used = {b.rpartition(".")[0] for b in os.listdir(self.sysfs_root / "bus/pci/devices")}
        return next(f"{s}.0" for s in (f"0000:00:{i:02x}" for i in range(4, 32)) if s not in used)

    def _free_group(self, exclude=()) -> int:
        used = set(os.listdir(self.sysfs_root / "kernel/iommu_groups")) | set(exclude)
        return next(i for i in range(1024) if str(i) not in used)

    def _free_accel(self) -> int:
        return next(i for i in range(256) if not (self.dev_root / f"accel{i}").exists()
                    and not any(p[0].endswith(f"/accel{i}") for p in self._removed_nodes.values()))

    @staticmethod
    def _mknod(path: Path, major: int, minor: int) -> None:
        if path.exists():
            return
        os.mknod(path, 0o660 | stat.S_IFCHR, os.makedev(major, minor))

    @staticmethod
    def _write(path: Path, text: str) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def _aer_text(fatal: int) -> str:
    lines = [f"{n} {fatal if n == 'TLP' else 0}" for n in AER_FATAL_NAMES]
    return "\n".join(lines + [f"TOTAL_ERR_FATAL {fatal}"]) + "\n"
