"""Leader election on a ``coordination.k8s.io/v1`` Lease, with client-go's semantics
(docs/controller.md, "Leader election").

Invariants: every write carries the resourceVersion last read or written (the leader renews
with a PUT of the Lease it last wrote, without a read; a conflict makes it read first), so two
candidates never both win; clocks are never compared across machines (a lease expires after
``leaseDurationSeconds`` of *local* monotonic time without a change of record); the renew
deadline is shorter than the lease, so a leader that cannot renew knows it before anyone may
take over, and :meth:`LeaderElector.run` returns False for the caller to stop at once. On
``stop`` it returns True; :meth:`LeaderElector.release` then hands the Lease over as client-go's
ReleaseOnCancel does.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import quote

from accelnode.kube.client import Client, KubeError, Unreachable, is_not_found
from accelnode.log import kv

log = logging.getLogger("accelnode.controller.leader")

RECORD_FIELDS = ("holderIdentity", "leaseDurationSeconds", "acquireTime", "renewTime", "leaseTransitions")


def micro_time(t: float | None = None) -> str:
    """A Kubernetes MicroTime (RFC 3339, microseconds, UTC)."""
    when = dt.datetime.fromtimestamp(time.time() if t is None else t, dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Timing:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def check(self) -> None:
        """client-go's rules: lease > renew deadline > 1.2 x retry period > 0."""
        if not self.retry_period > 0:
            raise ValueError("--retry-period must be positive")
        if not self.renew_deadline > 1.2 * self.retry_period:
            raise ValueError(f"--renew-deadline ({self.renew_deadline:g}s) must be longer than 1.2 x --retry-period "
                             f"({1.2 * self.retry_period:g}s)")
        if not self.lease_duration > self.renew_deadline:
            raise ValueError(f"--lease-duration ({self.lease_duration:g}s) must be longer than --renew-deadline "
                             f"({self.renew_deadline:g}s)")


class LeaderElector:
    def __init__(self, client: Client, namespace: str, name: str, identity: str, timing: Timing = Timing(), *,
                 on_started_leading: Callable[[], None] = lambda: None,
                 on_stopped_leading: Callable[[], None] = lambda: None):
        timing.check()
        if not identity:
            raise ValueError("a leader election identity must not be empty")
        self.client, self.namespace, self.name, self.identity = client, namespace, name, identity
        self.timing = timing
        self.on_started_leading, self.on_stopped_leading = on_started_leading, on_stopped_leading
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace, safe='')}/leases"
        self.leading = threading.Event()
        self._observed: dict | None = None  # the last record seen
        self._observed_at = 0.0  # monotonic time it was first seen
        self._lease: dict | None = None  # the last Lease object read or written (for its resourceVersion)
        self.last_contact: float | None = None  # monotonic time the Lease was last read or written
        self.last_error: str = ""

    @property
    def holder(self) -> str:
        """The holder as last observed ('' when none or released)."""
        return (self._observed or {}).get("holderIdentity") or ""

    # -- the loop ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> bool:
        """Acquire, lead, renew; True when ``stop`` ended it (the Lease still held if it was:
        call :meth:`release` once work has stopped), False when leadership was lost."""
        t = self.timing
        while not self.leading.is_set():
            if stop.is_set():
                return True
            if self._try(timeout=t.renew_deadline):
                self.leading.set()
                break
            stop.wait(t.retry_period * (1 + 0.2 * random.random()))
        log.info("became leader", extra=kv(lease=f"{self.namespace}/{self.name}", identity=self.identity))
        self.on_started_leading()
        last_renew = time.monotonic()
        while not stop.wait(t.retry_period):
            left = last_renew + t.renew_deadline - time.monotonic()
            if left > 0 and self._try(timeout=max(0.1, left)):
                last_renew = time.monotonic()
            elif time.monotonic() - last_renew >= t.renew_deadline:
                self.leading.clear()
                log.error("leadership lost: no renewal within the renew deadline",
                          extra=kv(lease=f"{self.namespace}/{self.name}", identity=self.identity,
                                   renew_deadline=t.renew_deadline, holder=self.holder, error=self.last_error))
                self.on_stopped_leading()
                return False
        return True

    def release(self) -> bool:
        """Give the Lease up if this candidate holds it: the next candidate need not wait."""
        if not self.leading.is_set() or self._lease is None:
            return False
        self.leading.clear()
        lease = dict(self._lease)
        lease["spec"] = dict(lease.get("spec") or {}, holderIdentity="", leaseDurationSeconds=1,
                             acquireTime=micro_time(), renewTime=micro_time())
        try:
            self._lease = self.client.request("PUT", self._object_path(), body=lease,
                                              timeout=self.timing.renew_deadline)
        except (KubeError, Unreachable, OSError) as e:
            log.warning("could not release the lease", extra=kv(lease=f"{self.namespace}/{self.name}", error=str(e)))
            return False
        log.info("released the lease", extra=kv(lease=f"{self.namespace}/{self.name}", identity=self.identity))
        return True

    # -- one attempt ---------------------------------------------------------------------------

    def _object_path(self) -> str:
        return f"{self.path}/{quote(self.name, safe='')}"

    def _try(self, timeout: float) -> bool:
        """One acquire-or-renew; True when this candidate holds the Lease afterwards."""
        try:
            ok = self._try_once(timeout)
            self.last_error = ""
            return ok
        except (KubeError, Unreachable, OSError, ValueError) as e:
            self.last_error = str(e)
        log.info("lease attempt failed", extra=kv(lease=f"{self.namespace}/{self.name}", error=self.last_error))
        return False

    def _try_once(self, timeout: float) -> bool:
        now = time.monotonic()
        if self.leading.is_set() and self._lease is not None and self._renew(timeout):
            return True
        try:
            lease = self.client.request("GET", self._object_path(), timeout=timeout)
        except KubeError as e:
            if not is_not_found(e):
                raise
            self.last_contact = time.monotonic()
            spec = self._record(transitions=0, acquired=micro_time())
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
            self._lease = self.client.request("POST", self.path, body=body, timeout=timeout)
            self._observe(spec, time.monotonic())
            return True
        self.last_contact = time.monotonic()
        spec = lease.get("spec") or {}
        self._observe(spec, now)
        holder = spec.get("holderIdentity") or ""
        if holder and holder != self.identity and not self._expired(now):
            return False  # someone else holds a live lease
        if holder == self.identity and self.leading.is_set():
            new = self._record(transitions=spec.get("leaseTransitions") or 0, acquired=spec.get("acquireTime"))
        else:
            new = self._record(transitions=(spec.get("leaseTransitions") or 0) + (1 if holder != self.identity else 0),
                               acquired=micro_time())
        updated = dict(lease, spec=dict(spec, **new))
        self._lease = self.client.request("PUT", self._object_path(), body=updated, timeout=timeout)
        self._observe(new, time.monotonic())
        return True

    def _renew(self, timeout: float) -> bool:
        """The leader's renewal without a read: a PUT of the Lease as this candidate last wrote it
        (its resourceVersion), as client-go's optimistic update does; True when it was written.
        Any answer but success (a conflict: someone wrote the Lease since; a Lease deleted) falls
        back to reading it first; a server not reached is the caller's failure."""
        spec = self._lease.get("spec") or {}
        new = self._record(transitions=spec.get("leaseTransitions") or 0, acquired=spec.get("acquireTime"))
        try:
            body = dict(self._lease, spec=dict(spec, **new))
            self._lease = self.client.request("PUT", self._object_path(), body=body, timeout=timeout)
        except KubeError as e:
            log.info("optimistic lease renewal refused, reading the lease",
                     extra=kv(lease=f"{self.namespace}/{self.name}", error=str(e)))
            return False
        self.last_contact = time.monotonic()
        self._observe(new, self.last_contact)
        return True

    def _record(self, *, transitions: int, acquired: str | None) -> dict:
        return {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.timing.lease_duration)),
                "acquireTime": acquired or micro_time(), "renewTime": micro_time(), "leaseTransitions": transitions}

    def _observe(self, spec: dict, now: float) -> None:
        record = {k: spec.get(k) for k in RECORD_FIELDS}
        if record != self._observed:
            self._observed, self._observed_at = record, now

    def _expired(self, now: float) -> bool:
        duration = (self._observed or {}).get("leaseDurationSeconds") or 0
        return self._observed_at + duration <= now
