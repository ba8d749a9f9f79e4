"""Streaming, hostile-input-safe extraction of image layers, and the merge of layers in order
(docs/cache-format.md lists what is refused).

Each layer unpacks from its digest-checked stream into its own directory (layers unpack in
parallel); :func:`merge` applies them in order, whiteouts honoured, with renames only.

Invariants: nothing here follows a symlink (every parent is checked with ``lstat`` before
anything is created or removed under it), so no entry, whiteout or hardlink reaches outside the
tree; a layer's in-memory ``entries`` always mirror what is on disk; modes and owners come from
us, never from the tar. Everything is bounded by :class:`Limits`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import posixpath
import shutil
import stat
import tarfile
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from accelnode.oci.limits import Limits


def inflater():
    """The module gzip layers inflate with: ISA-L's ``isal_zlib`` (about 2.5x zlib's rate on a
    pull's data; bench/bench_cache.py prints both) where the optional ``isal`` package is
    installed, else ``zlib`` (the same interface). Imported at the first gzip layer, not before:
    a node whose caches are zstd or uncompressed never maps it."""
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib
    return isal_zlib


CHUNK = 512 << 10  # per-read size: 8 layers in parallel stay well under 100 MB RSS
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_META_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
               tarfile.SOLARIS_XHDTYPE)
_MAX_META = 1 << 20  # a pax or GNU long-name header larger than this is a bomb, not a name
_MAX_META_CHAIN = 8  # metadata headers in a row before one member (tarfile recurses per header)
NAME_MAX, PATH_MAX = 255, 4095  # bytes of one path component / of a whole name or link target
_RATIO_FLOOR = 16 << 20  # compression ratio is judged once a layer has produced this much


class Refused(Exception):
    """Raised inside extraction; the store turns it into HostileContent naming the image."""


class Budget:
    """Limits shared by every layer of one image, plus the flag that stops them all."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.bytes = self.files = 0
        self.cancelled = threading.Event()
        self._lock = threading.Lock()

    def charge(self, nbytes: int) -> None:
        with self._lock:
            self.files += 1
            self.bytes += nbytes
            if self.files > self.limits.max_files:
                raise Refused(f"more than {self.limits.max_files} entries (the per-image limit, --max-image-files)")
            if self.bytes > self.limits.max_bytes:
                raise Refused(f"more than {self.limits.max_bytes} bytes of file content (the per-image limit, "
                              "--max-image-size)")

    def attempt(self) -> _Attempt:
        """A budget for one try at one layer: it charges this one, and what it charged can be
        given back when the layer is fetched again from another host."""
        return _Attempt(self)

    def refund(self, files: int, nbytes: int) -> None:
        with self._lock:
            self.files -= files
            self.bytes -= nbytes


class _Attempt:
    def __init__(self, budget: Budget):
        self.budget, self.limits, self.cancelled = budget, budget.limits, budget.cancelled
        self.files = self.bytes = 0

    def charge(self, nbytes: int) -> None:
        self.files += 1
        self.bytes += nbytes
        self.budget.charge(nbytes)

    def refund(self) -> None:
        self.budget.refund(self.files, self.bytes)
        self.files = self.bytes = 0


@dataclass(frozen=True)
class Entry:
    """One path of an extracted tree as verify re-checks it."""

    type: str  # "dir" | "file" | "symlink"
    mode: int
    size: int = 0
    sha256: str = ""
    target: str = ""  # symlink target

    def as_json(self) -> list:
        return [self.type, self.mode, self.size, self.sha256 or self.target]

    @classmethod
    def from_json(cls, v: list) -> Entry:
        t, mode, size, extra = v
        return cls(t, mode, size, extra if t == "file" else "", extra if t == "symlink" else "")


@dataclass
class Layer:
    root: Path
    entries: dict[str, Entry] = field(default_factory=dict)
    whiteouts: list[str] = field(default_factory=list)
    opaque: list[str] = field(default_factory=list)
    implicit: set[str] = field(default_factory=set)  # parent dirs with no entry of their own


class _Gunzip:
    """gzip (possibly multi-member) decompression of a raw stream, ``read(n)`` at a time, by
    ``lib`` (:func:`inflater`'s unless told)."""

    def __init__(self, raw, lib=None):
        self._raw = raw
        self._lib = lib or inflater()
        self._d = self._lib.decompressobj(31)

    def read(self, n: int) -> bytes:
        while True:
            if self._d.eof:
                pending = self._d.unused_data or self._raw.read(CHUNK)
                if not pending:
                    return b""
                self._d = self._lib.decompressobj(31)
            else:
                pending = self._d.unconsumed_tail or self._raw.read(CHUNK)
                if not pending:
                    raise Refused("gzip stream ends before its end marker")
            try:
                out = self._d.decompress(pending, n)
            except (zlib.error, self._lib.error) as e:
                raise Refused(f"not a valid gzip stream ({e})") from None
            if out:
                return out


class _Metered:
    """Counts uncompressed bytes; stops compression bombs and cancelled pulls."""

    def __init__(self, src, raw, budget: Budget):
        self._src, self._raw, self._budget = src, raw, budget
        self.out = 0
        self._cap = budget.limits.max_tar_bytes

    def read(self, n: int = CHUNK) -> bytes:
        if self._budget.cancelled.is_set():
            raise Refused("cancelled: another layer of this image failed")
        data = self._src.read(n)
        self.out += len(data)
        ratio = self._budget.limits.max_ratio
        if self.out > _RATIO_FLOOR and self.out > ratio * max(self._raw.offset, 1):
            raise Refused(f"compression ratio over {ratio}:1 (decompression bomb)")
        if self.out > self._cap:
            raise Refused(f"layer expands past {self._cap} bytes (what --max-image-size and --max-image-files allow)")
        return data


class _TarInfo(tarfile.TarInfo):
    def _proc_member(self, tf):
        if self.type not in _META_TYPES:
            return super()._proc_member(tf)
        if self.size > _MAX_META:
            raise Refused(f"tar metadata header of {self.size} bytes (limit {_MAX_META})")
        depth = getattr(tf, "_meta_depth", 0)  # tarfile recurses once per header of a chain
        if depth >= _MAX_META_CHAIN:
            raise Refused(f"more than {_MAX_META_CHAIN} tar metadata headers in a row")
        tf._meta_depth = depth + 1
        try:
            return super()._proc_member(tf)
        finally:
            tf._meta_depth = depth


def decompressor(blob, compression: str | None):
    if compression == "gzip":
        return _Gunzip(blob)
    if compression == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(blob, read_size=CHUNK, read_across_frames=True)
    return blob


def clean_name(name: str) -> str | None:
    """Relative, normalised member name; None for the root itself. Refuses escapes."""
    if "\0" in name:
        raise Refused(f"member name with a NUL byte: {name!r}")
    if name.startswith("/"):
        raise Refused(f"absolute member name {_short(name)!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"member name {_short(name)!r} contains '..'")
    _check_length(name, "member name")
    return "/".join(parts) or None


def _check_length(name: str, what: str) -> None:
    if len(os.fsencode(name)) > PATH_MAX:
        raise Refused(f"{what} {_short(name)!r} is longer than {PATH_MAX} bytes")
    if any(len(os.fsencode(p)) > NAME_MAX for p in name.split("/")):
        raise Refused(f"{what} {_short(name)!r} has a component longer than {NAME_MAX} bytes")


def _short(name: str) -> str:
    return name if len(name) <= 200 else f"{name[:120]}...({len(name)} chars)"


def extract_layer(blob, compression: str | None, dest: Path, budget: Budget) -> Layer:
    """Unpack one layer from ``blob`` (a verifying BlobStream) into the new directory ``dest``."""
    mkdir(dest)
    layer = Layer(dest)
    stream = _Metered(decompressor(blob, compression), blob, budget)
    try:
        tf = tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK, tarinfo=_TarInfo)
        while (m := tf.next()) is not None:
            tf.members.clear()  # stream mode keeps every header otherwise
            _extract_member(tf, m, layer, budget)
        tf.close()
    except tarfile.TarError as e:
        raise Refused(f"not a valid tar stream ({e})") from None
    except zstandard.ZstdError as e:
        raise Refused(f"not a valid zstd stream ({e})") from None
    except RecursionError:
        raise Refused("tar metadata headers nested too deeply") from None
    blob.drain()  # verifies the digest, including any bytes after the tar's end
    return layer


def _extract_member(tf: tarfile.TarFile, m: tarfile.TarInfo, layer: Layer, budget: Budget) -> None:
    name = clean_name(m.name)
    if name is None:
        return
    parent, base = posixpath.split(name)
    if base.startswith(WHITEOUT):
        budget.charge(0)
        if base == OPAQUE:
            layer.opaque.append(parent)
        elif base[len(WHITEOUT):] in ("", ".", ".."):
            raise Refused(f"malformed whiteout {m.name!r}")
        else:
            layer.whiteouts.append(posixpath.join(parent, base[len(WHITEOUT):]))
        return
    if m.size < 0:
        raise Refused(f"{m.name!r} has a negative size ({m.size})")
    if m.type == tarfile.GNUTYPE_SPARSE or m.sparse is not None:
        raise Refused(f"sparse file {m.name!r} (not allowed in a cache layer)")
    budget.charge(m.size if m.isreg() else 0)
    _make_parents(layer, parent, m.name, budget)
    path = layer.root / name
    old = layer.entries.get(name)
    if old is not None and not (old.type == "dir" and m.isdir()):
        delete(layer.root, layer.entries, name)
    if m.isdir():
        if old is None or old.type != "dir":
            mkdir(path)
        layer.entries[name] = Entry("dir", 0o755)
        layer.implicit.discard(name)
    elif m.isreg():
        mode = 0o755 if m.mode & 0o111 else 0o644
        layer.entries[name] = _write_file(tf.extractfile(m), path, mode, m.size, m.name)
    elif m.issym():
        target = m.linkname
        if not target or target.startswith("/") or "\0" in target:
            raise Refused(f"symlink {m.name!r} -> {_short(target)!r} is absolute or empty")
        _check_length(target, f"symlink {m.name!r} target")
        resolved = posixpath.normpath(posixpath.join(parent, target))
        if resolved == ".." or resolved.startswith("../"):
            raise Refused(f"symlink {m.name!r} -> {target!r} points outside the cache")
        os.symlink(target, path)
        layer.entries[name] = Entry("symlink", 0o777, target=target)
    elif m.islnk():
        target = clean_name(m.linkname)
        entry = layer.entries.get(target or "")
        if entry is None or entry.type != "file":
            raise Refused(f"hardlink {m.name!r} -> {m.linkname!r} does not name a regular file earlier in this layer")
        os.link(real_path(layer.root, target), path, follow_symlinks=False)
        layer.entries[name] = entry
    elif m.ischr() or m.isblk():
        raise Refused(f"device node {m.name!r}")
    elif m.isfifo():
        raise Refused(f"FIFO {m.name!r}")
    else:
        raise Refused(f"unsupported tar entry type {m.type!r} for {m.name!r}")


def _make_parents(layer: Layer, parent: str, member: str, budget: Budget) -> None:
    """Create missing parent directories; refuse to go through anything that is not a directory."""
    if not parent:
        return
    done = ""
    for part in parent.split("/"):
        done = f"{done}/{part}" if done else part
        entry = layer.entries.get(done)
        if entry is None:
            budget.charge(0)  # an implied directory is an inode like any other
            mkdir(layer.root / done)
            layer.entries[done] = Entry("dir", 0o755)
            layer.implicit.add(done)
        elif entry.type != "dir":
            raise Refused(f"{member!r} would be written through {entry.type} {done!r}")


def mkdir(path: Path) -> None:
    """A new 0755 directory, whatever the umask."""
    os.mkdir(path, 0o755)
    os.chmod(path, 0o755)


def real_path(root: Path, rel: str) -> Path:
    """``root/rel`` after checking with lstat that no parent of it is a symlink or missing: the
    guard in front of every delete and hardlink, so none of them can leave ``root``."""
    here = root
    for part in rel.split("/")[:-1] if rel else ():
        here = here / part
        if not stat.S_ISDIR(os.lstat(here).st_mode):
            raise Refused(f"internal check: {rel!r} goes through a non-directory {str(here.relative_to(root))!r}")
    return root / rel


_WRITEBACK_FROM = 4 << 20  # files at least this big start their writeback as soon as they are written
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h
try:
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
except (OSError, AttributeError):  # not Linux with glibc: the store's one flush does it all
    _sync_file_range = None


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing a finished file to disk now (``sync_file_range`` with
    SYNC_FILE_RANGE_WRITE: it waits for nothing and promises nothing), so that the disk works while
    the pull goes on and the store's one ``syncfs`` before publishing has less left to wait for.
    Durability still comes from that syncfs alone (agent/store.py)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _write_file(src, path: Path, mode: int, size: int, member: str) -> Entry:
    h = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb", buffering=0) as out:
        os.fchmod(fd, mode)  # not narrowed by the umask
        left = size
        while left:
            chunk = src.read(min(left, CHUNK))
            if not chunk:
                raise Refused(f"tar stream ends inside {member!r}")
            h.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[out.write(view):]
            left -= len(chunk)
        if size >= _WRITEBACK_FROM:
            _start_writeback(fd)
    return Entry("file", mode, size, h.hexdigest())


def delete(root: Path, entries: dict[str, Entry], rel: str, *, keep_self: bool = False) -> None:
    """Remove ``root/rel`` - a whole tree for a directory, only its contents with ``keep_self``
    - from disk and from ``entries``, never through a symlink. Costs the size of what goes."""
    path = real_path(root, rel)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        os.unlink(path)
        entries.pop(rel, None)
        return
    for dirpath, dirs, files in os.walk(path):  # never descends into symlinks
        for name in dirs + files:
            entries.pop(os.path.relpath(os.path.join(dirpath, name), root), None)
    if not keep_self:
        shutil.rmtree(path)
        entries.pop(rel, None)
        return
    for child in os.scandir(path):
        if child.is_dir(follow_symlinks=False):
            shutil.rmtree(child.path)
        else:
            os.unlink(child.path)


_MAX_HOPS = 40  # nested symlinks followed while resolving one, as the kernel's ELOOP limit


class _Node:
    __slots__ = ("parent", "children", "link", "path")

    def __init__(self, parent):
        self.parent, self.children, self.link, self.path = parent, {}, None, ""


def check_symlinks(entries: dict[str, Entry]) -> None:
    """Refuse a finished tree in which any symlink, resolved through the tree's own symlinks,
    leaves the root. Each link is checked lexically as it is unpacked, but a chain can still
    escape (``d/s -> ..`` then ``x -> d/s/..``), so the merged tree is checked as a whole.

    Linear in the total length of names and targets: each symlink is resolved once (memoised),
    a position is a tree node plus a count of components below it that do not exist."""
    root = _Node(None)
    links = []
    for path, entry in entries.items():
        node = root
        for part in path.split("/"):
            node = node.children.get(part) or node.children.setdefault(part, _Node(node))
        if entry.type == "symlink":
            node.link, node.path = entry.target, path
            links.append(node)
    done: dict[_Node, tuple[_Node, int]] = {}

    def resolve(link: _Node, depth: int) -> tuple[_Node, int]:
        if link in done:
            return done[link]
        if depth > _MAX_HOPS:
            raise Refused(f"symlink {link.path!r} -> {link.link!r}: too many levels of symlinks")
        node, missing = link.parent, 0
        for part in link.link.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if missing:
                    missing -= 1
                elif node.parent is None:
                    raise Refused(f"symlink {link.path!r} -> {link.link!r} resolves outside the cache "
                                  "through other symlinks")
                else:
                    node = node.parent
            elif missing or part not in node.children:
                missing += 1
            else:
                node = node.children[part]
                if node.link is not None:
                    node, missing = resolve(node, depth + 1)
        done[link] = (node, missing)
        return done[link]

    for link in links:
        resolve(link, 0)


def merge(base: Layer, upper: Layer) -> None:
    """Apply ``upper`` onto ``base`` (moving its files): whiteouts first, then its entries. An
    explicit directory entry replaces a lower symlink; a path that merely goes through one
    (``link/file`` with no ``link/`` entry) is refused."""
    for path in upper.whiteouts:
        if path in base.entries:
            delete(base.root, base.entries, path)
    for path in upper.opaque:
        if not path or getattr(base.entries.get(path), "type", None) == "dir":
            delete(base.root, base.entries, path, keep_self=True)
    for path in sorted(upper.entries):
        entry = upper.entries[path]
        old = base.entries.get(path)
        target = base.root / path
        if entry.type == "dir":
            if old is not None and old.type == "symlink" and path in upper.implicit:
                raise Refused(f"{path!r} is a symlink in a lower layer and this layer writes through it")
            if old is not None and old.type != "dir":
                delete(base.root, base.entries, path)
            if old is None or old.type != "dir":
                mkdir(target)
        else:
            if old is not None:
                delete(base.root, base.entries, path)
            os.rename(upper.root / path, target)
        base.entries[path] = entry
    shutil.rmtree(upper.root)

