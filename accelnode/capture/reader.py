"""Reading a view's writable layer as hostile input.

A pod wrote the layer, and may still be writing it. The walk holds each directory open and names
every child relative to it (``dir_fd``, ``O_NOFOLLOW``): no symlink is ever followed, and a
directory swapped for a symlink mid-walk fails the open instead of leading out. Each file is
opened without following, checked with ``fstat`` on the open descriptor (so what is checked is
what is read) and copied into memory under :class:`CaptureLimits`.

Refused (the whole layer, :class:`Poisoned`): a symlink, a device node other than overlayfs's
whiteout (char 0/0, a deletion, which is skipped), a FIFO or socket, a set-uid, set-gid or sticky
regular file, a hard link (a file with ``st_nlink > 1`` on the view's own tmpfs), a name that is
not valid UTF-8 or is longer than the kernel's limits, more files, bytes or depth than the limits.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from .errors import Poisoned

NAME_MAX = 255


@dataclass(frozen=True)
class CaptureLimits:
    max_files: int = 20_000  # files (and directories) of one contribution
    # Content bytes of one contribution, all files together. It is read into memory (and a
    # publication holds at most this much of compressed contributions, fetch_within), so it is
    # sized by the agent's and the controller's memory limits (256Mi each), not by how large a
    # cache may grow: a larger capture is refused whole with its reason.
    max_bytes: int = 32 << 20
    max_file_bytes: int = 32 << 20  # one file
    max_depth: int = 16  # directories deep
    max_path: int = 1024  # bytes of one relative path


def read_layer(upper: str, limits: CaptureLimits = CaptureLimits()) -> dict[str, bytes]:
    """``{relative path: content}`` of every regular file under the directory ``upper`` (itself
    opened without following a symlink); whiteouts skipped. :class:`Poisoned` for anything the
    module's rules refuse."""
    try:
        root = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise Poisoned(f"the writable layer {upper!r} cannot be opened as a directory: {e.strerror}") from None
    out: dict[str, bytes] = {}
    counts = [0, 0]  # entries, bytes
    try:
        _walk(root, "", 0, out, counts, limits)
    finally:
        os.close(root)
    return out


def _walk(dfd: int, prefix: str, depth: int, out: dict, counts: list, limits: CaptureLimits) -> None:
    if depth > limits.max_depth:
        raise Poisoned(f"{prefix!r} is more than {limits.max_depth} directories deep")
    try:
        with os.scandir(dfd) as it:
            names = sorted(e.name for e in it)
    except OSError as e:
        raise Poisoned(f"directory {prefix or '.'!r} cannot be listed ({e.strerror})") from None
    for name in names:
        rel = f"{prefix}{_checked_name(name, prefix)}"
        if len(os.fsencode(rel)) > limits.max_path:
            raise Poisoned(f"path {rel[:120]!r}... is longer than {limits.max_path} bytes")
        counts[0] += 1
        if counts[0] > limits.max_files:
            raise Poisoned(f"more than {limits.max_files} entries (the capture file limit)")
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError as e:
            raise Poisoned(f"{rel!r} changed while read ({e.strerror})") from None
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except OSError as e:
                raise Poisoned(f"directory {rel!r} changed while read ({e.strerror})") from None
            try:
                _walk(sub, rel + "/", depth + 1, out, counts, limits)
            finally:
                os.close(sub)
        elif stat.S_ISREG(mode):
            out[rel] = _read_file(dfd, name, rel, counts, limits)
        elif stat.S_ISCHR(mode) and st.st_rdev == 0:
            continue  # overlayfs whiteout: the pod deleted a base entry; deletions are not contributed
        elif stat.S_ISLNK(mode):
            raise Poisoned(f"symlink {rel!r} (no cache kind writes symlinks; none is followed or kept)")
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            raise Poisoned(f"device node {rel!r}")
        else:
            raise Poisoned(f"{rel!r} is not a regular file or directory (FIFO or socket)")


def _checked_name(name: str, prefix: str) -> str:
    try:
        os.fsencode(name).decode("utf-8")
    except UnicodeDecodeError:
        raise Poisoned(f"a name under {prefix!r} is not UTF-8: {name!r}") from None
    if len(os.fsencode(name)) > NAME_MAX or any(c in name for c in "\n\r\0"):
        raise Poisoned(f"name {name[:80]!r} under {prefix!r} is too long or has control characters")
    return name


def _read_file(dfd: int, name: str, rel: str, counts: list, limits: CaptureLimits) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        raise Poisoned(f"{rel!r} cannot be opened without following a link ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Poisoned(f"{rel!r} changed type while read")
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
            raise Poisoned(f"{rel!r} is set-uid, set-gid or sticky (mode {stat.S_IMODE(st.st_mode):o})")
        if st.st_nlink > 1:
            raise Poisoned(f"{rel!r} has {st.st_nlink} hard links (a cache entry has one)")
        if st.st_size > limits.max_file_bytes:
            raise Poisoned(f"{rel!r} is {st.st_size} bytes, more than {limits.max_file_bytes} (one file's limit)")
        chunks, got = [], 0
        while True:  # read to the end, never past a bound: the pod may grow the file meanwhile
            chunk = os.read(fd, min(1 << 20, limits.max_file_bytes + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if got > limits.max_file_bytes:
                raise Poisoned(f"{rel!r} grew past {limits.max_file_bytes} bytes while read")
        counts[1] += got
        if counts[1] > limits.max_bytes:
            raise Poisoned(f"more than {limits.max_bytes} bytes of content (the capture size limit)")
        return b"".join(chunks)
    finally:
        os.close(fd)
