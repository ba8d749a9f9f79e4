"""Pulls the caches this node should hold before any pod asks for them."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from accelnode.health import GRACE_DEFAULT, NOBEAT, Heartbeat
from accelnode.log import kv

from . import fit
from .nodestatus import Cache

log = logging.getLogger("accelnode.agent.prefetch")


@dataclass
class _Outcome:
    fits: bool = True
    failed: str | None = None
    at: float = field(default_factory=time.monotonic)


class Prefetcher:
    """Pulls the caches this node should hold, one at a time, before any pod asks.

    Each is pulled as its cache: ``pull(cache key, image)`` and ``inspect(cache key, image)``
    use the credentials that cache's requests get (agent/credentials.py) and prove its digest
    for them, so a cache's status shows only what its own credentials brought
    (docs/agent-status.md). Two caches naming one image are two prefetches (one download).

    Only the controller's pin is pulled (:meth:`Cache.prefetchable`), never a tag nor a digest
    only ``spec.image`` names, and only for caches the signature rule admits (the reporter
    leaves out those :func:`accelnode.oci.refusal.pull_refusal` refuses).

    A cache wanted by node selector is pulled as is (a misfit then shows as Error). One wanted
    only through the prefetch annotation is first inspected (manifests and config, no layers)
    and pulled only if it fits this node's accelerators. A failed pull is retried after
    ``retry`` seconds.

    Its loop beats ``beat`` (:mod:`accelnode.health`): every :attr:`IDLE_WAKE` seconds while
    idle, and before each prefetch, promising to be done within ``busy_bound`` seconds.
    """

    IDLE_WAKE = 60.0

    def __init__(self, pull, accelerators, inspect, *, on_done, retry: float = 60.0, beat: Heartbeat = NOBEAT,
                 busy_bound: float = 600.0, grace: float = GRACE_DEFAULT):
        self._pull, self._inspect, self._on_done = pull, inspect, on_done
        self.accelerators, self.retry = accelerators, retry
        self.beat, self.busy_bound, self.grace = beat, busy_bound, grace
        self._queue: queue.Queue = queue.Queue()
        self._outcomes: dict[tuple, _Outcome] = {}  # (cache key, pinned image) -> last outcome
        self._queued: set[tuple] = set()
        self._lock = threading.Lock()

    def want(self, caches: list[Cache], held: set) -> None:
        """Queue what should be on the node for each cache and is not (``held``: the keys of
        caches whose digest is installed and proved for them): never tried, failed more than
        ``retry`` seconds ago, or pulled before and removed since (``accelnode cache gc``)."""
        now = time.monotonic()
        with self._lock:
            for c in caches:
                image = c.prefetchable()
                item = (c.key, image)
                if image is None or item in self._queued:
                    continue
                done = self._outcomes.get(item)
                if done is not None:
                    if done.failed is not None and now - done.at < self.retry:
                        continue
                    if done.failed is None and (not done.fits or c.key in held):
                        continue
                self._queued.add(item)
                self._queue.put((item, not c.node_selector))
            current = {(c.key, c.prefetchable()) for c in caches}
            for item in [i for i in self._outcomes if i not in current and i not in self._queued]:
                del self._outcomes[item]  # bounded by the caches wanted now

    def outcome(self, cache_key: tuple[str, str], image: str) -> _Outcome | None:
        """How the last prefetch of a pinned image for a cache ended (None: not tried yet)."""
        with self._lock:
            return self._outcomes.get((cache_key, image))

    def fits(self, cache: Cache) -> bool:
        """Known to fit (a node-selector cache is taken to fit until its pull says otherwise)."""
        done = self.outcome(cache.key, cache.prefetchable())
        return done.fits if done is not None else bool(cache.node_selector)

    def failed(self) -> dict[tuple, tuple[str, str]]:
        """cache key -> (digest, message) of each cache's last failed prefetch."""
        with self._lock:
            return {key: (img.rsplit("@", 1)[1], o.failed) for (key, img), o in self._outcomes.items() if o.failed}

    def wake(self) -> None:
        self._queue.put(None)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.beat.beat(self.IDLE_WAKE + self.grace)
            try:
                item = self._queue.get(timeout=self.IDLE_WAKE)
            except queue.Empty:
                continue
            if item is None:
                continue
            self.beat.beat(self.busy_bound)
            (key, image), check_fit = item
            outcome = _Outcome()
            try:
                if check_fit and self._inspect is not None:
                    info = self._inspect(key, image)
                    outcome.fits = any(fit.check(m["targets"], self.accelerators) is None for m in info["manifests"])
                if outcome.fits:
                    ok, message = self._pull(key, image)
                    outcome.failed = None if ok else message
            except Exception as e:  # registry down, bad image...: report it, retry later
                outcome.failed = str(e)
            log.log(logging.WARNING if outcome.failed else logging.INFO, "prefetch done",
                    extra=kv(image=image, cache="/".join(filter(None, key)), fits=outcome.fits, error=outcome.failed))
            with self._lock:
                outcome.at = time.monotonic()
                self._outcomes[(key, image)] = outcome
                self._queued.discard((key, image))
            self._on_done()
        self.beat.close()
