"""The driver's local copy of the cache objects (GKMCache in every namespace, ClusterGKMCache)
and of the ClusterCacheTrustPolicy objects, kept current by three watches, so that a publish
never waits on the API server.

Objects are trimmed to what a publish reads: name, namespace, labels, ``spec.image``,
``spec.workloadNamespaces``, ``status.resolvedDigest``, ``status.verification`` and the
conditions; policies to their name, generation and whom they cover. A kind is usable once
its first list has arrived (:meth:`CacheView.synced`); until then a publish that needs it is
answered UNAVAILABLE and ``/readyz`` says which kind is missing (the trust policies too: until
they are listed, the driver cannot tell which caches need a verified signature, so it mounts
none; nor once their watch has been broken for longer than ``--trust-policy-max-age``:
:meth:`CacheView.policies_stale`). A missing CRD, an unreachable
server or a refused watch are retried by the reflectors with backoff. Each reflector beats a
heartbeat (``watch GKMCaches``, ``watch ClusterGKMCaches``, ``watch ClusterCacheTrustPolicies``) in the driver's
:class:`~accelnode.health.Health`: a watch thread that dies or hangs turns ``/healthz``.
"""

from __future__ import annotations

import threading

from accelnode.health import GRACE_DEFAULT, Health
from accelnode.kube.client import Client, custom_path
from accelnode.kube.reflector import FLEET_JITTER, Reflector

from accelnode.oci.refusal import POLICY_GROUP, POLICY_PLURAL, POLICY_VERSION, VERIFICATION, trim_policy

from .resolve import POLICY_MAX_AGE, CacheRef

GROUP, VERSION = "gkm.io", "v1alpha1"
CAPTURE_PREFIX = "accelnode.io/capture"  # the capture annotations (docs/capture.md) are kept, no other


def trim(obj: dict) -> dict:
    """What the driver keeps of a cache object."""
    md, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    kept = {"resolvedDigest": status.get("resolvedDigest"),
            "conditions": [{k: c.get(k) for k in ("type", "status", "reason", "message")}
                           for c in status.get("conditions") or [] if isinstance(c, dict)]}
    if VERIFICATION in status:
        kept[VERIFICATION] = status[VERIFICATION]
    notes = {k: v for k, v in (md.get("annotations") or {}).items() if k.startswith(CAPTURE_PREFIX)}
    return {"metadata": {**{k: md[k] for k in ("name", "namespace", "labels") if k in md},
                         **({"annotations": notes} if notes else {})},
            "spec": {k: spec[k] for k in ("image", "workloadNamespaces") if k in spec},
            "status": kept}


KINDS = (("GKMCaches", "gkmcaches"), ("ClusterGKMCaches", "clustergkmcaches"),
         ("ClusterCacheTrustPolicies", POLICY_PLURAL))


class CacheView:
    def __init__(self, client: Client, health: Health | None = None, *, policy_max_age: float = POLICY_MAX_AGE,
                 **reflector_options):
        """``reflector_options`` go to every reflector (tests: ``watch_seconds``, ``stall_after``;
        ``watch_jitter`` is :data:`FLEET_JITTER` unless given: one plugin a node, and a fleet's
        watches must not end and re-open together, as the agent's do, docs/scale.md);
        ``policy_max_age``: seconds the trust policies' watch may be broken before :meth:`policies`
        refuses to answer (fail closed)."""
        health = health or Health()
        self.policy_max_age = policy_max_age
        reflector_options = {"watch_jitter": FLEET_JITTER, **reflector_options}
        self.namespaced, self.cluster, self.trust = (
            Reflector(client, path, trim=trimmed, beat=health.heartbeat(f"watch {kind}", GRACE_DEFAULT),
                      **reflector_options)
            for (kind, _), path, trimmed in zip(KINDS, (custom_path(GROUP, VERSION, "gkmcaches"),
                                                        custom_path(GROUP, VERSION, "clustergkmcaches"),
                                                        custom_path(POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL)),
                                                (trim, trim, trim_policy)))
        self._all = (self.namespaced, self.cluster, self.trust)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _of(self, cache: CacheRef) -> Reflector:
        return self.namespaced if cache.namespace else self.cluster

    def synced(self, cache: CacheRef) -> bool:
        return self._of(cache).synced.is_set()

    def get(self, cache: CacheRef) -> dict | None:
        return self._of(cache).get(cache.namespace, cache.name)

    def policies(self) -> list[dict] | None:
        """The trust policies, None until they have been listed once."""
        return self.trust.snapshot() if self.trust.synced.is_set() else None

    def policies_stale(self) -> str | None:
        """Why the copy of the trust policies cannot be trusted to be current, or None: its watch
        has been broken for longer than ``policy_max_age`` (a policy created or edited meanwhile
        would go unseen)."""
        age = self.trust.out_of_sync_for()
        if age is None or age <= self.policy_max_age:
            return None
        return (f"the driver's copy of the ClusterCacheTrustPolicies is {age:.0f} s old (their watch has not "
                f"been in sync for more than --trust-policy-max-age {self.policy_max_age:g} s)")

    def ready(self) -> tuple[bool, str]:
        """(both kinds listed, which are not yet): the driver's readiness."""
        missing = [kind for (kind, _), r in zip(KINDS, self._all) if not r.synced.is_set()]
        if missing:
            listed = ", ".join(missing[:-1]) + " and " + missing[-1] if len(missing) > 1 else missing[0]
            return False, f"{listed} not read from the API server yet"
        return True, ""

    def start(self) -> "CacheView":
        for (_, name), r in zip(KINDS, self._all):
            t = threading.Thread(target=r.run, args=(self._stop,), name=f"watch-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for r in self._all:
            r.interrupt()
        for t in self._threads:
            t.join(5)
