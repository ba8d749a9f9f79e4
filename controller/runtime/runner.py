"""The core that runs reconcilers (:mod:`controller.runtime.reconciler`): watches feed a work queue,
workers reconcile keys from it (docs/controller.md, "Reconcilers").

One :class:`Controller` per reconciler. Invariants: level-based (a periodic resync requeues
every watched key, so a missed event is caught within one resync); a key is never reconciled
twice at once (:class:`~controller.runtime.queue.WorkQueue`); an error or ``requeue=True`` backs
off per key, and a success resets it; :meth:`Controller.stop` lets workers finish the key in
hand; workers take no key before every watch has listed once. :class:`Metrics` is one set per process, labelled by reconciler name.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from accelnode.kube.client import Client
from accelnode.kube.reflector import Reflector
from accelnode.log import kv

from controller.runtime.queue import Backoff, WorkQueue
from controller.runtime.reconciler import Cache, Reconciler, Result

log = logging.getLogger("accelnode.controller")


class Metrics:
    def __init__(self, registry: CollectorRegistry):
        self.reconciles = Counter("accelnode_controller_reconciles", "Reconciles, by reconciler and result "
                                  "(success, requeue, requeue_after, error)", ["reconciler", "result"],
                                  registry=registry)
        self.duration = Histogram("accelnode_controller_reconcile_seconds", "Time one reconcile took",
                                  ["reconciler"], registry=registry,
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.depth = Gauge("accelnode_controller_queue_depth", "Keys ready to be reconciled", ["reconciler"],
                           registry=registry)
        self.adds = Counter("accelnode_controller_queue_adds", "Keys queued (events, resyncs and retries; a key "
                            "already queued counts again)", ["reconciler"], registry=registry)


class Controller:
    def __init__(self, client: Client, reconciler: Reconciler, metrics: Metrics, *, workers: int = 2,
                 resync: float = 300.0, backoff: Backoff | None = None):
        if not reconciler.name:
            raise ValueError(f"{type(reconciler).__name__} has no name")
        if workers < 1 or resync <= 0:
            raise ValueError("a controller needs workers >= 1 and resync > 0")
        self.client, self.reconciler, self.metrics = client, reconciler, metrics
        self.name, self.workers, self.resync = reconciler.name, workers, resync
        self.queue = WorkQueue(backoff)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.reflectors: dict[str, Reflector] = {}
        for w in reconciler.watches:
            if w.path in self.reflectors:
                raise ValueError(f"{self.name}: {w.path} is watched twice")
            self.reflectors[w.path] = Reflector(client, w.path, query=w.query, trim=w.trim,
                                                on_event=lambda _type, obj, w=w: self._enqueue_for(w, obj))
        reconciler.cache = Cache(self.reflectors)
        metrics.depth.labels(self.name).set_function(lambda: len(self.queue))

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "Controller":
        for r in self.reflectors.values():
            self._spawn(f"watch-{r.path}", r.run, self._stop)
        self._spawn("resync", self._resync)
        for i in range(self.workers):
            self._spawn(f"worker-{i}", self._work)
        log.info("controller started", extra=kv(reconciler=self.name, workers=self.workers,
                                                watches=list(self.reflectors)))
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop watching and queueing; wait (at most ``timeout`` in all) for workers to finish
        the key each holds."""
        self._stop.set()
        self.queue.shutdown()
        for r in self.reflectors.values():
            r.interrupt()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("controller threads still running after stop", extra=kv(reconciler=self.name, threads=alive))

    def enqueue(self, key: str) -> None:
        self.metrics.adds.labels(self.name).inc()
        self.queue.add(key)

    def synced(self) -> bool:
        return self.reconciler.cache.synced()

    def _spawn(self, name: str, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, name=f"{self.name}-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    # -- feeding the queue ---------------------------------------------------------------------

    def _enqueue_for(self, watch, obj: dict) -> None:
        try:
            keys = list(watch.keys(obj))
        except Exception:  # a mapping bug must not kill the watch
            log.exception("mapping an object to keys failed", extra=kv(reconciler=self.name, path=watch.path))
            return
        for key in keys:
            self.enqueue(key)

    def _resync(self) -> None:
        while not self._stop.wait(self.resync):
            for w in self.reconciler.watches:
                for obj in self.reflectors[w.path].snapshot():
                    self._enqueue_for(w, obj)

    # -- working -------------------------------------------------------------------------------

    def _work(self) -> None:
        # As client-go's WaitForCacheSync: no key is reconciled on a half-listed cache (a teardown
        # that sees no Nodes or children yet would let them go; a cache's status would count part
        # of its nodes; claims would be made again or leftovers missed). Keys queued meanwhile wait.
        while not self.synced():
            if self._stop.wait(0.05):
                return
        while True:
            key = self.queue.get()
            if key is None:
                return
            try:
                self._reconcile(key)
            finally:
                self.queue.done(key)

    def _reconcile(self, key: str) -> None:
        started = time.monotonic()
        try:
            result = self.reconciler.reconcile(key) or Result()
        except Exception as e:
            delay = self.queue.add_rate_limited(key)
            outcome = "error"
            log.warning("reconcile failed", exc_info=log.isEnabledFor(logging.DEBUG),
                        extra=kv(reconciler=self.name, key=key, error=f"{type(e).__name__}: {e}", retry_in=round(delay, 3),
                                 failures=self.queue.backoff.failures(key)))
        else:
            if result.requeue_after is not None and result.requeue_after > 0:
                self.queue.forget(key)
                self.queue.add_after(key, result.requeue_after)
                outcome = "requeue_after"
            elif result.requeue:
                self.queue.add_rate_limited(key)
                outcome = "requeue"
            else:
                self.queue.forget(key)
                outcome = "success"
        self.metrics.reconciles.labels(self.name, outcome).inc()
        self.metrics.duration.labels(self.name).observe(time.monotonic() - started)
