"""Running the reconcilers only while this process leads.

Which reconcilers run is the wiring's choice (:func:`controller.cli.reconcilers`).
:class:`Manager` starts one :class:`~controller.runtime.runner.Controller` per reconciler when this
process becomes leader and stops them all on shutdown; a process that loses leadership exits
instead (``accelnode controller``), so nothing here ever restarts a controller.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry

from accelnode.kube.client import Client
from accelnode.log import kv

from .conditions import ConditionsCollector
from .reconciler import Reconciler
from .runner import Controller, Metrics

log = logging.getLogger("accelnode.controller")


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
