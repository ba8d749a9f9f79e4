"""Replacing a small file atomically, and sweeping what a crash left of such a write.

Every daemon that keeps a file a reader must never see half written (the agent's references and
indexes, a copy-on-write view's record, a DRA claim's CDI spec and checkpoint, the webhook's
serving key and certificate) writes it through :func:`write`: a temporary file beside it, then a
rename over it. Invariants:

* a reader sees the old file or the new one, never a part;
* no error (a full file system, a quota, a signal) leaves the temporary file behind: it is
  removed before the error goes on;
* only a process killed between the create and the rename leaves one; :func:`sweep` removes such
  leftovers at the next start. Temporary names are ``.<name>.<pid>.<thread>.tmp``, so two
  writers of one file never share one.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from pathlib import Path

# ours, and the ``.<name>.tmp`` of releases before this module existed
TEMPORARY = re.compile(r"^\.(?P<name>.+?)(\.\d+\.\d+)?\.tmp$")


def write(path: str | os.PathLike, data: bytes | str, *, mode: int = 0o644, durable: bool = True) -> None:
    """Make ``path`` hold ``data`` (created with ``mode``); ``durable``: the file and its directory
    entry are on disk before this returns. Raises the OSError of the failed step, with nothing of
    this write left on disk."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a killed writer that had this process and thread id
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename or unlink in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sweep(directory: str | os.PathLike, *, prefix: str = "", min_age: float = 0.0) -> list[Path]:
    """Remove the temporary files of interrupted :func:`write` calls directly in ``directory``
    (not below it) for files whose name starts with ``prefix`` (a directory shared with other
    programs), last changed at least ``min_age`` seconds ago (0: all of them; callers that may
    run beside a live writer in another process pass a bound far beyond one write). The paths
    removed; a missing directory has none."""
    removed = []
    cutoff = time.time() - min_age
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = TEMPORARY.match(entry.name)
        if m is None or not m["name"].startswith(prefix) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            if min_age and entry.stat(follow_symlinks=False).st_mtime > cutoff:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(Path(entry.path))
    return removed
