"""What wakes the device plugin: events first - inotify on the dev root, ``dev/vfio`` and the
kubelet dir, udev where it runs - and a slow sysfs tick for what gives no event
(docs/device-plugin.md).

:class:`Watcher` runs one loop on its own thread. An event rescans at once and again
:data:`SETTLE` seconds later, because events often arrive mid-change; the tick exists because
PCI ``vendor`` and AER counters are sysfs attributes, which give no inotify event. An idle
plugin wakes once per tick, and its heartbeat promise covers the time to the next wake-up, so a
scan that hangs on sysfs breaks it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
import time
from pathlib import Path
from typing import Callable

from accelnode.health import GRACE_DEFAULT, NOBEAT, Heartbeat
from accelnode.log import kv

from .health import ChipState, Inventory

log = logging.getLogger("accelnode.device_plugin")

IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x4000, 0x8000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
DIR_EVENTS = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of NUL-padded name)
SETTLE = 0.25  # seconds after an event before the follow-up scan
DEFAULT_TICK = 5.0  # seconds between sysfs reads


class Inotify:
    """A minimal inotify(7) binding: watch directories, read (wd, mask, name) events."""

    def __init__(self):
        self._libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols include libc's
        self._libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_init1: {os.strerror(ctypes.get_errno())}")
        self.fd = fd

    def add_watch(self, path: str | os.PathLike, mask: int = DIR_EVENTS) -> int | None:
        """Watch descriptor for ``path``, or None when it does not exist (yet)."""
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR):
                return None
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}")
        return wd

    def read(self) -> list[tuple[int, int, str]]:
        """Every queued event (the queue is drained). IN_Q_OVERFLOW comes with wd -1: events were lost."""
        events = []
        while True:
            try:
                buf = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                return events
            off = 0
            while off < len(buf):
                wd, mask, _cookie, length = _EVENT.unpack_from(buf, off)
                off += _EVENT.size
                name = buf[off:off + length].rstrip(b"\0").decode(errors="replace")
                off += length
                events.append((wd, mask, name))

    def close(self) -> None:
        os.close(self.fd)


def udev_monitor(sysfs_root: Path):
    """A pyudev monitor for PCI/VFIO/accel events, where udev runs and we look at the real /sys."""
    if not Path("/run/udev/control").exists() or sysfs_root.resolve() != Path("/sys"):
        return None
    import pyudev

    mon = pyudev.Monitor.from_netlink(pyudev.Context())
    for subsystem in ("pci", "vfio", "accel"):
        mon.filter_by(subsystem)
    mon.start()
    return mon


class Watcher:
    def __init__(self, inventory: Inventory, kubelet_dir: Path,
                 on_devices: Callable[[tuple[ChipState, ...]], None], on_kubelet: Callable[[], None],
                 tick: float = DEFAULT_TICK, beat: Heartbeat = NOBEAT, grace: float = GRACE_DEFAULT,
                 on_scan: Callable[[str], None] = lambda cause: None):
        self.inventory = inventory
        self.kubelet_dir = kubelet_dir
        self.on_devices = on_devices
        self.on_kubelet = on_kubelet
        self.tick = tick
        self.beat, self.grace = beat, grace
        self._ino = Inotify()
        self._udev = udev_monitor(inventory.sysfs_root)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._wds: dict[int, Path] = {}
        self._thread = threading.Thread(target=self._run, name="watcher", daemon=True)
        self.last: tuple[ChipState, ...] | None = None
        self._next_tick = 0.0  # monotonic time of the next sysfs read
        self._settle: float | None = None  # monotonic time of the follow-up scan after an event
        self.on_scan = on_scan  # on_scan("event" | "tick") before each scan

    def start(self) -> "Watcher":
        self._watch_dirs()
        self.last = self.inventory.scan()
        self._next_tick = time.monotonic() + self.tick
        self.on_devices(self.last)
        log.info("watching for device and kubelet changes",
                 extra=kv(udev=self._udev is not None, inotify_dirs=sorted(map(str, self._wds.values())),
                          sysfs_tick_s=self.tick))
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop (if it was started) and close the descriptors."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(5)
        self._ino.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _watch_dirs(self) -> None:
        """(Re)arm watches on the kubelet dir, the dev root and dev/vfio, when they exist."""
        have = set(self._wds.values())
        for d in (self.kubelet_dir, self.inventory.dev_root, self.inventory.dev_root / "vfio"):
            if d not in have:
                wd = self._ino.add_watch(d)
                if wd is not None:
                    self._wds[wd] = d

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self._until_next()
            self.beat.beat(wait + self.grace)
            self.step(wait)
        self.beat.close()  # only a stop ends the loop on purpose; an exception leaves it dead

    def _until_next(self) -> float:
        due = self._next_tick if self._settle is None else min(self._next_tick, self._settle)
        return max(0.0, due - time.monotonic())

    def _chip_node(self, watched: Path | None, name: str) -> bool:
        """Whether an event in ``watched`` concerns a chip's device node."""
        dev = self.inventory.dev_root
        return watched == dev / "vfio" or (watched == dev and (name.startswith("accel") or name == "vfio"))

    def step(self, timeout: float) -> None:
        """One wake-up: wait up to ``timeout`` for events; rescan on a device event, a due
        follow-up or a due tick; report what changed."""
        fds = [self._ino.fd, self._wake_r] + ([self._udev.fileno()] if self._udev else [])
        ready, _, _ = select.select(fds, [], [], timeout)
        kubelet = event = False
        if self._ino.fd in ready:
            for wd, mask, name in self._ino.read():
                watched = self._wds.get(wd)
                if mask & IN_IGNORED:  # the watch is gone (its directory was deleted)
                    self._wds.pop(wd, None)
                lost = mask & (IN_DELETE_SELF | IN_Q_OVERFLOW)
                # a lost event may have been kubelet's: let the registrar look (it is idempotent)
                if watched == self.kubelet_dir or lost:
                    kubelet = True
                if lost or self._chip_node(watched, name):
                    event = True
        if len(self._wds) < 3:  # a watched dir is missing: re-arm once it exists
            self._watch_dirs()
        if self._udev and self._udev.fileno() in ready:
            while self._udev.poll(timeout=0) is not None:
                event = True
        if self._stop.is_set():
            return
        now = time.monotonic()
        cause = None
        if event:
            cause, self._settle = "event", now + SETTLE
        elif self._settle is not None and now >= self._settle:
            cause, self._settle = "event", None
        if now >= self._next_tick:
            cause, self._next_tick = cause or "tick", now + self.tick
        if cause is not None:
            self._scan(cause)
        if kubelet:
            self.on_kubelet()

    def _scan(self, cause: str) -> None:
        self.on_scan(cause)
        try:
            states = self.inventory.scan()
        except Exception:  # a scan must never kill the watcher; the next wake-up retries
            log.exception("scanning chips failed")
            return
        if states != self.last:
            self.last = states
            self.on_devices(states)
