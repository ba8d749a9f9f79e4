"""Copy-on-write views: an overlay of a store cache with a private, size-bounded writable layer.

Invariant: the store's copy is never written; each view's upper and work directories live on a
tmpfs of their own (``size=`` is the hard bound on bytes, ``nr_inodes=`` on files, each of which
costs kernel memory that ``size=`` does not count; pages are charged to the writing pod's memory
cgroup, nothing survives a crash) at ``<views-dir>/<id>``, ``id`` a hash of the resolved target,
so a restarted driver finds a view from its target alone. A view is ours when the mount at its
target shows the (st_dev, st_ino) recorded in ``view.json`` next to the upper directory.
See docs/csi.md ("Views").
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass

from accelnode import atomic
from accelnode.decode import SMALL, read_file
from accelnode.kube.quantity import to_bytes
from accelnode.log import kv

from . import mounts

log = logging.getLogger("accelnode.csi")

VIEW_ATTR = "accelnode.io/view"
SIZE_ATTR = "accelnode.io/writable-size"
PREFIX = "accelnode.io/"
READ_ONLY, COPY_ON_WRITE = "read-only", "copy-on-write"
WRITING_KINDS = ("triton", "vllm")  # their consumers write the cache tree as they go
# kinds that get a copy-on-write view when their cache captures (docs/capture.md): JAX writes its
# persistent cache on a miss, so a capturing JAX cache needs somewhere to write
CAPTURE_KINDS = ("triton", "vllm", "jax")
SOURCE = "accelnode-view"  # the source name of both mounts, as df and the mount table show it
RECORD = "view.json"
MAX_STACKED = 16
# files a view may hold: one per BYTES_PER_INODE of its size, at least MIN_INODES. Empty files
# take no pages, so without this bound a pod could make millions of them (kernel memory, each
# inode and dentry about 1 KiB) inside a 1 MiB view.
BYTES_PER_INODE = 8192
MIN_INODES = 4096


def inodes_for(size: int) -> int:
    """The ``nr_inodes=`` of a view of ``size`` bytes."""
    return max(MIN_INODES, size // BYTES_PER_INODE)
# characters overlayfs's option parser gives a meaning to (',' between options, ':' between
# lower layers, '\' escapes) or that have no business in a path we hand it
_UNSAFE = re.compile(r"[,:\\\x00-\x1f\x7f]")


class BadAttribute(ValueError):
    """A volume attribute the driver refuses (INVALID_ARGUMENT, naming the attribute)."""


def quantity(value: str) -> int:
    """Bytes of a Kubernetes quantity (fractions rounded up); ValueError for anything else."""
    n = to_bytes(value)
    if n is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as 1Gi, 512Mi or 2G")
    return n


@dataclass(frozen=True)
class Wanted:
    """What a volume's attributes ask, checked before anything else happens."""

    view: str | None  # READ_ONLY, COPY_ON_WRITE, or None: by the cache's kind
    size: int | None  # SIZE_ATTR in bytes, or None: the driver's default


def wanted(volume_context: dict, max_size: int) -> Wanted:
    """The view attributes of a volume; BadAttribute for an unknown ``accelnode.io/`` key, an
    unknown view, a size that is not a quantity, not positive or above ``max_size``."""
    for key in volume_context:
        if key.startswith(PREFIX) and key not in (VIEW_ATTR, SIZE_ATTR):
            raise BadAttribute(f"volume attribute {key!r} is not known; {PREFIX}* attributes are {VIEW_ATTR} "
                               f"and {SIZE_ATTR}")
    view = volume_context.get(VIEW_ATTR)
    if view is not None and view not in (READ_ONLY, COPY_ON_WRITE):
        raise BadAttribute(f"volume attribute {VIEW_ATTR} is {view[:64]!r}: expected {READ_ONLY} or {COPY_ON_WRITE}")
    size = volume_context.get(SIZE_ATTR)
    if size is None:
        return Wanted(view, None)
    if view == READ_ONLY:
        raise BadAttribute(f"volume attribute {SIZE_ATTR} applies to copy-on-write views only, and "
                           f"{VIEW_ATTR} is {READ_ONLY}")
    try:
        n = quantity(size)
    except ValueError as e:
        raise BadAttribute(f"volume attribute {SIZE_ATTR}: {str(e)[:160]}") from None
    if n <= 0:
        raise BadAttribute(f"volume attribute {SIZE_ATTR} is {size!r}: it must be more than 0")
    if n > max_size:
        raise BadAttribute(f"volume attribute {SIZE_ATTR} is {size!r} ({n} bytes): more than this node allows "
                           f"({max_size} bytes, the driver's --max-writable-size)")
    return Wanted(view, n)


def writable_size(w: Wanted, kind: str, read_only_request: bool, default_size: int,
                  capturing: bool = False) -> int | None:
    """Bytes of the writable layer this volume gets, or None for a read-only bind. A read-only
    request never gets a writable view; otherwise the attribute, else copy-on-write for the kinds
    whose consumers write (:data:`WRITING_KINDS`; every kind of :data:`CAPTURE_KINDS` when the
    cache captures) and read-only for the rest."""
    if read_only_request:
        return None
    writes = kind in (CAPTURE_KINDS if capturing else WRITING_KINDS)
    view = w.view or (COPY_ON_WRITE if writes else READ_ONLY)
    if view == READ_ONLY:
        return None
    return w.size or default_size


def check_path(path: str, what: str) -> None:
    """A path handed to overlayfs in its mount options must be absolute and carry none of the
    characters its option parser interprets; refused rather than escaped."""
    if not path.startswith("/") or _UNSAFE.search(path):
        raise ValueError(f"{what} {path!r} cannot be an overlay layer: it must be absolute and contain no ',', "
                         "':', '\\' or control characters")


@dataclass(frozen=True)
class Record:
    target: str
    digest: str
    size: int
    overlay: tuple[int, int] | None  # identity of the overlay's root; None until mounted
    # what the driver hands the agent at unpublish when the cache captures (docs/capture.md):
    # cache_namespace, cache_name, pod_namespace, pod_name, pod_uid, repository, push_secret
    capture: dict | None = None


class Views:
    """The views under ``root`` (``--views-dir``), one directory per target."""

    def __init__(self, root: str):
        check_path(root, "--views-dir")
        self.root = root

    def start(self) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self.sweep()

    def dir_of(self, target: str) -> str:
        return os.path.join(self.root, hashlib.sha256(os.fsencode(target)).hexdigest()[:32])

    def record(self, target: str) -> Record | None:
        """The view of ``target`` as recorded on its tmpfs; None when it has none (or no tmpfs)."""
        return self._read(self.dir_of(target))

    @staticmethod
    def _read(d: str) -> Record | None:
        try:
            r = read_file(os.path.join(d, RECORD), SMALL)
            capture = r.get("capture")
            return Record(r["target"], r["digest"], int(r["size"]), tuple(r["overlay"]) if r.get("overlay") else None,
                          {str(k): str(v) for k, v in capture.items()} if isinstance(capture, dict) else None)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def ours(self, target: str, shown: tuple[int, int] | None, rec: Record | None = None) -> bool:
        """Is the top mount at ``target`` (showing ``shown``) this target's overlay? ``rec``: its
        record when the caller has read it already."""
        rec = rec or self.record(target)
        if rec is None or rec.target != target or shown is None:
            return False
        if rec.overlay is not None:
            return tuple(rec.overlay) == tuple(shown)
        # a publish stopped between the mount and the record: ask the mount table (rare path)
        top = mounts.top_mount(target)
        upper = os.path.join(self.dir_of(target), "upper")
        return (top is not None and top.fstype == "overlay" and top.source == SOURCE
                and f"upperdir={upper}" in top.super_options.split(","))

    # -- making and taking away ----------------------------------------------------------------

    def create(self, target: str, lower: str, size: int, flags: int, digest: str, at: str | None = None,
               capture: dict | None = None) -> None:
        """Mount a view of ``lower`` at ``target`` (an empty directory) with a ``size``-byte
        writable layer; ``flags``: nosuid, nodev (always) and noexec. ``at``: the path the overlay
        is mounted on, when not ``target`` (``/proc/self/fd/N`` of the directory the caller holds
        open). Any failure undoes it all."""
        check_path(lower, "cache directory")
        d = self.dir_of(target)
        self.remove(target)  # what a crashed publish or unpublish left
        flags |= mounts.MS_NOSUID | mounts.MS_NODEV
        os.mkdir(d, 0o700)
        try:
            mounts.mount(SOURCE, d, "tmpfs", mounts.MS_NOSUID | mounts.MS_NODEV,
                         f"size={size},nr_inodes={inodes_for(size)},mode=0700")
            upper, work = os.path.join(d, "upper"), os.path.join(d, "work")
            os.mkdir(work, 0o700)
            _writable_dirs(lower, upper)
            self._write(d, Record(target, digest, size, None, capture))
            mounts.mount(SOURCE, at or target, "overlay", flags, f"lowerdir={lower},upperdir={upper},workdir={work}")
            try:
                got = mounts.options_at(target) if mounts.is_mountpoint(target) else None
                if got is None or "ro" in got or not mounts.options_of(flags) <= got:
                    raise OSError(errno.EPERM, f"{target} is not mounted {sorted(mounts.options_of(flags))} "
                                               f"after the overlay mount (it has {sorted(got or [])})", target)
                self._write(d, Record(target, digest, size, mounts.mounted_root(target), capture))
            except BaseException as e:
                mounts.undo(at or target, e)
                raise
        except BaseException:
            self._teardown(d)
            raise
        log.info("copy-on-write view made", extra=kv(target=target, digest=digest, size=size, view=d))

    @staticmethod
    def _write(d: str, rec: Record) -> None:
        # on the view's own tmpfs: gone at reboot with the view, so not flushed
        atomic.write(os.path.join(d, RECORD), json.dumps({"target": rec.target, "digest": rec.digest, "size": rec.size,
                                                          "overlay": list(rec.overlay) if rec.overlay else None,
                                                          "capture": rec.capture}),
                     durable=False)

    def upper_of(self, target: str) -> str:
        """The writable layer of the view of ``target`` (what the agent reads at unpublish)."""
        return os.path.join(self.dir_of(target), "upper")

    def remove(self, target: str) -> bool:
        """Take the view directory of ``target`` away (its tmpfs, then the directory); the caller
        has unmounted the overlay at ``target`` first. True when there was one."""
        d = self.dir_of(target)
        if not os.path.lexists(d):
            return False
        self._teardown(d)
        return True

    @staticmethod
    def _teardown(d: str) -> None:
        for _ in range(MAX_STACKED):
            if not mounts.is_mountpoint(d):
                break
            # callers unmount the overlay first: the kernel would let this tmpfs go even while an
            # overlay uses it as its upper layer (overlayfs holds a private clone of the mount)
            mounts.unmount(d)
        else:
            raise OSError(errno.EBUSY, f"{d} still mounted after {MAX_STACKED} unmounts", d)
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass

    def sweep(self) -> int:
        """At start: take away every view whose target no longer shows its overlay."""
        swept = 0
        for name in sorted(os.listdir(self.root)):
            d = os.path.join(self.root, name)
            rec = None
            try:
                rec = self._read(d) if mounts.is_mountpoint(d) else None
                if (rec is not None and self.dir_of(rec.target) == d
                        and self.ours(rec.target, mounts.mounted_root(rec.target), rec)):
                    continue
                self._teardown(d)
                swept += 1
                log.info("orphaned view removed", extra=kv(view=d, target=rec.target if rec else None))
            except OSError as e:
                log.error("cannot remove an orphaned view", extra=kv(view=d, error=str(e)))
        return swept

    # -- accounting ----------------------------------------------------------------------------

    def usage(self) -> list[tuple[int, int]]:
        """(bytes used, size) of each view's tmpfs."""
        out = []
        try:
            names = os.listdir(self.root)
        except OSError:
            return out
        for name in names:
            d = os.path.join(self.root, name)
            try:
                if not mounts.is_mountpoint(d):
                    continue
                st = os.statvfs(d)
            except OSError:
                continue
            out.append(((st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize))
        return out


def _writable_dirs(lower: str, upper: str) -> None:
    """The upper layer's root and its copies of the cache's top-level directories (io.<kind>.cache/
    ...), mode 1777 like /tmp: the overlay shows their attributes, so a pod of any uid may add
    entries there (the lower directories are root's 0755); deeper entries keep the store's modes."""
    os.mkdir(upper)
    os.chmod(upper, 0o1777)
    for entry in os.scandir(lower):
        if entry.is_dir(follow_symlinks=False):
            p = os.path.join(upper, entry.name)
            os.mkdir(p)
            os.chmod(p, 0o1777)
