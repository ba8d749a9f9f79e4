"""The reconcilers this process runs, and running them only while it leads.

:data:`RECONCILERS` lists a factory per reconciler (``factory(client, resolver) -> Reconciler``;
``resolver`` is the process's :class:`controller.pinning.Resolver`, shared with the admission
webhooks so an image resolved at admission is not asked of the registry again).
:class:`Manager` starts one :class:`~controller.core.Controller` per reconciler when this
process becomes leader and stops them all on shutdown; a process that loses leadership exits
instead (``accelnode controller``), so nothing here ever restarts a controller.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from prometheus_client import CollectorRegistry

from accelnode.kube.client import Client
from accelnode.log import kv

from .caches import clustergkmcache_reconciler, gkmcache_reconciler
from .claims import clustergkmcache_claims_reconciler, gkmcache_claims_reconciler
from .conditionmetrics import ConditionsCollector
from .core import Controller, Metrics
from .pinning import Resolver
from .reconciler import Reconciler
from .tpuscale import statefulset_env_reconciler

log = logging.getLogger("accelnode.controller")

RECONCILERS: list[Callable[[Client, Resolver], Reconciler]] = [
    gkmcache_reconciler, clustergkmcache_reconciler,  # pin, cluster status (docs/cache-controller.md)
    gkmcache_claims_reconciler, clustergkmcache_claims_reconciler,  # PV/PVC per workload namespace (docs/cache-claims.md)
    statefulset_env_reconciler,  # TPU env of StatefulSets scaled through /scale (docs/tpu-env.md)
]


class Manager:
    def __init__(self, client: Client, reconcilers: list[Reconciler], registry: CollectorRegistry, *,
                 workers: int = 2, resync: float = 300.0):
        names = [r.name for r in reconcilers]
        if len(set(names)) != len(names):
            raise ValueError(f"reconciler names must be unique: {names}")
        self.metrics = Metrics(registry)
        self.controllers = [Controller(client, r, self.metrics, workers=workers, resync=resync) for r in reconcilers]
        registry.register(ConditionsCollector(self.controllers))
        self._lock = threading.Lock()
        self.started = False

    def start(self) -> None:
        with self._lock:
            if self.started:
                return
            self.started = True
            for c in self.controllers:
                c.start()
            log.info("reconcilers running", extra=kv(reconcilers=[c.name for c in self.controllers]))

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            if not self.started:
                return
            for c in self.controllers:
                c.stop(timeout)

    def synced(self) -> bool:
        return all(c.synced() for c in self.controllers)
