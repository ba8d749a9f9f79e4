"""The claims reconciler: a pre-bound PersistentVolume and PersistentVolumeClaim named after the
cache in each of its workload namespaces (docs/cache-claims.md).

One :class:`ClaimsReconciler` per cache kind. It reads only its watches' local copies (reverse
indexes: :class:`controller.caches.reconciler.Mentions`) and writes only what differs. Kept:

* the finalizer goes on before anything is made, and comes off only once nothing is left;
* a PVC of that name that the controller did not make for this cache is never touched
  (``Conflict``, looked at again every :data:`CONFLICT_RECHECK` seconds);
* the PV is deleted only after its PVC is gone (pvc-protection keeps a PVC a pod uses);
* ``status.pvcStatus`` is written with the read resourceVersion and the rest of the status as
  read, so a stale read fails with 409 instead of undoing the cache reconciler's writes.
"""

from __future__ import annotations

import logging
import threading
from urllib.parse import quote

from accelnode.kube.client import Client, KubeError, custom_path, is_conflict, is_forbidden, is_not_found
from accelnode.log import kv

from controller.caches import volumes as co
from controller.caches.reconciler import Mentions, now_rfc3339, trim_cache, without_managed_fields
from controller.caches.pinning import GROUP, VERSION
from controller.runtime.reconciler import Reconciler, Result, Watch, object_key, split_key
from controller.runtime.writes import ReadYourWrites, patch_if_changed, patch_status

log = logging.getLogger("accelnode.controller")

PVCS = "/api/v1/persistentvolumeclaims"
PVS = "/api/v1/persistentvolumes"
NAMESPACES = "/api/v1/namespaces"
CONFLICT_RECHECK = 30.0  # seconds between two looks at a claim someone else made


def pvc_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace, safe='')}/persistentvolumeclaims/{quote(name, safe='')}"


def pv_path(name: str) -> str:
    return f"{PVS}/{quote(name, safe='')}"


def trim_namespace(obj: dict) -> dict:
    md = obj.get("metadata") or {}
    return {"metadata": {k: md[k] for k in ("name", "resourceVersion", "deletionTimestamp") if k in md},
            "status": {"phase": (obj.get("status") or {}).get("phase")}}


def deleting(obj: dict | None) -> bool:
    return bool(((obj or {}).get("metadata") or {}).get("deletionTimestamp"))


class ClaimsReconciler(Reconciler):
    """PV/PVC pairs of one cache kind: ``cluster=False`` for GKMCache (keys ``namespace/name``,
    one claim in the cache's namespace), ``cluster=True`` for ClusterGKMCache (keys ``name``,
    one claim per ``spec.workloadNamespaces``)."""

    def __init__(self, client: Client, *, cluster: bool, conflict_recheck: float = CONFLICT_RECHECK):
        self.client, self.cluster, self.conflict_recheck = client, cluster, conflict_recheck
        self.plural = "clustergkmcaches" if cluster else "gkmcaches"
        self.name = "clustergkmcache-claims" if cluster else "gkmcache-claims"
        self.caches_path = custom_path(GROUP, VERSION, self.plural)
        selected = {"labelSelector": co.selector(cluster)}
        self.pvcs, self.pvs = Mentions(), Mentions()  # object key -> the cache key it was made for
        self.watches = [
            Watch(self.caches_path, trim=trim_cache),
            Watch(PVCS, query=selected, keys=lambda o: self._claim_changed(PVCS, self.pvcs, o),
                  trim=without_managed_fields),
            Watch(PVS, query=selected, keys=lambda o: self._claim_changed(PVS, self.pvs, o),
                  trim=without_managed_fields),
        ]
        if cluster:  # a GKMCache's namespace exists while it does; a terminating one refuses the claim
            self.watches.append(Watch(NAMESPACES, keys=self._namespace_changed, trim=trim_namespace))
        self._index_lock = threading.Lock()  # a reflector event and a resync may map at once
        self._lock = threading.Lock()
        self._written = ReadYourWrites()
        self._conflicts: set[tuple[str, str]] = set()  # (cache key, workload namespace)

    # -- watched objects -> cache keys -----------------------------------------------------------

    def _claim_changed(self, path: str, index: Mentions, obj: dict) -> frozenset[str]:
        """The cache a PV/PVC was made for (as stored now, and as the event had it); the index
        follows the stored copy, so a deleted object leaves it."""
        key = object_key(obj)
        with self._index_lock:
            current = co.cache_key_of(self.cache.get(path, key))
            named = index.set(key, frozenset({current}) if current else frozenset())
        event = co.cache_key_of(obj)
        return named | {event} if event else named

    def _namespace_changed(self, obj: dict) -> list[str]:
        """The caches that want a claim in this namespace (from the local copy of the caches)."""
        ns = (obj.get("metadata") or {}).get("name")
        return [object_key(c) for c in self.cache.list(self.caches_path)
                if ns in co.workload_namespaces(c, self.cluster)]

    def _known_namespaces(self, key: str) -> set[str]:
        """The workload namespaces where a PV or PVC of this cache exists (from the watches)."""
        out = {split_key(k)[0] for k in self.pvcs.nodes_of(key)}
        for name in self.pvs.nodes_of(key):
            pv = self.cache.get(PVS, name)
            ns = ((pv or {}).get("metadata") or {}).get("labels", {}).get(co.WORKLOAD_LABEL) or \
                ((pv or {}).get("spec") or {}).get("claimRef", {}).get("namespace")
            if ns:
                out.add(ns)
        return {ns for ns in out if ns}

    # -- reconcile -------------------------------------------------------------------------------

    def reconcile(self, key: str) -> Result | None:
        obj = self._current(key)
        ns, name = split_key(key)
        if obj is None:  # gone (its finalizer removed by hand, or it never had one): clear leftovers
            cache = co.CacheId(self.cluster, ns, name)
            for wns in sorted(self._known_namespaces(key)):
                self._retire(cache, wns)
            self._written.forget(key)
            with self._lock:
                self._conflicts = {c for c in self._conflicts if c[0] != key}
            return None

        cache = co.CacheId.of(obj, self.cluster)
        md = obj["metadata"]
        dying = deleting(obj)
        wanted = [] if dying else co.workload_namespaces(obj, self.cluster)
        if wanted and co.FINALIZER not in (md.get("finalizers") or []):
            obj = self._set_finalizer(key, obj, True)
        with self._lock:
            self._conflicts = {c for c in self._conflicts if c[0] != key or c[1] in wanted}

        old = (obj.get("status") or {}).get("pvcStatus") or {}
        entries, now = {}, now_rfc3339()
        for wns in sorted(set(wanted) | self._known_namespaces(key)):
            state = self._ensure(cache, obj, wns) if wns in wanted else self._retire(cache, wns)
            if state is not None:
                entries[wns] = co.entry(old.get(wns), cache, wns, *state, now)

        has_finalizer = co.FINALIZER in (obj["metadata"].get("finalizers") or [])
        if not wanted and not self._known_namespaces(key):
            if has_finalizer:
                self._set_finalizer(key, obj, False)  # nothing of it is left: let it go
                return None
            if dying:
                return None
        if not dying or has_finalizer:
            self._write_status(key, obj, co.claims_status(obj.get("status") or {}, entries))
        with self._lock:
            conflicted = any(c[0] == key for c in self._conflicts)
        return Result(requeue_after=self.conflict_recheck) if conflicted else None

    # -- one workload namespace ------------------------------------------------------------------

    def _ours(self, path: str, key: str, cache: co.CacheId) -> dict | None:
        obj = self.cache.get(path, key)
        return obj if co.is_ours(obj, cache) else None

    def _ensure(self, cache: co.CacheId, obj: dict, wns: str) -> tuple[str, str]:
        """Make or keep the pair in ``wns``; (reason, message) of its status entry."""
        nsobj = self.cache.get(NAMESPACES, wns) if self.cluster else {"metadata": {"name": wns}}
        if nsobj is None:
            self._retire(cache, wns)
            return co.REASON_NO_NAMESPACE, f"namespace {wns} does not exist; the claim is made once it does"
        if deleting(nsobj) or (nsobj.get("status") or {}).get("phase") == "Terminating":
            self._retire(cache, wns)
            return co.REASON_NAMESPACE_TERMINATING, f"namespace {wns} is terminating"

        capacity = co.capacity_bytes((obj["metadata"].get("annotations") or {}))
        pvc = self._ours(PVCS, f"{wns}/{cache.name}", cache)
        if pvc is not None and deleting(pvc):
            return co.REASON_PENDING, (f"PersistentVolumeClaim {wns}/{cache.name} is being deleted (Kubernetes keeps "
                                       "it while a pod uses it); it is made again once it is gone")
        if pvc is None:
            pvc, why = self._make_pvc(cache, wns, capacity)
            if pvc is None:
                return why

        pv = self._ours(PVS, co.pv_name(cache, wns), cache)
        uid = pvc["metadata"]["uid"]
        if pv is None:
            pv, why = self._make_pv(cache, wns, uid, capacity)
            if pv is None:
                return why
        elif deleting(pv):
            return co.REASON_PENDING, (f"PersistentVolume {pv['metadata']['name']} is being deleted; it is made "
                                       "again once it is gone")
        else:
            wanted = co.pv_wants_update(pv, cache, wns, uid, capacity)
            if wanted is not None:
                pv = without_managed_fields(self.client.request("PUT", pv_path(pv["metadata"]["name"]), body=wanted))
                log.info("claim volume updated", extra=kv(reconciler=self.name, cache=cache.key, namespace=wns,
                                                          pv=pv["metadata"]["name"], capacity=capacity))
        return co.binding(pv, pvc)

    def _make_pvc(self, cache: co.CacheId, wns: str, capacity: int) -> tuple[dict | None, tuple[str, str] | None]:
        """(our PVC, None), or (None, (reason, message)) when there is a claim of that name that
        is not ours (the conflict is remembered, and only looked at, not created over, until it
        is gone) or the namespace cannot take one."""
        with self._lock:
            known_conflict = (cache.key, wns) in self._conflicts
        existing = self._get(pvc_path(wns, cache.name)) if known_conflict else None
        if existing is None:
            try:
                made = self.client.request("POST", f"/api/v1/namespaces/{quote(wns, safe='')}/persistentvolumeclaims",
                                           body=co.pvc_body(cache, wns, capacity))
            except KubeError as e:
                if is_not_found(e):
                    return None, (co.REASON_NO_NAMESPACE, f"namespace {wns} does not exist; the claim is made "
                                                          "once it does")
                if is_forbidden(e) and "terminat" in e.message:
                    return None, (co.REASON_NAMESPACE_TERMINATING, f"namespace {wns} is terminating")
                if not is_conflict(e):
                    raise
                # a claim of that name exists: ours (the watch has not brought it yet) or not
                existing = self._get(pvc_path(wns, cache.name))
                if existing is None:
                    raise KubeError(409, "Conflict", f"PersistentVolumeClaim {wns}/{cache.name} existed and is "
                                                     "gone again; retrying") from None
            else:
                with self._lock:
                    self._conflicts.discard((cache.key, wns))
                log.info("claim made", extra=kv(reconciler=self.name, cache=cache.key, namespace=wns,
                                                pvc=cache.name, pv=co.pv_name(cache, wns)))
                return without_managed_fields(made), None
        if co.is_ours(existing, cache):
            with self._lock:
                self._conflicts.discard((cache.key, wns))
            return existing, None
        with self._lock:
            self._conflicts.add((cache.key, wns))
        self._retire_pv(cache, wns)  # a volume of ours pre-bound to that name must not stay behind
        other = co.made_for(existing)
        whose = f"made by the controller for {other}" if other else "not made by the controller"
        if not known_conflict:
            log.warning("claim name taken", extra=kv(reconciler=self.name, cache=cache.key, namespace=wns,
                                                     pvc=cache.name, owner=other or "unknown"))
        return None, (co.REASON_CONFLICT, f"PersistentVolumeClaim {wns}/{cache.name} exists and was {whose}; it "
                                          "is left as it is, and pods naming it get that claim, not this cache")

    def _get(self, path: str) -> dict | None:
        try:
            return without_managed_fields(self.client.request("GET", path))
        except KubeError as e:
            if is_not_found(e):
                return None
            raise

    def _make_pv(self, cache: co.CacheId, wns: str, pvc_uid: str,
                 capacity: int) -> tuple[dict | None, tuple[str, str] | None]:
        body = co.pv_body(cache, wns, pvc_uid, capacity)
        name = body["metadata"]["name"]
        try:
            made = without_managed_fields(self.client.request("POST", PVS, body=body))
            log.info("claim volume made", extra=kv(reconciler=self.name, cache=cache.key, namespace=wns, pv=name))
            return made, None
        except KubeError as e:
            if not is_conflict(e):
                raise
        existing = self._get(pv_path(name))
        if existing is None:
            raise KubeError(409, "Conflict", f"PersistentVolume {name} existed and is gone again; retrying")
        if co.is_ours(existing, cache):  # the watch has not brought it yet
            wanted = co.pv_wants_update(existing, cache, wns, pvc_uid, capacity)
            if wanted is not None:
                existing = without_managed_fields(self.client.request("PUT", pv_path(name), body=wanted))
            return existing, None
        return None, (co.REASON_CONFLICT, f"PersistentVolume {name} exists and was not made by the controller for "
                                          f"{cache}; it is left as it is")

    def _retire(self, cache: co.CacheId, wns: str) -> tuple[str, str] | None:
        """Delete the pair in ``wns``: the PVC first, the PV once the PVC is gone. (Deleting,
        message) while anything is left, None when nothing is."""
        pvc = self._ours(PVCS, f"{wns}/{cache.name}", cache)
        if pvc is not None:
            self._delete(pvc_path(wns, cache.name), pvc, cache, wns)
            return co.REASON_DELETING, (f"PersistentVolumeClaim {wns}/{cache.name} is being deleted; Kubernetes keeps "
                                        "it while a pod uses it, then the PersistentVolume goes")
        return self._retire_pv(cache, wns)

    def _retire_pv(self, cache: co.CacheId, wns: str) -> tuple[str, str] | None:
        pv = self._ours(PVS, co.pv_name(cache, wns), cache)
        if pv is None:
            return None
        self._delete(pv_path(pv["metadata"]["name"]), pv, cache, wns)
        return co.REASON_DELETING, f"PersistentVolume {pv['metadata']['name']} is being deleted"

    def _delete(self, path: str, obj: dict, cache: co.CacheId, wns: str) -> None:
        """DELETE, once (an object already being deleted is waited for), only the very object
        read (uid precondition: a claim made meanwhile by someone else under that name is safe)."""
        if deleting(obj):
            return
        md = obj["metadata"]
        try:
            self.client.request("DELETE", path, body={"apiVersion": "v1", "kind": "DeleteOptions",
                                                      "preconditions": {"uid": md["uid"]}})
        except KubeError as e:
            if not (is_not_found(e) or is_conflict(e)):  # gone already / replaced: the watch tells the rest
                raise
            return
        log.info("claim object deleted", extra=kv(reconciler=self.name, cache=cache.key, namespace=wns,
                                                  kind=obj.get("kind", ""), object=md.get("name")))

    # -- the cache object ------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        ns, name = split_key(key)
        return custom_path(GROUP, VERSION, self.plural, ns, name)

    def _current(self, key: str) -> dict | None:
        return self._written.current(key, self.cache.get(self.caches_path, key))

    def _remember(self, key: str, before: dict, written: dict | None) -> dict:
        if written is None:
            return before
        written = trim_cache(written)
        self._written.remember(key, before, written)
        return written

    def _set_finalizer(self, key: str, obj: dict, present: bool) -> dict:
        def mutate(o: dict) -> None:
            fins = [f for f in o["metadata"].get("finalizers") or [] if f != co.FINALIZER]
            if present:
                fins.append(co.FINALIZER)
            if fins:
                o["metadata"]["finalizers"] = fins
            else:
                o["metadata"].pop("finalizers", None)

        written = patch_if_changed(self.client, self._path(key), obj, mutate)
        if written is not None:
            log.info("cache finalizer " + ("added" if present else "removed"),
                     extra=kv(reconciler=self.name, key=key, finalizer=co.FINALIZER))
        return self._remember(key, obj, written)

    def _write_status(self, key: str, obj: dict, status: dict) -> None:
        written = patch_status(self.client, self._path(key), obj, status)
        if written is not None:
            self._remember(key, obj, written)
            log.info("cache claims status written", extra=kv(
                reconciler=self.name, key=key,
                claims={ns: e["conditions"][0]["reason"] for ns, e in (status.get("pvcStatus") or {}).items()}))


def gkmcache_claims_reconciler(client: Client, resolver=None) -> ClaimsReconciler:
    """The GKMCache claims reconciler. ``resolver`` is accepted, and unused, so the factory fits
    :func:`controller.cli.always_running` beside the cache reconcilers' ``(client, resolver)``."""
    return ClaimsReconciler(client, cluster=False)


def clustergkmcache_claims_reconciler(client: Client, resolver=None) -> ClaimsReconciler:
    """The ClusterGKMCache claims reconciler (same signature as :func:`gkmcache_claims_reconciler`)."""
    return ClaimsReconciler(client, cluster=True)
