"""Read-only bind mounts through mount(2)/umount2(2), and questions about one mount point that
cost the same whatever the size of the node's mount table (docs/csi.md).

Invariant: publish and unpublish never read /proc/self/mountinfo (a busy node holds thousands of
mounts). Whether a path is a mount point and what it shows is one statx(2)
(:func:`mounted_root`; ``STATX_ATTR_MOUNT_ROOT`` sees a same-filesystem bind mount that
``os.path.ismount`` cannot); its options are statvfs(2)'s (:func:`options_at`). The mount table
is read only on kernels before 5.8, to describe a mount in an error, and by tests; paths are
compared in its escaped, resolved form (:func:`resolve`).

A publish mounts onto a directory it holds open (:func:`target_dir`), never onto a path looked
up again after its checks: a bind is attached there with open_tree(2)/move_mount(2)
(:func:`bind_readonly_at`, Linux 5.2), other mounts go through ``/proc/self/fd/N``
(:func:`fd_path`), so a symlink swapped in for the target after the checks is never followed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
from dataclasses import dataclass

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH, MOVE_MOUNT_T_EMPTY_PATH = 0x1, 0x4, 0x40
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429  # one number on every architecture (added in Linux 5.2)
AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_NO_AUTOMOUNT = -100, 0x100, 0x800
STATX_TYPE, STATX_INO, STATX_ATTR_MOUNT_ROOT = 0x1, 0x100, 0x2000
# mount option name -> flag, for the options a read-only cache mount may carry
FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
ALWAYS = MS_RDONLY | MS_NOSUID | MS_NODEV
_libc = ctypes.CDLL(None, use_errno=True)
_OCTAL = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    point: str
    options: frozenset[str]  # the per-mount options (mountinfo field 6): ro, nosuid, ...
    root: str = "/"  # the directory of its filesystem the mount shows
    fstype: str = ""
    source: str = ""
    super_options: str = ""  # the filesystem's options (mountinfo's last field)


class _Statx(ctypes.Structure):
    """struct statx (linux/stat.h), 256 bytes; the fields read here and padding for the rest."""

    _fields_ = [("mask", ctypes.c_uint32), ("blksize", ctypes.c_uint32), ("attributes", ctypes.c_uint64),
                ("nlink", ctypes.c_uint32), ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32),
                ("mode", ctypes.c_uint16), ("_spare0", ctypes.c_uint16), ("ino", ctypes.c_uint64),
                ("size", ctypes.c_uint64), ("blocks", ctypes.c_uint64), ("attributes_mask", ctypes.c_uint64),
                ("_times", ctypes.c_uint8 * 64), ("rdev_major", ctypes.c_uint32), ("rdev_minor", ctypes.c_uint32),
                ("dev_major", ctypes.c_uint32), ("dev_minor", ctypes.c_uint32), ("_rest", ctypes.c_uint8 * 112)]


def _check(rc: int, what: str, path) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what} {path}: {os.strerror(e)}", str(path))


def options_of(flags: int) -> frozenset[str]:
    return frozenset(name for name, flag in FLAGS.items() if flags & flag)


def bind_readonly(source: str | os.PathLike, target: str | os.PathLike, extra_flags: int = 0) -> None:
    """Bind ``source`` at ``target``, then remount it read-only, nosuid, nodev (| ``extra_flags``).

    Checks that the mount now at ``target`` carries those options. When any step after the
    bind fails the bind is undone, so no writable mount is ever left at ``target``.
    """
    src, dst = os.fsencode(source), os.fsencode(target)
    flags = ALWAYS | extra_flags
    _check(_libc.mount(src, dst, None, MS_BIND, None), "bind mount onto", target)
    try:
        _check(_libc.mount(None, dst, None, MS_BIND | MS_REMOUNT | flags, None), "read-only remount of", target)
        got = options_at(target) if is_mountpoint(target) else None
        if got is None or not options_of(flags) <= got:
            raise OSError(errno.EROFS, f"{target} lacks {sorted(options_of(flags))} after the remount "
                                       f"(it has: {sorted(got) if got is not None else 'not mounted'})", str(target))
    except BaseException as e:
        undo(target, e)
        raise


@contextlib.contextmanager
def target_dir(path: str, *, create: bool, mode: int = 0o750):
    """A descriptor of the directory ``path`` (created first when ``create``), opened without
    following a symlink at its last component (ENOTDIR, ELOOP); mounts made through it
    (:func:`bind_readonly_at`, or mount(2) on :func:`fd_path`) land on that very directory
    whatever happens to the name afterwards. Readable: ``os.listdir(fd)`` checks it is empty."""
    parent, name = os.path.split(path)
    pfd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if create:
            os.mkdir(name, mode, dir_fd=pfd)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
    finally:
        os.close(pfd)
    try:
        yield fd
    finally:
        os.close(fd)


def fd_path(fd: int) -> str:
    """The path that names exactly what ``fd`` refers to, for a call that takes paths only."""
    return f"/proc/self/fd/{fd}"


def bind_readonly_at(source: str | os.PathLike, target_fd: int, extra_flags: int = 0, name: str = "") -> None:
    """:func:`bind_readonly` onto the directory ``target_fd`` refers to (``name``: for errors):
    ``source`` is cloned as a detached mount (open_tree), attached onto ``target_fd``
    (move_mount), then remounted read-only, nosuid, nodev (| ``extra_flags``) through the
    clone's own descriptor and checked; any failure takes the mount away again."""
    flags = ALWAYS | extra_flags
    name = name or fd_path(target_fd)
    tree = _libc.syscall(ctypes.c_long(SYS_OPEN_TREE), ctypes.c_int(AT_FDCWD), os.fsencode(source),
                         ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC))
    _check(0 if tree >= 0 else -1, "open_tree of", source)
    try:
        _check(_libc.syscall(ctypes.c_long(SYS_MOVE_MOUNT), ctypes.c_int(tree), b"", ctypes.c_int(target_fd), b"",
                             ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)), "bind mount onto", name)
        try:
            _check(_libc.mount(None, os.fsencode(fd_path(tree)), None, MS_BIND | MS_REMOUNT | flags, None),
                   "read-only remount of", name)
            got = options_of(os.fstatvfs(tree).f_flag)
            if not options_of(flags) <= got:
                raise OSError(errno.EROFS, f"{name} lacks {sorted(options_of(flags))} after the remount "
                                           f"(it has: {sorted(got)})", name)
        except BaseException as e:
            os.close(tree)  # an open descriptor of the mount would keep it busy
            tree = -1
            undo(fd_path(target_fd), e)
            raise
    finally:
        if tree >= 0:
            os.close(tree)


def mount(source: str, target: str | os.PathLike, fstype: str, flags: int, data: str) -> None:
    """mount(2) of a ``fstype`` file system (tmpfs, overlay) at ``target`` with ``data`` options."""
    _check(_libc.mount(os.fsencode(source), os.fsencode(target), os.fsencode(fstype), flags, os.fsencode(data)),
           f"{fstype} mount onto", target)


def undo(target, cause: BaseException) -> None:
    """Take a just-made bind mount away. Nothing can hold it yet; if something does anyway, a
    lazy detach still removes it from the tree: a writable mount must not outlive this call."""
    for flags in (0, MNT_DETACH):
        if _libc.umount2(os.fsencode(target), flags) == 0:
            return
    e = ctypes.get_errno()
    raise OSError(e, f"cannot undo the mount at {target} after: {cause}: {os.strerror(e)}", str(target)) from cause


def unmount(target: str | os.PathLike) -> None:
    """Unmount the top mount at ``target``; a busy mount is an error (EBUSY), never detached lazily.
    A symlink at ``target`` is not followed (EINVAL: nothing is mounted on the link itself)."""
    _check(_libc.umount2(os.fsencode(target), UMOUNT_NOFOLLOW), "unmount", target)


def resolve(path: str | os.PathLike) -> str:
    """``path`` as the mount table names it: absolute, normalised, symlinks resolved."""
    return os.path.realpath(path)


def _unescape(field: bytes) -> str:
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def mounts() -> list[Mount]:
    """Every mount in this process's mount namespace, in mount order (later ones on top).
    Linear in the mount table: for errors, old kernels and tests, never a publish's common path."""
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            x = line.split()
            after = x.index(b"-")  # optional fields (shared:N, master:N) end at a lone "-"
            out.append(Mount(_unescape(x[4]), frozenset(x[5].decode().split(",")), _unescape(x[3]),
                             _unescape(x[after + 1]), _unescape(x[after + 2]),
                             _unescape(x[after + 3]) if len(x) > after + 3 else ""))
    return out


def mount_points() -> set[str]:
    return {m.point for m in mounts()}


def top_mount(path: str | os.PathLike) -> Mount | None:
    """The mount visible at ``path`` when ``path`` is a mount point, else None (reads the table)."""
    p = resolve(path)
    return next((m for m in reversed(mounts()) if m.point == p), None)


def _statx(path: str | os.PathLike) -> _Statx | None:
    """statx(2) of ``path`` itself (a symlink is not followed, a mount on it is); None when this
    kernel or C library cannot say whether it is a mount's root."""
    if not hasattr(_libc, "statx"):
        return None
    buf = _Statx()
    _check(_libc.statx(AT_FDCWD, os.fsencode(path), AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT,
                       STATX_TYPE | STATX_INO, ctypes.byref(buf)), "statx", path)
    return buf if buf.attributes_mask & STATX_ATTR_MOUNT_ROOT else None


def mounted_root(path: str | os.PathLike) -> tuple[int, int] | None:
    """When ``path`` is a mount point, the (st_dev, st_ino) of the directory its top mount shows
    (for a bind mount: of the source directory); None when it is not one or does not exist."""
    try:
        st = _statx(path)
        if st is not None:
            if not st.attributes & STATX_ATTR_MOUNT_ROOT:
                return None
            return os.makedev(st.dev_major, st.dev_minor), st.ino
        if top_mount(path) is None:  # kernels before 5.8
            return None
        return identity(path)
    except (FileNotFoundError, NotADirectoryError):  # OSError(ENOENT, ...) is made a FileNotFoundError
        return None


def is_mountpoint(path: str | os.PathLike) -> bool:
    return mounted_root(path) is not None


def options_at(path: str | os.PathLike) -> frozenset[str]:
    """The options of :data:`FLAGS` that the mount visible at ``path`` carries (statvfs f_flag;
    ``ro`` also when the whole filesystem is read-only)."""
    return options_of(os.statvfs(path).f_flag)


def identity(path: str | os.PathLike) -> tuple[int, int]:
    """(st_dev, st_ino) of ``path`` itself (not following a symlink)."""
    st = os.stat(path, follow_symlinks=False)
    return st.st_dev, st.st_ino


def describe(path: str | os.PathLike) -> str:
    """What the top mount at ``path`` is, for an error message (reads the mount table)."""
    top = top_mount(path)
    if top is None:
        return "nothing mounted"
    return f"{top.fstype} {top.source} (its {top.root}, mounted {','.join(sorted(top.options))})"


def same_directory(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when ``a`` shows the very directory ``b`` is (a bind mount of it, or itself)."""
    sa, sb = os.stat(a), os.stat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
