"""The node's cache status in the Kubernetes API: one ``GKMCacheNode`` per (namespace, node) and
one ``ClusterGKMCacheNode`` per node, written by this node's agent only (docs/agent-status.md).

Inputs are kept current without polling the API server (watches, and the agent's local view on
:meth:`Reporter.poke` and every ``resync``); :func:`agent.nodestatus.node_statuses` computes the
wanted status, and an object is written only when that differs from what was last written. The
caches meant for this node are pulled before any pod asks (:class:`~agent.prefetch.Prefetcher`).
Each watch and loop beats a heartbeat; :meth:`Reporter.ready` names a watch not listed yet.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass

from accelnode import volumeattrs
from accelnode.health import GRACE_DEFAULT, Health
from accelnode.kube.client import Client, Config, KubeError, Unreachable, custom_path, is_conflict, is_not_found
from accelnode.kube.reflector import FLEET_JITTER, Reflector
from accelnode.log import kv

from . import core
from .nodestatus import (CLUSTER, FAILED, GROUP, HOSTNAME_LABEL, PULLING, QUEUED_PULL, VERSION, Cache, Local,
                         node_statuses, rolled_off, wanted)
from .prefetch import Prefetcher

log = logging.getLogger("accelnode.agent.status")
WATCH_JITTER = FLEET_JITTER  # each watch lasts 300 to 600 s (accelnode/kube/reflector.py), as client-go's

# A pod's csi.gkm.io inline volume (docs/csi.md): the driver, and the attributes naming its cache
DRIVER, CACHE_ATTR, NAMESPACE_ATTR, IMAGE_ATTR = (volumeattrs.DRIVER, volumeattrs.CACHE, volumeattrs.NAMESPACE,
                                                  volumeattrs.IMAGE)
MAX_POD_CACHES = 16  # caches of one pod whose pulls start when it is bound
MAX_PULLED_FOR = 4096  # pods remembered as having had their pulls started


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

    ``view()`` returns the agent's :class:`Local` view; ``prefetch(cache key, image) -> (ok,
    message)`` pulls one digest-pinned image for a cache, with its credentials (blocking), and
    says whether it is on the node now, proved for that cache; ``proof_of(image, cache key)`` is
    the proof a cache's requests for that image are asked under (None: unknown now).
    ``start_pull(cache key, image)`` starts the pull of a cache's image without waiting (None:
    never): called as soon as the pod watch shows a pod bound to this node with a volume of that
    cache (:meth:`_pod_event`), so the pull runs while kubelet admits the pod and gets to
    NodePublishVolume, which then joins it (docs/agent-store.md, "Speed of a cold pull").
    """

    CONFLICT_ATTEMPTS = 3

    def __init__(self, client: Client, node: str, accelerators, view, prefetch, *, resync: float = 2.0,
                 inspect=None, collect=None, health: Health | None = None, grace: float = GRACE_DEFAULT,
                 prefetch_bound: float = 600.0 + 2 * GRACE_DEFAULT, proof_of=lambda image, cache: None,
                 start_pull=None):
        """``prefetch_bound``: the most seconds one prefetch (inspect and pull) may take before
        the prefetch loop counts as stuck."""
        self.client, self.node, self.accelerators = client, node, list(accelerators)
        self.view, self.resync, self._proof_of = view, resync, proof_of
        self._start_pull = start_pull
        self._pulled_for: set[str] = set()  # uids of pods whose caches' pulls were started (bounded)
        health = health or Health()
        self.grace = grace
        # one reconcile step (the local view, or one object's write with its conflict retries)
        self._step_bound = 2 * self.CONFLICT_ATTEMPTS * client.timeout + grace
        self._beat = health.heartbeat("status writer", grace)
        self.writes = Writes()
        self.retry_in = 0.0  # the current backoff after failed writes (0 while all is well)
        self._stop = threading.Event()
        self._dirty = threading.Event()
        poke = self.poke
        beat = lambda what: health.heartbeat(f"watch {what}", grace)  # noqa: E731
        # one agent per node: its watches end at spread times (docs/scale.md)
        spread = {"on_change": poke, "watch_jitter": WATCH_JITTER}
        self.caches = Reflector(client, custom_path(GROUP, VERSION, "gkmcaches"), trim=_trim_cache,
                                beat=beat("GKMCaches"), **spread)
        self.cluster_caches = Reflector(client, custom_path(GROUP, VERSION, "clustergkmcaches"),
                                        trim=_trim_cache, beat=beat("ClusterGKMCaches"), **spread)
        self.node_obj = Reflector(client, "/api/v1/nodes", name=node, trim=_trim_node, beat=beat("Node"), **spread)
        self.pods = Reflector(client, "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node}"},
                              on_event=self._pod_event, trim=_trim_pod, beat=beat("Pods"), **spread)
        self._reflectors = (self.caches, self.cluster_caches, self.node_obj, self.pods)
        # touched by the reconcile thread only
        self._written: dict[str, _Written] | None = None  # None until read back from the API
        self._history: dict = {}
        self._seen: set[str] = set()  # installed digests some cache has named (candidates after a roll)
        self._collect = collect  # collect(digests) removes rolled-off digests from the store; None: never
        self.prefetcher = Prefetcher(prefetch, self.accelerators, inspect, on_done=poke,
                                     beat=health.heartbeat("prefetch", grace), busy_bound=prefetch_bound,
                                     grace=grace)
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

    def ready(self) -> tuple[bool, str]:
        """Ready once every watch has listed; else which have not."""
        missing = [name for name, r in (("GKMCaches", self.caches), ("ClusterGKMCaches", self.cluster_caches),
                                        ("Node", self.node_obj), ("Pods", self.pods)) if not r.synced.is_set()]
        if missing:
            return False, f"{', '.join(missing)} not read from the API server yet"
        return True, ""

    # -- a pod's caches, pulled when it is bound ----------------------------------------------

    def _pod_event(self, kind: str, pod: dict) -> None:
        """A pod bound to this node that has not started names caches in csi.gkm.io volumes:
        start each one's pull now, as its cache (its credentials, the controller's pin), under
        the rules a publish applies first: a cache the pod's namespace may use
        (:meth:`Cache.admits`) whose signature rule lets it be pulled. Nothing waits here."""
        md = pod.get("metadata") or {}
        uid = md.get("uid", "")
        if kind == "DELETED":
            self._pulled_for.discard(uid)
            return
        if (self._start_pull is None or not pod.get("caches") or not pod.get("pending") or not uid
                or md.get("deletionTimestamp") or uid in self._pulled_for):
            return
        if len(self._pulled_for) >= MAX_PULLED_FOR:  # pods set nodeName themselves; forget, never grow
            self._pulled_for.clear()
        self._pulled_for.add(uid)
        for ns, name in pod["caches"]:
            obj = (self.caches if ns else self.cluster_caches).get(ns or None, name)
            if obj is None:
                continue
            cache = Cache.from_object(obj)
            image = cache.prefetchable()
            if image is None or cache.refused is not None or not cache.admits(md.get("namespace", "")):
                continue
            try:
                self._start_pull(cache.key, image)
            except Exception as e:  # the publish asks again and answers kubelet; this was a head start
                log.info("pull for a bound pod not started", extra=kv(
                    pod=f"{md.get('namespace')}/{md.get('name')}", image=image, error=str(e)))

    # -- reconcile -----------------------------------------------------------------------------

    def _loop(self) -> None:
        self._run_loop()
        self._beat.close()  # stopped on purpose (an exception out of the loop leaves the heartbeat dead)

    def _run_loop(self) -> None:
        while True:
            self._beat.beat(self.resync + self.grace)
            self._dirty.wait(self.resync)
            if self._stop.is_set():
                return
            self._dirty.clear()
            try:
                self._beat.beat(self._step_bound)
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
            self._beat.beat(self.retry_in + self.grace)
            if self._stop.wait(self.retry_in):
                return
            self._dirty.set()

    def reconcile(self) -> None:
        """One pass: compute every object's status and write the ones that changed."""
        if not all(r.synced.is_set() for r in self._reflectors):
            return
        caches = [Cache.from_object(o) for r in (self.caches, self.cluster_caches) for o in r.snapshot()]
        node = next(iter(self.node_obj.snapshot()), {}).get("metadata", {})
        want = [c for c in caches if c.prefetchable() and c.refused is None and wanted(c, node.get("labels", {}))]
        local = self.view()
        if self._written is None:
            self._written = self._read_back({c.namespace for c in caches} | _held_namespaces(local))
        # the proof of each cache whose digest the node has or is pulling (reads pull secrets: at
        # most every 30 s per namespace, accelnode/kube/pullsecrets.py)
        near = local.pulling | {proof[2] for proof in local.pulls}
        proofs = {c.key: self._proof_of(image, c.key) for c in caches if (image := c.pinned()) is not None
                  and (c.digest in near or local.manifest_of(c.digest) is not None)}
        self.prefetcher.want(want, {c.key for c in want if local.held(c, proofs.get(c.key)) is not None})
        local.failed.update(self.prefetcher.failed())
        wanted_keys = {c.key for c in want if self.prefetcher.fits(c)}
        deleting = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in self.pods.snapshot()
                    if p["metadata"].get("deletionTimestamp")}
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        desired = node_statuses(self.node, self.accelerators, caches, local, wanted_keys, self._history, deleting,
                                {ns: w.status for ns, w in self._written.items()}, now, proofs)
        self._collect_rolled_off(caches, local)
        for ns, status in sorted(desired.items()):
            w = self._written.get(ns)
            if w is not None and w.status == status:
                continue
            if w is None and ns != CLUSTER and not status["caches"]:
                continue  # no object for a namespace with nothing to report
            self._write(ns, status, node.get("uid"))
        self.writes.passes += 1

    def _collect_rolled_off(self, caches: list[Cache], local: Local) -> None:
        """A roll's old digest goes from the node once no pod holds it (docs/agent-status.md)."""
        self._seen.update(m for c in caches if c.digest for m in (local.manifest_of(c.digest),) if m is not None)
        self._seen.intersection_update(local.installed)
        garbage = rolled_off(local, caches, self._seen)
        if garbage and self._collect is not None:
            for d in self._collect(garbage):
                log.info("rolled-off cache removed", extra=kv(node=self.node, digest=d))
                self._seen.discard(d)

    # -- API -----------------------------------------------------------------------------------

    def _path(self, ns: str, sub: str | None = None) -> str:
        return custom_path(GROUP, VERSION, _plural(ns), ns or None, self.node, sub)

    def _read_back(self, namespaces: set[str]) -> dict[str, _Written]:
        """What this node wrote before (survives agent restarts: no rewrite when unchanged): one
        GET per object it may have, the ClusterGKMCacheNode and the GKMCacheNode of each of
        ``namespaces`` (those with a GKMCache, and those whose caches this node's volumes hold).
        Never a list of the node kind: every node listing every node's objects costs the API
        server N x N objects at a fleet start (docs/scale.md)."""
        found = {}
        for ns in sorted(namespaces | {CLUSTER}):
            obj = self._get(ns)
            if obj is None:
                continue
            status = obj.get("status") or {}
            found[ns] = _Written(status, obj["metadata"]["resourceVersion"])
            for name, by_digest in (status.get("caches") or {}).items():
                self._history.setdefault((ns, name), set()).update(by_digest)
                self._seen.update(by_digest)  # what this node reported before a restart
        return found

    def _get(self, ns: str) -> dict | None:
        try:
            return self.client.request("GET", self._path(ns))
        except KubeError as e:
            if is_not_found(e):
                return None
            raise

    def _write(self, ns: str, status: dict, node_uid: str | None) -> None:
        """Make the object's status ``status``: a PUT at the version last seen; on a conflict,
        re-read the object and try again only if it still differs (never over a version we
        have not seen)."""
        kind = _kind(ns)
        self._beat.beat(self._step_bound)
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
                if is_conflict(e):
                    self.writes.conflicts += 1
                    current = self._get(ns)
                elif is_not_found(e):
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
            obj = self._get(ns) if is_conflict(e) else None
            if obj is None:
                raise
        return _Written(obj.get("status") or {}, obj["metadata"]["resourceVersion"])


def _held_namespaces(local: Local) -> set[str]:
    """Namespaces of the caches this node's volumes hold (a reference without its cache: the
    pod's namespace), whether or not those caches still exist."""
    return {(r.get("cache") or (r.get("namespace", ""),))[0] for info in local.installed.values()
            for r in info.get("refs") or ()}


def _kind(ns: str) -> str:
    """The kind of the node object of a namespace key (CLUSTER: the cluster-scoped one)."""
    return "GKMCacheNode" if ns else "ClusterGKMCacheNode"


def _plural(ns: str) -> str:
    return _kind(ns).lower() + "s"


def _trim_cache(obj: dict) -> dict:
    """What the agent keeps of a cache object: what :meth:`Cache.from_object` reads, no more. Its
    pod template's other fields (``affinity`` preserves unknown fields: 1.5 MiB of ``{}`` would
    be 35 MB on every node, per object) are not kept."""
    md = obj.get("metadata") or {}
    st = obj.get("status") or {}
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    tmpl = spec.get("podTemplate") if isinstance(spec.get("podTemplate"), dict) else {}
    pod = tmpl.get("spec") if isinstance(tmpl.get("spec"), dict) else {}
    kept = {k: spec[k] for k in ("image", "workloadNamespaces") if k in spec}
    if "nodeSelector" in pod:
        kept["podTemplate"] = {"spec": {"nodeSelector": pod["nodeSelector"]}}
    return {"metadata": {k: md[k] for k in ("name", "namespace", "annotations", "labels") if k in md},
            "spec": kept, "status": {"resolvedDigest": st.get("resolvedDigest"),
                                     "verification": st.get("verification"),
                                                      "conditions": [c for c in st.get("conditions") or ()
                                                                     if isinstance(c, dict) and c.get("type") == "Verified"]}}


def _trim_node(obj: dict) -> dict:
    md = obj.get("metadata") or {}
    return {"metadata": {"name": md.get("name"), "uid": md.get("uid"), "labels": md.get("labels") or {}}}


def _trim_pod(obj: dict) -> dict:
    """A pod's names, whether it has not started yet, and the caches its csi.gkm.io volumes name
    ((namespace, name); namespace "" for a ClusterGKMCache; at most MAX_POD_CACHES). A volume
    naming its image itself (``csi.gkm.io/image``) is left to the publish: it is pulled
    anonymously, with no cache's credentials."""
    md = obj.get("metadata") or {}
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    caches = []
    for vol in spec.get("volumes") or ():
        csi = vol.get("csi") if isinstance(vol, dict) else None
        attrs = csi.get("volumeAttributes") if isinstance(csi, dict) and csi.get("driver") == DRIVER else None
        if not isinstance(attrs, dict) or IMAGE_ATTR in attrs or not isinstance(attrs.get(CACHE_ATTR), str):
            continue
        ns = attrs.get(NAMESPACE_ATTR)
        key = (ns if isinstance(ns, str) else "", attrs[CACHE_ATTR])
        if key not in caches and len(caches) < MAX_POD_CACHES:
            caches.append(key)
    phase = (obj.get("status") or {}).get("phase") if isinstance(obj.get("status"), dict) else None
    return {"metadata": {k: md[k] for k in ("name", "namespace", "uid", "deletionTimestamp") if k in md},
            "pending": phase in (None, "", "Pending"), "caches": caches}


# ---------------------------------------------------------------------------------------------
# the agent core as the reporter sees it


def local_view(agent: core.Agent, capturer=None) -> Local:
    """The reporter's input from the in-process agent core (and its capturer)."""
    installed, pulling, pulls = {}, set(), {}
    proven = agent.proven()
    for c in agent.caches():
        if c.state == core.INSTALLED:
            installed[c.digest] = {"image": c.image, "size": c.size_bytes, "targets": list(c.targets),
                                   "refs": [{"volume_id": m.get("volume_id", ""), "namespace": m.get("namespace", ""),
                                             "name": m.get("name", ""), "uid": m.get("uid", ""),
                                             "cache": (m["cache"]["namespace"], m["cache"]["name"]) if "cache" in m
                                             else None} for m in c.references]}
        elif c.state == core.PULLING:
            pulling.add(c.digest)
            pulls[c.proof] = (QUEUED_PULL if c.queued else PULLING, "")
        elif c.state == core.FAILED:
            pulls[c.proof] = (FAILED, c.message)
    return Local(installed, pulling, proven, pulls, captures=capturer.results() if capturer is not None else {})


def for_agent(agent: core.Agent, node: str, kubeconfig: str | None, *, resync: float,
              pull_timeout: float = 600.0, health: Health | None = None, capturer=None) -> Reporter:
    """A reporter over the in-process agent core, talking to the API server of ``kubeconfig``
    (when None: as kubectl finds it, the pod's service account last). Raises ValueError/OSError on bad configuration."""
    config = Config.load(kubeconfig)
    return Reporter(Client(config), node, agent.accelerators, lambda: local_view(agent, capturer),
                    lambda cache, image: agent.ensure_until_done(image, pull_timeout, cache=cache), resync=resync,
                    inspect=lambda cache, image: agent.inspect(image, cache),
                    collect=agent.collect, health=health, prefetch_bound=pull_timeout + 2 * GRACE_DEFAULT,
                    proof_of=agent.proof_of,
                    start_pull=lambda cache, image: agent.ensure(image, 0, cache=cache))  # 0: do not wait
