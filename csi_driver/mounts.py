"""Read-only bind mounts through mount(2)/umount2(2), and the mount table as the source of truth.

A bind mount of a directory on the same filesystem is invisible to ``os.path.ismount`` (same
st_dev as the parent), so :func:`is_mountpoint` reads /proc/self/mountinfo instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x20, 0x1000
_libc = ctypes.CDLL(None, use_errno=True)
_OCTAL = re.compile(r"\\([0-7]{3})")


def _check(rc: int, what: str, path) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what} {path}: {os.strerror(e)}", str(path))


def bind_readonly(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Bind ``source`` at ``target``, then remount it read-only, nosuid, nodev.

    Leaves nothing mounted when any step fails, and checks the result really is read-only.
    """
    src, dst = os.fsencode(source), os.fsencode(target)
    _check(_libc.mount(src, dst, None, MS_BIND, None), "bind mount onto", target)
    try:
        _check(_libc.mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None),
               "read-only remount of", target)
        if not is_readonly(target):
            raise OSError(errno.EROFS, f"{target} is still writable after the read-only remount", str(target))
    except BaseException:
        unmount(target)
        raise


def unmount(target: str | os.PathLike) -> None:
    _check(_libc.umount2(os.fsencode(target), 0), "unmount", target)


def is_readonly(path: str | os.PathLike) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def mount_points() -> set[str]:
    """Every mount point in this process's mount namespace."""
    with open("/proc/self/mountinfo", "rb") as f:
        return {_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), line.split()[4].decode(errors="surrogateescape"))
                for line in f}


def is_mountpoint(path: str | os.PathLike) -> bool:
    return os.path.abspath(path) in mount_points()


def same_directory(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when ``a`` shows the very directory ``b`` is (a bind mount of it, or itself)."""
    sa, sb = os.stat(a), os.stat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)

