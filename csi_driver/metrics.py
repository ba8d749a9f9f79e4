"""The CSI driver's Prometheus metrics: every RPC counted by method and answer code, and timed;
copy-on-write views counted and their tmpfs usage read (statvfs) at each scrape."""

from __future__ import annotations

import functools
import time

import grpc
from prometheus_client.metrics import Counter, Gauge, Histogram  # not the package: accelnode/metricstext.py
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry


class Metrics:
    def __init__(self, registry: CollectorRegistry, views=None):
        self.registry = registry
        if views is not None:
            registry.register(_ViewCollector(views))
        self.rpcs = Counter("accelnode_csi_operations", "CSI RPCs answered, by method and gRPC code",
                            ["method", "code"], registry=registry)
        self.seconds = Histogram("accelnode_csi_operation_seconds", "Time to answer CSI RPCs", ["method"],
                                 registry=registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30, 120))
        self.registered = Gauge("accelnode_csi_registered", "1 while kubelet reports the driver registered",
                                registry=registry)

    def instrument(self, servicer, base: type) -> None:
        """Record answer code and duration of every RPC ``servicer`` implements from ``base``."""
        for name in vars(base):
            if not name.startswith("_"):
                setattr(servicer, name, self._observed(name, getattr(servicer, name)))

    def _observed(self, name: str, method):
        @functools.wraps(method)
        def wrapper(request, context):
            t0, answered = time.perf_counter(), False
            try:
                response = method(request, context)
                answered = True
                return response
            finally:  # an abort sets the code; any other exception reaches the client as UNKNOWN
                code = context.code() or (grpc.StatusCode.OK if answered else grpc.StatusCode.UNKNOWN)
                self.rpcs.labels(name, code.name).inc()
                self.seconds.labels(name).observe(time.perf_counter() - t0)

        return wrapper


class _ViewCollector:
    """accelnode_csi_views, accelnode_csi_view_bytes, accelnode_csi_view_limit_bytes: one statvfs
    per view at scrape time (the views' tmpfs, memory charged to the pods that wrote it)."""

    def __init__(self, views):
        self.views = views

    def describe(self):
        return []

    def collect(self):
        usage = self.views.usage()
        yield GaugeMetricFamily("accelnode_csi_views", "Copy-on-write views mounted on this node",
                                value=len(usage))
        yield GaugeMetricFamily("accelnode_csi_view_bytes", "Bytes written to the views' writable layers "
                                "(memory, charged to the writing pods)", value=sum(u for u, _ in usage))
        yield GaugeMetricFamily("accelnode_csi_view_limit_bytes", "Sum of the views' size bounds",
                                value=sum(t for _, t in usage))
