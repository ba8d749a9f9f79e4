"""The DRA kubelet plugin: registration, the DRAPlugin services, chips -> ResourceSlice.

Sockets (kubelet 1.35): registration ``<kubelet root>/plugins_registry/<driver>-reg.sock``, or
``<driver>-<pod UID>-reg.sock`` with ``--pod-uid`` (rolling updates: old and new pod serve side by
side, kubelet serialises them); the DRAPlugin endpoint ``<kubelet root>/plugins/<driver>/dra.sock``
(``dra-<pod UID>.sock`` with ``--pod-uid``), serving ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin``, and
kubelet's ``v1.DRAResourceHealth`` / ``v1alpha1.DRAResourceHealth`` (healthsvc.py).
kubelet finds the registration socket itself (it watches the directory, also after its own
restarts) and calls GetInfo, then NotifyRegistrationStatus.

Threads: the device watcher (events + sysfs tick, shared with the device plugin) publishes chip
states and kicks the registration check; the slice publisher and its watch (slices.py); gRPC.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path

import grpc

from accelnode import grpcutil
from accelnode.health import GRACE_DEFAULT, Health
from accelnode.log import kv

from ..events import Watcher
from ..server import file_identity
from accelnode.hw.tpu import numbered

from ..health import ChipState, Inventory
from . import api, healthsvc, slices
from .claims import ClaimError, Claims, ClaimWatch

log = logging.getLogger("accelnode.dra")

GETINFO_TIMEOUT = 1.0
GONE = "the chip left the PCI bus (its function is gone)"


class NameTaken(Exception):
    """Another live plugin registered our driver name on this node."""


class DRAService:
    """NodePrepareResources / NodeUnprepareResources for one API version (``pb``: its messages)."""

    def __init__(self, pb, claims: Claims):
        self.pb, self.claims = pb, claims

    def NodePrepareResources(self, request, context):  # noqa: N802 (gRPC method names)
        out = self.pb.NodePrepareResourcesResponse()
        for c in request.claims:
            try:
                devs = self.claims.prepare(c.namespace, c.name, c.uid)
                out.claims[c.uid].devices.extend(self.pb.Device(**d) for d in devs)
            except (ClaimError, OSError, ValueError) as e:  # this claim's failure, never the others'
                log.warning("claim not prepared", extra=kv(claim=f"{c.namespace}/{c.name}", uid=c.uid, error=str(e)))
                out.claims[c.uid].error = str(e)
        return out

    def NodeUnprepareResources(self, request, context):  # noqa: N802
        out = self.pb.NodeUnprepareResourcesResponse()
        for c in request.claims:
            try:
                self.claims.unprepare(c.uid)
                out.claims[c.uid].SetInParent()
            except (ClaimError, OSError) as e:
                out.claims[c.uid].error = str(e)
        return out


class RegistrationService(api.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path, on_registered):
        self.driver, self.endpoint, self.on_registered = driver, endpoint, on_registered
        self.registered = threading.Event()

    def GetInfo(self, request, context):  # noqa: N802
        return api.PluginInfo(type=api.PLUGIN_TYPE, name=self.driver, endpoint=str(self.endpoint),
                              supported_versions=[*api.SERVICES, *api.HEALTH_SERVICES])

    def NotifyRegistrationStatus(self, request, context):  # noqa: N802
        if request.plugin_registered:
            log.info("registered with kubelet", extra=kv(driver=self.driver))
            self.registered.set()
            self.on_registered()
        else:
            log.error("kubelet refused the registration", extra=kv(driver=self.driver, error=request.error))
            self.registered.clear()
        return api.RegistrationStatusResponse()


class Driver:
    def __init__(self, *, driver: str, node: str, client, kubelet_root: Path, sysfs_root: Path, dev_root: Path,
                 cdi_dir: Path, state_dir: Path, log_size: int, config, tick: float,
                 pod_uid: str | None = None, health: Health | None = None, grace: float = GRACE_DEFAULT,
                 watch_claims: bool = True):
        self.driver, self.node, self.pod_uid = driver, node, pod_uid
        self.health = health or Health()
        self.registry_dir = kubelet_root / "plugins_registry"
        self.plugin_dir = kubelet_root / "plugins" / driver
        suffix = f"-{pod_uid}" if pod_uid else ""
        self.reg_socket = self.registry_dir / f"{driver}{suffix}-reg.sock"
        self.endpoint = self.plugin_dir / f"dra{suffix}.sock"
        self.config = config if callable(config) else (lambda: config)
        self.sysfs_root = sysfs_root
        self._states: tuple[ChipState, ...] = ()
        self.publisher = slices.Publisher(client, node, driver)
        self.health_feed = healthsvc.HealthFeed(pool=node)
        self.claim_watch = ClaimWatch(client, driver, node, self.health.heartbeat("claim watch", grace)) \
            if watch_claims else None
        self.claims = Claims(client=client, driver=driver, node=node, cdi_dir=cdi_dir, state_dir=state_dir,
                             dev_root=dev_root, states=lambda: self._states, config=self.config, log_size=log_size,
                             watch=self.claim_watch)
        self.registration = RegistrationService(driver, self.endpoint, self.publisher.kick)
        self.watcher = Watcher(Inventory(sysfs_root, dev_root), self.registry_dir, self._on_devices, self._check_sockets,
                               tick, self.health.heartbeat("device watcher", tick + grace), grace)
        self._dra_server: grpc.Server | None = None
        self._reg_server: grpc.Server | None = None
        self._reg_ident = None
        self._lock = threading.Lock()
        self.health.check("DRA plugin", lambda: grpcutil.serving_problem(self.endpoint) if self._dra_server else
                          "gRPC server not serving")

    def ready(self) -> tuple[bool, str]:
        if not self.registration.registered.is_set():
            return False, "not registered with kubelet"
        if not self.publisher.published.is_set():
            return False, "ResourceSlice not published"
        return True, ""

    def start(self) -> "Driver":
        for d in (self.registry_dir, self.plugin_dir, self.claims.cdi_dir, self.claims.state_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.refuse_taken_name()
        self.watcher.start()  # scans once and hands the chips to _on_devices before it returns
        if self.claim_watch is not None:
            self.claim_watch.start()

        def add(server):
            for pb, pb_grpc in api.SERVICES.values():
                pb_grpc.add_DRAPluginServicer_to_server(DRAService(pb, self.claims), server)
            for pb, pb_grpc in api.HEALTH_SERVICES.values():
                pb_grpc.add_DRAResourceHealthServicer_to_server(healthsvc.HealthService(pb, self.health_feed), server)

        # 8 workers for prepare/unprepare besides the health streams, each of which holds one
        self._dra_server = grpcutil.serve_unix(self.endpoint, add, max_workers=8 + healthsvc.MAX_STREAMS)
        log.info("serving the DRAPlugin API", extra=kv(socket=str(self.endpoint), services=",".join(api.SERVICES)))
        self.publisher.start()
        self._check_sockets()
        return self

    def stop(self) -> None:
        self.watcher.stop()
        self.publisher.stop()
        self.health_feed.stop()
        if self.claim_watch is not None:
            self.claim_watch.stop()
        with self._lock:
            for server, path, ident in ((self._reg_server, self.reg_socket, self._reg_ident),
                                        (self._dra_server, self.endpoint, None)):
                if server is not None:
                    server.stop(grace=1).wait()
                    if ident is None or file_identity(path) == ident:
                        path.unlink(missing_ok=True)
            self._reg_server = self._dra_server = None
        log.info("DRA plugin stopped")

    def refuse_taken_name(self) -> None:
        """Raise :class:`NameTaken` when a live plugin in plugins_registry registers our driver
        name (a stale socket nobody answers on does not count; with ``--pod-uid``, our own
        rolling-update peers ``<driver>-<uid>-reg.sock`` do not either)."""
        for sock in sorted(self.registry_dir.glob("*.sock")):
            if sock == self.reg_socket or (self.pod_uid and sock.name.startswith(f"{self.driver}-")
                                           and sock.name != f"{self.driver}-reg.sock"):
                continue
            try:
                with grpcutil.unix_channel(sock) as ch:
                    info = api.RegistrationStub(ch).GetInfo(api.InfoRequest(), timeout=GETINFO_TIMEOUT)
            except (grpc.RpcError, OSError, ValueError):
                continue
            if info.type == api.PLUGIN_TYPE and info.name == self.driver:
                raise NameTaken(f"another DRA plugin already registered driver {self.driver!r} on this node "
                                f"({sock}, endpoint {info.endpoint}); choose another --driver-name or stop it")

    def facts_changed(self) -> None:
        self.publisher.set_pool(*slices.pool(self._states, self.config(), self.sysfs_root, self.driver))

    def _on_devices(self, states: tuple[ChipState, ...]) -> None:
        states = self._with_gone(states)
        before = {s.chip.bdf: s.problem for s in self._states}
        for s in states:
            if s.chip.bdf in before and before[s.chip.bdf] != s.problem:
                (log.warning if s.problem else log.info)("chip health changed", extra=kv(
                    chip=s.chip.id, index=s.chip.index, health=s.health, **({"reason": s.problem} if s.problem else {})))
        self._states = states
        self.health_feed.set(slices.health(states))
        self.publisher.set_pool(*slices.pool(states, self.config(), self.sysfs_root, self.driver))

    def _with_gone(self, states: tuple[ChipState, ...]) -> tuple[ChipState, ...]:
        """``states`` plus the chips seen before whose PCI function is gone now, unhealthy and off the
        bus: their devices stay in the slice, tainted NoExecute, and the host keeps its numbering
        (its other chips keep their indices) until the chip is back or the plugin restarts."""
        here = {s.chip.bdf for s in states}
        gone = [ChipState(s.chip, GONE, off_bus=True) for s in self._states if s.chip.bdf not in here]
        if not gone:
            return states
        by_bdf = {s.chip.bdf: s for s in (*states, *gone)}
        return tuple(replace(by_bdf[c.bdf], chip=c) for c in numbered(s.chip for s in by_bdf.values()))

    def _check_sockets(self) -> None:
        """Serve the registration socket again when it was removed (kubelet then registers us anew)."""
        with self._lock:
            served = self._reg_server is not None and file_identity(self.reg_socket) == self._reg_ident
            if self._dra_server is None or served:
                return
            if self._reg_server is not None:
                log.info("registration socket gone; serving it again", extra=kv(socket=str(self.reg_socket)))
                self._reg_server.stop(grace=0).wait()
            self.registration.registered.clear()
            self._reg_server = grpcutil.serve_unix(
                self.reg_socket, lambda s: api.add_RegistrationServicer_to_server(self.registration, s), max_workers=2)
            self._reg_ident = file_identity(self.reg_socket)
            log.info("serving plugin registration", extra=kv(socket=str(self.reg_socket), driver=self.driver))
