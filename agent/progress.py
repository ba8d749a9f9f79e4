"""Byte progress for pulls and builds: a redrawn bar on a terminal, log lines otherwise.

The store and the builder call ``start(total, label)``, then ``advance(n)`` from any thread,
then ``finish()``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from accelnode.log import kv

log = logging.getLogger("accelnode.agent.progress")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


class Progress:
    def __init__(self, stream=None, *, tty: bool | None = None, interval: float | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval if interval is not None else (0.1 if self.tty else 5.0)
        self._lock = threading.Lock()
        self.total = self.done = 0
        self.label = ""
        self._start = self._last = 0.0

    def start(self, total: int, label: str) -> None:
        with self._lock:
            self.total, self.done, self.label = total, 0, label
            self._start = self._last = time.monotonic()
        if not self.tty:
            log.info("transfer started", extra=kv(what=label, bytes=total))

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < self.interval:
                return
            self._last = now
            self._show(now)

    def finish(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self.tty:
                self._show(now)
                self.stream.write("\n")
                self.stream.flush()
            else:
                log.info("transfer done", extra=kv(what=self.label, bytes=self.done,
                                                   seconds=round(now - self._start, 2)))

    def _show(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-6)
        rate = self.done / elapsed
        frac = self.done / self.total if self.total else 1.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        if not self.tty:
            log.info("transfer progress", extra=kv(what=self.label, bytes=self.done, total=self.total,
                                                   percent=round(100 * frac, 1), rate=f"{_size(rate)}/s",
                                                   eta_s=round(eta)))
            return
        width = 30
        bar = "#" * int(width * min(frac, 1.0))
        self.stream.write(f"\r[{bar:<{width}}] {100 * frac:5.1f}% {_size(self.done)}/{_size(self.total)} "
                          f"{_size(rate)}/s ETA {int(eta // 60)}:{int(eta % 60):02d} ")
        self.stream.flush()
