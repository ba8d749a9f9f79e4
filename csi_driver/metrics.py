"""The CSI driver's Prometheus metrics: every RPC counted by method and answer code, and timed."""

from __future__ import annotations

import functools
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
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
