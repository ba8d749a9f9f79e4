"""`accelnode cache ...` end to end, as an operator runs it, against the real registry."""

from __future__ import annotations

import json
import os
import subprocess

from accelnode import exitcodes
from tests.cache.helpers import GZ, TRITON_CONFIG, tar
from tests.conftest import accelnode_cmd


def cache(*args, check_rc=0):
    proc = subprocess.run(accelnode_cmd() + ["cache", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == check_rc, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def test_build_inspect_pull_verify_gc(registry, tmp_path):
    raw = tmp_path / "jaxcache"
    raw.mkdir()
    (raw / "jit_train_step-0a1b2c").write_bytes(os.urandom(30_000))
    (raw / "jit_eval-3d4e5f").write_bytes(os.urandom(10_000))
    image = f"{registry.host}/cli/jax:v5e"
    built = cache("build", str(raw), image, "--kind", "jax", "--target", "backend=tpu,arch=v5litepod",
                  "--label", "cache.jax.image/jax-version=0.4.35", "--plain-http", "--log-format", "text")
    ref = built.stdout.strip()
    assert ref.startswith(f"{registry.host}/cli/jax@sha256:")
    assert "transfer done" in built.stderr  # not a terminal: plain log lines, no bar

    info = json.loads(cache("inspect", image, "--json", "--plain-http").stdout)
    (m,) = info["manifests"]
    assert m["digest"] == ref.split("@")[1] and m["kind"] == "jax" and m["size_bytes"] == 40_000
    assert m["targets"] == [{"backend": "tpu", "arch": "v5e"}]
    assert m["labels"]["cache.jax.image/jax-version"] == "0.4.35"
    text = cache("inspect", image, "--plain-http").stdout
    assert "kind:    jax" in text and "tpu/v5e" in text and "40000 bytes" in text

    store = str(tmp_path / "store")
    digest, path = cache("pull", ref, "--plain-http", "--store", store).stdout.split()
    assert digest == m["digest"]
    assert sorted(os.listdir(os.path.join(path, "io.jax.cache"))) == ["jit_eval-3d4e5f", "jit_train_step-0a1b2c"]
    pulled = json.loads(cache("pull", ref, "--plain-http", "--store", store, "--json").stdout)
    assert pulled["path"] == path and pulled["kind"] == "jax"

    assert cache("verify", "--store", store).stdout.strip() == "ok"
    os.chmod(os.path.join(path, "io.jax.cache", "jit_eval-3d4e5f"), 0o600)
    bad = cache("verify", "--store", store, digest, check_rc=exitcodes.FAILURE)
    assert "jit_eval-3d4e5f: type, mode or target changed" in bad.stdout and "1 problem(s)" in bad.stderr

    assert cache("gc", "--store", store).stdout.strip() == f"removed {digest}"
    assert cache("gc", "--store", store).stdout == ""


def test_errors_are_one_line_with_exit_codes(registry, tmp_path):
    store = str(tmp_path / "store")
    hostile = registry.push_raw("cli/hostile", "v1", config=TRITON_CONFIG, layers=[(GZ, tar(("../x", "file", b"x")))])
    proc = cache("pull", hostile, "--plain-http", "--store", store, check_rc=exitcodes.FAILURE)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"accelnode cache: HostileContent: {hostile}: layer 0 ({_layer(proc)}): member name '../x' contains '..'")
    cache("pull", "not a reference", "--store", store, check_rc=exitcodes.USAGE)
    proc = cache("pull", "127.0.0.1:9/x/y:z", "--plain-http", "--timeout", "1", "--store", store,
                 check_rc=exitcodes.UNAVAILABLE)
    assert "deadline" in proc.stderr
    proc = cache("build", str(tmp_path), f"{registry.host}/cli/empty:v1", "--plain-http", check_rc=exitcodes.FAILURE)
    assert "give --kind" in proc.stderr


def _layer(proc) -> str:
    line = proc.stderr.strip().splitlines()[-1]
    return line.split("layer 0 (")[1].split(")")[0]


def test_env_equivalents(registry, tmp_path):
    image = registry.push_raw("cli/env", "v1", config=TRITON_CONFIG, layers=[(GZ, tar(("io.triton.cache/f", "file", b"x")))])
    env = {**os.environ, "ACCELNODE_PLAIN_HTTP": "true", "ACCELNODE_STORE": str(tmp_path / "store")}
    proc = subprocess.run(accelnode_cmd() + ["cache", "pull", image], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(image.split("@")[1])
