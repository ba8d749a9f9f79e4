"""CSI Node service: publish a cache read-only at the pod's target path, and take it away again.

The driver keeps nothing in memory that a later call needs: the mount table says what is
mounted, and the agent's durable references say which volume holds which cache at which
target. A restarted driver therefore unpublishes what its predecessor published.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import grpc

from accelnode.log import kv

from . import mounts, resolve
from .api import agent, agent_grpc, csi, csi_grpc
from .resolve import ResolveError

log = logging.getLogger("accelnode.csi")
Code = grpc.StatusCode
Ensure = agent.EnsureCacheResponse

# EnsureCache failures -> the code kubelet gets (UNAVAILABLE ones are retried soon)
FAILURE_CODES = {
    Ensure.NOT_FOUND: Code.NOT_FOUND,
    Ensure.REGISTRY_UNAVAILABLE: Code.UNAVAILABLE,
    Ensure.DENIED: Code.UNAUTHENTICATED,
    Ensure.INVALID_REFERENCE: Code.INVALID_ARGUMENT,
}
MAX_STACKED_UNMOUNTS = 16
Mode = csi.VolumeCapability.AccessMode
# Access modes under which one volume may be published at several target paths on this node.
SHARED_MODES = {Mode.MULTI_NODE_READER_ONLY, Mode.MULTI_NODE_SINGLE_WRITER, Mode.MULTI_NODE_MULTI_WRITER,
                Mode.SINGLE_NODE_MULTI_WRITER}


class AgentClient:
    """The node agent's API with its errors turned into answers for kubelet."""

    def __init__(self, channel: grpc.Channel, socket: str):
        self.stub = agent_grpc.AgentStub(channel)
        self.socket = socket

    def call(self, context, method: str, request, timeout: float = 10.0):
        try:
            return getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                context.abort(Code.UNAVAILABLE, f"node agent at {self.socket} did not answer {method}: {e.details()}")
            context.abort(e.code(), e.details())


class NodeServer(csi_grpc.NodeServicer):
    def __init__(self, node_id: str, agent_client: AgentClient, resolver: resolve.Resolver, *,
                 pull_wait: float = 20.0):
        self.node_id = node_id
        self.agent = agent_client
        self.resolver = resolver
        self.pull_wait = pull_wait

    # -- publish -------------------------------------------------------------------------

    def NodePublishVolume(self, request, context):  # noqa: N802 (gRPC naming)
        vid, target = request.volume_id, request.target_path
        _require(context, vid, "volume_id")
        _require(context, target, "target_path")
        if not request.HasField("volume_capability"):
            context.abort(Code.INVALID_ARGUMENT, "volume_capability is required")
        if request.volume_capability.HasField("block"):
            context.abort(Code.INVALID_ARGUMENT, "block access is not supported: a cache is a directory, "
                                                 "ask for a mount volume")
        vc = dict(request.volume_context)
        try:
            cache = resolve.cache_ref(vc)
            pod = resolve.pod_of(vc)
            resolve.check_namespace(cache, pod)
            image = self.resolver.image(cache, pod, vc)
        except ResolveError as e:
            context.abort(Code[e.code], str(e))
        ready = self._ensure(context, cache, image)

        if mounts.is_mountpoint(target):
            if not (mounts.same_directory(target, ready.path) and mounts.is_readonly(target)):
                context.abort(Code.ALREADY_EXISTS, f"{target} is already a mount point of something other "
                                                   f"than {cache} ({ready.digest}) read-only")
            self._acquire(context, request, ready.digest, pod)  # checks it is the same volume
            return csi.NodePublishVolumeResponse()

        self._acquire(context, request, ready.digest, pod)
        created = not os.path.lexists(target)
        try:
            Path(target).mkdir(mode=0o750, parents=True, exist_ok=True)
            mounts.bind_readonly(ready.path, target)
        except OSError as e:
            if created:
                _rmdir(target)
            self.agent.call(context, "ReleaseReference",
                            agent.ReleaseReferenceRequest(volume_id=vid, target_path=target))
            context.abort(Code.INTERNAL, f"cannot mount {cache} at {target}: {e.strerror or e}")
        log.info("volume published", extra=kv(volume_id=vid, cache=str(cache), digest=ready.digest,
                                              target=target, pod=f"{pod.namespace}/{pod.name}"))
        return csi.NodePublishVolumeResponse()

    def _ensure(self, context, cache, image: str):
        wait = self.pull_wait
        remaining = context.time_remaining()
        if remaining is not None:
            wait = max(0.0, min(wait, remaining - 1.0))
        answer = self.agent.call(context, "EnsureCache", agent.EnsureCacheRequest(image=image, wait_seconds=wait),
                                 timeout=wait + 10.0)
        if answer.state == Ensure.READY:
            return answer
        if answer.state == Ensure.PULLING:
            context.abort(Code.UNAVAILABLE, f"{cache}: {image} is still being pulled to this node; retry")
        if answer.state == Ensure.INCOMPATIBLE:
            context.abort(Code.FAILED_PRECONDITION, f"{cache}: {image} does not fit this node: expected "
                                                    f"{answer.expected}, found {answer.found}")
        context.abort(FAILURE_CODES.get(answer.failure, Code.INTERNAL), f"{cache}: {answer.message}")

    def _acquire(self, context, request, digest: str, pod: resolve.Pod) -> None:
        mode = request.volume_capability.access_mode.mode
        self.agent.call(context, "AcquireReference", agent.AcquireReferenceRequest(
            volume_id=request.volume_id, digest=digest, target_path=request.target_path,
            exclusive=mode not in SHARED_MODES,
            pod=agent.PodRef(namespace=pod.namespace, name=pod.name, uid=pod.uid)))

    # -- unpublish -----------------------------------------------------------------------

    def NodeUnpublishVolume(self, request, context):  # noqa: N802
        vid, target = request.volume_id, request.target_path
        _require(context, vid, "volume_id")
        _require(context, target, "target_path")
        try:
            for _ in range(MAX_STACKED_UNMOUNTS):
                if not mounts.is_mountpoint(target):
                    break
                mounts.unmount(target)
            else:
                context.abort(Code.INTERNAL, f"{target} still mounted after {MAX_STACKED_UNMOUNTS} unmounts")
            _rmdir(target)
        except OSError as e:
            context.abort(Code.INTERNAL, f"cannot unpublish {target}: {e.strerror or e}")
        released = self.agent.call(context, "ReleaseReference",
                                   agent.ReleaseReferenceRequest(volume_id=vid, target_path=target))
        log.info("volume unpublished", extra=kv(volume_id=vid, target=target, released=released.released))
        return csi.NodeUnpublishVolumeResponse()

    # -- info ----------------------------------------------------------------------------

    def NodeGetVolumeStats(self, request, context):  # noqa: N802
        vid, path = request.volume_id, request.volume_path
        _require(context, vid, "volume_id")
        _require(context, path, "volume_path")
        if not os.path.exists(path):
            context.abort(Code.NOT_FOUND, f"volume path {path} does not exist")
        listing = self.agent.call(context, "ListCaches", agent.ListCachesRequest())
        cache = next((c for c in listing.caches for r in c.references
                      if (r.volume_id, r.target_path) == (vid, path)), None)
        if cache is None:
            context.abort(Code.NOT_FOUND, f"volume {vid} is not published on this node")
        healthy = mounts.is_mountpoint(path) and mounts.is_readonly(path)
        return csi.NodeGetVolumeStatsResponse(
            usage=[csi.VolumeUsage(unit=csi.VolumeUsage.BYTES, total=cache.size_bytes, used=cache.size_bytes)],
            volume_condition=csi.VolumeCondition(
                abnormal=not healthy,
                message="read-only mount of " + cache.digest if healthy else f"{path} is not a read-only mount"))

    def NodeGetCapabilities(self, request, context):  # noqa: N802
        rpc = csi.NodeServiceCapability.RPC
        return csi.NodeGetCapabilitiesResponse(capabilities=[
            csi.NodeServiceCapability(rpc=rpc(type=t)) for t in (rpc.GET_VOLUME_STATS, rpc.VOLUME_CONDITION)])

    def NodeGetInfo(self, request, context):  # noqa: N802
        return csi.NodeGetInfoResponse(node_id=self.node_id)


def _require(context, value: str, name: str) -> None:
    if not value:
        context.abort(Code.INVALID_ARGUMENT, f"{name} is required")


def _rmdir(path: str) -> None:
    """Remove an empty target directory; a missing one is fine, anything else is an error."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.ENOTDIR, errno.EEXIST):
            raise OSError(e.errno, f"{path} is not an empty directory; leaving it alone", path) from e
        raise
