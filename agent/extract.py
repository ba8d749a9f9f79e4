"""Streaming, hostile-input-safe extraction of image layers, and the merge of layers in order.

Each layer is decompressed and unpacked straight from its (digest-checked) blob stream into
its own directory, so layers can download and unpack in parallel; :func:`merge` then applies
them in order onto the first, honouring OCI whiteouts (``.wh.NAME``, ``.wh..wh..opq``), with
renames only. Nothing here ever follows a symlink: every parent of a path is checked with
``lstat`` as a real directory before anything is created under it.

Refused: absolute names, ``..``, writing through a symlink, symlinks or hardlinks that leave the
tree, device nodes, FIFOs and any other special entry, oversized tar metadata headers, and
anything beyond the :class:`Limits` (total bytes, file count, compression ratio). Setuid,
setgid, sticky and group/world-write bits are dropped: files become 0644 or 0755, dirs 0755.
"""

from __future__ import annotations

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


CHUNK = 512 << 10  # per-read size: 8 layers in parallel stay well under 100 MB RSS
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_META_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
               tarfile.SOLARIS_XHDTYPE)
_MAX_META = 1 << 20  # a pax or GNU long-name header larger than this is a bomb, not a name
_RATIO_FLOOR = 16 << 20  # compression ratio is judged once a layer has produced this much


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 64 << 30  # regular-file bytes of one image, all layers together
    max_files: int = 2_000_000  # entries of one image, all layers together
    max_ratio: int = 250  # uncompressed / compressed bytes of one layer
    max_manifest_bytes: int = 4 << 20
    max_config_bytes: int = 4 << 20


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
                raise Refused(f"more than {self.limits.max_files} entries")
            if self.bytes > self.limits.max_bytes:
                raise Refused(f"more than {self.limits.max_bytes} bytes of file content")


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
    """gzip (possibly multi-member) decompression of a raw stream, ``read(n)`` at a time."""

    def __init__(self, raw):
        self._raw = raw
        self._d = zlib.decompressobj(31)

    def read(self, n: int) -> bytes:
        while True:
            if self._d.eof:
                pending = self._d.unused_data or self._raw.read(CHUNK)
                if not pending:
                    return b""
                self._d = zlib.decompressobj(31)
            else:
                pending = self._d.unconsumed_tail or self._raw.read(CHUNK)
                if not pending:
                    raise Refused("gzip stream ends before its end marker")
            try:
                out = self._d.decompress(pending, n)
            except zlib.error as e:
                raise Refused(f"not a valid gzip stream ({e})") from None
            if out:
                return out


class _Metered:
    """Counts uncompressed bytes; stops compression bombs and cancelled pulls."""

    def __init__(self, src, raw, budget: Budget):
        self._src, self._raw, self._budget = src, raw, budget
        self.out = 0
        self._cap = budget.limits.max_bytes + (budget.limits.max_files + 16) * 2048

    def read(self, n: int = CHUNK) -> bytes:
        if self._budget.cancelled.is_set():
            raise Refused("cancelled: another layer of this image failed")
        data = self._src.read(n)
        self.out += len(data)
        ratio = self._budget.limits.max_ratio
        if self.out > _RATIO_FLOOR and self.out > ratio * max(self._raw.offset, 1):
            raise Refused(f"compression ratio over {ratio}:1 (decompression bomb)")
        if self.out > self._cap:
            raise Refused(f"layer expands past {self._cap} bytes")
        return data


class _TarInfo(tarfile.TarInfo):
    def _proc_member(self, tf):
        if self.type in _META_TYPES and self.size > _MAX_META:
            raise Refused(f"tar metadata header of {self.size} bytes (limit {_MAX_META})")
        return super()._proc_member(tf)


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
        raise Refused(f"absolute member name {name!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"member name {name!r} contains '..'")
    return "/".join(parts) or None


def extract_layer(blob, compression: str | None, dest: Path, budget: Budget) -> Layer:
    """Unpack one layer from ``blob`` (a verifying BlobStream) into the new directory ``dest``."""
    dest.mkdir(mode=0o755)
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
    blob.drain()  # verifies the digest, including any bytes after the tar's end
    return layer


def _extract_member(tf: tarfile.TarFile, m: tarfile.TarInfo, layer: Layer, budget: Budget) -> None:
    name = clean_name(m.name)
    if name is None:
        return
    parent, base = posixpath.split(name)
    if base.startswith(WHITEOUT):
        if base == OPAQUE:
            layer.opaque.append(parent)
        elif base[len(WHITEOUT):] in ("", ".", ".."):
            raise Refused(f"malformed whiteout {m.name!r}")
        else:
            layer.whiteouts.append(posixpath.join(parent, base[len(WHITEOUT):]))
        return
    budget.charge(m.size if m.isreg() else 0)
    _make_parents(layer, parent, m.name)
    path = layer.root / name
    old = layer.entries.pop(name, None)
    if old is not None and not (old.type == "dir" and m.isdir()):
        _remove(path)
    if m.isdir():
        if old is None or old.type != "dir":
            os.mkdir(path, 0o755)
        layer.entries[name] = Entry("dir", 0o755)
        layer.implicit.discard(name)
    elif m.isreg():
        mode = 0o755 if m.mode & 0o111 else 0o644
        layer.entries[name] = _write_file(tf.extractfile(m), path, mode, m.size, m.name)
    elif m.issym():
        target = m.linkname
        if not target or target.startswith("/") or "\0" in target:
            raise Refused(f"symlink {m.name!r} -> {target!r} is absolute or empty")
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
        os.link(layer.root / target, path, follow_symlinks=False)
        layer.entries[name] = entry
    elif m.ischr() or m.isblk():
        raise Refused(f"device node {m.name!r}")
    elif m.isfifo():
        raise Refused(f"FIFO {m.name!r}")
    else:
        raise Refused(f"unsupported tar entry type {m.type!r} for {m.name!r}")


def _make_parents(layer: Layer, parent: str, member: str) -> None:
    """Create missing parent directories; refuse to go through anything that is not a directory."""
    if not parent:
        return
    done = ""
    for part in parent.split("/"):
        done = f"{done}/{part}" if done else part
        entry = layer.entries.get(done)
        if entry is None:
            os.mkdir(layer.root / done, 0o755)
            layer.entries[done] = Entry("dir", 0o755)
            layer.implicit.add(done)
        elif entry.type != "dir":
            raise Refused(f"{member!r} would be written through {entry.type} {done!r}")


def _write_file(src, path: Path, mode: int, size: int, member: str) -> Entry:
    h = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb", buffering=0) as out:
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
    return Entry("file", mode, size, h.hexdigest())


def _remove(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _drop(entries: dict[str, Entry], path: str, *, keep_self: bool = False) -> None:
    prefix = path + "/" if path else ""
    for k in [k for k in entries if k.startswith(prefix) or (k == path and not keep_self)]:
        del entries[k]


_MAX_HOPS = 40  # symlinks followed while resolving one target, as the kernel's ELOOP limit


def check_symlinks(entries: dict[str, Entry]) -> None:
    """Refuse a finished tree in which any symlink, resolved through the tree's own symlinks,
    leaves the root. Each link is checked lexically as it is unpacked, but a chain can still
    escape (``d/s -> ..`` then ``x -> d/s/..``), so the merged tree is checked as a whole."""
    for path, entry in entries.items():
        if entry.type != "symlink":
            continue
        where = path.split("/")[:-1]
        todo = entry.target.split("/")
        hops = 0
        while todo:
            part = todo.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if not where:
                    raise Refused(f"symlink {path!r} -> {entry.target!r} resolves outside the cache "
                                  "through other symlinks")
                where.pop()
                continue
            where.append(part)
            hop = entries.get("/".join(where))
            if hop is not None and hop.type == "symlink":
                hops += 1
                if hops > _MAX_HOPS:
                    raise Refused(f"symlink {path!r} -> {entry.target!r}: too many levels of symlinks")
                where.pop()
                todo = hop.target.split("/") + todo


def merge(base: Layer, upper: Layer) -> None:
    """Apply ``upper`` onto ``base`` (moving its files): whiteouts first, then its entries. An
    explicit directory entry replaces a lower symlink; a path that merely goes through one
    (``link/file`` with no ``link/`` entry) is refused."""
    for path in upper.whiteouts:
        if path in base.entries:
            _remove(base.root / path)
            _drop(base.entries, path)
    for path in upper.opaque:
        if path and getattr(base.entries.get(path), "type", None) != "dir":
            continue
        for child in list(os.scandir(base.root / path)):
            _remove(Path(child.path))
        _drop(base.entries, path, keep_self=True)
    for path in sorted(upper.entries):
        entry = upper.entries[path]
        old = base.entries.get(path)
        target = base.root / path
        if entry.type == "dir":
            if old is not None and old.type == "symlink" and path in upper.implicit:
                raise Refused(f"{path!r} is a symlink in a lower layer and this layer writes through it")
            if old is not None and old.type != "dir":
                os.unlink(target)
                del base.entries[path]
            if old is None or old.type != "dir":
                os.mkdir(target, 0o755)
        else:
            if old is not None:
                _remove(target)
                _drop(base.entries, path)
            os.rename(upper.root / path, target)
        base.entries[path] = entry
    shutil.rmtree(upper.root)

