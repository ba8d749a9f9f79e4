"""The contribution layer: a deterministic tar of selected entries, and reading one back.

Deterministic: members sorted, every parent directory present once, owner 0, mtime 0, modes
0755/0644, no user or group names, gzip without a timestamp - two nodes that captured the same
kernel produce the same bytes, so the same layer digest, and the registry stores it once.

:func:`read` is the controller's side: a layer fetched from the registry is hostile input again
(whoever holds the push credentials could have pushed anything), read under the same
:class:`~accelnode.capture.reader.CaptureLimits` - regular files and directories only, no
absolute or ``..`` names, no duplicates - before :func:`~accelnode.capture.entries.select` judges
its entries again.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from dataclasses import dataclass

from . import entries, reader
from .errors import Poisoned
from .reader import CaptureLimits

MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"


@dataclass(frozen=True)
class Layer:
    blob: bytes  # gzip-compressed tar
    digest: str  # of the blob
    diff_id: str  # of the uncompressed tar
    content_bytes: int

    @property
    def descriptor(self) -> dict:
        return {"mediaType": MEDIA_TYPE, "digest": self.digest, "size": len(self.blob)}


def build(files: dict[str, bytes]) -> Layer:
    """The layer holding ``files`` (image path -> content)."""
    names = set(files)
    dirs = {"/".join(p.split("/")[:i]) for p in names for i in range(1, p.count("/") + 1)}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name in sorted(dirs | names):
            ti = tarfile.TarInfo(name)
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "", ""
            if name in names:
                ti.size, ti.mode = len(files[name]), 0o644
                tf.addfile(ti, io.BytesIO(files[name]))
            else:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(ti)
    tar = raw.getvalue()
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=0) as gz:
        gz.write(tar)
    blob = out.getvalue()
    return Layer(blob, "sha256:" + hashlib.sha256(blob).hexdigest(), "sha256:" + hashlib.sha256(tar).hexdigest(),
                 sum(len(v) for v in files.values()))


def read(blob: bytes, limits: CaptureLimits = CaptureLimits()) -> dict[str, bytes]:
    """``{path: content}`` of a contribution layer; :class:`Poisoned` for anything but plain
    directories and regular files within ``limits``."""
    out: dict[str, bytes] = {}
    total = entries = 0
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(blob)) as gz, tarfile.open(fileobj=_Capped(gz, limits), mode="r|") as tf:
            for m in tf:
                entries += 1
                if entries > limits.max_files:
                    raise Poisoned(f"more than {limits.max_files} entries in the layer")
                name = _clean(m.name)
                if name is None or m.isdir():
                    continue
                if not m.isreg():
                    raise Poisoned(f"{m.name[:120]!r} is not a regular file or directory in a contribution layer")
                if m.mode & 0o7000:
                    raise Poisoned(f"{m.name[:120]!r} is set-uid, set-gid or sticky")
                if m.size > limits.max_file_bytes:
                    raise Poisoned(f"{m.name[:120]!r} is {m.size} bytes, more than {limits.max_file_bytes}")
                total += m.size
                if total > limits.max_bytes:
                    raise Poisoned(f"more than {limits.max_bytes} bytes of content in the layer")
                if name in out:
                    raise Poisoned(f"{name[:120]!r} appears twice in the layer")
                out[name] = tf.extractfile(m).read(m.size)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise Poisoned(f"not a gzip-compressed tar layer: {str(e)[:200]}") from None
    return out


class _Capped:
    """The uncompressed stream, stopped where no layer within the limits can reach (a pax header
    or padding of gigabytes is a bomb, not a cache entry)."""

    def __init__(self, src, limits: CaptureLimits):
        self.src, self.left = src, limits.max_bytes + (limits.max_files + 16) * 2048

    def read(self, n: int = -1) -> bytes:
        data = self.src.read(n if n >= 0 else 1 << 20)
        self.left -= len(data)
        if self.left < 0:
            raise Poisoned("the layer expands past what the capture limits allow (decompression bomb)")
        return data


def _clean(name: str) -> str | None:
    """A relative, normalised member name (None for the root); Poisoned for an escape."""
    if "\0" in name or name.startswith("/"):
        raise Poisoned(f"member name {name[:120]!r} is absolute or has a NUL byte")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Poisoned(f"member name {name[:120]!r} contains '..'")
    return "/".join(parts) or None


def contribute(upper: str, kind: str, pod_path: str, base_root=None,
               limits: CaptureLimits = CaptureLimits()):
    """The node's side in one call: read a view's writable layer ``upper`` as hostile input, keep
    the valid entries the base cache (installed at ``base_root``) lacks, and build their layer.
    Returns (Layer or None when nothing was kept, Selection); :class:`Poisoned` for a refused one."""
    sel = entries.select(reader.read_layer(upper, limits), kind, pod_path, base_root)
    return (build(sel.files) if sel.files else None), sel
