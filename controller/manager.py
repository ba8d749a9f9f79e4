"""The reconcilers this process runs, and running them only while it leads.

:data:`RECONCILERS` lists a factory per reconciler (``factory(client) -> Reconciler``); none is
registered yet (the GKMCache, TPU node group and env-injection work builds on this core).
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

from .core import Controller, Metrics
from .reconciler import Reconciler

log = logging.getLogger("accelnode.controller")

RECONCILERS: list[Callable[[Client], Reconciler]] = []


class Manager:
    def __init__(self, client: Client, reconcilers: list[Reconciler], registry: CollectorRegistry, *,
                 workers: int = 2, resync: float = 300.0):
        names = [r.name for r in reconcilers]
        if len(set(names)) != len(names):
            raise ValueError(f"reconciler names must be unique: {names}")
        self.metrics = Metrics(registry)
        self.controllers = [Controller(client, r, self.metrics, workers=workers, resync=resync) for r in reconcilers]
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
