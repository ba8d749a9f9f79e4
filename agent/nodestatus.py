"""The wanted status of this node's cache objects: one ``GKMCacheNode`` per (namespace, node)
and one ``ClusterGKMCacheNode`` per node (docs/agent-status.md).

Pure: :func:`node_statuses` turns the caches of the cluster (:class:`Cache`) and the agent's own
view of the node (:class:`Local`) into the status of each object; :mod:`agent.reporter` reads
the inputs and writes what changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accelnode.oci.reference import Reference
from accelnode.oci.refusal import pull_refusal

from . import fit

GROUP, VERSION = "gkm.io", "v1alpha1"
HOSTNAME_LABEL = "kubernetes.io/hostname"
PREFETCH_ANNOTATION = "accelnode.io/prefetch"  # "true": pull on every node the cache fits
IN_USE = ("Running", "Outdated", "Deleting")
CLUSTER = ""  # the namespace key of the ClusterGKMCacheNode
CACHE_DIGEST = "cacheDigest"  # an entry's field: the cache's current digest it was reported for
QUEUED = "queued: waiting for a free pull slot on this node"
QUEUED_PULL, PULLING, FAILED = "QUEUED", "PULLING", "FAILED"  # Local.pulls states


# ---------------------------------------------------------------------------------------------
# inputs


def _refused(labels: dict, status: dict, digest: str | None) -> str | None:
    refused = pull_refusal(labels, status, digest)
    return None if refused is None else refused[1]


@dataclass(frozen=True)
class Cache:
    """What the reporter reads from one GKMCache (``namespace`` set) or ClusterGKMCache."""

    namespace: str  # CLUSTER for a ClusterGKMCache
    name: str
    image: str
    digest: str | None  # status.resolvedDigest, else the digest pinned in spec.image
    node_selector: dict
    prefetch: bool
    workload_namespaces: tuple[str, ...]
    refused: str | None = None  # why it must not be pulled (signature refused or not verified yet)
    resolved: str | None = None  # status.resolvedDigest: the controller's pin (only it may write it)

    @classmethod
    def from_object(cls, obj: dict) -> "Cache":
        md, spec, st = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
        image = spec.get("image", "")
        digest = st.get("resolvedDigest") or (image.rsplit("@", 1)[1] if "@" in image else None)
        tmpl = ((spec.get("podTemplate") or {}).get("spec") or {})
        return cls(md.get("namespace", CLUSTER), md.get("name", ""), image, digest,
                   dict(tmpl.get("nodeSelector") or {}),
                   (md.get("annotations") or {}).get(PREFETCH_ANNOTATION, "").lower() == "true",
                   tuple(spec.get("workloadNamespaces") or ()),
                   _refused(md.get("labels") or {}, st, digest), st.get("resolvedDigest") or None)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def pinned(self) -> str | None:
        """``registry/repo@digest`` for the current digest, or None while it is unknown."""
        if not self.digest:
            return None
        try:
            return Reference.parse(self.image).pinned(self.digest)
        except Exception:  # an image the CRD let through but we cannot parse: nothing to pull
            return None

    def prefetchable(self) -> str | None:
        """What the node may pull for this cache before any pod asks: ``registry/repo@digest``
        of the controller's pin (``status.resolvedDigest``), and only while a digest that
        ``spec.image`` names agrees with it; None otherwise (a tag the controller has not
        resolved, a digest it has not pinned and checked, a pin that lags the spec)."""
        try:
            named = Reference.parse(self.image).digest
        except Exception:  # an image the CRD let through but we cannot parse: nothing to pull
            return None
        if not self.resolved or (named and named != self.resolved):
            return None
        return self.pinned()

    def admits(self, pod_namespace: str) -> bool:
        """Whether a pod of that namespace may use this cache (and so counts as its user)."""
        if self.namespace:
            return pod_namespace == self.namespace
        return not self.workload_namespaces or pod_namespace in self.workload_namespaces


@dataclass(frozen=True)
class Local:
    """The agent's own view of the node: what is installed, pulling, failed, and who uses what.

    A cache's status shows only what was proved for it (docs/agent-status.md): its proof (the
    (registry, repository, digest, credentials key) its requests are proved under, see
    :meth:`agent.core.Agent.proof_of`) among ``proven``, its own pull in ``pulls``, its own
    prefetch failure in ``failed``; never what another cache's credentials brought or met."""

    # manifest digest -> {"image", "size", "targets", "refs": [{"volume_id", "namespace", "name", "uid", "cache"}]}
    # where a ref's "cache" is the (namespace, name) key of the cache its volume names, or None
    # for references taken before the CSI driver said so
    installed: dict
    pulling: set  # reference digests being pulled (or waiting for a pull slot), whoever asked
    proven: set = field(default_factory=set)  # proofs the agent holds
    pulls: dict = field(default_factory=dict)  # proof -> (QUEUED | PULLING | FAILED, message) of its latest pull
    failed: dict = field(default_factory=dict)  # cache key -> (digest, message) of its last failed prefetch
    # (namespace, name) of a GKMCache -> its latest capture results on this node (agent/capture.py)
    captures: dict = field(default_factory=dict)

    def manifest_of(self, digest: str) -> str | None:
        """The installed manifest digest for a cache digest (itself, or the manifest an index
        resolved to on this node), or None when it is not installed."""
        return next((m for m, i in self.installed.items() if m == digest or i["image"].endswith("@" + digest)), None)

    def held(self, cache: "Cache", proof: tuple | None) -> str | None:
        """The installed manifest of ``cache``'s digest when it was proved for that cache: its
        proof is held, or a volume naming that cache holds it (a publish proved it); else None."""
        manifest = self.manifest_of(cache.digest) if cache.digest else None
        if manifest is None:
            return None
        if proof is not None and proof in self.proven:
            return manifest
        refs = self.installed[manifest].get("refs") or ()
        return manifest if any(r.get("cache") == cache.key for r in refs) else None


def wanted(cache: Cache, node_labels: dict) -> bool:
    """Should this node hold the cache before any pod asks? (its podTemplate's nodeSelector
    matches the node, or it is marked for prefetch - compatibility is checked before pulling)."""
    if cache.node_selector:
        return all(node_labels.get(k) == v for k, v in cache.node_selector.items())
    return cache.prefetch


# ---------------------------------------------------------------------------------------------
# the status of each object


def uses(ref: dict, cache: Cache) -> bool:
    """Whether a reference is a use of ``cache``: the cache its volume names, or - for a
    reference that does not say - any cache of that digest the pod's namespace may use."""
    if ref.get("cache") is not None:
        return ref["cache"] == cache.key
    return cache.admits(ref["namespace"])


def gpus(accelerators) -> list[tuple[object, list[int]]]:
    """Each accelerator kind with the ids of its devices (numbered across the node, in order)."""
    out, n = [], 0
    for acc in accelerators:
        out.append((acc, list(range(n, n + acc.count))))
        n += acc.count
    return out


def node_statuses(node: str, accelerators, caches: list[Cache], local: Local, wanted_keys: set,
                  history: dict, deleting_pods: set, previous: dict, now: str,
                  proofs: dict | None = None) -> dict[str, dict]:
    """The status of every node object: namespace (CLUSTER for the ClusterGKMCacheNode) ->
    status. ``history`` (cache key -> status keys reported for it) is updated in place.
    ``previous`` (namespace -> status last written) only lends ``lastUpdated`` to entries whose
    content did not change, and keeps an emptied object listed (with no caches). ``proofs``:
    cache key -> the proof its current digest is asked under (:meth:`Local.held`)."""
    proofs = proofs or {}
    groups = gpus(accelerators)
    gpu_list = [{"gpuType": f"{a.backend}/{a.arch or 'unknown'}", "ids": ids} for a, ids in groups]
    by_key = {c.key: c for c in caches}
    entries: dict[str, dict[str, dict]] = {ns: {} for ns in previous}
    entries.setdefault(CLUSTER, {})

    def pods_of(digest: str, cache: Cache) -> list[dict]:
        refs = (local.installed.get(digest) or {}).get("refs", [])
        return sorted(({"podNamespace": r["namespace"], "podName": r["name"], "volumeId": r["volume_id"]}
                       for r in refs if uses(r, cache)), key=lambda p: tuple(p.values()))

    def put(cache_key, key: str, entry: dict, cache_digest: str | None = None) -> None:
        history.setdefault(cache_key, set()).add(key)
        if cache_digest is not None:  # an entry for the cache's current digest says which it is
            entry[CACHE_DIGEST] = cache_digest
        entries.setdefault(cache_key[0], {}).setdefault(cache_key[1], {})[key] = entry

    for cache in caches:
        d = cache.digest
        if not d:
            continue  # nothing to report until the controller resolves the tag
        proof = proofs.get(cache.key)
        manifest = local.held(cache, proof)
        pull, message = local.pulls.get(proof, (None, ""))
        failed = local.failed.get(cache.key)
        if manifest is not None:
            inst = local.installed[manifest]
            fits = {i for a, ids in groups if fit.check(inst["targets"], [a]) is None for i in ids}
            mismatch = fit.check(inst["targets"], accelerators)
            pods = pods_of(manifest, cache)
            entry = {"state": "Error" if mismatch is not None else "Running" if pods else "Extracted",
                     "volumeSize": inst["size"], "compatibleGPUs": sorted(fits),
                     "incompatibleGPUs": sorted(i for _, ids in groups for i in ids if i not in fits)}
            if mismatch is not None:
                entry["message"] = f"incompatible: {mismatch}"
            if pods:
                entry["pods"] = pods
            put(cache.key, manifest, entry, d)
        elif pull == QUEUED_PULL:  # a stable message: the queue position would cost a write per move
            put(cache.key, d, {"state": "Downloading", "message": QUEUED}, d)
        elif pull == PULLING:
            put(cache.key, d, {"state": "Downloading"}, d)
        elif pull == FAILED:
            put(cache.key, d, {"state": "Error", "message": message}, d)
        elif failed is not None and failed[0] == d:
            put(cache.key, d, {"state": "Error", "message": failed[1]}, d)
        elif cache.key in wanted_keys:
            put(cache.key, d, {"state": "Pending"}, d)

    # digests a cache used before (its current digest moved on, or the cache was deleted) that
    # pods still hold
    for cache_key, keys in list(history.items()):
        cache = by_key.get(cache_key)
        current = entries.get(cache_key[0], {}).get(cache_key[1], {})
        for key in sorted(keys):
            if key in current:
                continue
            pods = pods_of(key, cache or Cache(cache_key[0], cache_key[1], "", None, {}, False, ()))
            if not pods:
                keys.discard(key)
                continue
            put(cache_key, key, {"state": "Outdated" if cache else "Deleting", "pods": pods,
                                 "volumeSize": local.installed[key]["size"]})
        if not keys:
            del history[cache_key]

    for ns, _ in local.captures:
        entries.setdefault(ns, {})
    out = {}
    for ns, caches_of_ns in entries.items():
        old = (previous.get(ns) or {}).get("caches") or {}
        for name, by_digest in caches_of_ns.items():
            for key, entry in by_digest.items():
                before = dict((old.get(name) or {}).get(key) or {})
                stamp = before.pop("lastUpdated", None)
                entry["lastUpdated"] = stamp if before == entry and stamp else now
        out[ns] = {"nodeName": node, "gpus": gpu_list, "counts": _counts(caches_of_ns, deleting_pods),
                   "caches": caches_of_ns}
        captured = {name: results for (cns, name), results in sorted(local.captures.items()) if cns == ns and ns}
        if captured:
            out[ns]["captures"] = captured
    return out


def _counts(caches: dict, deleting_pods: set) -> dict:
    entries = [e for by_digest in caches.values() for e in by_digest.values()]
    states = {e["state"] for e in entries}
    in_use = any(s in IN_USE for s in states)
    users = [(e["state"], (p["podNamespace"], p["podName"])) for e in entries for p in e.get("pods", ())]

    def pods(state: str) -> int:
        return len({pod for s, pod in users if s == state})

    deleting = {pod for s, pod in users if s == "Deleting" or pod in deleting_pods}
    return {"nodeCnt": 1, "nodeInUseCnt": int(in_use),
            "nodeNotInUseCnt": int(not in_use and "Extracted" in states), "nodeErrorCnt": int("Error" in states),
            "podRunningCnt": pods("Running"), "podOutdatedCnt": pods("Outdated"), "podDeletingCnt": len(deleting)}


def rolled_off(local: Local, caches: list[Cache], seen: set[str]) -> set[str]:
    """Installed digests a cache used to name and none names now, that no volume holds and no
    pull is refreshing: what a roll (or a deleted cache) leaves behind once its last pod is gone.
    ``seen`` holds every installed digest some cache has named (a digest that only a pod's own
    image attribute or the operator's ``accelnode cache pull`` brought is never collected here)."""
    current = {m for c in caches if c.digest for m in (local.manifest_of(c.digest),) if m is not None}
    return {d for d, info in local.installed.items()
            if d in seen and d not in current and not info["refs"] and d not in local.pulling}
