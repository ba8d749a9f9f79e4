"""kubelet's ``DRAResourceHealth`` service (KEP-4680): the health of every device of our slice.

kubelet 1.37 opens one ``NodeWatchResources`` stream per registered plugin that advertises
``v1.DRAResourceHealth`` (or ``v1alpha1.DRAResourceHealth``) and writes what it hears into
``status.containerStatuses[].allocatedResourcesStatus`` of the pods whose claims hold those
devices. Each message is the full list (every chip and block of the slice, by pool and device
name, as the allocation names them): a device left out reads Unknown once its report expires.
A message goes out on every change and at least every :data:`HEARTBEAT` seconds; each carries
``health_check_timeout_seconds`` = :data:`TIMEOUT`, so kubelet marks the devices Unknown only
when the plugin stopped reporting.

Each stream holds a worker of the plugin's gRPC server for its lifetime: at most
:data:`MAX_STREAMS` at a time (kubelet needs one), so that watchers can never starve
NodePrepareResources.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from accelnode.log import kv

log = logging.getLogger("accelnode.dra")

HEARTBEAT = 5.0  # seconds between two full reports when nothing changes
TIMEOUT = 30  # seconds kubelet trusts a report (its default too)
MAX_STREAMS = 4


class HealthFeed:
    """The latest device health list, and the streams waiting on it."""

    def __init__(self, pool: str, heartbeat: float = HEARTBEAT):
        self.pool, self.heartbeat = pool, heartbeat
        self._cond = threading.Condition()
        self._devices: tuple[tuple[str, str | None], ...] | None = None  # (device, problem); None: not known yet
        self._version = 0
        self._streams = 0
        self._stopped = False

    def set(self, devices: list[tuple[str, str | None]]) -> None:
        with self._cond:
            devices = tuple(devices)
            if devices != self._devices:
                self._devices = devices
                self._version += 1
                self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def watch(self, pb, context):
        """The stream's messages (``pb``: the API version's messages) until the client or we stop."""
        with self._cond:
            if self._streams >= MAX_STREAMS:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {MAX_STREAMS} health streams at a time")
            self._streams += 1
        context.add_callback(self._wake)
        try:
            seen = -1
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopped or not context.is_active() or self._version != seen,
                                        timeout=self.heartbeat)
                    if self._stopped or not context.is_active():
                        return
                    devices, seen = self._devices, self._version
                if devices is not None:
                    yield self.report(pb, devices)
        finally:
            with self._cond:
                self._streams -= 1

    def report(self, pb, devices) -> object:
        now = int(time.time())
        return pb.NodeWatchResourcesResponse(devices=[pb.DeviceHealth(
            device=pb.DeviceIdentifier(pool_name=self.pool, device_name=name),
            health=pb.HEALTHY if problem is None else pb.UNHEALTHY, message=problem or "",
            last_updated_time=now, health_check_timeout_seconds=TIMEOUT) for name, problem in devices])


class HealthService:
    """``NodeWatchResources`` of one API version."""

    def __init__(self, pb, feed: HealthFeed):
        self.pb, self.feed = pb, feed

    def NodeWatchResources(self, request, context):  # noqa: N802 (gRPC method names)
        log.info("kubelet watches device health", extra=kv(peer=context.peer()))
        yield from self.feed.watch(self.pb, context)
