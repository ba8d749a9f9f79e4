"""Prometheus metrics of the device plugin (one registry per process)."""

from __future__ import annotations

from prometheus_client.metrics import Counter, Gauge  # not the package: accelnode/metricstext.py
from prometheus_client.registry import CollectorRegistry

from .health import HEALTHY, UNHEALTHY


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.chips = Gauge("accelnode_tpu_chips", "TPU chips on this node, by health",
                           ["health"], registry=self.registry)
        self.allocations = Counter("accelnode_tpu_allocations", "Containers given chips by Allocate",
                                   registry=self.registry)
        self.refused = Counter("accelnode_tpu_requests_refused", "Allocate/GetPreferredAllocation requests "
                               "refused, by gRPC status code", ["code"], registry=self.registry)
        self.registrations = Counter("accelnode_device_plugin_registrations",
                                     "Register calls to kubelet, by result", ["result"], registry=self.registry)
        self.registered = Gauge("accelnode_device_plugin_registered",
                                "1 while registered with the running kubelet", registry=self.registry)
        self.scans = Counter("accelnode_device_plugin_scans", "Chip inventory scans, by cause: event (a device "
                             "node or udev event) or tick (the --health-interval read of sysfs attributes)",
                             ["cause"], registry=self.registry)
        for h in (HEALTHY, UNHEALTHY):
            self.chips.labels(h).set(0)

    def set_chips(self, states) -> None:
        healthy = sum(1 for s in states if s.problem is None)
        self.chips.labels(HEALTHY).set(healthy)
        self.chips.labels(UNHEALTHY).set(len(states) - healthy)
