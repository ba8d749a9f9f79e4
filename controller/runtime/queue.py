"""The work queue of a controller: object keys waiting to be reconciled (controller-runtime's
workqueue semantics).

* A key queued again while it waits is queued once (dedup).
* A key is never handed to two workers at once: queued while a worker holds it, it waits and
  comes back (once) after :meth:`WorkQueue.done`.
* :meth:`WorkQueue.add_after` delays a key; a key delayed twice keeps the earlier time.
* :class:`Backoff` gives per-key exponential delays with jitter, capped, reset by
  :meth:`Backoff.forget` (a success).
* :meth:`WorkQueue.shutdown` wakes every waiting worker; :meth:`WorkQueue.get` then answers None
  at once. Keys still queued are dropped: reconcilers are level-based, and whoever leads next
  lists everything again.
"""

from __future__ import annotations

import heapq
import random
import threading
import time


class Backoff:
    """Per-key exponential backoff: ``base * 2**failures``, capped at ``cap``, each delay
    multiplied by a random factor in ``[1 - jitter, 1]`` so that keys failing together spread
    out (never above the cap)."""

    def __init__(self, base: float = 0.5, cap: float = 300.0, jitter: float = 0.2, rng: random.Random | None = None):
        if not 0 < base <= cap or not 0 <= jitter < 1:
            raise ValueError("backoff needs 0 < base <= cap and 0 <= jitter < 1")
        self.base, self.cap, self.jitter = base, cap, jitter
        self._rng = rng or random.Random()
        self._failures: dict[str, int] = {}
        self._lock = threading.Lock()

    def when(self, key: str) -> float:
        """Count one more failure of ``key``; the delay before its next attempt."""
        with self._lock:
            n = self._failures.get(key, 0)
            self._failures[key] = n + 1
            jitter = 1.0 - self._rng.random() * self.jitter
        return min(self.cap, self.base * 2.0 ** min(n, 64)) * jitter

    def failures(self, key: str) -> int:
        with self._lock:
            return self._failures.get(key, 0)

    def forget(self, key: str) -> None:
        """``key`` succeeded: its next failure starts from ``base`` again."""
        with self._lock:
            self._failures.pop(key, None)


class WorkQueue:
    def __init__(self, backoff: Backoff | None = None):
        self.backoff = backoff or Backoff()
        self._cond = threading.Condition()
        self._queue: list[str] = []  # ready keys, in order
        self._dirty: set[str] = set()  # keys that need a reconcile (queued or to be re-queued)
        self._processing: set[str] = set()  # keys a worker holds
        self._waiting: dict[str, float] = {}  # key -> monotonic time it becomes ready
        self._heap: list[tuple[float, str]] = []  # (time, key); stale entries skipped
        self._shutdown = False

    def __len__(self) -> int:
        """Keys ready to be handed out (the queue depth)."""
        with self._cond:
            self._promote(time.monotonic())
            return len(self._queue)

    @property
    def shutting_down(self) -> bool:
        return self._shutdown

    def add(self, key: str) -> None:
        with self._cond:
            if self._shutdown or key in self._dirty:
                return
            self._dirty.add(key)
            if key not in self._processing:
                self._queue.append(key)
                self._cond.notify()

    def add_after(self, key: str, delay: float) -> None:
        """Queue ``key`` once ``delay`` seconds have passed (at once when ``delay <= 0``)."""
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            if self._shutdown:
                return
            when = time.monotonic() + delay
            if key in self._waiting and self._waiting[key] <= when:
                return
            self._waiting[key] = when
            heapq.heappush(self._heap, (when, key))
            self._cond.notify()  # a worker may be sleeping until a later time

    def add_rate_limited(self, key: str) -> float:
        """Queue ``key`` after its next backoff delay; the delay."""
        delay = self.backoff.when(key)
        self.add_after(key, delay)
        return delay

    def forget(self, key: str) -> None:
        self.backoff.forget(key)

    def get(self, timeout: float | None = None) -> str | None:
        """The next key (the caller must call :meth:`done` with it), or None on shutdown or
        when ``timeout`` passes first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._shutdown:
                    return None
                now = time.monotonic()
                self._promote(now)
                if self._queue:
                    key = self._queue.pop(0)
                    self._processing.add(key)
                    self._dirty.discard(key)
                    return key
                waits = [t - now for t in (self._heap[0][0] if self._heap else None, end) if t is not None]
                if end is not None and now >= end:
                    return None
                self._cond.wait(max(0.0, min(waits)) if waits else None)

    def done(self, key: str) -> None:
        """A worker finished ``key``; if it was queued meanwhile, it is ready again now."""
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty and not self._shutdown:
                self._queue.append(key)
                self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._queue.clear()
            self._waiting.clear()
            self._heap.clear()
            self._cond.notify_all()

    def _promote(self, now: float) -> None:
        """Move delayed keys whose time has come to the ready queue (lock held)."""
        while self._heap and self._heap[0][0] <= now:
            when, key = heapq.heappop(self._heap)
            if self._waiting.get(key) != when:
                continue  # superseded by an earlier time
            del self._waiting[key]
            if key not in self._dirty:
                self._dirty.add(key)
                if key not in self._processing:
                    self._queue.append(key)
