"""What ``/healthz`` and ``/readyz`` report: a daemon's essential threads and servers, alive or not
(docs/health.md).

A :class:`Heartbeat` belongs to one long-running thread, which promises with ``beat(within)`` to
beat again within ``within`` seconds; a thread that waits with a timeout promises that timeout
plus slack, so a healthy idle wait never breaks its promise. A heartbeat is stuck once its
promise is overdue, dead once its thread ended without :meth:`Heartbeat.close`. A check is a
callable returning None or a problem. Not alive implies not ready.

Thread-safe; a beat costs one monotonic read.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

Check = Callable[[], "str | None"]
GRACE_DEFAULT = 30.0  # seconds a loop may overrun its promised wake-up (a slow scan, a slow API call)


class Heartbeat:
    """One thread's heartbeat: ``beat(within)`` each time round its loop, ``close()`` when it ends
    on purpose (a daemon stopping). A heartbeat not bound to a registry (:data:`NOBEAT`) does nothing."""

    def __init__(self, name: str, within: float, clock=time.monotonic):
        self.name = name
        self._clock = clock
        self._last = clock()
        self._deadline = self._last + within
        self._thread: threading.Thread | None = None
        self.closed = False

    def beat(self, within: float) -> None:
        """Alive now; the next beat comes within ``within`` seconds."""
        now = self._clock()
        self._thread = threading.current_thread()
        self._last, self._deadline = now, now + within
        self.closed = False

    def close(self) -> None:
        """The thread ends on purpose: no longer watched."""
        self.closed = True

    def problem(self) -> str | None:
        if self.closed:
            return None
        now = self._clock()
        if self._thread is not None and not self._thread.is_alive():
            return f"thread {self._thread.name!r} died {now - self._last:.1f}s after its last beat"
        if now > self._deadline:
            return (f"stuck: no beat for {now - self._last:.1f}s "
                    f"(promised within {self._deadline - self._last:.1f}s)")
        return None


class _NoBeat(Heartbeat):
    def __init__(self):
        super().__init__("-", 0.0)

    def beat(self, within: float) -> None:
        pass

    def problem(self) -> str | None:
        return None


NOBEAT: Heartbeat = _NoBeat()  # the default where a loop runs without a Health (tests, tools)


class Health:
    """The essential parts of one daemon; see the module docstring."""

    def __init__(self, clock=time.monotonic):
        self._lock = threading.Lock()
        self._beats: dict[str, Heartbeat] = {}
        self._checks: dict[str, Check] = {}
        self._clock = clock

    def heartbeat(self, name: str, within: float) -> Heartbeat:
        """A new heartbeat named ``name`` (unique in this daemon) that must beat within ``within``
        seconds of now (its startup allowance)."""
        hb = Heartbeat(name, within, self._clock)
        with self._lock:
            if name in self._beats:
                raise ValueError(f"heartbeat {name!r} is registered twice")
            self._beats[name] = hb
        return hb

    def check(self, name: str, fn: Check) -> None:
        """A check run on every probe: ``fn()`` returns None or what is wrong."""
        with self._lock:
            self._checks[name] = fn

    def problems(self) -> list[str]:
        with self._lock:
            beats, checks = list(self._beats.values()), list(self._checks.items())
        out = [f"{hb.name} {p}" for hb in beats if (p := hb.problem())]
        for name, fn in checks:
            try:
                p = fn()
            except Exception as e:  # a check that fails to run is a failed check
                p = f"check failed: {e!r}"
            if p:
                out.append(f"{name} {p}")
        return out

    def liveness(self) -> tuple[bool, str]:
        problems = self.problems()
        return (not problems, "; ".join(problems))
