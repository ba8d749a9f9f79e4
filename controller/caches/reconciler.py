"""The GKMCache / ClusterGKMCache reconciler (docs/cache-controller.md): pins each cache's image
to a digest and sums the agents' per-node reports into the cache's status.

One :class:`CacheReconciler` per kind (:func:`gkmcache_reconciler`,
:func:`clustergkmcache_reconciler`), each watching its cache kind and the matching node kind
(``GKMCacheNode`` / ``ClusterGKMCacheNode``). A node object's change queues exactly the caches it
names now or named before (:class:`Mentions`); a reconcile reads only those node objects, from
the local copies. Status is written when it changed, and at most once per
:func:`controller.caches.status.write_interval` per cache (1 s, longer on more than 1,000 nodes;
a key reconciled sooner waits for the rest of the interval): many nodes changing at once make
one write, carrying the aggregate as it is at that moment.

No finalizer: deleting a cache leaves nothing for this reconciler to undo.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone

from accelnode.kube.client import Client, KubeError, custom_path, is_conflict
from accelnode.log import kv
from accelnode.oci.errors import ImageError, quoted

from controller.caches import status as cs
from controller.caches.pinning import GROUP, VERSION, Pin, Resolver
from controller.runtime import events
from controller.runtime.reconciler import Reconciler, Result, Watch, object_key, split_key
from controller.caches.signatures import (POLICY_GROUP, POLICY_PLURAL, POLICY_VERSION, UNAVAILABLE, Outcome, Signer,
                                         parse_policy, requirement, trim_policy)
from controller.runtime.writes import ReadYourWrites, patch_if_changed, patch_status

log = logging.getLogger("accelnode.controller")



def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# What the controller reads of a GKMCache / ClusterGKMCache (the cache and claims reconcilers,
# their status, pin, signature and claim helpers, the events about it): a tenant writes the rest
# (a pod template whose affinity preserves unknown fields: 1.5 MiB of {} is 35 MB parsed), and
# the controller writes caches by merge patches of these fields only (controller.runtime.writes).
CACHE_METADATA = ("name", "namespace", "uid", "resourceVersion", "generation", "labels", "annotations",
                  "finalizers", "deletionTimestamp")
CACHE_SPEC = ("image", "workloadNamespaces")


def trim_cache(obj: dict) -> dict:
    """What the cache of cache objects stores: kind, the metadata in CACHE_METADATA, the spec
    fields in CACHE_SPEC and the status (written by the controller alone)."""
    md, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    out = {k: obj[k] for k in ("apiVersion", "kind", "status") if k in obj}
    out["metadata"] = {k: md[k] for k in CACHE_METADATA if k in md}
    out["spec"] = {k: spec[k] for k in CACHE_SPEC if k in spec}
    return out


def without_managed_fields(obj: dict) -> dict:
    """All of an object but ``managedFields``: for the objects a reconciler writes back whole
    (a claim's PersistentVolume is updated with ``PUT``; an update without them keeps the
    server's)."""
    md = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {**obj, "metadata": md}


def trim_node(obj: dict) -> dict:
    """What the cache of node objects stores: name, namespace, resourceVersion and, per cache
    and digest, the state, message, pods and the cache digest it was reported for."""
    md = obj.get("metadata") or {}
    caches = {}
    for name, by_digest in ((obj.get("status") or {}).get("caches") or {}).items():
        if isinstance(by_digest, dict):
            caches[name] = {d: {k: e[k] for k in ("state", "message", "pods", cs.CACHE_DIGEST) if k in e}
                            for d, e in by_digest.items() if isinstance(e, dict)}
    return {"metadata": {k: md[k] for k in ("name", "namespace", "resourceVersion") if k in md},
            "status": {"caches": caches}}


class Mentions:
    """Which caches each node object names, and the reverse: so that a node object's change
    queues the caches it names now *and* those it stopped naming, and a cache's reconcile reads
    only the node objects that name it. Kept current from the reflector's own copy."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_node: dict[str, frozenset[str]] = {}
        self._by_cache: dict[str, set[str]] = {}

    def set(self, node_key: str, cache_keys: frozenset[str]) -> frozenset[str]:
        """Record what ``node_key`` names now; the cache keys it named before or names now."""
        with self._lock:
            old = self._by_node.pop(node_key, frozenset())
            if cache_keys:
                self._by_node[node_key] = cache_keys
            for k in old - cache_keys:
                nodes = self._by_cache.get(k)
                if nodes is not None:
                    nodes.discard(node_key)
                    if not nodes:
                        del self._by_cache[k]
            for k in cache_keys - old:
                self._by_cache.setdefault(k, set()).add(node_key)
            return old | cache_keys

    def nodes_of(self, cache_key: str) -> list[str]:
        with self._lock:
            return sorted(self._by_cache.get(cache_key, ()))


class CacheReconciler(Reconciler):
    """Pins and summarises the caches of one kind: ``cluster=False`` for GKMCache (keys
    ``namespace/name``, node objects GKMCacheNode of the cache's namespace), ``cluster=True``
    for ClusterGKMCache (keys ``name``, node objects ClusterGKMCacheNode)."""

    def __init__(self, client: Client, resolver: Resolver, *, cluster: bool,
                 fanout_per_second: float = cs.FANOUT_PER_SECOND, signer: Signer | None = None):
        self.client, self.resolver, self.cluster = client, resolver, cluster
        self.signer = signer or Signer(resolver.options)  # signatures (docs/signatures.md)
        self.plural = "clustergkmcaches" if cluster else "gkmcaches"
        self.name = "clustergkmcache" if cluster else "gkmcache"
        cs.write_interval(0, fanout_per_second)  # a bad setting fails here, not at the first write
        self.fanout_per_second = fanout_per_second
        self.caches_path = custom_path(GROUP, VERSION, self.plural)
        self.nodes_path = custom_path(GROUP, VERSION, "clustergkmcachenodes" if cluster else "gkmcachenodes")
        self.policies_path = custom_path(POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL)
        self.watches = [Watch(self.caches_path, trim=trim_cache),
                        Watch(self.nodes_path, keys=self._node_changed, trim=trim_node),
                        Watch(self.policies_path, keys=self._policy_changed, trim=trim_policy)]
        self.mentions = Mentions()
        self._mentions_lock = threading.Lock()  # a reflector event and a resync may map at once
        self._lock = threading.Lock()
        self._next_write: dict[str, float] = {}  # key -> monotonic time its next write may come (last + interval)
        self._written = ReadYourWrites()

    # -- node objects -> cache keys --------------------------------------------------------------

    def _named(self, node_obj: dict | None) -> frozenset[str]:
        if not node_obj:
            return frozenset()
        names = ((node_obj.get("status") or {}).get("caches") or {}).keys()
        ns = (node_obj.get("metadata") or {}).get("namespace")
        return frozenset(names if self.cluster else (f"{ns}/{n}" for n in names if ns))

    def _node_changed(self, obj: dict) -> frozenset[str]:
        """The caches a node object's change concerns: those it names as stored now (the
        reflector's copy, read under one lock so the latest reading wins) and those it named
        before, so a cache it stopped naming is counted again too."""
        key = object_key(obj)
        with self._mentions_lock:
            current = self.cache.get(self.nodes_path, key)
            return self.mentions.set(key, self._named(current)) | self._named(obj)

    def _policy_changed(self, obj: dict) -> list[str]:
        """A trust policy changed: every cache is looked at again; only those whose covering
        policies changed are verified again (the verdict is keyed by their generations)."""
        return [object_key(o) for o in self.cache.list(self.caches_path)]

    # -- reconcile -------------------------------------------------------------------------------

    def reconcile(self, key: str) -> Result | None:
        obj = self._current(key)
        if obj is None:  # deleted: nothing to undo
            with self._lock:
                self._next_write.pop(key, None)
            self._written.forget(key)
            return None
        with self._lock:
            wait = self._next_write.get(key, float("-inf")) - time.monotonic()
        if wait > 0:  # coalesce: one write carries what changed meanwhile; no recount of every
            return Result(requeue_after=wait)  # node per event until then (O(nodes), not O(nodes x events))
        try:
            return self._sync(key, obj)
        except KubeError as e:
            if not is_conflict(e):
                raise
        # another writer got in first (the claims reconciler adds its finalizer as a new cache
        # arrives): write again at once on the object as it is now, not after a backoff plus the
        # write interval (a second conflict is an error, retried with backoff)
        ns, name = split_key(key)
        fresh = self.client.request("GET", custom_path(GROUP, VERSION, self.plural, ns, name))
        return self._sync(key, trim_cache(fresh))

    def _sync(self, key: str, obj: dict) -> Result | None:
        """Pin, verify and count ``obj``; write what changed."""
        pin, resolved = self._pin(key, obj)
        now = now_rfc3339()
        verified = self._verified(key, obj, pin, now)
        agg = cs.aggregate(self._reports(key), pin and pin.digest)
        status = cs.cache_status(obj, pin, resolved, agg, now,
                                 verified=verified and (verified.status, verified.reason, verified.message),
                                 verification=verified.verdict if verified else None)
        annotations = cs.wanted_annotations((obj.get("metadata") or {}).get("annotations") or {}, pin)
        retry = Result(requeue=True) if resolved[0] in cs.RETRYABLE or (verified and verified.retry) else None
        if obj.get("status") == status and ((obj.get("metadata") or {}).get("annotations") or {}) == annotations:
            return retry
        self._write(key, obj, status, annotations, pin, nodes=agg.counts["nodeCnt"])
        return retry

    def _current(self, key: str) -> dict | None:
        return self._written.current(key, self.cache.get(self.caches_path, key))

    def _pin(self, key: str, obj: dict) -> tuple[Pin | None, tuple[str, str]]:
        """(the pin or None, (Resolved reason, message))."""
        image = (obj.get("spec") or {}).get("image", "")
        try:
            pin = cs.known_pin(obj)
            if pin is None:
                pin = self.resolver.pin(image, split_key(key)[0])
                log.info("cache image resolved", extra=kv(reconciler=self.name, key=key, image=image,
                                                          digest=pin.digest, size_bytes=pin.size_bytes))
        except ImageError as e:
            reason = cs.failure(e)
            log.warning("cache image not resolved", extra=kv(reconciler=self.name, key=key, image=image,
                                                             reason=reason, error=str(e)))
            return None, (reason, quoted(e))
        return pin, (cs.REASON_RESOLVED, cs.pinned_message(image, pin.digest))

    def _verified(self, key: str, obj: dict, pin: Pin | None, now: str) -> Outcome | None:
        """The verdict on the pinned digest (None: no signature needed or nothing pinned yet)."""
        if pin is None:
            return None
        policies = [parse_policy(p) for p in self.cache.list(self.policies_path)]
        ns, _ = split_key(key)
        try:
            _, options = self.resolver.credentials(ns, pin.image)  # the cache's, as for its pin
        except ImageError as e:
            if requirement(ns, (obj.get("metadata") or {}).get("labels") or {}, policies) is None:
                return None
            return Outcome("Unknown", UNAVAILABLE, f"signatures of {pin.digest} not read: {quoted(e)}", retry=True)
        return self.signer.outcome(key, obj, pin, ns, policies, now, options=options)

    def _reports(self, key: str) -> dict[str, dict]:
        """Node name -> this cache's entries on that node, from the local copies."""
        ns, name = split_key(key)
        out = {}
        for node_key in self.mentions.nodes_of(key):
            node = self.cache.get(self.nodes_path, node_key)
            entries = ((node or {}).get("status") or {}).get("caches", {}).get(name) if node else None
            if entries is not None and (node["metadata"].get("namespace") or None) == ns:
                out[node["metadata"]["name"]] = entries
        return out

    def _write(self, key: str, obj: dict, status: dict, annotations: dict, pin: Pin | None, *, nodes: int) -> None:
        """Status first when there is a pin (the authority leads, its mirror follows);
        annotations first when the pin goes (a leftover annotation must never outlive it)."""
        ns, name = split_key(key)
        path = custom_path(GROUP, VERSION, self.plural, ns, name)

        def set_annotations(o: dict) -> None:
            if (o["metadata"].get("annotations") or {}) != annotations:
                o["metadata"]["annotations"] = annotations

        steps = [lambda o: patch_status(self.client, path, o, status),
                 lambda o: patch_if_changed(self.client, path, o, set_annotations)]
        if pin is None:
            steps.reverse()
        current = obj
        try:
            for step in steps:
                written = step(current)
                if written is not None:
                    current = trim_cache(written)
        finally:
            if current is not obj:  # a refused write (409) is no write: it does not delay the next
                with self._lock:
                    self._next_write[key] = time.monotonic() + cs.write_interval(nodes, self.fanout_per_second)
                self._written.remember(key, obj, current)
        events.transitions(obj, status, progress=(cs.DOWNLOADING, cs.PENDING), quiet=(cs.READY,))
        log.info("cache status written", extra=kv(reconciler=self.name, key=key,
                                                  reason=status["conditions"][0]["reason"],
                                                  digest=status.get("resolvedDigest")))


def gkmcache_reconciler(client: Client, resolver: Resolver, *,
                        fanout_per_second: float = cs.FANOUT_PER_SECOND) -> CacheReconciler:
    """The GKMCache reconciler (register it with the process's shared :class:`Resolver`)."""
    return CacheReconciler(client, resolver, cluster=False, fanout_per_second=fanout_per_second)


def clustergkmcache_reconciler(client: Client, resolver: Resolver, *,
                               fanout_per_second: float = cs.FANOUT_PER_SECOND) -> CacheReconciler:
    """The ClusterGKMCache reconciler (same resolver as :func:`gkmcache_reconciler`)."""
    return CacheReconciler(client, resolver, cluster=True, fanout_per_second=fanout_per_second)
