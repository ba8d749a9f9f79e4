"""The device plugin: gRPC service on its own socket, registration with kubelet, and the
lifecycle that keeps both alive across kubelet restarts.

Threads: the watcher (events + sysfs tick, see :mod:`.events`) publishes chip lists into a
:class:`DeviceState`; every open ListAndWatch stream sleeps on that state and sends the full
list after each change. The registrar thread owns the gRPC server and the registration: it
wakes on kubelet-dir events and (re)serves our socket when it was deleted, and registers when
kubelet.sock is new; it also looks every :data:`REGISTRAR_WAKE` seconds (two ``lstat``), so that
it beats. Nothing polls kubelet.

Health (:mod:`accelnode.health`): the watcher and the registrar each beat a heartbeat, and the
gRPC server is alive while it answers on our socket.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

import grpc

from accelnode import grpcutil
from accelnode.health import GRACE_DEFAULT, Health
from accelnode.log import kv

from . import api, topology
from .events import Watcher
from .health import ChipState, Inventory
from .metrics import Metrics

log = logging.getLogger("accelnode.device_plugin")

OPTIONS = api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
REGISTER_TIMEOUT = 5.0
RETRY_MAX = 1.0  # seconds between Register attempts while kubelet.sock exists but refuses
REGISTRAR_WAKE = 30.0  # seconds the registrar sleeps at most without an event


class DeviceState:
    """The latest chip list, versioned; streams wait for a newer version."""

    def __init__(self):
        self._cond = threading.Condition()
        self.version = 0
        self.states: tuple[ChipState, ...] = ()

    def publish(self, states: tuple[ChipState, ...]) -> None:
        with self._cond:
            self.states = states
            self.version += 1
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait_newer(self, seen: int, alive) -> tuple[int, tuple[ChipState, ...]] | None:
        """(version, states) once version > seen; None as soon as ``alive()`` turns false."""
        with self._cond:
            self._cond.wait_for(lambda: self.version > seen or not alive())
            return (self.version, self.states) if alive() else None

    def by_id(self) -> dict[str, ChipState]:
        return {s.chip.id: s for s in self.states}


def to_device(s: ChipState):
    topo = None
    if s.chip.numa_node is not None:
        topo = api.TopologyInfo(nodes=[api.NUMANode(ID=s.chip.numa_node)])
    return api.Device(ID=s.chip.id, health=s.health, topology=topo)


class TPUService(api.DevicePluginServicer):
    def __init__(self, state: DeviceState, dev_root: Path, config: Callable[[], topology.NodeConfig],
                 metrics: Metrics, closing: threading.Event, on_stream_end):
        self.state = state
        self.dev_root = dev_root
        self.config = config  # the node's slice facts now (they may change: nodefacts.NodeFacts)
        self.metrics = metrics
        self.closing = closing
        self.on_stream_end = on_stream_end

    def GetDevicePluginOptions(self, request, context):  # noqa: N802 (gRPC method names)
        return OPTIONS

    def ListAndWatch(self, request, context):  # noqa: N802
        context.add_callback(self.state.wake)  # a cancelled stream must stop waiting at once
        alive = lambda: context.is_active() and not self.closing.is_set()  # noqa: E731
        seen = 0
        try:
            while (got := self.state.wait_newer(seen, alive)) is not None:
                seen, states = got
                yield api.ListAndWatchResponse(devices=[to_device(s) for s in states])
        finally:
            self.on_stream_end()

    def GetPreferredAllocation(self, request, context):  # noqa: N802
        known = self.state.by_id()
        out = []
        for n, req in enumerate(request.container_requests):
            available = self._chips(context, known, req.available_deviceIDs, f"container request {n} available")
            must = self._chips(context, known, req.must_include_deviceIDs, f"container request {n} must_include")
            size = req.allocation_size
            if not set(req.must_include_deviceIDs) <= set(req.available_deviceIDs):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"container request {n}: must_include devices are not all in available_deviceIDs")
            if not len(must) <= size <= len(available):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"container request {n}: allocation_size {size} must be between "
                              f"{len(must)} (must_include) and {len(available)} (available)")
            chosen = topology.preferred(available, must, size)
            out.append(api.ContainerPreferredAllocationResponse(deviceIDs=[c.id for c in chosen]))
        return api.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request, context):  # noqa: N802
        known = self.state.by_id()
        plans = []
        for n, req in enumerate(request.container_requests):
            what = f"container request {n}"
            if not req.devices_ids:
                self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"{what} names no devices")
            chips = self._chips(context, known, req.devices_ids, what)
            for c in chips:
                problem = known[c.id].problem
                if problem is not None:
                    self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                                 f"{what}: chip {c.id} (index {c.index}) is Unhealthy: {problem}")
            plans.append(chips)
        responses = [self._container(chips, len(known)) for chips in plans]
        self.metrics.allocations.inc(len(responses))
        return api.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request, context):  # noqa: N802
        return api.PreStartContainerResponse()

    def _container(self, chips, host_chips: int):
        nodes = dict.fromkeys(p for c in chips for p in c.dev_paths)  # ordered, vfio/vfio once
        specs = [api.DeviceSpec(container_path="/dev/" + os.path.relpath(p, self.dev_root), host_path=p,
                                permissions="rw") for p in nodes]
        env = topology.container_env(chips, host_chips, self.config())
        return api.ContainerAllocateResponse(envs=env, devices=specs)

    def _chips(self, context, known: dict[str, ChipState], ids, what: str):
        unknown = [i for i in ids if i not in known]
        if unknown:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"{what}: unknown device ID(s) {', '.join(map(repr, unknown))}; "
                         f"this node has {', '.join(sorted(known)) or 'no chips'}")
        if len(set(ids)) != len(ids):
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"{what}: a device ID is listed twice")
        return [known[i].chip for i in ids]

    def _refuse(self, context, code: grpc.StatusCode, message: str):
        self.metrics.refused.labels(code.name).inc()
        log.warning("request refused", extra=kv(code=code.name, reason=message))
        context.abort(code, message)


def file_identity(path: Path):
    """Identity of a file that changes when it is recreated (inode numbers alone may be reused)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class Plugin:
    def __init__(self, *, sysfs_root: Path, dev_root: Path, kubelet_dir: Path,
                 config: topology.NodeConfig | Callable[[], topology.NodeConfig], metrics: Metrics, resource: str,
                 socket_name: str, tick: float, health: Health | None = None,
                 grace: float = GRACE_DEFAULT):
        self.health = health or Health()
        self.grace = grace
        self.kubelet_dir = kubelet_dir
        self.socket = kubelet_dir / socket_name
        self.resource = resource
        self.metrics = metrics
        self.state = DeviceState()
        self.closing = threading.Event()
        self._kick = threading.Event()
        self._server: grpc.Server | None = None
        self._socket_ident = None
        self._registered_with = None  # identity of the kubelet.sock we registered with
        facts = config if callable(config) else (lambda: config)
        self.service = TPUService(self.state, dev_root, facts, metrics, self.closing, self._kick.set)
        self.watcher = Watcher(Inventory(sysfs_root, dev_root), kubelet_dir, self._on_devices,
                               self._kick.set, tick, self.health.heartbeat("device watcher", tick + grace), grace,
                               lambda cause: metrics.scans.labels(cause).inc())
        self._registrar = threading.Thread(target=self._registrar_loop, name="registrar", daemon=True)
        self._registrar_beat = self.health.heartbeat("registrar", REGISTRAR_WAKE + grace)
        self.health.check("device plugin", self._serving_problem)

    def _serving_problem(self) -> str | None:
        server = self._server
        if server is None:
            return "gRPC server not serving"
        return grpcutil.serving_problem(self.socket)

    def ready(self) -> tuple[bool, str]:
        if self._server is None:
            return False, "gRPC server not serving"
        if self._registered_with is None:
            return False, "not registered with kubelet"
        return True, ""

    def start(self) -> "Plugin":
        self.watcher.start()
        self._reconcile()  # serve now; register now if kubelet is there
        self._registrar.start()
        return self

    def stop(self) -> None:
        self.closing.set()
        self._kick.set()
        self.watcher.stop()
        self.state.wake()
        if self._registrar.is_alive():
            self._registrar.join(5)
        if self._server is not None:
            self._server.stop(grace=1).wait()
            if file_identity(self.socket) == self._socket_ident:
                self.socket.unlink(missing_ok=True)
        log.info("device plugin stopped")

    # -- device changes (watcher thread) -------------------------------------------------------

    def _on_devices(self, states: tuple[ChipState, ...]) -> None:
        before = {s.chip.bdf: s for s in self.state.states}
        for s in states:
            old = before.pop(s.chip.bdf, None)
            fields = kv(chip=s.chip.id, index=s.chip.index, generation=s.chip.generation,
                        numa_node=s.chip.numa_node, health=s.health, **({"reason": s.problem} if s.problem else {}))
            if old is None:
                log.info("chip found", extra=fields)
            elif old.problem != s.problem:
                (log.warning if s.problem else log.info)("chip health changed", extra=fields)
        for gone in before.values():
            log.info("chip removed", extra=kv(chip=gone.chip.id))
        self.metrics.set_chips(states)
        self.state.publish(states)

    # -- server and registration (registrar thread) --------------------------------------------

    def _registrar_loop(self) -> None:
        delay, retry = REGISTRAR_WAKE, None
        while not self.closing.is_set():
            self._registrar_beat.beat(delay + self.grace)
            self._kick.wait(delay)
            self._kick.clear()
            if self.closing.is_set():
                break
            try:
                done = self._reconcile()
            except Exception:
                log.exception("serving or registering failed")
                done = False
            retry = None if done else min(RETRY_MAX, (retry or 0.05) * 2)
            delay = retry or REGISTRAR_WAKE
        self._registrar_beat.close()

    def _reconcile(self) -> bool:
        """Serve our socket if it is gone, register if kubelet.sock is new. False: retry later."""
        if self._server is None or file_identity(self.socket) != self._socket_ident:
            self._serve()
        kubelet = file_identity(self.kubelet_dir / api.KUBELET_SOCKET)
        if kubelet is None:
            if self._registered_with is not None:
                log.info("kubelet socket gone; waiting for kubelet", extra=kv(dir=str(self.kubelet_dir)))
            self._set_registered(None)
            return True
        if kubelet == self._registered_with:
            return True
        return self._register(kubelet)

    def _serve(self) -> None:
        if self._server is not None:
            log.info("plugin socket replaced or removed (kubelet restart?); serving again",
                     extra=kv(socket=str(self.socket)))
            self._server.stop(grace=0).wait()
            self._server = None
        self._set_registered(None)
        self._server = grpcutil.serve_unix(
            self.socket, lambda s: api.add_DevicePluginServicer_to_server(self.service, s), max_workers=16)
        self._socket_ident = file_identity(self.socket)
        log.info("serving device plugin API", extra=kv(socket=str(self.socket)))

    def _register(self, kubelet) -> bool:
        req = api.RegisterRequest(version=api.VERSION, endpoint=self.socket.name, resource_name=self.resource,
                                  options=OPTIONS)
        try:
            with grpcutil.unix_channel(self.kubelet_dir / api.KUBELET_SOCKET) as ch:
                api.RegistrationStub(ch).Register(req, timeout=REGISTER_TIMEOUT)
        except grpc.RpcError as e:
            self.metrics.registrations.labels("error").inc()
            log.warning("kubelet refused or did not answer Register",
                        extra=kv(code=e.code().name, detail=e.details(), resource=self.resource))
            return False
        self.metrics.registrations.labels("ok").inc()
        self._set_registered(kubelet)
        log.info("registered with kubelet", extra=kv(resource=self.resource, endpoint=self.socket.name,
                                                     version=api.VERSION))
        return True

    def _set_registered(self, kubelet) -> None:
        self._registered_with = kubelet
        self.metrics.registered.set(0 if kubelet is None else 1)
