"""The node's side of capture (docs/capture.md): a pod's writable layer becomes a contribution.

:meth:`Capturer.capture` runs inside the driver's unpublish, after the pod's overlay is unmounted
(nothing writes the layer any more) and before its tmpfs goes: it reads the layer as hostile
input (:mod:`accelnode.capture.reader`: no symlink followed, no device, set-uid, hard link, and
bounded; two layers at once), keeps the valid entries of the cache's kind that the installed base lacks, and builds
their deterministic layer. One background thread pushes queued layers, each under the push
credentials its namespace lent (never the node's, never another namespace's), to the repository
the cache names; the result is kept for the node's status (``GKMCacheNode`` ``status.captures``),
whence the controller takes it. Bounded: ``max_queued`` layers wait (a full queue drops the new
one and says so), ``keep`` results per cache are reported.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from accelnode.capture import layer, publish
from accelnode.capture.errors import Poisoned
from accelnode.capture.reader import CaptureLimits
from accelnode.log import kv
from accelnode.oci import cacheformat as fmt
from accelnode.oci.errors import ImageError
from accelnode.oci.registry import RegistryOptions

log = logging.getLogger("accelnode.agent.capture")

QUEUED, NOTHING, REFUSED, BUSY = "QUEUED", "NOTHING", "REFUSED", "BUSY"
PUSHED, FAILED = "Pushed", "Failed"  # states of a result in the node's status (and Refused)
MAX_CACHES = 1024  # caches whose results are kept


@dataclass(frozen=True)
class Answer:
    state: str
    message: str = ""
    entries: int = 0
    layer_digest: str = ""


@dataclass
class _Job:
    cache: tuple[str, str]
    base: str
    lay: layer.Layer
    entries: int
    pod: dict
    repository: str
    push_secret: str
    time: str


READ_WAIT = 30.0  # seconds a view waits for the reader (one at a time: memory, see Capturer)


class Capturer:
    """``store``: the agent's :class:`~agent.store.CacheStore`; ``push_options(namespace,
    secret)``: the registry options carrying that namespace's lent push secret (raising when it
    cannot be read); ``on_change``: called when a result is recorded (the status reporter's poke)."""

    def __init__(self, store, push_options: Callable[[str, str], RegistryOptions], *,
                 limits: CaptureLimits = CaptureLimits(), max_queued: int = 8, keep: int = 16, readers: int = 1,
                 max_queued_bytes: int | None = None):
        self.store, self.push_options, self.limits, self.keep = store, push_options, limits, keep
        # The agent's memory, not the number of pods, bounds what capture holds: a layer being read
        # holds up to limits.max_bytes of content (and its tar and gzip while built), and the layers
        # waiting for their push (the one being pushed among them) at most max_queued_bytes of blobs
        # together. With the defaults (32 MiB; one reader) that is ~130 MiB at worst, inside the agent
        # container's 256Mi beside its ~70 MB at rest (daemonsets/csi-driver.yaml).
        self._readers = threading.BoundedSemaphore(readers)
        self.max_queued_bytes = limits.max_bytes if max_queued_bytes is None else max_queued_bytes
        self._queued_bytes = 0
        self.on_change: Callable[[], None] = lambda: None
        self._queue: queue.Queue[_Job | None] = queue.Queue(max_queued)
        self._lock = threading.Lock()
        self._results: collections.OrderedDict[tuple[str, str], collections.deque] = collections.OrderedDict()
        self._thread: threading.Thread | None = None

    def start(self) -> Capturer:
        self._thread = threading.Thread(target=self._pusher, name="capture-push", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)

    def capture(self, upper: str, digest: str, cache: tuple[str, str], pod: dict, repository: str,
                push_secret: str) -> Answer:
        namespace, name = cache
        if not namespace:
            return Answer(REFUSED, "capture is done for a GKMCache only (a ClusterGKMCache is shared by tenants)")
        inst = self.store.installed(digest)
        if inst is None or inst.kind not in fmt.KINDS:
            return Answer(REFUSED, f"the base cache {digest} is not installed on this node (or has no kind)")
        pod_path = inst.labels.get(fmt.POD_PATH_LABEL) or f"/cache/{fmt.CACHE_DIR[inst.kind]}"
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if not self._readers.acquire(timeout=READ_WAIT):  # the CSI driver's call waits up to 120 s
            return Answer(BUSY, f"other views were being read for {READ_WAIT:.0f} s; this layer is dropped")
        try:
            lay, sel = layer.contribute(upper, inst.kind, pod_path, inst.path, self.limits)
        except Poisoned as e:
            self._record(cache, {"state": "Refused", "message": str(e)[:1000], "time": now, "base": digest, **_pod(pod)})
            log.warning("capture refused", extra=kv(cache=f"{namespace}/{name}", pod=_pod(pod), reason=str(e)))
            return Answer(REFUSED, str(e))
        finally:
            self._readers.release()
        if lay is None:
            return Answer(NOTHING, f"no new valid entry (dropped: {sel.dropped or 'none'})")
        size = len(lay.blob)
        with self._lock:
            if self._queued_bytes + size > self.max_queued_bytes:
                return Answer(BUSY, f"layers waiting for their push hold {self._queued_bytes} bytes; this one "
                                    f"({size}) would pass {self.max_queued_bytes}: dropped")
            try:
                self._queue.put_nowait(_Job(cache, digest, lay, len(sel.keys), pod, repository, push_secret, now))
            except queue.Full:
                return Answer(BUSY, f"the push queue is full ({self._queue.maxsize} layers wait); this layer is dropped")
            self._queued_bytes += size
        log.info("capture queued", extra=kv(cache=f"{namespace}/{name}", pod=_pod(pod), entries=len(sel.keys),
                                            layer=lay.digest, dropped=sel.dropped))
        return Answer(QUEUED, "", len(sel.keys), lay.digest)

    def _pusher(self) -> None:
        while (job := self._queue.get()) is not None:
            result = {"time": job.time, "base": job.base, "entries": job.entries, "layer": job.lay.digest,
                      **_pod(job.pod)}
            try:
                opts = self.push_options(job.cache[0], job.push_secret)
                result |= {"state": PUSHED, "contribution": publish.push_contribution(job.lay, job.repository, opts)}
            except (ImageError, OSError, ValueError) as e:
                result |= {"state": FAILED, "message": str(e)[:1000]}
            except Exception as e:  # the thread must live on: a failure is reported, not fatal
                log.exception("capture push failed")
                result |= {"state": FAILED, "message": f"{type(e).__name__}: {str(e)[:1000]}"}
            cache, size = job.cache, len(job.lay.blob)
            del job  # the blob goes now, not when the next job arrives
            with self._lock:
                self._queued_bytes -= size
            self._record(cache, result)

    def _record(self, cache: tuple[str, str], result: dict) -> None:
        with self._lock:
            q = self._results.get(cache)
            if q is None:
                q = self._results[cache] = collections.deque(maxlen=self.keep)
                while len(self._results) > MAX_CACHES:
                    self._results.popitem(last=False)
            q.append(result)
        self.on_change()

    def results(self) -> dict[tuple[str, str], list[dict]]:
        """(namespace, name) -> the latest results, oldest first (what the node's status shows)."""
        with self._lock:
            return {k: [dict(r) for r in v] for k, v in self._results.items()}


def _pod(pod: dict) -> dict:
    return {"podNamespace": pod.get("namespace", ""), "podName": pod.get("name", "")}

