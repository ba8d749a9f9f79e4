"""Caches built from real Triton cache trees (triton 3.9, kernels compiled for a GPU target with
no GPU present): labels and manifest from Triton's own metadata, a pulled cache that Triton hits
read-only, the agent refusing a cache built for another GPU, and bad trees refused."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from accelnode import exitcodes
from tests.cache.test_cli import cache
from tests.conftest import ROOT, require, require_root

BASIC = ["add_1024_w4", "softmax_256_w4", "matmul_32x32x32", "matmul_64x64x32"]
MISSING = "add_64_w8"  # a variant the caches below never hold


def require_triton() -> None:
    require(importlib.util.find_spec("triton") is not None,
            "the triton package (pip install -e '.[triton]'; make deps installs it)")


def rig(cache_dir: Path, *args: str) -> dict:
    """Run tests/rigs/triton_kernels.py in a fresh Python with TRITON_CACHE_DIR=cache_dir."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_HOME", None)
    proc = subprocess.run([sys.executable, "-m", "tests.rigs.triton_kernels", *args], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def compiled(tree: Path, target: str = "cuda:90:32", kernels=BASIC) -> Path:
    require_triton()
    report = rig(tree, "--target", target, "--kernels", ",".join(kernels))
    assert not any(k["cache_hit"] for k in report["kernels"].values()), report
    return tree


def metadata_files(tree: Path) -> list[dict]:
    """Every kernel metadata JSON Triton wrote (not the ``__grp__`` indexes)."""
    return [json.loads(p.read_text()) for p in sorted(tree.glob("*/*.json")) if not p.name.startswith("__grp__")]


def listing(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def cuda_tree(tmp_path_factory):
    return compiled(tmp_path_factory.mktemp("triton-cuda") / "cache")


@contextlib.contextmanager
def read_only_at(src: Path, where: Path):
    """``src`` seen read-only at ``where``: a read-only bind mount (EROFS on write) as the CSI
    driver gives pods; without root, a copy with the write bits removed (EACCES)."""
    where.mkdir(parents=True)
    if os.geteuid() != 0:
        shutil.rmtree(where)
        shutil.copytree(src, where, symlinks=True)
        subprocess.run(["chmod", "-R", "a-w", str(where)], check=True)
        try:
            yield errno.EACCES
        finally:
            subprocess.run(["chmod", "-R", "u+w", str(where)], check=True)
        return
    subprocess.run(["mount", "--bind", str(src), str(where)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], check=True)
        yield errno.EROFS
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_build_from_triton_tree_labels_and_manifest(registry, cuda_tree, tmp_path):
    image = f"{registry.host}/triton/basic:cuda90"
    before = listing(cuda_tree)
    # no --kind: a TRITON_CACHE_DIR is recognised by its group files
    ref = cache("build", str(cuda_tree), image, "--plain-http", "--pod-path", "/cache/io.triton.cache").stdout.strip()
    assert listing(cuda_tree) == before  # the source tree is only read

    meta = metadata_files(cuda_tree)
    assert len(meta) == len(BASIC) and {m["triton_version"] for m in meta} == {"3.9.0"}
    expected_targets = []
    for m in meta:  # the summary is what Triton's metadata says, ptx_version included when it set one
        t = {"backend": m["target"]["backend"], "arch": str(m["target"]["arch"]), "warp_size": m["target"]["warp_size"]}
        if isinstance(m.get("ptx_version"), int):
            t["ptx_version"] = m["ptx_version"]
        if t not in expected_targets:
            expected_targets.append(t)
    assert expected_targets == [{"backend": "cuda", "arch": "90", "warp_size": 32}]

    (m,) = json.loads(cache("inspect", ref, "--json", "--plain-http").stdout)["manifests"]
    labels = m["labels"]
    assert m["kind"] == "triton" and m["targets"] == expected_targets
    assert json.loads(labels["cache.triton.image/summary"]) == {"targets": expected_targets}
    assert labels["cache.triton.image/entry-count"] == str(len(BASIC))
    assert labels["io.accelnode.cache/pod-path"] == "/cache/io.triton.cache"

    digest, path = cache("pull", ref, "--plain-http", "--store", str(tmp_path / "store")).stdout.split()
    content = Path(path)
    tree = content / "io.triton.cache"
    assert labels["cache.triton.image/cache-size-bytes"] == str(sum(p.stat().st_size for p in tree.rglob("*")
                                                                    if p.is_file()))
    # every file Triton wrote is there, byte for byte, except the group files (rebased)
    for rel, h in before.items():
        if "__grp__" not in rel:
            assert listing(tree)[rel] == h, rel
    for grp in tree.glob("*/__grp__*.json"):
        children = json.loads(grp.read_text())["child_paths"]
        assert children and all(p == f"/cache/io.triton.cache/{grp.parent.name}/{c}" for c, p in children.items())

    manifest = json.loads((content / "io.triton.manifest" / "manifest.json").read_text())
    entries = sorted(manifest["triton"], key=lambda e: e["hash"])
    assert [e["hash"] for e in entries] == sorted(m["hash"] for m in meta)
    by_hash = {m["hash"]: m for m in meta}
    for e in entries:
        src = by_hash[e["hash"]]
        assert (e["backend"], e["arch"], e["warp_size"]) == ("cuda", "90", 32)
        assert (e["num_warps"], e["num_stages"], e["debug"], e["name"]) == (
            src["num_warps"], src["num_stages"], src["debug"], src["name"])
        assert ("ptx_version" in e) == isinstance(src.get("ptx_version"), int)
    assert cache("verify", "--store", str(tmp_path / "store"), digest).stdout.strip() == "ok"


def test_pulled_cache_hits_read_only(registry, tmp_path, capsys):
    from agent.store import CacheStore

    src = compiled(tmp_path / "build-cache")
    cold = rig(tmp_path / "cold-cache", "--kernels", ",".join(BASIC))
    pod = tmp_path / "pod" / "cache"  # where the "pod" mounts the cache volume
    ref = cache("build", str(src), f"{registry.host}/triton/hits:v1", "--plain-http",
                "--pod-path", str(pod / "io.triton.cache")).stdout.strip()
    store = CacheStore(tmp_path / "store", registry=registry.options())
    inst = store.ensure(ref)
    shutil.rmtree(src)  # nothing may be read from where the kernels were compiled
    installed = listing(inst.path)

    with read_only_at(inst.path, pod) as write_errno:
        seen = listing(pod)
        warm = rig(pod / "io.triton.cache", "--kernels", ",".join(BASIC))
        assert listing(pod) == seen  # no entry written
        for name, k in warm["kernels"].items():
            # Triton's own evidence: its listener reports a hit, its cache manager wrote nothing
            assert k == {"cache_hit": True, "puts": 0, "seconds": k["seconds"]}, (name, k)
        # a kernel the cache lacks: Triton compiles it and its first write into the cache dir
        # fails - the crash the writable (copy-on-write) view removes
        miss = rig(pod / "io.triton.cache", "--kernels", MISSING)["kernels"][MISSING]
        assert miss["errno"] == errno.errorcode[write_errno], miss
    with capsys.disabled():
        print(f"\ntriton {warm['triton_version']}: {len(BASIC)} kernels cold {cold['seconds']:.3f}s, "
              f"from the pulled read-only cache {warm['seconds']:.3f}s; missing kernel: {miss['error']}")
    assert listing(inst.path) == installed and store.verify() == []  # the store's copy is unchanged


def test_a_cache_seen_at_another_path_misses(registry, cuda_tree, tmp_path):
    """Triton's group files hold absolute paths: mounted anywhere but --pod-path, every kernel
    misses (and compiling it fails on the read-only mount)."""
    from agent.store import CacheStore

    ref = cache("build", str(cuda_tree), f"{registry.host}/triton/elsewhere:v1", "--plain-http").stdout.strip()
    inst = CacheStore(tmp_path / "store", registry=registry.options()).ensure(ref)
    assert inst.labels["io.accelnode.cache/pod-path"] == "/cache/io.triton.cache"
    with read_only_at(inst.path, tmp_path / "elsewhere") as write_errno:
        k = rig(tmp_path / "elsewhere" / "io.triton.cache", "--kernels", BASIC[0])["kernels"][BASIC[0]]
    assert k["errno"] == errno.errorcode[write_errno], k


@pytest.fixture
def agent_for(tmp_path, registry):
    """An agent whose node declares its GPUs the way a real node does: PCI ids in sysfs."""
    from prometheus_client import CollectorRegistry

    from accelnode.hw import accelerators
    from agent import core
    from agent.store import CacheStore
    from tests.rigs.simhost import SimHost

    require_root()

    def make(name: str, device: int, vendor: int = 0x10DE):
        host = SimHost(tmp_path / name / "host")
        host.add_pci_device("0000:00:05.0", vendor=vendor, device=device)
        found = accelerators.detect(host.sysfs_root, host.dev_root)
        store = CacheStore(tmp_path / name / "store", registry=registry.options())
        return core.Agent(store, found, core.Metrics(CollectorRegistry()))

    return make


def test_agent_refuses_a_cache_built_for_another_gpu(registry, cuda_tree, tmp_path, agent_for):
    from agent import core

    cuda90 = cache("build", str(cuda_tree), f"{registry.host}/triton/fit:cuda90", "--plain-http").stdout.strip()
    hip = compiled(tmp_path / "hip-cache", "hip:gfx942:64")
    assert {m["target"]["backend"] for m in metadata_files(hip)} == {"hip"}
    gfx942 = cache("build", str(hip), f"{registry.host}/triton/fit:gfx942", "--plain-http").stdout.strip()

    a100 = agent_for("a100", 0x20B2)  # A100 SXM4 80GB: sm_80
    answer = a100.ensure(cuda90, wait_seconds=60)
    assert answer.state == core.INCOMPATIBLE, answer
    assert (answer.expected, answer.found) == ("cuda/90 (warp 32)", "cuda/sm_80 x1 (warp 32)")
    assert "built for cuda/90 (warp 32); this node has cuda/sm_80 x1 (warp 32)" in answer.message

    h100 = agent_for("h100", 0x2330)  # H100 SXM5: sm_90
    assert h100.ensure(cuda90, wait_seconds=60).state == core.READY
    answer = h100.ensure(gfx942, wait_seconds=60)
    assert answer.state == core.INCOMPATIBLE and answer.expected == "hip/gfx942 (warp 64)", answer

    mi300 = agent_for("mi300", 0x74A1, vendor=0x1002)  # MI300X: gfx942, wave64
    assert mi300.ensure(gfx942, wait_seconds=60).state == core.READY
    assert mi300.ensure(cuda90, wait_seconds=60).state == core.INCOMPATIBLE


def _tags(registry, repo: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{registry.host}/v2/{repo}/tags/list", timeout=5) as r:
            return len(json.loads(r.read()).get("tags") or [])
    except urllib.error.HTTPError as e:
        return 0 if e.code == 404 else -1


def test_bad_trees_are_refused_and_nothing_is_pushed(registry, cuda_tree, tmp_path):
    def refused(tree: Path, repo: str, *extra: str) -> str:
        before = listing(tree)
        proc = cache("build", str(tree), f"{registry.host}/{repo}:v1", "--plain-http", *extra,
                     check_rc=exitcodes.FAILURE)
        assert listing(tree) == before and _tags(registry, repo) == 0
        return proc.stderr.strip().splitlines()[-1]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no Triton kernel in this tree" in refused(empty, "bad/empty", "--kind", "triton")

    broken = tmp_path / "broken"
    shutil.copytree(cuda_tree, broken)
    victim = next(p for p in sorted(broken.glob("*/*.json")) if not p.name.startswith("__grp__"))
    victim.write_text(victim.read_text()[:40])
    line = refused(broken, "bad/json")
    assert f"{victim}: not a Triton metadata file" in line

    badtarget = tmp_path / "badtarget"
    shutil.copytree(cuda_tree, badtarget)
    victim = next(p for p in sorted(badtarget.glob("*/*.json")) if not p.name.startswith("__grp__"))
    doc = json.loads(victim.read_text())
    doc["target"] = {"backend": "cuda"}
    victim.write_text(json.dumps(doc))
    assert f"{victim}: bad Triton target" in refused(badtarget, "bad/target")

    orphan = tmp_path / "orphan"
    shutil.copytree(cuda_tree, orphan)
    victim = next(p for p in sorted(orphan.glob("*/*")) if p.suffix == ".cubin")
    victim.unlink()
    assert f"lists {victim.name!r}, which is not a file beside it" in refused(orphan, "bad/group")

    assert "--pod-path must be absolute" in refused(cuda_tree, "bad/podpath", "--pod-path", "cache/x")


def test_vllm_shaped_tree(registry, cuda_tree, tmp_path):
    """A VLLM_CACHE_ROOT as vLLM lays it out (torch_compile_cache/<hash>/rank_<r>_<dp>/<prefix>/
    {triton_cache,inductor_cache}): vLLM labels, MCV's vLLM manifest, group files rebased under
    the pod's VLLM_CACHE_ROOT, and Triton hits the nested tree read-only."""
    from agent.store import CacheStore

    root = tmp_path / "vllm-root"
    local = root / "torch_compile_cache" / "0a1b2c3d4e" / "rank_0_0" / "backbone"
    shutil.copytree(cuda_tree, local / "triton_cache")
    (local / "inductor_cache" / "fxgraph").mkdir(parents=True)
    (local / "inductor_cache" / "fxgraph" / "entry").write_bytes(b"\x00" * 100)
    (local / "inductor_cache" / "config.json").write_text('{"not": "triton"}')
    pod_root = tmp_path / "pod" / "vllm"
    ref = cache("build", str(root), f"{registry.host}/vllm/shaped:v1", "--plain-http", "--kind", "vllm",
                "--pod-path", str(pod_root / "io.vllm.cache")).stdout.strip()
    inst = CacheStore(tmp_path / "store", registry=registry.options()).ensure(ref)
    assert inst.kind == "vllm" and inst.targets == [{"backend": "cuda", "arch": "90", "warp_size": 32}]
    assert inst.labels["cache.vllm.image/format"] == "triton"
    assert inst.labels["cache.vllm.image/entry-count"] == str(len(BASIC))
    (group,) = json.loads((inst.path / "io.vllm.manifest" / "manifest.json").read_text())["vllm"]
    assert group["vllmHash"] == "0a1b2c3d4e" and group["cacheFormat"] == "triton" and len(group["triton"]) == len(BASIC)

    nested = Path("io.vllm.cache/torch_compile_cache/0a1b2c3d4e/rank_0_0/backbone/triton_cache")
    with read_only_at(inst.path, pod_root):
        warm = rig(pod_root / nested, "--kernels", ",".join(BASIC))
    assert all(k["cache_hit"] and k["puts"] == 0 for k in warm["kernels"].values()), warm
