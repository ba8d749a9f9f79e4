"""Read-only bind mounts through mount(2)/umount2(2), and the mount table as the source of truth.

A bind mount of a directory on the same filesystem is invisible to ``os.path.ismount`` (same
st_dev as the parent), so mount points are read from /proc/self/mountinfo. The kernel writes
them fully resolved (no symlinks) with space, tab, newline and backslash octal-escaped, so paths
are compared in that form (:func:`resolve`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from dataclasses import dataclass

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MNT_DETACH = 2
# mount option name -> flag, for the options a read-only cache mount may carry
FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
ALWAYS = MS_RDONLY | MS_NOSUID | MS_NODEV
_libc = ctypes.CDLL(None, use_errno=True)
_OCTAL = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    point: str
    options: frozenset[str]  # the per-mount options (mountinfo field 6): ro, nosuid, ...


def _check(rc: int, what: str, path) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what} {path}: {os.strerror(e)}", str(path))


def options_of(flags: int) -> frozenset[str]:
    return frozenset(name for name, flag in FLAGS.items() if flags & flag)


def bind_readonly(source: str | os.PathLike, target: str | os.PathLike, extra_flags: int = 0) -> None:
    """Bind ``source`` at ``target``, then remount it read-only, nosuid, nodev (| ``extra_flags``).

    Checks in the mount table that the result carries those options. When any step after the
    bind fails the bind is undone, so no writable mount is ever left at ``target``.
    """
    src, dst = os.fsencode(source), os.fsencode(target)
    flags = ALWAYS | extra_flags
    _check(_libc.mount(src, dst, None, MS_BIND, None), "bind mount onto", target)
    try:
        _check(_libc.mount(None, dst, None, MS_BIND | MS_REMOUNT | flags, None), "read-only remount of", target)
        top = top_mount(target)
        if top is None or not options_of(flags) <= top.options:
            raise OSError(errno.EROFS, f"{target} lacks {sorted(options_of(flags))} after the remount "
                                       f"(mount table: {sorted(top.options) if top else 'not mounted'})", str(target))
    except BaseException as e:
        _undo(target, e)
        raise


def _undo(target, cause: BaseException) -> None:
    """Take a just-made bind mount away. Nothing can hold it yet; if something does anyway, a
    lazy detach still removes it from the tree: a writable mount must not outlive this call."""
    for flags in (0, MNT_DETACH):
        if _libc.umount2(os.fsencode(target), flags) == 0:
            return
    e = ctypes.get_errno()
    raise OSError(e, f"cannot undo the mount at {target} after: {cause}: {os.strerror(e)}", str(target)) from cause


def unmount(target: str | os.PathLike) -> None:
    """Unmount the top mount at ``target``; a busy mount is an error (EBUSY), never detached lazily."""
    _check(_libc.umount2(os.fsencode(target), 0), "unmount", target)


def resolve(path: str | os.PathLike) -> str:
    """``path`` as the mount table names it: absolute, normalised, symlinks resolved."""
    return os.path.realpath(path)


def _unescape(field: bytes) -> str:
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def mounts() -> list[Mount]:
    """Every mount in this process's mount namespace, in mount order (later ones on top)."""
    with open("/proc/self/mountinfo", "rb") as f:
        fields = [line.split() for line in f]
    return [Mount(_unescape(x[4]), frozenset(x[5].decode().split(","))) for x in fields]


def mount_points() -> set[str]:
    return {m.point for m in mounts()}


def top_mount(path: str | os.PathLike) -> Mount | None:
    """The mount visible at ``path`` when ``path`` is a mount point, else None."""
    p = resolve(path)
    return next((m for m in reversed(mounts()) if m.point == p), None)


def is_mountpoint(path: str | os.PathLike) -> bool:
    return top_mount(path) is not None


def same_directory(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when ``a`` shows the very directory ``b`` is (a bind mount of it, or itself)."""
    sa, sb = os.stat(a), os.stat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
