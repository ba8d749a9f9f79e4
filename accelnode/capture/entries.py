"""Which files of a contribution are cache entries of the cache's kind (docs/capture.md, "What is
kept"). Anything else is dropped and counted; an entry whose content contradicts its key is
poison, and refuses the whole contribution.

* Triton (``io.triton.cache/<KEY>/``, and the ``triton_cache/`` trees of a vLLM cache): a kernel
  directory is kept when it is complete - its ``__grp__<name>.json`` group file lists files that
  are all beside it, one of them the ``<name>.json`` metadata - and its name is the key Triton
  files it under: the base32 of the metadata's ``hash`` (Triton's ``_base32``). A name that does
  not match is poison. The metadata's ``target`` must name a backend and an arch. The group file
  is rewritten to list its files at ``pod_path`` (where pods see ``io.<kind>.cache``), the path
  convention of the cache it joins; Triton's own temporary directories (``tmp.*``) are dropped.
* JAX (``io.jax.cache/``): files named as JAX's persistent cache names them,
  ``<module>-<64 hex>-cache``, whose content is a zstd or zlib stream (what JAX writes), checked
  by decompressing it under a bound; ``-atime`` files and anything else are dropped.
* vLLM: only its Triton kernel directories (above); inductor and AOT artefacts are dropped.

An entry the base cache already holds (same key) is dropped: the base wins.
"""

from __future__ import annotations

import base64
import binascii
import json
import posixpath
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from accelnode.decode import KERNEL_METADATA, DocumentError, decode
from accelnode.oci import cacheformat as fmt

from .errors import Poisoned

_TRITON_KEY = re.compile(r"[A-Z2-7]{52}")  # base32 of a sha256, unpadded
_TRITON_FILE = re.compile(r"[A-Za-z0-9_]{1,200}\.[A-Za-z0-9_]{1,16}")
_JAX_ENTRY = re.compile(r"[A-Za-z0-9_.]{1,200}-[0-9a-f]{64}-cache")
_VLLM_TRITON = re.compile(r"torch_compile_cache/[^/]+/rank_[^/]+/(?:[^/]+/)*triton_cache")
MAX_EXPANDED = 1 << 30  # bytes a JAX entry may decompress to while checked


@dataclass
class Selection:
    """What a contribution holds: ``files`` (path in the image -> content) of kept entries,
    ``keys`` (entry key -> its paths), ``targets`` of Triton kernels, and what was ``dropped``."""

    files: dict[str, bytes] = field(default_factory=dict)
    keys: dict[str, list[str]] = field(default_factory=dict)
    targets: list[dict] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> files

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n


def triton_key(hash_hex: str) -> str:
    """The directory Triton files a kernel under, from its metadata's ``hash``."""
    return base64.b32encode(binascii.unhexlify(hash_hex)).decode().rstrip("=")


def select(files: dict[str, bytes], kind: str, pod_path: str, base_root: Path | None = None) -> Selection:
    """The valid entries of ``files`` (paths relative to the view's root, so under
    ``io.<kind>.cache/``) for a ``kind`` cache whose pods see ``io.<kind>.cache`` at
    ``pod_path``; ``base_root``: the installed base cache (entries it has are dropped).
    :class:`Poisoned` for an entry whose content contradicts its key."""
    if kind not in fmt.KINDS:
        raise ValueError(f"unknown cache kind {kind!r}")
    top = fmt.CACHE_DIR[kind] + "/"
    sel = Selection()
    dirs: dict[str, dict[str, bytes]] = {}
    for path, data in files.items():
        if not path.startswith(top):
            sel.drop(f"outside {top}")
            continue
        rel = path[len(top):]
        if kind == "jax":
            _jax(sel, path, rel, data)
            continue
        parent, name = posixpath.split(rel)
        owner = posixpath.dirname(parent)
        if kind == "triton" and parent and not owner or kind == "vllm" and _VLLM_TRITON.fullmatch(owner):
            dirs.setdefault(parent, {})[name] = data
        else:
            sel.drop("not in a Triton kernel directory")
    for rel_dir, content in sorted(dirs.items()):
        _triton(sel, top + rel_dir, rel_dir, content, pod_path)
    if base_root is not None:
        for key in [k for k in sel.keys if (base_root / k).exists()]:
            for p in sel.keys.pop(key):
                del sel.files[p]
            sel.drop("already in the base cache")
    return sel


def _jax(sel: Selection, path: str, rel: str, data: bytes) -> None:
    if "/" in rel or not _JAX_ENTRY.fullmatch(rel):
        sel.drop("not a JAX cache entry name" if not rel.endswith("-atime") else "JAX access-time file")
        return
    try:
        if data[:4] == b"\x28\xb5\x2f\xfd":
            reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
            total = 0
            while chunk := reader.read(1 << 20):
                total += len(chunk)
                if total > MAX_EXPANDED:
                    raise Poisoned(f"JAX entry {path!r} expands past {MAX_EXPANDED} bytes")
        else:
            d = zlib.decompressobj()
            total = len(d.decompress(data, MAX_EXPANDED))
            if d.unconsumed_tail or not d.eof:
                raise Poisoned(f"JAX entry {path!r} is not one whole zlib stream within {MAX_EXPANDED} bytes")
    except (zstandard.ZstdError, zlib.error) as e:
        raise Poisoned(f"JAX entry {path!r} is not what JAX writes (a zstd or zlib stream): {e}") from None
    if total == 0:
        raise Poisoned(f"JAX entry {path!r} is empty")
    sel.files[path] = data
    sel.keys[path] = [path]


def _triton(sel: Selection, key: str, rel_dir: str, content: dict[str, bytes], pod_path: str) -> None:
    name = posixpath.basename(rel_dir)
    if name.startswith("tmp."):
        sel.drop("Triton temporary directory", len(content))
        return
    groups = [n for n in content if n.startswith("__grp__") and n.endswith(".json")]
    if not _TRITON_KEY.fullmatch(name):
        raise Poisoned(f"{key!r}: not a Triton cache key (base32 of a sha256)")
    if len(groups) != 1:
        sel.drop("incomplete Triton kernel directory (no group file)" if not groups
                 else "Triton kernel directory with several group files", len(content))
        return
    group = _json(content[groups[0]], f"{key}/{groups[0]}")
    children = group.get("child_paths")
    if not isinstance(children, dict) or not children or not all(
            isinstance(c, str) and isinstance(v, str) for c, v in children.items()):
        raise Poisoned(f"{key}/{groups[0]}: child_paths is not an object of file names to paths")
    for child in children:
        if not _TRITON_FILE.fullmatch(child) or child not in content:
            raise Poisoned(f"{key}/{groups[0]} lists {child[:80]!r}, which is not a file beside it")
    kernel = groups[0][len("__grp__"):]
    if kernel not in children:
        raise Poisoned(f"{key}/{groups[0]} does not list the kernel's metadata {kernel!r}")
    meta = _json(content[kernel], f"{key}/{kernel}")
    h = meta.get("hash")
    if not isinstance(h, str) or not re.fullmatch(r"[0-9a-f]{64}", h) or triton_key(h) != name:
        raise Poisoned(f"{key}: the directory is not the key of its kernel (metadata hash {str(h)[:70]!r} "
                       f"is filed under {triton_key(h) if isinstance(h, str) and re.fullmatch(r'[0-9a-f]{64}', h) else '?'})")
    raw = meta.get("target")
    try:
        if not isinstance(raw, dict):
            raise ValueError("no target object")
        target = fmt.normalize_target({k: raw[k] for k in ("backend", "arch", "warp_size") if k in raw})
    except (ValueError, TypeError) as e:
        raise Poisoned(f"{key}/{kernel}: bad Triton target: {e}") from None
    if target not in sel.targets:
        sel.targets.append(target)
    unlisted = [n for n in content if n not in children and n != groups[0]]
    if unlisted:
        sel.drop("file in a kernel directory its group does not list", len(unlisted))
    group["child_paths"] = {c: f"{pod_path.rstrip('/')}/{rel_dir}/{c}" for c in sorted(children)}
    paths = []
    for child in sorted(children):
        sel.files[f"{key}/{child}"] = content[child]
        paths.append(f"{key}/{child}")
    sel.files[f"{key}/{groups[0]}"] = json.dumps(group, sort_keys=True).encode()
    paths.append(f"{key}/{groups[0]}")
    sel.keys[key] = paths


def _json(data: bytes, what: str) -> dict:
    try:
        doc = decode(data, KERNEL_METADATA, what)
    except (DocumentError, ValueError, UnicodeDecodeError) as e:
        raise Poisoned(f"{what}: not JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict):
        raise Poisoned(f"{what}: not a JSON object")
    return doc
