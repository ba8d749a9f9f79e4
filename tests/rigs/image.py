"""The ``accelnode`` container image, built without a container engine.

``Containerfile`` is the path for people with docker/podman/buildah. These machines have none, so
this module makes the same image from Debian's own tools and writes it as an OCI image archive
that ``ctr images import`` (containerd) takes:

1. **base layer**: ``mmdebstrap --variant=essential`` of Debian bookworm with ``python3``,
   ``python3-venv``, ``ca-certificates`` and ``libstdc++6`` (grpcio needs it); a customize hook makes the virtualenv
   ``/opt/accelnode`` and installs the runtime dependencies (``pyproject.toml``'s
   ``dependencies``, wheels fetched beforehand by pip, installed offline) and the ``accelnode``
   user (uid/gid 65532). Rebuilt only when those dependencies or this recipe change.
2. **app layer**: the ``accelnode`` wheel of this checkout, unpacked into the virtualenv's
   site-packages with its byte code and the ``accelnode`` command, as a deterministic tar
   (sorted, owner root, fixed times). Rebuilt when the source changes.

Both layers and the archive are cached under ``.tools/images/`` (git-ignored) by a hash of their
inputs, so tests and the demo reuse them. ``python -m tests.rigs.image`` builds and prints
the archive's path; ``--import SOCKET`` also imports it into containerd's ``k8s.io`` namespace
with the containerd 2.2 ``ctr`` we build (``.tools/containerd2/bin``; ``--ctr PATH`` for another),
``--push REF`` pushes it to a registry the operator chooses (``make image PUSH=REF``; credentials
from the Docker config file, as ``accelnode cache build`` takes them).

The image's command is ``accelnode`` (every subcommand), user 65532 unless a manifest says
otherwise, ``PYTHONDONTWRITEBYTECODE=1`` (read-only root filesystems).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from accelnode import IMAGE

ROOT = Path(__file__).resolve().parents[2]
NAME = IMAGE  # the name every manifest uses (ghcr.io/accelnode/accelnode:<version>)
PAUSE_NAME = "localhost/accelnode/pause:catatonit"
SUITE = "bookworm"
PYVER = "3.11"  # bookworm's python3
VENV = "/opt/accelnode"
SITE = f"{VENV}/lib/python{PYVER}/site-packages"
UID = 65532
EPOCH = 1700000000  # fixed mtime of everything we write (SOURCE_DATE_EPOCH for mmdebstrap)
RECIPE_VERSION = "2"  # bump when the recipe below changes what it makes
SOURCE_DIRS = ("accelnode", "agent", "bootstrap", "csi_driver", "device_plugin", "controller")  # pyproject's packages
ENV = [f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1", "LANG=C.UTF-8"]


class ImageError(RuntimeError):
    """The image could not be built (the message says which step and why)."""


@dataclass(frozen=True)
class Image:
    archive: Path  # OCI image layout as a tar, for `ctr images import`
    name: str
    key: str  # hash of every input


def _run(argv: list, what: str, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(a) for a in argv], check=True, capture_output=True, text=True, **kw)
    except FileNotFoundError as e:
        raise ImageError(f"{what}: {e.filename} not found (Debian packages in tools/apt/image.txt)") from None
    except subprocess.CalledProcessError as e:
        raise ImageError(f"{what} failed (exit {e.returncode}):\n{(e.stderr or '')[-3000:]}") from None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _hash(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def runtime_requirements(root: Path = ROOT) -> list[str]:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]


def source_files(root: Path = ROOT) -> list[Path]:
    """The files the wheel is made of: pyproject and the packages' Python files (tracked or not,
    never byte code)."""
    files = [root / "pyproject.toml"]
    for d in SOURCE_DIRS:
        files += sorted(p for p in (root / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                        and p.suffix in (".py", ".pyi", ".typed", ".json", ".yaml"))
    return files


# ---------------------------------------------------------------------------------------------
# layers


def base_key(root: Path = ROOT) -> str:
    return _hash(RECIPE_VERSION.encode(), SUITE.encode(), json.dumps(runtime_requirements(root)).encode())


def build_base(out: Path, root: Path = ROOT, log=print) -> None:
    """The Debian + Python + dependencies layer as a tar (mmdebstrap)."""
    py = Path(sys.executable)
    with tempfile.TemporaryDirectory(prefix="accelnode-image-") as td:
        wheels = Path(td) / "wheels"
        log(f"image: fetching wheels of the runtime dependencies ({len(runtime_requirements(root))})")
        _run([py, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", wheels,  # same platform as bookworm's
              *runtime_requirements(root)], "pip download")
        log(f"image: mmdebstrap {SUITE} (python3, python3-venv, ca-certificates, libstdc++6)")
        hook = (f'set -e; chroot "$1" python3 -m venv {VENV}; '
                f'mkdir -p "$1/tmp/wheels"; cp {wheels}/*.whl "$1/tmp/wheels/"; '
                f'chroot "$1" {VENV}/bin/pip install -q --no-index --no-compile --find-links /tmp/wheels '
                + " ".join(f"'{r}'" for r in runtime_requirements(root)) + "; "
                f'chroot "$1" {VENV}/bin/python -m compileall -q --invalidation-mode unchecked-hash {VENV}/lib; '
                f'chroot "$1" {VENV}/bin/pip uninstall -q -y pip; '
                f'rm -rf "$1/tmp/wheels" "$1/root/.cache"; '
                f'echo "accelnode:x:{UID}:{UID}:accelnode:/nonexistent:/usr/sbin/nologin" >> "$1/etc/passwd"; '
                f'echo "accelnode:x:{UID}:" >> "$1/etc/group"')
        env = dict(os.environ, SOURCE_DATE_EPOCH=str(EPOCH))
        tmp = out.with_name(out.stem + ".partial.tar")  # mmdebstrap picks its output format by the name
        _run(["mmdebstrap", "--variant=essential", "--mode=root", "--include=python3,python3-venv,ca-certificates,libstdc++6,pci.ids",
              "--aptopt=APT::Install-Recommends \"false\"",
              "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/locale/*",
              "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
              f"--customize-hook={hook}", SUITE, tmp], "mmdebstrap", env=env)
        tmp.rename(out)


def app_key(root: Path = ROOT) -> str:
    files = source_files(root)
    return _hash(RECIPE_VERSION.encode(), *(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() for p in files))


def build_app(out: Path, root: Path = ROOT, log=print) -> None:
    """The accelnode wheel of this checkout, installed into the virtualenv, as a deterministic tar."""
    with tempfile.TemporaryDirectory(prefix="accelnode-wheel-") as td:
        log("image: building the accelnode wheel")
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", td, root], "pip wheel")
        (whl,) = Path(td).glob("accelnode-*.whl")
        stage = Path(td) / "stage"
        site = stage / SITE.lstrip("/")
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
        dist = next(site.glob("accelnode-*.dist-info"))
        (dist / "INSTALLER").write_text("accelnode-image\n")
        scripts = _console_scripts(dist / "entry_points.txt")
        bindir = stage / VENV.lstrip("/") / "bin"
        bindir.mkdir(parents=True)
        for name, target in scripts.items():
            mod, func = target.split(":")
            (bindir / name).write_text(f"#!{VENV}/bin/python\nimport sys\nfrom {mod} import {func}\n"
                                       f"sys.exit({func}())\n")
            (bindir / name).chmod(0o755)
        # byte code for bookworm's CPython 3.11 (same magic number as any 3.11), hash-checked so
        # the fixed mtimes do not matter
        if sys.version_info[:2] == (3, 11):
            _run([sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash",
                  "-s", stage, "-p", "/", site], "compileall")  # file names as installed, not the stage's
        _deterministic_tar(stage, out)


def _console_scripts(path: Path) -> dict[str, str]:
    out, section = {}, None
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "console_scripts" and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _deterministic_tar(src: Path, out: Path) -> None:
    tmp = out.with_suffix(".partial")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        paths = sorted(src.rglob("*"))
        parents = set()
        for p in paths:  # the parents of the stage root (./opt, ./opt/accelnode ...) exist in the base
            parents.update(p.relative_to(src).parents)
        for p in paths:
            info = tar.gettarinfo(p, arcname=str(p.relative_to(src)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = EPOCH
            info.mode = (info.mode & 0o755) | (0o755 if p.is_dir() else 0)
            if p.is_file():
                with open(p, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    tmp.rename(out)


def pause_layer(out: Path) -> None:
    """The sandbox ("pause") image's layer: Debian's static catatonit as /pause."""
    exe = shutil.which("catatonit") or "/usr/bin/catatonit"
    if not os.path.exists(exe):
        raise ImageError("catatonit not found (Debian package catatonit, tools/apt/kubelet.txt)")
    with tempfile.TemporaryDirectory() as td:
        shutil.copy(exe, Path(td) / "pause")
        _deterministic_tar(Path(td), out)


# ---------------------------------------------------------------------------------------------
# OCI archive


def write_oci_archive(out: Path, name: str, layers: list[Path], *, entrypoint: list[str], cmd: list[str] | None = None,
                      user: str = "", env: list[str] | None = None, labels: dict | None = None) -> None:
    """An OCI image layout (oci-layout, index.json, blobs/) in a tar; layers are uncompressed tars
    (their digest is their diff id). The index names the image for containerd
    (``io.containerd.image.name``) and by tag (``org.opencontainers.image.ref.name``)."""
    diff_ids, descs = [], []
    for layer in layers:
        d = "sha256:" + _sha256_file(layer)
        diff_ids.append(d)
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d,
                      "size": layer.stat().st_size})
    config = {"architecture": "amd64", "os": "linux", "created": "2023-11-14T22:13:20Z",
              "config": {"Entrypoint": entrypoint, "Cmd": cmd, "User": user, "Env": env or ENV[:1],
                         "WorkingDir": "/", "Labels": labels or {}},
              "rootfs": {"type": "layers", "diff_ids": diff_ids},
              "history": [{"created": "2023-11-14T22:13:20Z", "created_by": "tests.rigs.image"}
                          for _ in layers]}
    config_b = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": "sha256:" + hashlib.sha256(config_b).hexdigest(), "size": len(config_b)},
                "layers": descs}
    manifest_b = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": manifest["mediaType"],
                            "digest": "sha256:" + hashlib.sha256(manifest_b).hexdigest(), "size": len(manifest_b),
                            "platform": {"architecture": "amd64", "os": "linux"},
                            "annotations": {"io.containerd.image.name": name,
                                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}}]}
    tmp = out.with_suffix(".partial")
    with tarfile.open(tmp, "w") as tar:
        def add_bytes(arcname: str, data: bytes) -> None:
            info = tarfile.TarInfo(arcname)
            info.size, info.mtime, info.mode = len(data), EPOCH, 0o644
            tar.addfile(info, io.BytesIO(data))

        add_bytes("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add_bytes("index.json", json.dumps(index, sort_keys=True).encode())
        add_bytes(f"blobs/sha256/{manifest['config']['digest'][7:]}", config_b)
        add_bytes(f"blobs/sha256/{index['manifests'][0]['digest'][7:]}", manifest_b)
        for layer, desc in zip(layers, descs):
            info = tarfile.TarInfo(f"blobs/sha256/{desc['digest'][7:]}")
            info.size, info.mtime, info.mode = desc["size"], EPOCH, 0o644
            with open(layer, "rb") as f:
                tar.addfile(info, f)
    tmp.rename(out)


# ---------------------------------------------------------------------------------------------
# the cached builds


def cache_dir(root: Path = ROOT) -> Path:
    return Path(os.environ.get("ACCELNODE_IMAGE_CACHE", root / ".tools" / "images"))


def _cached(path: Path, make) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        make(path)
    return path


def build(root: Path = ROOT, log=print) -> Image:
    """The accelnode image archive of this checkout, built (or reused) under :func:`cache_dir`."""
    cache = cache_dir(root)
    bkey, akey = base_key(root), app_key(root)
    base = _cached(cache / f"base-{bkey}.tar", lambda p: build_base(p, root, log))
    app = _cached(cache / f"app-{akey}.tar", lambda p: build_app(p, root, log))
    key = _hash(bkey.encode(), akey.encode())
    archive = cache / f"accelnode-{key}.oci.tar"
    if not archive.exists():
        log("image: writing the OCI archive")
        write_oci_archive(archive, NAME, [base, app], entrypoint=[f"{VENV}/bin/accelnode"], user=f"{UID}:{UID}",
                          env=ENV, labels={"org.opencontainers.image.title": "accelnode",
                                           "org.opencontainers.image.version": NAME.rsplit(":", 1)[1]})
        for old in [*cache.glob("accelnode-*.oci.tar"), *cache.glob("base-*.tar"), *cache.glob("app-*.tar")]:
            if old not in (archive, base, app):  # keep the current ones only: they are large
                old.unlink(missing_ok=True)
    return Image(archive, NAME, key)


def build_pause(root: Path = ROOT) -> Image:
    cache = cache_dir(root)
    layer = _cached(cache / "pause-layer.tar", pause_layer)
    entrypoint = ["/pause", "-P"]  # catatonit's pause mode: sleep, reap, exit on SIGINT/SIGTERM
    key = _hash(_sha256_file(layer).encode(), json.dumps(entrypoint).encode())
    archive = cache / f"pause-{key}.oci.tar"
    if not archive.exists():
        write_oci_archive(archive, PAUSE_NAME, [layer], entrypoint=entrypoint, user="65535:65535")
    return Image(archive, PAUSE_NAME, key)


def ctr_import(image: Image, address: str, ctr: str, namespace: str = "k8s.io") -> None:
    """Import (and unpack) the archive into containerd at ``address`` with the ``ctr`` given (the
    containerd 2.2 one we build: tests/rigs/node.py ``containerd_bin``)."""
    _run([ctr, "--address", address, "--namespace", namespace, "images", "import", image.archive], f"ctr images import {image.archive.name}")


def push(image: Image, ref: str, options) -> str:
    """Push the archive's image to ``ref`` (``host[:port]/repository:tag``) with the product's own
    registry client (``options``: :class:`accelnode.oci.registry.RegistryOptions`); returns the
    reference pinned to the manifest's digest, the same digest the archive holds."""
    from accelnode.oci.reference import Reference
    from accelnode.oci.registry import Deadline, Registry

    target = Reference.parse(ref)
    if not target.tag or target.digest:
        raise ImageError(f"--push {ref}: name a tag (registry.example.com/team/accelnode:{NAME.rsplit(':', 1)[1]})")
    with tarfile.open(image.archive) as tar:
        def blob(digest: str):
            return tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")

        [desc] = json.load(tar.extractfile("index.json"))["manifests"]
        body = blob(desc["digest"]).read()
        manifest = json.loads(body)
        reg = Registry(target.host, options, Deadline(options.timeout))
        for d in (*manifest["layers"], manifest["config"]):
            reg.upload_blob(target.repository, d["digest"], blob(d["digest"]), ref)
        digest = reg.put_manifest(target.repository, target.tag, body, desc["mediaType"], ref)
    return target.pinned(digest)


def import_ctr(given: str | None) -> Path:
    """The ctr that ``--import`` runs: ``given``, else the containerd 2 one we build (PATH's may be
    Debian's 1.x, or none: fresh machines have no ``containerd`` package)."""
    from tests.rigs.node import containerd_bin

    ctr = Path(given) if given else containerd_bin(Path(os.environ.get("ACCELNODE_TOOLS_BIN", ROOT / ".tools/bin"))) / "ctr"
    if not ctr.is_file():
        raise ImageError(f"no ctr at {ctr}: `make tools` builds containerd 2 there (tools/mk/containerd2.mk), "
                         "or name one with --ctr")
    return ctr


def main(argv: list[str] | None = None) -> int:
    from accelnode.oci.errors import ImageError as OCIError
    from accelnode.oci.registry import RegistryOptions

    p = argparse.ArgumentParser(prog="python -m tests.rigs.image", description=__doc__.splitlines()[0])
    p.add_argument("--import", dest="address", metavar="SOCKET", help="import into containerd at SOCKET (k8s.io)")
    p.add_argument("--ctr", metavar="PATH", default=None,
                   help="the ctr of --import (default: the containerd 2 one tools/mk/containerd2.mk builds, "
                        "beside $ACCELNODE_TOOLS_BIN or .tools/bin; never the one on PATH)")
    p.add_argument("--push", metavar="REF", help="push to REF (registry/repository:tag), e.g. "
                   "registry.example.com/team/accelnode:" + NAME.rsplit(":", 1)[1])
    p.add_argument("--plain-http", action="store_true", help="talk HTTP to the registry of --push (a local one)")
    p.add_argument("--registry-config", metavar="FILE",
                   help="Docker config JSON with the credentials for --push (default: ~/.docker/config.json)")
    p.add_argument("--pause", action="store_true", help="the sandbox image instead")
    args = p.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        ctr = import_ctr(args.ctr) if args.address else None  # before the build: a missing one fails at once
        image = build_pause() if args.pause else build(log=log)
        if ctr:
            ctr_import(image, args.address, str(ctr))
        if args.push:
            pinned = push(image, args.push, RegistryOptions(plain_http=args.plain_http, config_file=args.registry_config))
            log(f"image: pushed {pinned}")
    except (ImageError, OCIError, ValueError) as e:
        print(f"image: {e}", file=sys.stderr)
        return 1
    print(image.archive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
