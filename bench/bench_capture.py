"""Capture: a first pod compiles cold into its copy-on-write view, its work becomes a delta cache
image, a second node's pod starts warm from it (docs/capture.md). Needs root (overlay and tmpfs
mounts, as the CSI driver makes them), triton and jax.

Per framework, in fresh Python processes:

- Triton: N=50 real kernels (tests/rigs/triton_kernels.py) AOT for ``cuda:90`` on CPU; the base
  cache holds one of them. ``first_s``: the first pod, in a view of the base (49 compiled);
  ``warm_s``: a pod on a second node on the promoted digest, read-only (50 hits, 0 compiles).
- JAX (CPU): a program jitted at 12 shapes; the base holds one shape's run.

``publish_s``: from the first pod's exit to the signed delta image (unmount, read the writable
layer, build and push the contribution, fetch and merge it, push the delta, sign, verify);
what the API server adds (a node status write, the controller's watch, the spec patch) is not in
it. ``pushed_bytes``: what the capture pushed (the contribution layer, the delta's config and
manifest: the merged layer is the contribution's, stored once), against ``cache_bytes``, the
compressed layers of the whole new image.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
N = 50
JAX_SHAPES = [16 * (i + 2) for i in range(12)]
# after tests/node/test_jax.py's probe header (JAX's event listener, the persistent-cache settings)
JAX_PROBE_TAIL = r"""
import time

@jax.jit
def step(x):
    y = jnp.tanh(x @ x.T) * 2 + jnp.sin(x).sum()
    for _ in range(6):
        y = jnp.tanh(y @ x) + jnp.cos(y).mean()
    return y

t0 = time.monotonic()
for n in json.loads(sys.argv[2]):
    step(jnp.ones((n, n))).block_until_ready()
print(json.dumps({"seconds": time.monotonic() - t0, "hits": seen.get("/jax/compilation_cache/cache_hits", 0),
                  "misses": seen.get("/jax/compilation_cache/cache_misses", 0)}))
"""


def _triton(cache_dir: Path, *args: str) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.rigs.triton_kernels", *args], env=env, capture_output=True,
                         text=True, timeout=900, check=True)
    return json.loads(out.stdout)


def _jax(cache_dir: Path, shapes: list[int]) -> dict:
    env = {**os.environ, "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none", "JAX_PLATFORMS": "cpu"}
    from tests.node.test_jax import PROBE

    probe = PROBE.split("@jax.jit")[0] + JAX_PROBE_TAIL
    out = subprocess.run([sys.executable, "-c", probe, str(cache_dir), json.dumps(shapes)], env=env,
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loop(name: str, kind: str, work: Path, reg, base_src: Path, first, warm, key) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from accelnode.capture import layer, publish
    from accelnode.oci import signatures
    from accelnode.oci.build import build
    from accelnode.oci.registry import RegistryOptions
    from tests.capture.test_loop import Node

    opts = RegistryOptions(plain_http=True)
    pod = work / name / "pod" / "cache"
    pod_path = str(pod / f"io.{kind}.cache")
    base = build(base_src, f"{reg.host}/bench/{name}:base", options=opts, kind=kind, pod_path=pod_path,
                 targets=[{"backend": "tpu", "arch": "v5e"}] if kind == "jax" else ()).reference
    node_a = Node(work / name / "node-a", type("R", (), {"options": lambda self: opts})())
    inst = node_a.view(base, pod)
    cold = first(pod / f"io.{kind}.cache")
    t0 = time.monotonic()

    def capture(upper: Path):
        lay, _ = layer.contribute(str(upper), kind, pod_path, inst.path)
        ref = publish.push_contribution(lay, f"{reg.host}/bench/{name}-captured", opts)
        merged = publish.merge([publish.fetch_contribution(ref, "node-a", "bench/first", "now", opts)], kind, pod_path)
        out = publish.publish(base, merged, kind, f"{reg.host}/bench/{name}-captured", opts)
        private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        signatures.sign_v2(out.reference, private, opts)
        public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        assert signatures.verify(f"{reg.host}/bench/{name}-captured", out.digest,
                                 [signatures.TrustedKey.from_pem("k", public)], opts).ok
        return lay, out, merged

    lay, out, merged = node_a.unpublish(pod, capture)
    publish_s = time.monotonic() - t0
    node_b = Node(work / name / "node-b", type("R", (), {"options": lambda self: opts})())
    inst_b = node_b.store.ensure(out.reference)
    pod.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(inst_b.path), str(pod)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(pod)], check=True)
        hot = warm(pod / f"io.{kind}.cache")
    finally:
        subprocess.run(["umount", str(pod)], check=True)
    from accelnode.oci.manifest import inspect

    cache_bytes = inspect(out.reference, opts)["manifests"][0]["compressed_bytes"]
    print(f"BENCH capture {name}_first_s={cold['seconds']:.3f} {name}_warm_s={hot['seconds']:.3f} "
          f"{name}_warm_ratio={hot['seconds'] / cold['seconds']:.3f} target_{name}_warm_ratio<=0.2")
    print(f"BENCH capture {name}_entries={len(merged.sources)} {name}_publish_s={publish_s:.3f} "
          f"target_{name}_publish_s<=30")
    print(f"BENCH capture {name}_pushed_bytes={len(lay.blob) + out.pushed_bytes} {name}_cache_bytes={cache_bytes}")


def main() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    from tests.fixtures.registry import RunningRegistry

    if os.geteuid() != 0:
        print("BENCH capture skipped=1 (overlay views need root)")
        return
    work = Path(tempfile.mkdtemp(prefix="bench-capture.", dir=os.environ.get("ACCELNODE_BENCH_DIR")))
    (work / "registry").mkdir()
    reg = RunningRegistry(work / "registry")
    key = ec.generate_private_key(ec.SECP256R1())
    try:
        from tests.rigs.triton_kernels import variants

        names = list(variants())[:N]
        base_src = work / "triton-base"
        _triton(base_src, "--target", "cuda:90:32", "--kernels", names[0])

        def first(d):
            r = _triton(d, "--kernels", ",".join(names))
            assert sum(not k["cache_hit"] for k in r["kernels"].values()) == N - 1, "the base kernel missed"
            return r

        def warm(d):
            r = _triton(d, "--kernels", ",".join(names))
            assert all(k["cache_hit"] and k["puts"] == 0 for k in r["kernels"].values()), "a kernel recompiled"
            return r

        _loop("triton", "triton", work, reg, base_src, first, warm, key)

        jax_base = work / "jax-base"
        _jax(jax_base, JAX_SHAPES[:1])

        def jfirst(d):
            r = _jax(d, JAX_SHAPES)
            assert r["misses"] >= len(JAX_SHAPES) - 1, r
            return r

        def jwarm(d):
            r = _jax(d, JAX_SHAPES)
            assert r["misses"] == 0, r
            return r

        _loop("jax", "jax", work, reg, jax_base, jfirst, jwarm, key)
    finally:
        reg.stop()
        subprocess.run(["umount", "-R", str(work)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
