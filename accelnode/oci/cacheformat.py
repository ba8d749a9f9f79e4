"""The kernel-cache image format (see docs/cache-format.md): kinds, labels, targets, index choice.

A cache image is an ordinary OCI (or Docker schema 2) image whose root holds one cache tree
(``io.<kind>.cache/`` and its ``io.<kind>.manifest/manifest.json``) and whose config labels
(``cache.<kind>.image/...``) describe it.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

KINDS = ("triton", "vllm", "jax")
CACHE_DIR = {k: f"io.{k}.cache" for k in KINDS}
MANIFEST_DIR = {k: f"io.{k}.manifest" for k in KINDS}
TITLE_LABEL = "org.opencontainers.image.title"
# Annotation on an index's manifest descriptors: JSON list of targets that manifest serves.
TARGETS_ANNOTATION = "io.accelnode.cache/targets"

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


def parse_config(config: dict) -> tuple[str | None, list[dict], dict]:
    """(kind or None, normalised targets, labels) from an image config blob."""
    labels = ((config.get("config") or {}).get("Labels") or {}) if isinstance(config, dict) else {}
    if not isinstance(labels, dict):
        raise ValueError("config.Labels is not an object")
    labels = {str(k): str(v) for k, v in labels.items()}
    kind = next((k for k in KINDS if label(k, "summary") in labels), None)
    targets = []
    if kind:
        summary = json.loads(labels[label(kind, "summary")])
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
        plat = desc.get("platform") or {}
        if plat and (plat.get("os", "linux") != host["os"] or plat.get("architecture", host["architecture"])
                     != host["architecture"]):
            continue
        raw = (desc.get("annotations") or {}).get(TARGETS_ANNOTATION)
        if raw is None:
            fallback = fallback or desc
            continue
        if not accelerators:
            continue
        try:
            targets = [normalize_target(t) for t in json.loads(raw)]
        except (ValueError, TypeError, AttributeError):
            continue
        if any(target_fits(t, accelerators) for t in targets):
            return desc
    return fallback


def summarize(cache: Path, kind: str, extra_targets: list[dict] = (), manifest: Path | None = None) -> dict:
    """Config labels for the cache tree ``cache`` (the content of ``io.<kind>.cache/``); a JAX
    cache's versions come from its ``io.jax.manifest/manifest.json`` when given."""
    size = kernels = files_seen = 0
    targets: list[dict] = [normalize_target(t) for t in extra_targets]
    for dirpath, _dirs, files in os.walk(cache):
        files_seen += len(files)
        for name in files:
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            nbytes = p.stat().st_size
            size += nbytes
            if name.endswith(".json") and not name.startswith("__grp__"):
                t = _triton_target(p, nbytes)
                if t is not None:
                    kernels += 1
                    if t not in targets:
                        targets.append(t)
    entries = files_seen if kind == "jax" else kernels  # a JAX cache entry is one file
    labels = {
        label(kind, "summary"): json.dumps({"targets": targets}, sort_keys=True, separators=(",", ":")),
        label(kind, "cache-size-bytes"): str(size),
        label(kind, "entry-count"): str(entries),
    }
    if kind == "jax" and manifest is not None and manifest.is_file():
        meta = json.loads(manifest.read_text())
        for key in ("jax-version", "jaxlib-version", "libtpu-version", "accelerator-type"):
            if meta.get(key):
                labels[label(kind, key)] = str(meta[key])
    return labels


def _triton_target(path: Path, size: int) -> dict | None:
    """The ``target`` of a Triton kernel metadata file (``size`` bytes), or None for any other JSON."""
    if size > 1 << 20:
        return None
    try:
        doc = json.loads(path.read_text())
        t = doc.get("target") if isinstance(doc, dict) else None
        if isinstance(t, dict) and "backend" in t and "arch" in t:
            return normalize_target({k: t[k] for k in ("backend", "arch", "warp_size") if k in t})
    except (ValueError, UnicodeDecodeError):
        pass
    return None
