"""CSI Node service: publish a cache at the pod's target path, as a read-only bind or as a
copy-on-write view (:mod:`.views`), and take it away again.

The driver keeps nothing in memory that a later call needs: what is mounted at a target says
what is mounted, and the agent's durable references say which volume holds which cache at which
target, and a view's record on its own tmpfs says which overlay is ours. A restarted driver
therefore unpublishes what its predecessor published. In memory are
only which target paths have a call in flight (a second call for the same target is answered
ABORTED, CSI's "operation pending for volume", instead of racing the first) and the identities
of the store's cache directories, a cache of what the agent says (:mod:`.confine`).

Targets are confined to kubelet's shape under ``--kubelet-dir``, and unpublish takes away only
mounts of the store's caches (:mod:`.confine`). Neither call reads the node's mount table.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import threading

import grpc

from accelnode.log import kv

from . import confine, mounts, resolve, views
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
    Ensure.NO_SPACE: Code.RESOURCE_EXHAUSTED,
}
MAX_STACKED_UNMOUNTS = 16
Mode = csi.VolumeCapability.AccessMode
# Access modes under which one volume may be published at several target paths on this node.
SHARED_MODES = {Mode.MULTI_NODE_READER_ONLY, Mode.MULTI_NODE_SINGLE_WRITER, Mode.MULTI_NODE_MULTI_WRITER,
                Mode.SINGLE_NODE_MULTI_WRITER}
GiB = 1 << 30


class AgentError(Exception):
    """The node agent's answer to a call, as the status kubelet gets."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class AgentClient:
    """The node agent's API; calls end by the deadline of the CSI call they serve."""

    def __init__(self, channel: grpc.Channel, socket: str):
        self.stub = agent_grpc.AgentStub(channel)
        self.socket = socket

    def call(self, context, method: str, request, timeout: float = 10.0):
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = max(0.0, min(timeout, remaining))
        try:
            return getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                raise AgentError(Code.UNAVAILABLE,
                                 f"node agent at {self.socket} did not answer {method}: {e.details()}") from None
            raise AgentError(e.code(), e.details()) from None


def _answers_agent_errors(rpc):
    @functools.wraps(rpc)
    def wrapper(self, request, context):
        try:
            return rpc(self, request, context)
        except AgentError as e:
            context.abort(e.code, str(e))

    return wrapper


class NodeServer(csi_grpc.NodeServicer):
    def __init__(self, node_id: str, agent_client: AgentClient, resolver: resolve.Resolver, *,
                 kubelet_dir: str = "/var/lib/kubelet", pull_wait: float = 20.0,
                 view_store: views.Views | None = None, writable_size: int = GiB, max_writable_size: int = 8 * GiB):
        self.node_id = node_id
        self.views = view_store
        self.writable_size = writable_size
        self.max_writable_size = max_writable_size
        self.agent = agent_client
        self.resolver = resolver
        self.kubelet_dir = kubelet_dir
        self.pull_wait = pull_wait
        self.store_dirs = confine.StoreDirs()
        self._busy: set[str] = set()  # resolved target paths with a publish/unpublish in flight
        self._busy_lock = threading.Lock()

    # -- publish -------------------------------------------------------------------------

    @_answers_agent_errors
    def NodePublishVolume(self, request, context):  # noqa: N802 (gRPC naming)
        vid, target = request.volume_id, request.target_path
        _require(context, vid, "volume_id")
        _require(context, target, "target_path")
        flags = _mount_flags(context, request)
        where = self._confined(context, target)
        _check_place(context, where, target)
        vc = dict(request.volume_context)
        try:
            asked = views.wanted(vc, self.max_writable_size)
        except views.BadAttribute as e:
            context.abort(Code.INVALID_ARGUMENT, str(e))
        if asked.view == views.COPY_ON_WRITE and self.views is None:
            context.abort(Code.INVALID_ARGUMENT, f"volume attribute {views.VIEW_ATTR}: this driver makes no "
                                                 "copy-on-write views (no --views-dir)")
        try:
            cache = resolve.cache_ref(vc)
            pod = resolve.pod_of(vc)
            resolve.check_namespace(cache, pod)
            image = self.resolver.image(cache, pod, vc)
        except ResolveError as e:
            context.abort(Code[e.code], str(e))
        ready = self._ensure(context, cache, image)
        self.store_dirs.learn(ready.path)
        # A reader-only access mode (the controller's claims are ReadOnlyMany) still allows a
        # copy-on-write view: the volume's content, the store's copy, is never written; writes
        # stay in the pod's private layer. Only the pod's (or the PV's) readOnly forces a bind.
        read_only = request.readonly or "ro" in request.volume_capability.mount.mount_flags
        size = (views.writable_size(asked, ready.kind, read_only, self.writable_size, image.capture is not None)
                 if self.views else None)
        capture = ({"cache_namespace": cache.namespace or "", "cache_name": cache.name, "pod_namespace": pod.namespace,
                    "pod_name": pod.name, "pod_uid": pod.uid, **image.capture}
                   if image.capture is not None and size is not None else None)
        if size is not None:
            flags &= ~mounts.MS_RDONLY
            try:
                views.check_path(ready.path, "cache directory")
            except ValueError as e:
                context.abort(Code.FAILED_PRECONDITION, str(e))

        with self._only_call_on(where, context):
            top = mounts.mounted_root(where)
            wanted = mounts.options_of(flags)
            if top is None:
                _check_empty_dir(context, where, target)
            elif not self._is_this(where, top, ready, wanted, size):
                what = f"a copy-on-write view ({size} bytes writable)" if size else "a read-only bind"
                context.abort(Code.ALREADY_EXISTS, f"{target} is already a mount point of something other than "
                                                   f"{what} of {cache} ({ready.digest}) {','.join(sorted(wanted))}")
            self._acquire(context, request, ready.digest, pod, cache)  # also: is a mount there this volume's?
            if top is not None:
                return csi.NodePublishVolumeResponse()
            created = not os.path.lexists(where)
            try:  # onto the directory checked, held open: a symlink swapped in for it is not followed
                with mounts.target_dir(where, create=created) as fd:
                    if os.listdir(fd):
                        raise OSError(errno.ENOTEMPTY, "the target is not an empty directory")
                    if size is None:
                        mounts.bind_readonly_at(ready.path, fd, flags & ~mounts.ALWAYS, target)
                    else:
                        self.views.create(where, ready.path, size, flags, ready.digest, at=mounts.fd_path(fd),
                                          capture=capture)
            except OSError as e:
                if created:
                    with contextlib.suppress(OSError):  # not a directory any more: what replaced it is not ours
                        _rmdir(where)
                self._release_after_failure(context, vid, target)
                context.abort(Code.INTERNAL, f"cannot mount {cache} at {target}: {e.strerror or e}")
        log.info("volume published", extra=kv(volume_id=vid, cache=str(cache), digest=ready.digest,
                                              target=target, pod=f"{pod.namespace}/{pod.name}",
                                              view=views.COPY_ON_WRITE if size else views.READ_ONLY,
                                              writable_bytes=size))
        return csi.NodePublishVolumeResponse()

    def _is_this(self, where: str, top, ready, wanted: frozenset, size: int | None) -> bool:
        """Is the mount at ``where`` what this publish would make (a retry, or after a restart)?"""
        if wanted != mounts.options_at(where):
            return False
        if size is None:
            return top == mounts.identity(ready.path)
        rec = self.views.record(where)
        return (rec is not None and self.views.ours(where, top, rec) and rec.digest == ready.digest
                and rec.size == size)

    def _ensure(self, context, cache, pinned: resolve.Image):
        wait = self.pull_wait
        remaining = context.time_remaining()
        if remaining is not None:  # leave a second of the caller's deadline for the mount
            wait = max(0.0, min(wait, remaining - 1.0))
        image = pinned.reference
        answer = self.agent.call(context, "EnsureCache",
                                 agent.EnsureCacheRequest(image=image, wait_seconds=wait, anonymous=pinned.anonymous,
                                                          cache=agent.CacheRef(namespace=cache.namespace or "",
                                                                               name=cache.name)),
                                 timeout=wait + 10.0)
        if answer.state == Ensure.READY:
            return answer
        if answer.state == Ensure.PULLING:
            context.abort(Code.UNAVAILABLE, f"{cache}: {image} is still being pulled to this node; retry "
                                            f"({answer.message})")
        if answer.state == Ensure.INCOMPATIBLE:
            context.abort(Code.FAILED_PRECONDITION, f"{cache}: {image} does not fit this node: expected "
                                                    f"{answer.expected}, found {answer.found}")
        context.abort(FAILURE_CODES.get(answer.failure, Code.INTERNAL), f"{cache}: {answer.message}")

    def _acquire(self, context, request, digest: str, pod: resolve.Pod, cache: resolve.CacheRef) -> None:
        """AcquireReference; the agent's refusal is the code kubelet gets (ALREADY_EXISTS, or
        FAILED_PRECONDITION for a single-node volume wanted at a second target)."""
        mode = request.volume_capability.access_mode.mode
        self.agent.call(context, "AcquireReference", agent.AcquireReferenceRequest(
            volume_id=request.volume_id, digest=digest, target_path=request.target_path,
            exclusive=mode not in SHARED_MODES,
            pod=agent.PodRef(namespace=pod.namespace, name=pod.name, uid=pod.uid),
            cache=agent.CacheRef(namespace=cache.namespace or "", name=cache.name)))

    def _release_after_failure(self, context, vid: str, target: str) -> None:
        """Drop the reference a failed publish took; the publish's own error is what kubelet gets."""
        try:
            self.agent.call(context, "ReleaseReference",
                            agent.ReleaseReferenceRequest(volume_id=vid, target_path=target))
        except AgentError as e:
            log.error("cannot release the reference of a failed publish; the next unpublish of this volume "
                      "releases it", extra=kv(volume_id=vid, target=target, error=str(e)))

    @contextlib.contextmanager
    def _only_call_on(self, where: str, context):
        with self._busy_lock:
            if where in self._busy:
                context.abort(Code.ABORTED, f"another publish or unpublish of {where} is in progress")
            self._busy.add(where)
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy.discard(where)

    # -- unpublish -----------------------------------------------------------------------

    @_answers_agent_errors
    def NodeUnpublishVolume(self, request, context):  # noqa: N802
        vid, target = request.volume_id, request.target_path
        _require(context, vid, "volume_id")
        _require(context, target, "target_path")
        where = self._confined(context, target)
        with self._only_call_on(where, context):
            if mounts.mounted_root(where) is not None:
                self._check_holder(context, vid, target, where)
            try:
                for _ in range(MAX_STACKED_UNMOUNTS):
                    shown = mounts.mounted_root(where)
                    if shown is None:
                        break
                    if self.views is not None and self.views.ours(where, shown):
                        pass  # our overlay; its tmpfs goes once it is unmounted
                    elif self.store_dirs.cache_at(shown, lambda ident: self._shown(context, ident)) is None:
                        context.abort(Code.FAILED_PRECONDITION, f"{target} has a mount that is not a cache of this "
                                                                f"node's store: {mounts.describe(where)}; leaving it "
                                                                "there")
                    mounts.unmount(where)
                else:
                    context.abort(Code.INTERNAL, f"{target} still mounted after {MAX_STACKED_UNMOUNTS} unmounts")
                if self.views is not None:
                    self._capture(context, where)
                    self.views.remove(where)
                _rmdir(where)
            except OSError as e:
                context.abort(Code.INTERNAL, f"cannot unpublish {target}: {e.strerror or e}")
        released = self.agent.call(context, "ReleaseReference",
                                   agent.ReleaseReferenceRequest(volume_id=vid, target_path=target))
        log.info("volume unpublished", extra=kv(volume_id=vid, target=target, released=released.released))
        return csi.NodeUnpublishVolumeResponse()

    def _capture(self, context, where: str) -> None:
        """Hand a capturing view's writable layer to the agent (docs/capture.md): the overlay is
        unmounted, so no pod writes it any more, and its tmpfs is still there. Capture never
        fails an unpublish: whatever goes wrong is logged and the view goes as always."""
        rec = self.views.record(where)
        c = rec.capture if rec is not None else None
        if not c:
            return
        try:
            answer = self.agent.call(context, "CaptureView", agent.CaptureViewRequest(
                upper_dir=self.views.upper_of(where), digest=rec.digest,
                cache=agent.CacheRef(namespace=c.get("cache_namespace", ""), name=c.get("cache_name", "")),
                pod=agent.PodRef(namespace=c.get("pod_namespace", ""), name=c.get("pod_name", ""),
                                 uid=c.get("pod_uid", "")),
                repository=c.get("repository", ""), push_secret=c.get("push_secret", "")), timeout=120.0)
            log.info("view captured", extra=kv(target=where, cache=f"{c.get('cache_namespace')}/{c.get('cache_name')}",
                                               state=agent.CaptureViewResponse.State.Name(answer.state),
                                               entries=answer.entries, message=answer.message))
        except AgentError as e:
            log.error("capture failed; the view goes without it", extra=kv(target=where, error=str(e)))

    def _check_holder(self, context, vid: str, target: str, where: str) -> None:
        """Refuse to take away what another volume holds at this target: the agent's references
        say which volume was published there. A mount that no reference holds (its record lost)
        is taken away as before: nothing else could ever clean it up."""
        held = self._held(context, target, where)
        holders = {h.reference.volume_id for h in held}
        if holders and vid not in holders:
            context.abort(Code.FAILED_PRECONDITION, f"{target} holds volume {', '.join(sorted(holders))}, not "
                                                    f"{vid}; leaving it mounted")

    def _confined(self, context, target: str) -> str:
        try:
            return confine.target(target, self.kubelet_dir)
        except confine.OutsideKubelet as e:
            context.abort(Code.INVALID_ARGUMENT, str(e))

    def _held(self, context, *targets: str):
        """The agent's references held at these target paths (one bounded answer)."""
        paths = list(dict.fromkeys(targets))
        return self.agent.call(context, "GetTarget", agent.GetTargetRequest(target_paths=paths)).held

    def _shown(self, context, ident: tuple[int, int]) -> str:
        """The store path of the installed cache whose directory has identity ``ident``, or ""."""
        return self.agent.call(context, "GetTarget", agent.GetTargetRequest(
            mount_root=agent.FileIdentity(device=ident[0], inode=ident[1]))).shown

    # -- info ----------------------------------------------------------------------------

    @_answers_agent_errors
    def NodeGetVolumeStats(self, request, context):  # noqa: N802
        vid, path = request.volume_id, request.volume_path
        _require(context, vid, "volume_id")
        _require(context, path, "volume_path")
        if not os.path.exists(path):
            context.abort(Code.NOT_FOUND, f"volume path {path} does not exist")
        cache = next((h for h in self._held(context, path) if h.reference.volume_id == vid), None)
        if cache is None:
            context.abort(Code.NOT_FOUND, f"volume {vid} is not published at {path} on this node")
        where, rec = self._view_of(path)
        if rec is not None:
            return self._view_stats(path, where, rec, cache)
        if not mounts.is_mountpoint(path):
            problem = f"{path} is no longer a mount point"
        elif not {"ro", "nosuid", "nodev"} <= (options := mounts.options_at(path)):
            problem = f"{path} is mounted {','.join(sorted(options))}, not ro,nosuid,nodev"
        elif not cache.path or not mounts.same_directory(path, cache.path):
            problem = f"{path} no longer shows {cache.digest}"
        else:
            problem = ""
        return csi.NodeGetVolumeStatsResponse(
            usage=[csi.VolumeUsage(unit=csi.VolumeUsage.BYTES, total=cache.size_bytes, used=cache.size_bytes)],
            volume_condition=csi.VolumeCondition(abnormal=bool(problem),
                                                 message=problem or f"read-only mount of {cache.digest}"))

    def _view_of(self, path: str) -> tuple[str | None, views.Record | None]:
        """(the confined target, its view's record), or (None, None) when it has no view."""
        if self.views is None:
            return None, None
        try:
            where = confine.target(path, self.kubelet_dir)
        except confine.OutsideKubelet:
            return None, None
        return where, self.views.record(where)

    def _view_stats(self, path: str, where: str, rec: views.Record, cache):
        """A view's usage is its writable layer's: bytes written (copied up) of its bound size."""
        shown = mounts.mounted_root(where)
        if shown is None:
            problem = f"{path} is no longer a mount point"
        elif not self.views.ours(where, shown, rec):
            problem = f"{path} no longer shows its copy-on-write view of {cache.digest}"
        elif not {"nosuid", "nodev"} <= mounts.options_at(where):
            problem = f"{path} lost nosuid,nodev"
        else:
            problem = ""
        try:
            st = os.statvfs(self.views.dir_of(where))
            total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        except OSError:
            total = free = 0
        return csi.NodeGetVolumeStatsResponse(
            usage=[csi.VolumeUsage(unit=csi.VolumeUsage.BYTES, total=total, used=total - free, available=free)],
            volume_condition=csi.VolumeCondition(
                abnormal=bool(problem), message=problem or f"copy-on-write view of {cache.digest}, "
                                                           f"{rec.size} bytes writable"))

    def NodeGetCapabilities(self, request, context):  # noqa: N802
        rpc = csi.NodeServiceCapability.RPC
        return csi.NodeGetCapabilitiesResponse(capabilities=[
            csi.NodeServiceCapability(rpc=rpc(type=t)) for t in (rpc.GET_VOLUME_STATS, rpc.VOLUME_CONDITION)])

    def NodeGetInfo(self, request, context):  # noqa: N802
        return csi.NodeGetInfoResponse(node_id=self.node_id)


def _require(context, value: str, name: str) -> None:
    if not value:
        context.abort(Code.INVALID_ARGUMENT, f"{name} is required")


def _mount_flags(context, request) -> int:
    """Check the volume capability; the mount flags the cache mount gets.

    Any access mode is accepted, writer modes included: kubelet asks SINGLE_NODE_WRITER for every
    inline volume whatever the pod's readOnly, and the mount is read-only either way. fs_type is
    ignored (a bind mount of a directory has none). mount_flags may only add what keeps the mount
    read-only: ro, nosuid, nodev (always set) and noexec.
    """
    if not request.HasField("volume_capability"):
        context.abort(Code.INVALID_ARGUMENT, "volume_capability is required")
    cap = request.volume_capability
    if cap.HasField("block"):
        context.abort(Code.INVALID_ARGUMENT, "block access is not supported: a cache is a directory, "
                                             "ask for a mount volume")
    if not cap.HasField("mount"):
        context.abort(Code.INVALID_ARGUMENT, "volume_capability needs an access type: mount")
    if cap.access_mode.mode not in Mode.Mode.values() or cap.access_mode.mode == Mode.UNKNOWN:
        context.abort(Code.INVALID_ARGUMENT, f"volume_capability.access_mode {cap.access_mode.mode} is not a "
                                             "known access mode")
    flags = mounts.ALWAYS
    for opt in cap.mount.mount_flags:
        if opt not in mounts.FLAGS:
            context.abort(Code.INVALID_ARGUMENT, f"mount flag {opt!r} is not supported: a cache is always mounted "
                                                 f"ro,nosuid,nodev and may add noexec")
        flags |= mounts.FLAGS[opt]
    return flags


def _check_place(context, where: str, target: str) -> None:
    """The CO makes the target's parent; the target itself is never a symlink."""
    if not os.path.isdir(os.path.dirname(where)):
        context.abort(Code.FAILED_PRECONDITION, f"the parent directory of target_path {target} does not exist "
                                                "(the CO creates it)")
    if os.path.islink(where):
        context.abort(Code.FAILED_PRECONDITION, f"target_path {target} is a symlink; refusing to mount through it")


def _check_empty_dir(context, where: str, target: str) -> None:
    """A target that is not a mount point yet must be absent (we create it) or an empty directory."""
    if os.path.lexists(where) and (not os.path.isdir(where) or os.listdir(where)):
        context.abort(Code.FAILED_PRECONDITION, f"target_path {target} exists and is not an empty directory")


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
