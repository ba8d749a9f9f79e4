"""``accelnode cache build``: package a cache directory as an OCI image and push it.

The image is reproducible: entries sorted, owners 0, mtimes 0, modes 0644/0755, gzip header
without a timestamp - the same directory always gives the same digest.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import stat
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import zstandard

from accelnode.decode import FILE, read_file
from . import cacheformat as fmt
from .reference import Reference
from .registry import Deadline, Registry, RegistryOptions

_LAYER_TYPE = {"gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
               "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
               "none": "application/vnd.oci.image.layer.v1.tar"}


class BuildError(Exception):
    """The source directory cannot be packaged (the message says why)."""


@dataclass(frozen=True)
class Built:
    reference: str  # digest-pinned
    digest: str
    kind: str
    labels: dict
    size_bytes: int
    manifest_size: int


class _Hashing:
    """Write-through file object that hashes and counts what passes."""

    def __init__(self, out, on_write=None):
        self.out, self.on_write = out, on_write
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.out is not None:
            self.out.write(data)
        if self.on_write is not None:
            self.on_write(len(data))
        return len(data)

    def flush(self) -> None:
        pass


def _members(src: Path, prefix: str) -> list[tuple[str, Path]]:
    """(name in the image, source path) for every dir, file and symlink, sorted, parents first."""
    out = []
    for dirpath, dirs, files in os.walk(src):
        dirs.sort()
        rel = os.path.relpath(dirpath, src)
        for name in dirs + sorted(files):
            p = Path(dirpath) / name
            if not (p.is_symlink() or p.is_dir() or p.is_file()):
                raise BuildError(f"{p}: only directories, regular files and symlinks can be packaged")
            arc = name if rel == "." else f"{rel}/{name}"
            out.append((f"{prefix}{arc}", p))
        dirs[:] = [d for d in dirs if not (Path(dirpath) / d).is_symlink()]
    return sorted(out)


def _split(members: list[tuple[str, Path]], n: int) -> list[list[tuple[str, Path]]]:
    """Spread files over ``n`` layers by size (largest first onto the lightest layer); every
    layer repeats the directories its files need."""
    files = [(name, p) for name, p in members if not p.is_dir() or p.is_symlink()]
    dirs = {name: p for name, p in members if p.is_dir() and not p.is_symlink()}
    groups: list[list] = [[] for _ in range(max(1, n))]
    load = [0] * len(groups)
    for size, name, p in sorted(((p.lstat().st_size, name, p) for name, p in files), key=lambda m: -m[0]):
        i = load.index(min(load))
        groups[i].append((name, p))
        load[i] += size
    out = []
    for i, g in enumerate(groups):
        need = {d for name, _ in g for d in _parents(name) if d in dirs}
        if i == 0:
            need = set(dirs)  # the first layer carries the whole directory skeleton
        out.append(sorted(g + [(d, dirs[d]) for d in need]))
    return [g for g in out if g]


def _regular_size(p: Path) -> int:
    """Size of a regular file (not through a symlink); 0 for anything else."""
    st = p.lstat()
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _parents(name: str):
    parts = name.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _write_layer(members, dest: Path, compression: str, on_write) -> tuple[dict, str]:
    """Write one layer blob to ``dest``; returns (descriptor, diff id)."""
    with open(dest, "wb") as f:
        blob = _Hashing(f)
        if compression == "gzip":
            comp = gzip.GzipFile(fileobj=blob, mode="wb", compresslevel=6, mtime=0)
        elif compression == "zstd":
            comp = zstandard.ZstdCompressor(level=3).stream_writer(blob, closefd=False)
        else:
            comp = None
        diff = _Hashing(comp if comp is not None else blob, on_write)
        with tarfile.open(fileobj=diff, mode="w|", format=tarfile.PAX_FORMAT) as tf:
            for name, p in members:
                ti = tf.gettarinfo(str(p), arcname=name)
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = ""
                ti.mtime = 0
                ti.mode = 0o755 if (ti.isdir() or ti.mode & 0o111) else 0o644
                if ti.isreg():
                    with open(p, "rb") as src:
                        tf.addfile(ti, src)
                else:
                    tf.addfile(ti)
        if comp is not None:
            comp.close()
    desc = {"mediaType": _LAYER_TYPE[compression], "digest": "sha256:" + blob.sha.hexdigest(), "size": blob.size}
    return desc, "sha256:" + diff.sha.hexdigest()


def _rebase_groups(members, cache_arc: str, pod_path: str, tmp: Path) -> tuple[list, int, int]:
    """Triton's ``__grp__<kernel>.json`` lists its files by absolute path, and Triton treats a
    group whose files are not at those paths as a miss (then compiles and writes). Rewrite every
    group under ``cache_arc`` (``io.<kind>.cache``) to the path pods will see it at, ``pod_path``;
    returns (members with the rewritten copies, bytes added, groups rewritten)."""
    out, delta, n = [], 0, 0
    for arc, p in members:
        name = arc.rsplit("/", 1)[-1]
        if not (arc.startswith(cache_arc + "/") and name.startswith("__grp__") and name.endswith(".json")
                and not p.is_symlink() and p.is_file()):
            out.append((arc, p))
            continue
        rel_dir = arc[len(cache_arc) + 1:].rsplit("/", 1)[0] if "/" in arc[len(cache_arc) + 1:] else ""
        try:
            doc = read_file(p, FILE)
            children = doc["child_paths"]
            if not isinstance(children, dict) or not all(isinstance(v, str) for v in children.values()):
                raise ValueError("child_paths is not an object of paths")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise BuildError(f"{p}: not a Triton group file: {e}") from None
        rebased = {}
        for child in children:
            if "/" in child or not (p.parent / child).is_file():
                raise BuildError(f"{p}: lists {child!r}, which is not a file beside it")
            rebased[child] = "/".join(x for x in (pod_path.rstrip("/"), rel_dir, child) if x)
        doc["child_paths"] = rebased
        n += 1
        new = tmp / "groups" / f"{n}.json"
        new.parent.mkdir(exist_ok=True)
        new.write_text(json.dumps(doc))
        delta += new.stat().st_size - p.stat().st_size
        out.append((arc, new))
    return out, delta, n


def _is_triton_tree(src: Path) -> bool:
    """A bare TRITON_CACHE_DIR: ``<hash>/__grp__<kernel>.json`` files one level down."""
    return any(src.glob("*/__grp__*.json"))


def build(src, image: str, *, options: RegistryOptions, kind: str | None = None, targets=(), labels=None,
          layers: int = 1, compression: str = "gzip", progress=None, pod_path: str | None = None) -> Built:
    """Package ``src`` and push it as ``image``; returns the digest-pinned reference.

    ``pod_path``: where pods will see ``io.<kind>.cache`` (their ``TRITON_CACHE_DIR`` or
    ``VLLM_CACHE_ROOT``; default ``/cache/io.<kind>.cache``): Triton group files are rewritten
    to it and it is recorded in the ``io.accelnode.cache/pod-path`` label."""
    src = Path(src)
    ref = Reference.parse(image)
    if not src.is_dir():
        raise BuildError(f"{src}: not a directory")
    if compression not in _LAYER_TYPE:
        raise BuildError(f"unknown compression {compression!r}: choose gzip, zstd or none")
    detected = fmt.detect_kind(src)
    if detected:  # an image root: io.<kind>.cache/ (and its manifest dir) at the top
        if kind and kind != detected:
            raise BuildError(f"{src} holds a {detected} cache, not {kind}")
        kind, prefix, cache_dir = detected, "", src / fmt.CACHE_DIR[detected]
    elif kind in fmt.KINDS or (kind is None and _is_triton_tree(src)):
        # a bare cache directory (a TRITON_CACHE_DIR is recognised): packaged under io.<kind>.cache/
        kind = kind or "triton"
        prefix, cache_dir = fmt.CACHE_DIR[kind] + "/", src
    else:
        raise BuildError(f"{src}: no io.triton.cache/, io.vllm.cache/ or io.jax.cache/ inside; "
                         "give --kind to package a bare cache directory")
    manifest_file = src / fmt.MANIFEST_DIR[kind] / "manifest.json" if not prefix else None
    try:
        found = fmt.scan(cache_dir, kind)
        all_labels = fmt.summarize(cache_dir, kind, list(targets), manifest_file, scanned=found)
    except fmt.TritonTreeError as e:
        raise BuildError(str(e)) from None
    except ValueError as e:
        raise BuildError(f"bad target: {e}") from None
    declared = targets or fmt.label(kind, "summary") in (labels or {})
    if kind == "triton" and not found.entries and not declared:
        raise BuildError(f"{cache_dir}: no Triton kernel in this tree (no <hash>/<kernel>.json with a target); "
                         "is it a TRITON_CACHE_DIR? (--target declares the targets of a tree without metadata)")
    if pod_path is not None and not pod_path.startswith("/"):
        raise BuildError(f"--pod-path must be absolute, got {pod_path!r}")
    pod_path = pod_path or (labels or {}).get(fmt.POD_PATH_LABEL) or f"/cache/{fmt.CACHE_DIR[kind]}"
    all_labels.update(labels or {})
    members = _members(src, prefix)
    with tempfile.TemporaryDirectory(prefix="accelnode-build.") as tmp:
        if prefix:
            members = [(fmt.CACHE_DIR[kind], src)] + members
        if kind in ("triton", "vllm"):
            members, delta, rebased = _rebase_groups(members, fmt.CACHE_DIR[kind], pod_path, Path(tmp))
            if rebased:
                size_label = fmt.label(kind, "cache-size-bytes")
                if size_label not in (labels or {}):
                    all_labels[size_label] = str(int(all_labels[size_label]) + delta)
                all_labels[fmt.POD_PATH_LABEL] = pod_path
        doc = fmt.manifest_document(kind, found) if prefix else None
        if doc is not None:  # a bare tree gets its MCV manifest; an image root keeps its own
            mdir = Path(tmp) / "manifest"
            mdir.mkdir()
            (mdir / "manifest.json").write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n")
            members += [(fmt.MANIFEST_DIR[kind], mdir), (f"{fmt.MANIFEST_DIR[kind]}/manifest.json", mdir / "manifest.json")]
        groups = _split(sorted(members), layers)
        file_sizes = [_regular_size(p) for _, p in members]
        total = sum(file_sizes)
        tar_bytes = sum(512 + -(-size // 512) * 512 for size in file_sizes)  # progress counts tar stream bytes
        if progress is not None:
            progress.start(tar_bytes, f"packaging {src}")
        on_write = progress.advance if progress is not None else None
        with ThreadPoolExecutor(max_workers=min(len(groups), os.cpu_count() or 2)) as pool:
            results = list(pool.map(lambda ig: _write_layer(ig[1], Path(tmp) / f"{ig[0]}.layer", compression,
                                                            on_write), enumerate(groups)))
        if progress is not None:
            progress.finish()
        config = {"architecture": fmt.host_platform()["architecture"], "os": "linux",
                  "config": {"Labels": all_labels},
                  "rootfs": {"type": "layers", "diff_ids": [diff for _, diff in results]}}
        config_body = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
        config_desc = {"mediaType": fmt.CONFIG_TYPES[0], "digest": "sha256:" + hashlib.sha256(config_body).hexdigest(),
                       "size": len(config_body)}
        manifest = {"schemaVersion": 2, "mediaType": fmt.OCI_MANIFEST, "config": config_desc,
                    "layers": [d for d, _ in results],
                    "annotations": {fmt.TITLE_LABEL: ref.repository.rsplit("/", 1)[-1]}}
        reg = Registry(ref.host, options, Deadline(options.timeout))
        for i, (desc, _) in enumerate(results):
            with open(Path(tmp) / f"{i}.layer", "rb") as f:
                reg.upload_blob(ref.repository, desc["digest"], f, image)
        reg.upload_blob(ref.repository, config_desc["digest"], config_body, image)
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    digest = reg.put_manifest(ref.repository, ref.ref, body, fmt.OCI_MANIFEST, image)
    return Built(ref.pinned(digest), digest, kind, all_labels, total, len(body))


def push_index(image: str, entries: list[dict], *, options: RegistryOptions) -> str:
    """Push an OCI image index over manifests already in the repository. Each entry has
    ``digest`` and ``size`` and optionally ``platform`` and ``targets`` (written as the
    io.accelnode.cache/targets annotation). Returns the digest-pinned reference."""
    ref = Reference.parse(image)
    manifests = []
    for e in entries:
        d = {"mediaType": fmt.OCI_MANIFEST, "digest": e["digest"], "size": e["size"]}
        if e.get("platform"):
            d["platform"] = e["platform"]
        if e.get("targets") is not None:
            d["annotations"] = {fmt.TARGETS_ANNOTATION: json.dumps(e["targets"], separators=(",", ":"))}
        manifests.append(d)
    body = json.dumps({"schemaVersion": 2, "mediaType": fmt.OCI_INDEX, "manifests": manifests},
                      separators=(",", ":")).encode()
    reg = Registry(ref.host, options, Deadline(options.timeout))
    digest = reg.put_manifest(ref.repository, ref.tag or "latest", body, fmt.OCI_INDEX, image)
    return ref.pinned(digest)
