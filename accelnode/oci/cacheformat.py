"""The kernel-cache image format (see docs/cache-format.md): kinds, labels, targets, index choice.

A cache image is an ordinary OCI (or Docker schema 2) image whose root holds one cache tree
(``io.<kind>.cache/`` and its ``io.<kind>.manifest/manifest.json``) and whose config labels
(``cache.<kind>.image/...``) describe it.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from accelnode.decode import KERNEL_METADATA, LABEL, decode, read_file

KINDS = ("triton", "vllm", "jax")
CACHE_DIR = {k: f"io.{k}.cache" for k in KINDS}
MANIFEST_DIR = {k: f"io.{k}.manifest" for k in KINDS}
TITLE_LABEL = "org.opencontainers.image.title"
# Annotation on an index's manifest descriptors: JSON list of targets that manifest serves.
TARGETS_ANNOTATION = "io.accelnode.cache/targets"
# Config label: where pods must see io.<kind>.cache (TRITON_CACHE_DIR / VLLM_CACHE_ROOT) for the
# absolute paths in Triton's group files to hold (accelnode cache build --pod-path).
POD_PATH_LABEL = "io.accelnode.cache/pod-path"

LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": None,
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
}
CONFIG_TYPES = (
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
)
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"

_BACKEND_ALIASES = {"rocm": "hip", "amd": "hip", "nvidia": "cuda", "gpu": "cuda", "google": "tpu"}
_TPU_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "tpu v5 lite": "v5e", "v6": "v6e", "trillium": "v6e",
                "tpu7x": "v7x", "ironwood": "v7x"}


def label(kind: str, name: str) -> str:
    return f"cache.{kind}.image/{name}"


def normalize_target(target: dict) -> dict:
    """Canonical form of a target: lower-case backend (rocm -> hip), CUDA arch without ``sm_``,
    TPU generation names (``v5litepod`` -> ``v5e``), integer ``warp_size``; other keys kept."""
    if not isinstance(target, dict):
        raise ValueError(f"target must be an object, got {type(target).__name__}")
    out = dict(target)
    backend = str(target.get("backend", "")).strip().lower()
    backend = _BACKEND_ALIASES.get(backend, backend)
    arch = str(target.get("arch", "")).strip().lower()
    if backend == "cuda" and arch.startswith("sm_"):
        arch = arch[3:]
    if backend == "tpu":
        arch = arch.removeprefix("tpu-").removeprefix("tpu ")
        arch = _TPU_ALIASES.get(arch, arch)
    if not backend or not arch:
        raise ValueError(f"target needs a backend and an arch: {target!r}")
    out["backend"], out["arch"] = backend, arch
    if target.get("warp_size") not in (None, ""):
        out["warp_size"] = int(target["warp_size"])
    return out


def target_fits(target: dict, accelerators: list[dict]) -> bool:
    """Same backend and arch (and warp size, when both sides know it) as one accelerator."""
    for acc in accelerators:
        a = normalize_target(acc)
        if (a["backend"], a["arch"]) == (target["backend"], target["arch"]) and (
                "warp_size" not in a or "warp_size" not in target or a["warp_size"] == target["warp_size"]):
            return True
    return False


def declared_kind(labels: dict) -> str | None:
    """The kind an image's config labels declare (they carry its ``cache.<kind>.image/summary``),
    or None: the kind the agent records and the CSI driver picks a volume's view by."""
    return next((k for k in KINDS if label(k, "summary") in labels), None)


def parse_config(config: dict) -> tuple[str | None, list[dict], dict]:
    """(kind or None, normalised targets, labels) from an image config blob."""
    labels = ((config.get("config") or {}).get("Labels") or {}) if isinstance(config, dict) else {}
    if not isinstance(labels, dict):
        raise ValueError("config.Labels is not an object")
    labels = {str(k): str(v) for k, v in labels.items()}
    kind = declared_kind(labels)
    targets = []
    if kind:
        summary = decode(labels[label(kind, "summary")], LABEL, f"label {label(kind, 'summary')}")
        targets = [normalize_target(t) for t in (summary.get("targets") or [])]
    return kind, targets, labels


def detect_kind(root: Path) -> str | None:
    found = [k for k in KINDS if (root / CACHE_DIR[k]).is_dir()]
    return found[0] if len(found) == 1 else None


def host_platform() -> dict:
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return {"os": "linux", "architecture": arch}


def choose_manifest(index: dict, accelerators: list[dict] | None) -> dict | None:
    """The index entry for this node, or None.

    An entry qualifies when its ``platform`` (if any) is this host's OS/CPU, and - when the
    node's accelerators are known and the entry carries the ``io.accelnode.cache/targets``
    annotation - one of those targets fits an accelerator. Entries whose targets fit win over
    entries without targets; otherwise the first qualifying entry in index order wins.
    """
    host = host_platform()
    fallback = None
    for desc in index.get("manifests") or []:
        if not isinstance(desc, dict):
            continue
        plat, notes = desc.get("platform") or {}, desc.get("annotations") or {}
        if not isinstance(plat, dict) or not isinstance(notes, dict):
            continue  # a malformed entry is never chosen
        if plat and (plat.get("os", "linux") != host["os"] or plat.get("architecture", host["architecture"])
                     != host["architecture"]):
            continue
        raw = notes.get(TARGETS_ANNOTATION)
        if raw is None:
            fallback = fallback or desc
            continue
        if not accelerators:
            continue
        try:
            targets = [normalize_target(t) for t in decode(raw, LABEL, TARGETS_ANNOTATION, list)]
        except (ValueError, TypeError, AttributeError):
            continue
        if any(target_fits(t, accelerators) for t in targets):
            return desc
    return fallback


class TritonTreeError(ValueError):
    """A Triton cache tree that cannot be described: a metadata file that is not JSON or has a bad
    ``target``, or (building a Triton image without ``--target``) no kernel at all."""


# Fields of a Triton kernel's metadata JSON that MCV's manifest.json keeps per entry (hash, PTX
# version, stages, warps, debug, and the target flattened); name and triton_version are ours.
_MANIFEST_FIELDS = ("hash", "name", "triton_version", "ptx_version", "num_stages", "num_warps", "debug")


@dataclass
class Scan:
    """What one walk of a cache tree found."""
    size: int = 0
    files: int = 0
    targets: list = field(default_factory=list)
    entries: list = field(default_factory=list)  # (path relative to the cache tree, manifest entry)


def scan(cache: Path, kind: str) -> Scan:
    """Walk ``cache`` (the content of ``io.<kind>.cache/``): bytes, files, and every Triton kernel
    (a ``<name>.json`` with a ``target``) with its target and MCV-style manifest entry.

    In a Triton tree (and in a vLLM tree's ``triton_cache/`` directories) every ``.json`` must be
    JSON and every ``target`` must name a backend and an arch: :class:`TritonTreeError` otherwise.
    """
    out = Scan()
    for dirpath, dirs, files in os.walk(cache):
        dirs.sort()
        rel_dir = Path(dirpath).relative_to(cache)
        strict = kind == "triton" or "triton_cache" in rel_dir.parts
        out.files += len(files)
        for name in sorted(files):
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            nbytes = p.stat().st_size
            out.size += nbytes
            if not name.endswith(".json") or nbytes > 1 << 20 and not strict:
                continue
            found = _triton_entry(p, nbytes, strict)
            if found is None:
                continue
            target, entry = found
            out.entries.append((str(rel_dir / name), entry))
            if target not in out.targets:
                out.targets.append(target)
    return out


def summarize(cache: Path, kind: str, extra_targets: list[dict] = (), manifest: Path | None = None,
              scanned: Scan | None = None) -> dict:
    """Config labels for the cache tree ``cache`` (the content of ``io.<kind>.cache/``); a JAX
    cache's versions come from its ``io.jax.manifest/manifest.json`` when given."""
    found = scanned or scan(cache, kind)
    targets: list[dict] = [normalize_target(t) for t in extra_targets]
    targets += [t for t in found.targets if t not in targets]
    entries = found.files if kind == "jax" else len(found.entries)  # a JAX cache entry is one file
    labels = {
        label(kind, "summary"): json.dumps({"targets": targets}, sort_keys=True, separators=(",", ":")),
        label(kind, "cache-size-bytes"): str(found.size),
        label(kind, "entry-count"): str(entries),
    }
    if kind == "vllm" and (formats := vllm_formats(cache)):
        labels[label(kind, "format")] = ",".join(formats)
    if kind == "jax" and manifest is not None and manifest.is_file():
        meta = read_file(manifest, FILE)
        for key in ("jax-version", "jaxlib-version", "libtpu-version", "accelerator-type"):
            if meta.get(key):
                labels[label(kind, key)] = str(meta[key])
    return labels


def vllm_formats(cache: Path) -> list[str]:
    """The vLLM cache formats a ``VLLM_CACHE_ROOT`` tree holds, as MCV names them: ``triton``
    (``torch_compile_cache/<hash>/rank_*/.../triton_cache``), ``aot_compile``
    (``torch_compile_cache/torch_aot_compile``), ``binary`` (``cache_key_factors.json``)."""
    tcc = cache / "torch_compile_cache"
    formats = []
    if tcc.is_dir():
        if any(p.is_dir() for p in tcc.glob("*/rank_*/**/triton_cache")):
            formats.append("triton")
        if (tcc / "torch_aot_compile").is_dir():
            formats.append("aot_compile")
        if any(tcc.glob("*/rank_*/**/cache_key_factors.json")):
            formats.append("binary")
    return formats


def manifest_document(kind: str, found: Scan) -> dict | None:
    """``io.<kind>.manifest/manifest.json`` as MCV writes it: ``{"triton": [entry...]}``, or for
    vLLM ``{"vllm": [{"vllmHash", "cacheFormat": "triton", "triton": [...]}]}`` grouped by the
    ``torch_compile_cache/<hash>`` directory. None when there is no Triton kernel to list."""
    if not found.entries:
        return None
    if kind == "triton":
        return {"triton": [e for _, e in found.entries]}
    if kind != "vllm":
        return None
    groups: dict[str, list] = {}
    for rel, entry in found.entries:
        parts = Path(rel).parts
        vhash = parts[1] if len(parts) > 2 and parts[0] == "torch_compile_cache" else ""
        groups.setdefault(vhash, []).append(entry)
    return {"vllm": [{"vllmHash": h, "cacheFormat": "triton", "triton": es} for h, es in sorted(groups.items())]}


def _triton_entry(path: Path, size: int, strict: bool) -> tuple[dict, dict] | None:
    """(target, manifest entry) of a Triton kernel metadata file (``size`` bytes); None for any
    other JSON (a ``__grp__`` index, an autotune record). ``strict``: a file that is not JSON, or a
    ``target`` without backend and arch, raises :class:`TritonTreeError` instead of being skipped."""
    try:
        doc = read_file(path, KERNEL_METADATA, expect=None)
    except (ValueError, UnicodeDecodeError) as e:
        if strict:
            raise TritonTreeError(f"{path}: not a Triton metadata file: {e}") from None
        return None
    raw = doc.get("target") if isinstance(doc, dict) else None
    if raw is None or path.name.startswith("__grp__"):
        return None
    try:
        if not isinstance(raw, dict):
            raise ValueError(f"expected {{backend, arch, warp_size}}, got {raw!r}")
        target = normalize_target({k: raw[k] for k in ("backend", "arch", "warp_size") if k in raw})
    except (ValueError, TypeError) as e:
        if strict:
            raise TritonTreeError(f"{path}: bad Triton target: {e}") from None
        return None
    if isinstance(doc.get("ptx_version"), int):  # Triton writes null unless the kernel set one
        target["ptx_version"] = doc["ptx_version"]
    entry = {k: doc[k] for k in _MANIFEST_FIELDS if doc.get(k) is not None}
    entry.update({"backend": target["backend"], "arch": target["arch"]})
    if "warp_size" in target:
        entry["warp_size"] = target["warp_size"]
    return target, entry
