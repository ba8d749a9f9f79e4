"""The agent's gRPC service (``proto/agent.proto``): a thin adapter over :class:`agent.core.Agent`.

Each RPC turns its request into a call of the core and the core's answer (or
:class:`~agent.core.Refused`) into the response (or the status code it names). Nothing else
happens here.
"""

from __future__ import annotations

import logging

import grpc

from accelnode.log import kv

from .api import agent as pb
from .api import agent_grpc as pb_grpc

from .core import Agent, Refused

log = logging.getLogger("accelnode.agent")
Ensure = pb.EnsureCacheResponse


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, agent: Agent, capturer=None):
        self.agent, self.capturer = agent, capturer

    def EnsureCache(self, request, context):  # noqa: N802 (gRPC naming)
        cache = (request.cache.namespace, request.cache.name) if request.HasField("cache") else None
        a = _call(context, self.agent.ensure, request.image, request.wait_seconds, anonymous=request.anonymous,
                  cache=cache)
        return Ensure(state=Ensure.State.Value(a.state), digest=a.digest, path=a.path, message=a.message,
                      failure=Ensure.Failure.Value(a.failure) if a.failure else 0, expected=a.expected,
                      found=a.found, size_bytes=a.size_bytes, kind=a.kind)

    def AcquireReference(self, request, context):  # noqa: N802
        pod = {"namespace": request.pod.namespace, "name": request.pod.name, "uid": request.pod.uid}
        cache = (request.cache.namespace, request.cache.name) if request.HasField("cache") else None
        _call(context, self.agent.acquire, request.volume_id, request.target_path, request.digest, pod,
              cache=cache, exclusive=request.exclusive)
        return pb.AcquireReferenceResponse()

    def ReleaseReference(self, request, context):  # noqa: N802
        released = _call(context, self.agent.release, request.volume_id, request.target_path)
        return pb.ReleaseReferenceResponse(released=released)

    def ListCaches(self, request, context):  # noqa: N802
        caches = [pb.CacheInfo(image=c.image, digest=c.digest, state=pb.CacheInfo.State.Value(c.state), path=c.path,
                               kind=c.kind, size_bytes=c.size_bytes, message=c.message, compatible=c.compatible,
                               references=[_reference(m) for m in c.references])
                  for c in _call(context, self.agent.caches)]
        return pb.ListCachesResponse(caches=caches, accelerators=[str(a) for a in self.agent.accelerators])

    def GetTarget(self, request, context):  # noqa: N802
        root = request.mount_root if request.HasField("mount_root") else None
        held, shown = _call(context, self.agent.at_targets, list(request.target_paths),
                            (root.device, root.inode) if root is not None else None)
        return pb.GetTargetResponse(
            held=[pb.HeldCache(reference=_reference(m), digest=m["digest"], path=str(inst.path) if inst else "",
                               size_bytes=inst.size_bytes if inst else 0) for m, inst in held],
            shown=str(shown.path) if shown is not None else "")

    def CaptureView(self, request, context):  # noqa: N802
        if self.capturer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this agent does not capture")
        pod = {"namespace": request.pod.namespace, "name": request.pod.name, "uid": request.pod.uid}
        a = _call(context, self.capturer.capture, request.upper_dir, request.digest,
                  (request.cache.namespace, request.cache.name), pod, request.repository, request.push_secret)
        return pb.CaptureViewResponse(state=pb.CaptureViewResponse.State.Value(a.state), message=a.message,
                                      entries=a.entries, layer_digest=a.layer_digest)


def _call(context, fn, *args, **kw):
    """``fn``'s answer; a refusal as the status it names, anything unforeseen as INTERNAL with
    its message (never gRPC's UNKNOWN "Exception calling application")."""
    try:
        return fn(*args, **kw)
    except Refused as e:
        context.abort(grpc.StatusCode[e.code], e.message)
    except Exception as e:
        log.exception("request failed", extra=kv(call=getattr(fn, "__name__", "")))
        context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


def _reference(meta: dict) -> pb.Reference:
    """A held reference as ListCaches shows it (references written by older agents may lack fields)."""
    return pb.Reference(volume_id=meta.get("volume_id", ""), target_path=meta.get("target_path", ""),
                        pod=pb.PodRef(namespace=meta.get("namespace", ""), name=meta.get("name", ""),
                                      uid=meta.get("uid", "")),
                        cache=pb.CacheRef(**meta["cache"]) if "cache" in meta else None)


def add_to_server(service: AgentService, server: grpc.Server) -> None:
    pb_grpc.add_AgentServicer_to_server(service, server)
