"""The node's cache status in the Kubernetes API: one ``GKMCacheNode`` per (namespace, node) and
one ``ClusterGKMCacheNode`` per node, written by this node's agent only (docs/agent-status.md).

Inputs, all kept current without polling the API server:

* the ``GKMCache``/``ClusterGKMCache`` objects (watched: they are few), this node's ``Node``
  (labels, for prefetch node selectors) and the pods on this node (``spec.nodeName``), each a
  :class:`~agent.kube.Reflector`;
* the agent's own view - installed digests, pulls in progress or failed, the CSI references -
  read from the agent service (local, cheap) whenever :meth:`Reporter.poke` is called and every
  ``resync`` seconds.

:func:`node_statuses` turns them into the wanted status of each object; the reporter writes an
object only when its wanted status differs from what it last wrote (one ``PUT .../status`` per
change, plus a ``POST`` the first time an object is needed). Caches this node should hold are
pulled before any pod asks (:class:`Prefetcher`).
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from accelnode.log import kv

from . import compat
from .kube import Client, KubeError, Reflector, Unreachable, custom_path
from .registry import Reference

log = logging.getLogger("accelnode.agent.status")

GROUP, VERSION = "gkm.io", "v1alpha1"
HOSTNAME_LABEL = "kubernetes.io/hostname"
PREFETCH_ANNOTATION = "accelnode.io/prefetch"  # "true": pull on every node the cache fits
IN_USE = ("Running", "Outdated", "Deleting")
CLUSTER = ""  # the namespace key of the ClusterGKMCacheNode


# ---------------------------------------------------------------------------------------------
# inputs


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

    @classmethod
    def from_object(cls, obj: dict) -> "Cache":
        md, spec, st = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
        image = spec.get("image", "")
        digest = st.get("resolvedDigest") or (image.rsplit("@", 1)[1] if "@" in image else None)
        tmpl = ((spec.get("podTemplate") or {}).get("spec") or {})
        return cls(md.get("namespace", CLUSTER), md.get("name", ""), image, digest,
                   dict(tmpl.get("nodeSelector") or {}),
                   (md.get("annotations") or {}).get(PREFETCH_ANNOTATION, "").lower() == "true",
                   tuple(spec.get("workloadNamespaces") or ()))

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

    def admits(self, pod_namespace: str) -> bool:
        """Whether a pod of that namespace may use this cache (and so counts as its user)."""
        if self.namespace:
            return pod_namespace == self.namespace
        return not self.workload_namespaces or pod_namespace in self.workload_namespaces


@dataclass(frozen=True)
class Local:
    """The agent's own view of the node: what is installed, pulling, failed, and who uses what."""

    # manifest digest -> {"image", "size", "targets", "refs": [{"volume_id", "namespace", "name", "uid", "cache"}]}
    # where a ref's "cache" is the (namespace, name) key of the cache its volume names, or None
    # for references taken before the CSI driver said so
    installed: dict
    pulling: set  # reference digests being pulled
    failed: dict  # reference digest -> message of the last failed pull or prefetch

    def manifest_of(self, digest: str) -> str | None:
        """The installed manifest digest for a cache digest (itself, or the manifest an index
        resolved to on this node), or None when it is not installed."""
        return next((m for m, i in self.installed.items() if m == digest or i["image"].endswith("@" + digest)), None)


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
                  history: dict, deleting_pods: set, previous: dict, now: str) -> dict[str, dict]:
    """The status of every node object: namespace (CLUSTER for the ClusterGKMCacheNode) ->
    status. ``history`` (cache key -> status keys reported for it) is updated in place.
    ``previous`` (namespace -> status last written) only lends ``lastUpdated`` to entries whose
    content did not change, and keeps an emptied object listed (with no caches)."""
    groups = gpus(accelerators)
    gpu_list = [{"gpuType": f"{a.backend}/{a.arch or 'unknown'}", "ids": ids} for a, ids in groups]
    by_key = {c.key: c for c in caches}
    entries: dict[str, dict[str, dict]] = {ns: {} for ns in previous}
    entries.setdefault(CLUSTER, {})

    def pods_of(digest: str, cache: Cache) -> list[dict]:
        refs = (local.installed.get(digest) or {}).get("refs", [])
        return sorted(({"podNamespace": r["namespace"], "podName": r["name"], "volumeId": r["volume_id"]}
                       for r in refs if uses(r, cache)), key=lambda p: tuple(p.values()))

    def put(cache_key, key: str, entry: dict) -> None:
        history.setdefault(cache_key, set()).add(key)
        entries.setdefault(cache_key[0], {}).setdefault(cache_key[1], {})[key] = entry

    for cache in caches:
        d = cache.digest
        if not d:
            continue  # nothing to report until the controller resolves the tag
        manifest = local.manifest_of(d)
        if manifest is not None:
            inst = local.installed[manifest]
            fits = {i for a, ids in groups if compat.check(inst["targets"], [a]) is None for i in ids}
            mismatch = compat.check(inst["targets"], accelerators)
            pods = pods_of(manifest, cache)
            entry = {"state": "Error" if mismatch is not None else "Running" if pods else "Extracted",
                     "volumeSize": inst["size"], "compatibleGPUs": sorted(fits),
                     "incompatibleGPUs": sorted(i for _, ids in groups for i in ids if i not in fits)}
            if mismatch is not None:
                entry["message"] = f"incompatible: {mismatch}"
            if pods:
                entry["pods"] = pods
            put(cache.key, manifest, entry)
        elif d in local.pulling:
            put(cache.key, d, {"state": "Downloading"})
        elif d in local.failed:
            put(cache.key, d, {"state": "Error", "message": local.failed[d]})
        elif cache.key in wanted_keys:
            put(cache.key, d, {"state": "Pending"})

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


# ---------------------------------------------------------------------------------------------
# the reporter


@dataclass
class Writes:
    """What the reporter did to the API (also exported as metrics by the CLI)."""

    passes: int = 0  # reconcile passes completed (writing or not)
    creates: int = 0
    updates: int = 0
    conflicts: int = 0
    failures: int = 0


@dataclass
class _Written:
    status: dict
    resource_version: str | None


class Reporter:
    """Keeps this node's GKMCacheNode/ClusterGKMCacheNode objects equal to the node's state.

    ``view()`` returns the agent's :class:`Local` view; ``prefetch(image) -> (ok, message)``
    pulls one digest-pinned image (blocking) and says whether it is on the node now.
    """

    CONFLICT_ATTEMPTS = 3

    def __init__(self, client: Client, node: str, accelerators, view, prefetch, *, resync: float = 2.0,
                 inspect=None):
        self.client, self.node, self.accelerators = client, node, list(accelerators)
        self.view, self.resync = view, resync
        self.writes = Writes()
        self.retry_in = 0.0  # the current backoff after failed writes (0 while all is well)
        self._stop = threading.Event()
        self._dirty = threading.Event()
        poke = self.poke
        self.caches = Reflector(client, custom_path(GROUP, VERSION, "gkmcaches"), on_change=poke, keep=_trim_cache)
        self.cluster_caches = Reflector(client, custom_path(GROUP, VERSION, "clustergkmcaches"), on_change=poke,
                                        keep=_trim_cache)
        self.node_obj = Reflector(client, "/api/v1/nodes", name=node, on_change=poke, keep=_trim_node)
        self.pods = Reflector(client, "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node}"}, on_change=poke,
                              keep=_trim_pod)
        self._reflectors = (self.caches, self.cluster_caches, self.node_obj, self.pods)
        # touched by the reconcile thread only
        self._written: dict[str, _Written] | None = None  # None until read back from the API
        self._history: dict = {}
        self.prefetcher = Prefetcher(prefetch, self.accelerators, inspect, on_done=poke)
        self._threads: list[threading.Thread] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "Reporter":
        for r in self._reflectors:
            self._spawn(r.run, self._stop)
        self._spawn(self._loop)
        self._spawn(self.prefetcher.run, self._stop)
        log.info("status reporter started", extra=kv(node=self.node))
        return self

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, name=f"status-{len(self._threads)}", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop watching and writing; waits at most ``timeout`` seconds in all (a prefetch in
        flight is left to finish on its own)."""
        self._stop.set()
        self._dirty.set()
        self.prefetcher.wake()
        for r in self._reflectors:
            r.interrupt()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    def poke(self) -> None:
        """Something may have changed: reconcile soon."""
        self._dirty.set()

    # -- reconcile -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self._dirty.wait(self.resync)
            if self._stop.is_set():
                return
            self._dirty.clear()
            try:
                self.reconcile()
                self.retry_in = 0.0
                continue
            except (KubeError, Unreachable, OSError) as e:
                self.writes.failures += 1
                self.retry_in = min(30.0, max(0.5, self.retry_in * 2))
                log.warning("status write failed, retrying", extra=kv(node=self.node, error=str(e),
                                                                      retry_in=self.retry_in))
            except Exception:  # a bug must not stop the agent's other duties; keep trying
                log.exception("status reconcile failed", extra=kv(node=self.node))
                self.retry_in = 30.0
            # back off: cues that come meanwhile wait (they are folded into the retry)
            if self._stop.wait(self.retry_in):
                return
            self._dirty.set()

    def reconcile(self) -> None:
        """One pass: compute every object's status and write the ones that changed."""
        if not all(r.synced.is_set() for r in self._reflectors):
            return
        if self._written is None:
            self._written = self._read_back()
        caches = [Cache.from_object(o) for r in (self.caches, self.cluster_caches) for o in r.snapshot()]
        node = next(iter(self.node_obj.snapshot()), {}).get("metadata", {})
        want = [c for c in caches if c.digest and wanted(c, node.get("labels", {}))]
        local = self.view()
        self.prefetcher.want(want, local)
        local.failed.update(self.prefetcher.failed())
        wanted_keys = {c.key for c in want if self.prefetcher.fits(c)}
        deleting = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in self.pods.snapshot()
                    if p["metadata"].get("deletionTimestamp")}
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        desired = node_statuses(self.node, self.accelerators, caches, local, wanted_keys, self._history, deleting,
                                {ns: w.status for ns, w in self._written.items()}, now)
        for ns, status in sorted(desired.items()):
            w = self._written.get(ns)
            if w is not None and w.status == status:
                continue
            if w is None and ns != CLUSTER and not status["caches"]:
                continue  # no object for a namespace with nothing to report
            self._write(ns, status, node.get("uid"))
        self.writes.passes += 1

    # -- API -----------------------------------------------------------------------------------

    def _path(self, ns: str, sub: str | None = None) -> str:
        return custom_path(GROUP, VERSION, _plural(ns), ns or None, self.node, sub)

    def _read_back(self) -> dict[str, _Written]:
        """What this node wrote before (survives agent restarts: no rewrite when unchanged)."""
        found = {}
        sel = {"labelSelector": f"{HOSTNAME_LABEL}={self.node}"}
        items = self.client.request("GET", custom_path(GROUP, VERSION, "gkmcachenodes"), query=sel).get("items") or []
        cluster_obj = self._get(CLUSTER)
        for obj in items + ([cluster_obj] if cluster_obj else []):
            md = obj["metadata"]
            if md["name"] != self.node:
                continue
            ns = md.get("namespace", CLUSTER)
            status = obj.get("status") or {}
            found[ns] = _Written(status, md["resourceVersion"])
            for name, by_digest in (status.get("caches") or {}).items():
                self._history.setdefault((ns, name), set()).update(by_digest)
        return found

    def _get(self, ns: str) -> dict | None:
        try:
            return self.client.request("GET", self._path(ns))
        except KubeError as e:
            if e.code == 404:
                return None
            raise

    def _write(self, ns: str, status: dict, node_uid: str | None) -> None:
        """Make the object's status ``status``: a PUT at the version last seen; on a conflict,
        re-read the object and try again only if it still differs (never over a version we
        have not seen)."""
        kind = _kind(ns)
        for _ in range(self.CONFLICT_ATTEMPTS):
            w = self._written.get(ns)
            if w is None:
                w = self._written[ns] = self._create(ns, node_uid)
            if w.status == status:
                return
            body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "status": status,
                    "metadata": {"name": self.node, "resourceVersion": w.resource_version,
                                 **({"namespace": ns} if ns else {})}}
            try:
                obj = self.client.request("PUT", self._path(ns, "status"), body=body)
            except KubeError as e:
                if e.code == 409:
                    self.writes.conflicts += 1
                    current = self._get(ns)
                elif e.code == 404:
                    current = None
                else:
                    raise
                if current is None:  # deleted under us (its node's garbage collection?): create it again
                    del self._written[ns]
                else:
                    self._written[ns] = _Written(current.get("status") or {}, current["metadata"]["resourceVersion"])
                continue
            self.writes.updates += 1
            self._written[ns] = _Written(status, obj["metadata"]["resourceVersion"])
            log.info("node status written", extra=kv(kind=kind, namespace=ns or None, node=self.node,
                                                     caches=sorted(status["caches"]), counts=status["counts"]))
            return
        raise KubeError(409, "Conflict", f"{kind} {self.node}: still changing under us after "
                                         f"{self.CONFLICT_ATTEMPTS} attempts")

    def _create(self, ns: str, node_uid: str | None) -> _Written:
        """Create the object (owned by the Node, so it goes when the node goes); an object that
        exists already is taken as it is."""
        md = {"name": self.node, "labels": {HOSTNAME_LABEL: self.node}}
        if node_uid:
            md["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node_uid}]
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": _kind(ns), "metadata": md}
        try:
            obj = self.client.request("POST", custom_path(GROUP, VERSION, _plural(ns), ns or None), body=body)
            self.writes.creates += 1
        except KubeError as e:
            obj = self._get(ns) if e.code == 409 else None
            if obj is None:
                raise
        return _Written(obj.get("status") or {}, obj["metadata"]["resourceVersion"])


def _kind(ns: str) -> str:
    """The kind of the node object of a namespace key (CLUSTER: the cluster-scoped one)."""
    return "GKMCacheNode" if ns else "ClusterGKMCacheNode"


def _plural(ns: str) -> str:
    return _kind(ns).lower() + "s"


def _trim_cache(obj: dict) -> dict:
    md = obj.get("metadata") or {}
    return {"metadata": {k: md[k] for k in ("name", "namespace", "annotations") if k in md},
            "spec": obj.get("spec") or {}, "status": {"resolvedDigest": (obj.get("status") or {}).get("resolvedDigest")}}


def _trim_node(obj: dict) -> dict:
    md = obj.get("metadata") or {}
    return {"metadata": {"name": md.get("name"), "uid": md.get("uid"), "labels": md.get("labels") or {}}}


def _trim_pod(obj: dict) -> dict:
    md = obj.get("metadata") or {}
    return {"metadata": {k: md[k] for k in ("name", "namespace", "uid", "deletionTimestamp") if k in md}}


# ---------------------------------------------------------------------------------------------
# the agent service as the reporter sees it


class ServiceView:
    """The reporter's inputs from the in-process agent service (its public gRPC methods)."""

    def __init__(self, service, store, *, pull_timeout: float = 600.0):
        from . import service as svc_module

        self._pb = svc_module.pb
        self.service, self.store, self.pull_timeout = service, store, pull_timeout
        self._targets: dict[str, list] = {}  # digest -> image targets (installed content never changes)

    def __call__(self) -> Local:
        listing = self.service.ListCaches(self._pb.ListCachesRequest(), None)
        installed, pulling, failed = {}, set(), {}
        for c in listing.caches:
            if c.state == c.INSTALLED:
                if c.digest not in self._targets:
                    inst = self.store.installed(c.digest)
                    self._targets[c.digest] = inst.targets if inst else []
                installed[c.digest] = {"image": c.image, "size": c.size_bytes, "targets": self._targets[c.digest],
                                       "refs": [{"volume_id": r.volume_id, "namespace": r.pod.namespace,
                                                 "name": r.pod.name, "uid": r.pod.uid,
                                                 "cache": (r.cache.namespace, r.cache.name) if r.HasField("cache")
                                                 else None} for r in c.references]}
            elif c.state == c.PULLING:
                pulling.add(c.digest)
            elif c.state == c.FAILED:
                failed[c.digest] = c.message
        return Local(installed, pulling, failed)

    def pull(self, image: str) -> tuple[bool, str]:
        """EnsureCache until the pull is over: (installed and fits, why not)."""
        ensure = self._pb.EnsureCacheResponse
        deadline = time.monotonic() + self.pull_timeout
        while True:
            answer = self.service.EnsureCache(self._pb.EnsureCacheRequest(image=image, wait_seconds=30), None)
            if answer.state != ensure.PULLING:
                return answer.state == ensure.READY, answer.message
            if time.monotonic() > deadline:
                return False, f"{image}: pull still running after {self.pull_timeout:.0f}s"


def for_service(service, store, node: str, kubeconfig: str | None, *, resync: float) -> Reporter:
    """A reporter over the in-process agent service, talking to the API server of
    ``kubeconfig`` (the pod's service account when None). Raises ValueError/OSError on bad
    configuration."""
    from .kube import Config
    from .store import inspect

    config = Config.from_kubeconfig(kubeconfig) if kubeconfig else Config.in_cluster()
    view = ServiceView(service, store)
    return Reporter(Client(config), node, service.accelerators, view, view.pull, resync=resync,
                    inspect=lambda image: inspect(image, store.options))


# ---------------------------------------------------------------------------------------------
# prefetch


@dataclass
class _Outcome:
    fits: bool = True
    failed: str | None = None
    at: float = field(default_factory=time.monotonic)


class Prefetcher:
    """Pulls the caches this node should hold, one at a time, before any pod asks.

    A cache wanted by node selector is pulled as is (a misfit then shows as Error). One wanted
    only through the prefetch annotation is first inspected (manifests and config, no layers)
    and pulled only if it fits this node's accelerators. A failed pull is retried after
    ``retry`` seconds.
    """

    def __init__(self, pull, accelerators, inspect, *, on_done, retry: float = 60.0):
        self._pull, self._inspect, self._on_done = pull, inspect, on_done
        self.accelerators, self.retry = accelerators, retry
        self._queue: queue.Queue = queue.Queue()
        self._outcomes: dict[str, _Outcome] = {}  # pinned image -> last outcome
        self._queued: set[str] = set()
        self._lock = threading.Lock()

    def want(self, caches: list[Cache], local: Local) -> None:
        """Queue what should be on the node and is not: never tried, failed more than ``retry``
        seconds ago, or pulled before and removed since (``accelnode cache gc``)."""
        now = time.monotonic()
        with self._lock:
            for c in caches:
                image = c.pinned()
                if image is None or image in self._queued:
                    continue
                done = self._outcomes.get(image)
                if done is not None:
                    if done.failed is not None and now - done.at < self.retry:
                        continue
                    if done.failed is None and (not done.fits or local.manifest_of(c.digest) is not None):
                        continue
                self._queued.add(image)
                self._queue.put((image, not c.node_selector))

    def outcome(self, image: str) -> _Outcome | None:
        """How the last prefetch of a pinned image ended (None: not tried yet)."""
        with self._lock:
            return self._outcomes.get(image)

    def fits(self, cache: Cache) -> bool:
        """Known to fit (a node-selector cache is taken to fit until its pull says otherwise)."""
        done = self.outcome(cache.pinned())
        return done.fits if done is not None else bool(cache.node_selector)

    def failed(self) -> dict[str, str]:
        with self._lock:
            return {img.rsplit("@", 1)[1]: o.failed for img, o in self._outcomes.items() if o.failed}

    def wake(self) -> None:
        self._queue.put(None)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            item = self._queue.get()
            if item is None:
                continue
            image, check_fit = item
            outcome = _Outcome()
            try:
                if check_fit and self._inspect is not None:
                    info = self._inspect(image)
                    outcome.fits = any(compat.check(m["targets"], self.accelerators) is None for m in info["manifests"])
                if outcome.fits:
                    ok, message = self._pull(image)
                    outcome.failed = None if ok else message
            except Exception as e:  # registry down, bad image...: report it, retry later
                outcome.failed = str(e)
            log.log(logging.WARNING if outcome.failed else logging.INFO, "prefetch done",
                    extra=kv(image=image, fits=outcome.fits, error=outcome.failed))
            with self._lock:
                outcome.at = time.monotonic()
                self._outcomes[image] = outcome
                self._queued.discard(image)
            self._on_done()
