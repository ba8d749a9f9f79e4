"""The agent's gRPC service (``proto/agent.proto``) over the node's cache store.

* EnsureCache answers from what is installed when it can. Otherwise it starts one background
  pull per reference digest (later callers join it) and waits at most ``wait_seconds`` for it,
  answering PULLING when the pull is still running. A failed pull is reported to everyone who
  waited on it; the next EnsureCache starts a fresh one.
* References are the store's durable references, so they survive restarts of the agent and of
  the CSI driver. A volume id holds one digest at one target path; asking again with other
  values is ALREADY_EXISTS, and asking for an exclusive volume at a second target path is
  FAILED_PRECONDITION (:func:`_refusal`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from accelnode.log import kv
from accelnode.pb import agent_pb2 as pb
from accelnode.pb import agent_pb2_grpc as pb_grpc

from . import compat, errors
from .accelerators import Accelerator

log = logging.getLogger("accelnode.agent")

DIGEST_PINNED = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
Ensure = pb.EnsureCacheResponse

FAILURES = [
    (errors.ImageNotFound, Ensure.NOT_FOUND),
    (errors.RegistryUnavailable, Ensure.REGISTRY_UNAVAILABLE),
    (errors.AuthError, Ensure.DENIED),
    (errors.InvalidReference, Ensure.INVALID_REFERENCE),
    ((errors.IntegrityError, errors.HostileContent), Ensure.BAD_CONTENT),
]


@dataclass
class Pull:
    """One background pull of one reference digest."""

    image: str
    started: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    response: Ensure | None = None  # set when done


class Metrics:
    def __init__(self, registry: CollectorRegistry):
        self.pulls = Counter("accelnode_agent_pulls", "Pulls started, by result", ["result"], registry=registry)
        self.pull_seconds = Histogram("accelnode_agent_pull_seconds", "Duration of pulls", registry=registry,
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
        self.ensure = Counter("accelnode_agent_ensure", "EnsureCache answers, by state", ["state"],
                              registry=registry)
        self.references = Gauge("accelnode_agent_references", "Volumes holding a cache", registry=registry)


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, store, accelerators: list[Accelerator], metrics: Metrics):
        self.store = store
        self.accelerators = accelerators
        self.metrics = metrics
        self._targets = [a.target() for a in accelerators if a.arch]
        self._lock = threading.Lock()
        self._ready: dict[str, Ensure] = {}  # reference digest -> READY/INCOMPATIBLE answer
        self._pulls: dict[str, Pull] = {}  # reference digest -> latest pull
        # The store's durable references, mirrored: the agent is their only writer.
        self._refs: dict[str, dict] = store.references()
        metrics.references.set(len(self._refs))
        # Called after a pull starts or ends and after a reference is taken or dropped: the
        # status reporter's cue to look again (agent/status.py).
        self.on_change: Callable[[], None] = lambda: None

    # -- EnsureCache ---------------------------------------------------------------------

    def EnsureCache(self, request, context):  # noqa: N802 (gRPC naming)
        image = request.image
        if not image:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "image is required")
        if not DIGEST_PINNED.match(image):
            return self._answer(Ensure(state=Ensure.FAILED, failure=Ensure.INVALID_REFERENCE,
                                       message=f"{image}: not a digest-pinned reference (…@sha256:<64 hex>)"))
        key = image.rsplit("@", 1)[1]
        answer = self._ready.get(key)
        if answer is None or (answer.path and not os.path.isdir(answer.path)):  # gone: removed by gc
            answer = self._from_store(key)
        if answer is None:
            pull = self._pull(key, image)
            if pull.done.wait(max(0.0, request.wait_seconds)):
                answer = pull.response
            else:
                answer = Ensure(state=Ensure.PULLING, digest=key,
                                message=f"{image}: pull in progress for {time.monotonic() - pull.started:.1f}s")
        return self._answer(answer)

    def _answer(self, answer: Ensure) -> Ensure:
        self.metrics.ensure.labels(Ensure.State.Name(answer.state)).inc()
        return answer

    def _from_store(self, key: str) -> Ensure | None:
        inst = self.store.installed(key)
        if inst is None:
            return None
        answer = self._judge(inst)
        self._ready[key] = answer
        return answer

    def _judge(self, inst) -> Ensure:
        mismatch = compat.check(inst.targets, self.accelerators)
        if mismatch:
            return Ensure(state=Ensure.INCOMPATIBLE, digest=inst.digest, expected=mismatch.expected,
                          found=mismatch.found, message=f"{inst.image}: {mismatch}")
        return Ensure(state=Ensure.READY, digest=inst.digest, path=str(inst.path), size_bytes=inst.size_bytes)

    def _pull(self, key: str, image: str) -> Pull:
        with self._lock:
            pull = self._pulls.get(key)
            if pull is None or pull.done.is_set():
                pull = self._pulls[key] = Pull(image)
                threading.Thread(target=self._run_pull, args=(key, pull), name=f"pull-{key[7:19]}",
                                 daemon=True).start()
                self.on_change()
            return pull

    def _run_pull(self, key: str, pull: Pull) -> None:
        log.info("pull started", extra=kv(image=pull.image))
        try:
            inst = self.store.ensure(pull.image, accelerators=self._targets or None)
        except errors.NoMatchingManifest as e:
            response = Ensure(state=Ensure.INCOMPATIBLE, digest=key, message=str(e), expected="a platform the image index lists",
                              found=compat.describe_node(self.accelerators))
        except Exception as e:  # every failure is reported to the callers, none kills the agent
            response = Ensure(state=Ensure.FAILED, digest=key, failure=_failure(e), message=str(e))
        else:
            response = self._judge(inst)
            self._ready[key] = response
        result = Ensure.State.Name(response.state).lower()
        self.metrics.pulls.labels(result).inc()
        self.metrics.pull_seconds.observe(time.monotonic() - pull.started)
        log.log(logging.INFO if response.state == Ensure.READY else logging.WARNING, "pull finished",
                extra=kv(image=pull.image, result=result, message=response.message,
                         seconds=round(time.monotonic() - pull.started, 3)))
        pull.response = response
        pull.done.set()
        self.on_change()

    # -- references ----------------------------------------------------------------------

    def AcquireReference(self, request, context):  # noqa: N802
        _require(context, request, "volume_id", "digest", "target_path")
        vid, target = request.volume_id, request.target_path
        meta = {"volume_id": vid, "target_path": target, "namespace": request.pod.namespace,
                "name": request.pod.name, "uid": request.pod.uid}
        if request.HasField("cache"):
            if not request.cache.name:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cache.name is required when cache is set")
            meta["cache"] = {"namespace": request.cache.namespace, "name": request.cache.name}
        key = holder(vid, target)
        with self._lock:
            refusal = _refusal(list(self._refs.values()), meta, request.digest, request.exclusive)
            if refusal is not None:
                context.abort(*refusal)
            if key in self._refs:
                return pb.AcquireReferenceResponse()
            try:
                self.store.acquire(request.digest, key, meta)
            except errors.InvalidReference as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except errors.ImageNotFound:
                context.abort(grpc.StatusCode.NOT_FOUND, f"{request.digest} is not installed on this node")
            self._refs[key] = dict(meta, digest=request.digest)
            self.metrics.references.set(len(self._refs))
        log.info("reference acquired", extra=kv(volume_id=vid, target=target, digest=request.digest,
                                                 pod=f"{request.pod.namespace}/{request.pod.name}"))
        self.on_change()
        return pb.AcquireReferenceResponse()

    def ReleaseReference(self, request, context):  # noqa: N802
        _require(context, request, "volume_id", "target_path")
        key = holder(request.volume_id, request.target_path)
        with self._lock:
            held = key in self._refs
            if held:
                self.store.release(key)
                del self._refs[key]
                self.metrics.references.set(len(self._refs))
        if held:
            log.info("reference released", extra=kv(volume_id=request.volume_id, target=request.target_path))
            self.on_change()
        return pb.ReleaseReferenceResponse(released=held)

    # -- ListCaches ----------------------------------------------------------------------

    def ListCaches(self, request, context):  # noqa: N802
        # pulls first: one that ends while the store is listed then shows as installed (which
        # wins) rather than vanishing from this answer
        with self._lock:
            held = list(self._refs.values())
            pulls = [(key, pull, pull.done.is_set()) for key, pull in self._pulls.items()]
        refs: dict[str, list] = {}
        for meta in held:
            refs.setdefault(meta.get("digest"), []).append(_reference(meta))
        caches = [pb.CacheInfo(image=inst.image, digest=inst.digest, state=pb.CacheInfo.INSTALLED, path=str(inst.path),
                               kind=inst.kind, size_bytes=inst.size_bytes, references=refs.get(inst.digest, []),
                               compatible=compat.check(inst.targets, self.accelerators) is None)
                  for inst in self.store.list()]
        for key, pull, done in pulls:
            if not done:
                caches.append(pb.CacheInfo(image=pull.image, digest=key, state=pb.CacheInfo.PULLING))
            elif pull.response.state == Ensure.FAILED:
                caches.append(pb.CacheInfo(image=pull.image, digest=key, state=pb.CacheInfo.FAILED,
                                           message=pull.response.message))
        return pb.ListCachesResponse(caches=caches, accelerators=[str(a) for a in self.accelerators])


def holder(volume_id: str, target_path: str) -> str:
    """The store's reference holder for a volume published at a target path."""
    return f"{volume_id}@{target_path}"


def _require(context, request, *fields: str) -> None:
    for name in fields:
        if not getattr(request, name):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} is required")


def _reference(meta: dict) -> pb.Reference:
    """A held reference as ListCaches shows it (references written by older agents may lack fields)."""
    return pb.Reference(volume_id=meta.get("volume_id", ""), target_path=meta.get("target_path", ""),
                        pod=pb.PodRef(namespace=meta.get("namespace", ""), name=meta.get("name", ""),
                                      uid=meta.get("uid", "")),
                        cache=pb.CacheRef(**meta["cache"]) if "cache" in meta else None)


def _refusal(held: list[dict], want: dict, digest: str, exclusive: bool) -> tuple[grpc.StatusCode, str] | None:
    """Why the references ``held`` forbid the wanted one, as the gRPC code and message to answer
    with, or None. An exclusive volume held at other target paths only is FAILED_PRECONDITION
    (the CSI spec's code for a single-node volume published at a second target); every other
    clash is ALREADY_EXISTS."""
    vid, target = want["volume_id"], want["target_path"]
    targets = {h.get("target_path") for h in held if h.get("volume_id") == vid}
    elsewhere = sorted(targets - {target})
    if exclusive and elsewhere and target not in targets:
        return grpc.StatusCode.FAILED_PRECONDITION, _one_target(vid, elsewhere[0])
    for h in held:
        if h.get("target_path") != target:
            continue
        if h.get("volume_id") != vid:
            return grpc.StatusCode.ALREADY_EXISTS, (f"target path {target} is already published for volume "
                                                    f"{h.get('volume_id')}")
        if h.get("digest") != digest or h.get("uid") != want["uid"]:
            return grpc.StatusCode.ALREADY_EXISTS, (f"volume {vid} is already published at {target} with "
                                                    f"{h.get('digest')} for pod {h.get('namespace')}/{h.get('name')}")
    if exclusive and elsewhere:
        return grpc.StatusCode.ALREADY_EXISTS, _one_target(vid, elsewhere[0])
    return None


def _one_target(vid: str, held_at: str) -> str:
    return f"volume {vid} is already published at {held_at} and its access mode allows one target"


def _failure(e: Exception) -> int:
    for kinds, failure in FAILURES:
        if isinstance(e, kinds):
            return failure
    return Ensure.INTERNAL


def add_to_server(service: AgentService, server: grpc.Server) -> None:
    pb_grpc.add_AgentServicer_to_server(service, server)
