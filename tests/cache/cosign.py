"""The real ``cosign`` (built into .tools/bin by tools/mk/cosign.mk) signing test images in the
local registry with generated keys, offline: no transparency log, no signing config.

``Cosign(tmp).keypair(name)`` -> (private key path, public key PEM); ``sign(image, key, fmt)``
writes a ``cosign-v2`` (``.sig`` tag) or ``cosign-v3`` (bundle referrer; Debian's registry has
no referrers API, so under the fallback tag ``sha256-<hex>``) signature; ``verify(image, pub,
fmt)`` is cosign's own verdict, the reference every test compares ours with.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import tool

REGISTRY_FLAGS = ["--allow-insecure-registry", "--allow-http-registry"]


class Cosign:
    def __init__(self, workdir: Path):
        self.bin = tool("cosign")
        self.workdir = workdir
        self.env = {**os.environ, "COSIGN_PASSWORD": "", "COSIGN_YES": "true", "HOME": str(workdir),
                    "SIGSTORE_NO_CACHE": "1", "TUF_ROOT": str(workdir / "tuf")}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([self.bin, *args], env=self.env, cwd=self.workdir, capture_output=True, text=True,
                             timeout=120)
        if check and out.returncode:
            raise AssertionError(f"cosign {' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
        return out

    def keypair(self, name: str) -> tuple[Path, str]:
        prefix = self.workdir / name
        if not prefix.with_suffix(".key").exists():
            self.run("generate-key-pair", "--output-key-prefix", str(prefix))
        return prefix.with_suffix(".key"), prefix.with_suffix(".pub").read_text()

    def sign(self, image: str, key: Path, fmt: str) -> None:
        args = ["sign", "--key", str(key), "--tlog-upload=false", "--use-signing-config=false", *REGISTRY_FLAGS]
        args.append("--new-bundle-format=" + ("true" if fmt == "cosign-v3" else "false"))
        self.run(*args, image)

    def verify(self, image: str, pub: str, fmt: str) -> bool:
        path = self.workdir / "verify.pub"
        path.write_text(pub)
        args = ["verify", "--key", str(path), "--insecure-ignore-tlog", *REGISTRY_FLAGS,
                "--new-bundle-format=" + ("true" if fmt == "cosign-v3" else "false")]
        return self.run(*args, image, check=False).returncode == 0


def get_manifest(reg, repo: str, ref: str) -> dict:
    from accelnode.oci.reference import Reference

    image = f"{reg.host}/{repo}"
    body, _, _ = _registry(reg).get_manifest(
        Reference(reg.host, repo, None if ref.startswith("sha256:") else ref, ref if ref.startswith("sha256:") else None),
        image)
    return json.loads(body)


def put_manifest(reg, repo: str, ref: str, manifest: dict, media_type: str) -> str:
    return _registry(reg).put_manifest(repo, ref, json.dumps(manifest).encode(), media_type, f"{reg.host}/{repo}")


def put_blob(reg, repo: str, data: bytes) -> dict:
    import hashlib

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    _registry(reg).upload_blob(repo, digest, data, f"{reg.host}/{repo}")
    return {"digest": digest, "size": len(data)}


def get_blob(reg, repo: str, desc: dict) -> bytes:
    return _registry(reg).read_blob(repo, desc, f"{reg.host}/{repo}", limit=1 << 20)


def _registry(reg):
    from accelnode.oci.registry import Deadline, Registry

    return Registry(reg.host, reg.options(), Deadline(30))
