"""A stand-in for kubelet's device manager, faithful to what a device plugin can observe.

It serves ``Registration`` on ``<dir>/kubelet.sock``; on Register it checks the API version and
that the resource is an extended resource name, dials ``<dir>/<endpoint>`` (the endpoint is a
file name in the same directory), calls GetDevicePluginOptions and then consumes ListAndWatch
on a thread, keeping the latest device list per resource. :meth:`restart` does what a kubelet
restart does to the directory: every non-directory entry except the checkpoint file is removed
and kubelet.sock is created anew. Allocate and GetPreferredAllocation are called the way
kubelet calls them (one container per request; GetPreferredAllocation only when advertised).

Used by the tests, the benchmarks and ``make demo``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from accelnode import grpcutil

from device_plugin import api

SUPPORTED_VERSIONS = ("v1beta1",)
DIAL_TIMEOUT = 10.0


@dataclass(frozen=True)
class DeviceView:
    health: str
    numa_nodes: tuple[int, ...]


@dataclass
class Endpoint:
    """One registered plugin as kubelet holds it."""

    request: object  # the RegisterRequest
    channel: grpc.Channel
    stub: object
    options: object
    devices: dict[str, DeviceView] = field(default_factory=dict)
    updates: int = 0
    connected: bool = True


class KubeletHarness(api.RegistrationServicer):
    def __init__(self, directory: str | os.PathLike, dial_timeout: float = DIAL_TIMEOUT):
        self.dir = Path(directory)
        self.dial_timeout = dial_timeout
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self.endpoints: dict[str, Endpoint] = {}  # resource name -> endpoint
        self.registrations: list[tuple[float, object]] = []  # (monotonic time, RegisterRequest)
        self.rejections: list[str] = []
        self.updates: list[tuple[float, str, dict[str, DeviceView]]] = []  # (time, resource, devices)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> "KubeletHarness":
        self.dir.mkdir(parents=True, exist_ok=True)
        self._server = grpcutil.serve_unix(self.dir / api.KUBELET_SOCKET,
                                           lambda s: api.add_RegistrationServicer_to_server(self, s))
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait()
            self._server = None
        with self._cond:
            for ep in self.endpoints.values():
                ep.channel.close()
            self.endpoints.clear()
        (self.dir / api.KUBELET_SOCKET).unlink(missing_ok=True)

    def restart(self) -> None:
        """Stop, wipe the sockets in the directory as kubelet does on start, start again."""
        self.stop()
        for entry in os.scandir(self.dir):
            if entry.name != api.KUBELET_CHECKPOINT and not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
        self.start()

    def __enter__(self) -> "KubeletHarness":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- Registration service (called by plugins) ---------------------------------------------

    def Register(self, request, context):  # noqa: N802 (gRPC method name)
        if request.version not in SUPPORTED_VERSIONS:
            self._reject(context, f"requested API version {request.version!r} is not supported by kubelet; "
                                  f"supported versions are {list(SUPPORTED_VERSIONS)}")
        if not api.is_extended_resource_name(request.resource_name):
            self._reject(context, f"the ResourceName {request.resource_name!r} is invalid")
        channel = grpcutil.unix_channel(self.dir / request.endpoint)
        stub = api.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(api.Empty(), timeout=self.dial_timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            channel.close()
            self._reject(context, f"failed to dial device plugin at {request.endpoint!r}: {e.details()}")
        ep = Endpoint(request=request, channel=channel, stub=stub, options=options)
        with self._cond:
            old = self.endpoints.get(request.resource_name)
            if old is not None:
                old.channel.close()
            self.endpoints[request.resource_name] = ep
            self.registrations.append((time.monotonic(), request))
            self._cond.notify_all()
        threading.Thread(target=self._watch, args=(ep,), name="harness-law", daemon=True).start()
        return api.Empty()

    def _reject(self, context, message: str):
        with self._cond:
            self.rejections.append(message)
            self._cond.notify_all()
        context.abort(grpc.StatusCode.UNKNOWN, message)

    def _watch(self, ep: Endpoint) -> None:
        resource = ep.request.resource_name
        try:
            for resp in ep.stub.ListAndWatch(api.Empty()):
                devices = {d.ID: DeviceView(d.health, tuple(n.ID for n in d.topology.nodes)) for d in resp.devices}
                with self._cond:
                    ep.devices = devices
                    ep.updates += 1
                    self.updates.append((time.monotonic(), resource, devices))
                    self._cond.notify_all()
        except grpc.RpcError:
            pass  # stream ended: plugin gone or harness stopping
        with self._cond:
            ep.connected = False
            self._cond.notify_all()

    # -- what tests ask -----------------------------------------------------------------------

    def wait(self, predicate, timeout: float = 10.0, what: str = "condition"):
        """Block until ``predicate(self)`` is truthy; return its value or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (value := predicate(self)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kubelet harness: timed out after {timeout}s waiting for {what}")
                self._cond.wait(left)
            return value

    def devices(self, resource: str = "google.com/tpu") -> dict[str, DeviceView]:
        ep = self.endpoints.get(resource)
        return dict(ep.devices) if ep else {}

    def endpoint(self, resource: str = "google.com/tpu") -> Endpoint:
        ep = self.endpoints.get(resource)
        if ep is None:
            raise LookupError(f"no device plugin registered for {resource}")
        return ep

    def allocate(self, ids: list[str], resource: str = "google.com/tpu"):
        """Allocate for one container, as kubelet does; returns its ContainerAllocateResponse."""
        req = api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=ids)])
        resp = self.endpoint(resource).stub.Allocate(req, timeout=DIAL_TIMEOUT)
        return resp.container_responses[0]

    def preferred(self, available: list[str], must_include: list[str], size: int,
                  resource: str = "google.com/tpu") -> list[str]:
        ep = self.endpoint(resource)
        if not ep.options.get_preferred_allocation_available:
            raise LookupError(f"{resource} does not offer GetPreferredAllocation; kubelet would not call it")
        req = api.PreferredAllocationRequest(container_requests=[api.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size)])
        return list(ep.stub.GetPreferredAllocation(req, timeout=DIAL_TIMEOUT).container_responses[0].deviceIDs)
