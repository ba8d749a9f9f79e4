"""The capture loop, judged by the frameworks themselves: a pod compiles cold into its real
copy-on-write view (overlayfs over the node's installed base cache, its writable layer on a
tmpfs: csi_driver/views.py), the node reads that layer as hostile input and pushes a contribution,
the controller's side merges, publishes a delta image (the base's layers plus one), signs it and
judges promotion; a second node pulls the new digest and its consumer hits every kernel the first
compiled, with zero compiles (Triton's compilation listener and cache-manager writes; JAX's
persistent-cache hit and miss events)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from accelnode.capture import layer, publish
from accelnode.oci import signatures
from tests.cache.cosign import Cosign, get_manifest
from tests.cache.test_cli import cache
from tests.cache.test_triton import BASIC, compiled, read_only_at, require_triton, rig
from tests.conftest import accelnode_cmd, require, require_root

NEW = ["add_64_w8", "softmax_128_w4", "matmul_16x16x16"]  # kernels the base cache lacks


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Node:
    """One node's store and views directory (the agent's and CSI driver's state)."""

    def __init__(self, root: Path, registry):
        from agent.store import CacheStore
        from csi_driver.views import Views

        self.store = CacheStore(root / "store", registry=registry.options())
        self.views = Views(str(root / "views"))
        self.views.start()

    def view(self, image: str, target: Path):
        """A pod's copy-on-write view of ``image`` at ``target``; returns the installed base."""
        from csi_driver import mounts

        inst = self.store.ensure(image)
        target.mkdir(parents=True)
        self.views.create(str(target), str(inst.path), 64 << 20, mounts.MS_NOSUID | mounts.MS_NODEV,
                          image.rsplit("@", 1)[-1])
        return inst

    def unpublish(self, target: Path, capture=None):
        """Unmount the pod's overlay (nothing writes the layer any more), hand its writable layer
        to ``capture`` (as the agent reads it at unpublish), then take the view away."""
        subprocess.run(["umount", str(target)], check=True)
        try:
            return capture(Path(self.views.dir_of(str(target))) / "upper") if capture else None
        finally:
            self.views.remove(str(target))
            target.rmdir()  # as kubelet does after an unpublish


@pytest.fixture
def keypair(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return private, public


def capture_and_publish(registry, tmp_path, base: str, kind: str, pod_path: str, upper: Path, base_root: Path,
                        private: bytes, public: str, repo: str):
    """The node's hand-over and the controller's publication; returns (Published, Merged)."""
    lay, sel = layer.contribute(str(upper), kind, pod_path, base_root)
    assert lay is not None and sel.keys, sel
    opts = registry.options()
    pushed = publish.push_contribution(lay, repo, opts)
    # the controller: what the node reported, fetched and judged again as hostile input
    contribution = publish.fetch_contribution(pushed, "node-a", "team-a/first", now(), opts)
    merged = publish.merge([contribution], kind, pod_path)
    assert not merged.refused and not merged.conflicts and set(merged.sources) == set(sel.keys)
    out = publish.publish(base, merged, kind, repo, opts)
    signatures.sign_v2(out.reference, private, opts)
    verdict = signatures.verify(repo, out.digest, [signatures.TrustedKey.from_pem("team-a", public)], opts,
                                formats=(signatures.V2,))
    assert verdict.ok, verdict
    assert Cosign(tmp_path / "cosign").verify(out.reference, public, "cosign-v2")  # cosign's own verdict
    ok, why = publish.promotable("auto", 1, merged, verdict.ok)
    assert ok, why
    # a delta: the base's layers, then one more; only that layer was pushed (the base's were there)
    base_manifest = get_manifest(registry, base.split("/", 1)[1].split("@")[0], base.rsplit("@", 1)[1])
    new_manifest = get_manifest(registry, repo.split("/", 1)[1], out.digest)
    assert new_manifest["layers"][:-1] == base_manifest["layers"] and new_manifest["layers"][-1]["digest"] == lay.digest
    return out, merged


def test_triton_capture_loop(registry, tmp_path, keypair, capsys):
    require_root()
    require_triton()
    (tmp_path / "cosign").mkdir()
    pod = tmp_path / "pod" / "cache"  # where pods mount the cache volume, on every node
    pod_path = str(pod / "io.triton.cache")
    base = cache("build", str(compiled(tmp_path / "build", kernels=BASIC)), f"{registry.host}/team-a/kernels:base",
                 "--plain-http", "--pod-path", pod_path).stdout.strip()
    node_a = Node(tmp_path / "node-a", registry)
    inst = node_a.view(base, pod)
    try:
        first = rig(pod / "io.triton.cache", "--kernels", ",".join(BASIC + NEW))
    finally:
        out, merged = node_a.unpublish(pod, lambda upper: capture_and_publish(
            registry, tmp_path, base, "triton", pod_path, upper, inst.path, *keypair,
            repo=f"{registry.host}/team-a/kernels-captured"))
    assert [first["kernels"][k]["cache_hit"] for k in BASIC] == [True] * len(BASIC)
    assert [first["kernels"][k]["cache_hit"] for k in NEW] == [False] * len(NEW)  # compiled cold
    assert len(merged.sources) == len(NEW)

    node_b = Node(tmp_path / "node-b", registry)
    inst_b = node_b.store.ensure(out.reference)
    assert inst_b.labels[publish.BASE_LABEL] == base
    assert json.loads(inst_b.labels[publish.PROVENANCE_LABEL])["from"][0]["pod"] == "team-a/first"
    assert inst_b.labels["cache.triton.image/entry-count"] == str(len(BASIC) + len(NEW))
    with read_only_at(inst_b.path, pod):
        second = rig(pod / "io.triton.cache", "--kernels", ",".join(BASIC + NEW))
    for name, k in second["kernels"].items():
        assert k["cache_hit"] is True and k["puts"] == 0, (name, k)
    with capsys.disabled():
        print(f"\ncapture triton: first pod {first['seconds']:.3f}s ({len(NEW)} compiled), second node "
              f"{second['seconds']:.3f}s (all hits); pushed {out.pushed_bytes} bytes")


JAX_ENV = {"JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none", "JAX_PLATFORMS": "cpu"}


def jax_run(cache_dir: Path, size: int) -> dict:
    from tests.node.test_jax import PROBE

    probe = PROBE.replace("jnp.ones((128, 128))", f"jnp.ones(({size}, {size}))")
    out = subprocess.run([sys.executable, "-c", probe, str(cache_dir)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **JAX_ENV})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def jax_base(registry, tmp_path) -> tuple[str, dict]:
    """A JAX cache image from a real run: the probe's program at another shape (some of its
    kernels are the same at every shape, so a later run hits those and misses the rest)."""
    import importlib.util

    require(importlib.util.find_spec("jax") is not None, "jax (the CPU wheel)")
    written = tmp_path / "jax-base"
    seed = jax_run(written, 64)
    assert seed["misses"] >= 1
    built = subprocess.run([*accelnode_cmd(), "cache", "build", str(written), f"{registry.host}/team-a/jax:base",
                            "--kind", "jax", "--plain-http", "--target", "backend=tpu,arch=v5e"],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    return built.stdout.strip(), seed


def test_jax_capture_loop(registry, tmp_path, keypair, capsys):
    require_root()
    (tmp_path / "cosign").mkdir()
    base, _ = jax_base(registry, tmp_path)
    pod = tmp_path / "pod" / "cache"
    node_a = Node(tmp_path / "node-a", registry)
    inst = node_a.view(base, pod)
    try:
        first = jax_run(pod / "io.jax.cache", 128)
    finally:
        out, merged = node_a.unpublish(pod, lambda upper: capture_and_publish(
            registry, tmp_path, base, "jax", str(pod / "io.jax.cache"), upper, inst.path, *keypair,
            repo=f"{registry.host}/team-a/jax-captured"))
    assert first["misses"] >= 1 and len(merged.sources) == first["misses"], (first, merged.sources)

    node_b = Node(tmp_path / "node-b", registry)
    inst_b = node_b.store.ensure(out.reference)
    with read_only_at(inst_b.path, pod):
        second = jax_run(pod / "io.jax.cache", 128)
    assert second["misses"] == 0 and second["hits"] == first["hits"] + first["misses"], second
    with capsys.disabled():
        print(f"\ncapture jax: first pod {first}, second node {second}; pushed {out.pushed_bytes} bytes")
