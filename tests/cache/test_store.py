"""Store semantics against the real registry: install, layers and whiteouts, indexes,
single download across threads and processes, crash leftovers, references, verify, gc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from accelnode.oci.build import build, push_index
from accelnode.oci.errors import ImageNotFound, NoMatchingManifest
from agent.errors import StoreCorrupt
from accelnode.oci.limits import Limits
from accelnode.oci.manifest import inspect
from agent.store import CacheStore
from tests.cache.helpers import GZ, TRITON_CONFIG, FaultProxy, tar
from tests.conftest import accelnode_cmd

C = "io.triton.cache"


def triton_tree(root, arch="sm_90", backend="cuda", nbytes=20_000, seed=b""):
    kdir = root / C / ("k" + arch)
    kdir.mkdir(parents=True)
    (kdir / "kernel.json").write_text(json.dumps({"target": {"backend": backend, "arch": arch, "warp_size": 32}}))
    (kdir / "kernel.bin").write_bytes(seed + os.urandom(nbytes))
    return root


def test_pull_installs_verifies_and_is_idempotent(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src"), "store/basic", layers=3)
    store = CacheStore(tmp_path / "store", registry=registry.options())
    inst = store.ensure(image)
    assert inst.digest == image.split("@")[1] and inst.kind == "triton" and inst.image == image
    assert inst.targets == [{"backend": "cuda", "arch": "90", "warp_size": 32}]
    assert (inst.path / C / "ksm_90" / "kernel.bin").read_bytes() == (tmp_path / "src" / C / "ksm_90" / "kernel.bin").read_bytes()
    assert inst.size_bytes == sum(p.stat().st_size for p in (tmp_path / "src").rglob("*") if p.is_file())
    assert store.ensure(image) == inst
    assert store.installed(inst.digest) == inst and store.list() == [inst]
    assert store.verify() == []
    # a tag resolves to the same digest
    assert store.ensure(image.split("@")[0] + ":latest").digest == inst.digest


def test_layers_apply_in_order_with_whiteouts(registry, tmp_path):
    image = registry.push_raw("store/whiteouts", "v1", config=TRITON_CONFIG, layers=[
        (GZ, tar((f"{C}/a/x", "file", b"x"), (f"{C}/a/y", "file", b"y"), (f"{C}/b/z", "file", b"z"),
                 (f"{C}/keep", "file", b"old"), (f"{C}/d", "symlink", "a"))),
        (GZ, tar((f"{C}/a/.wh.x", "file"), (f"{C}/b/.wh..wh..opq", "file"), (f"{C}/b/new", "file", b"n"),
                 (f"{C}/keep", "file", b"new"), (f"{C}/d", "dir"), (f"{C}/d/f", "file", b"f"))),
        (GZ, tar((f"{C}/.wh.a", "file"),)),
    ])
    inst = CacheStore(tmp_path / "store", registry=registry.options()).ensure(image)
    tree = sorted(str(p.relative_to(inst.path)) for p in inst.path.rglob("*"))
    assert tree == [C, f"{C}/b", f"{C}/b/new", f"{C}/d", f"{C}/d/f", f"{C}/keep"]
    assert (inst.path / C / "keep").read_bytes() == b"new"
    assert not (inst.path / C / "d").is_symlink()


def test_zstd_and_uncompressed_layers(registry, tmp_path):
    from tests.cache.helpers import TAR, ZST

    image = registry.push_raw("store/zstd", "v1", config=TRITON_CONFIG, layers=[
        (ZST, tar((f"{C}/z", "file", b"zstd"), compression="zstd")), (TAR, tar((f"{C}/t", "file", b"tar"), compression=None))])
    inst = CacheStore(tmp_path / "store", registry=registry.options()).ensure(image)
    assert (inst.path / C / "z").read_bytes() == b"zstd" and (inst.path / C / "t").read_bytes() == b"tar"


def test_docker_schema2_image(registry, tmp_path):
    image = registry.push_raw(
        "store/docker", "v1", config=TRITON_CONFIG, config_type="application/vnd.docker.container.image.v1+json",
        media_type="application/vnd.docker.distribution.manifest.v2+json",
        layers=[("application/vnd.docker.image.rootfs.diff.tar.gzip", tar((f"{C}/f", "file", b"docker")))])
    inst = CacheStore(tmp_path / "store", registry=registry.options()).ensure(image)
    assert (inst.path / C / "f").read_bytes() == b"docker"


def test_image_index_picks_the_manifest_for_the_node(registry, tmp_path):
    opts = registry.options()
    cuda = build(triton_tree(tmp_path / "cuda"), f"{registry.host}/store/multi:cuda", options=opts)
    jax_dir = tmp_path / "jax" / "io.jax.cache"
    jax_dir.mkdir(parents=True)
    (jax_dir / "jit_f-123").write_bytes(b"xla")
    tpu = build(tmp_path / "jax", f"{registry.host}/store/multi:tpu", options=opts,
                targets=[{"backend": "tpu", "arch": "v5litepod"}])
    index = push_index(f"{registry.host}/store/multi:latest", [
        {"digest": cuda.digest, "size": cuda.manifest_size, "targets": [{"backend": "cuda", "arch": "sm_90"}]},
        {"digest": tpu.digest, "size": tpu.manifest_size, "targets": [{"backend": "tpu", "arch": "v5e"}],
         "platform": {"os": "linux", "architecture": "amd64" if os.uname().machine == "x86_64" else "arm64"}},
    ], options=opts)
    store = CacheStore(tmp_path / "store", registry=opts)
    assert store.ensure(index, accelerators=[{"backend": "tpu", "arch": "v5e"}]).digest == tpu.digest
    assert store.ensure(index, accelerators=[{"backend": "cuda", "arch": "90"}]).kind == "triton"
    with pytest.raises(NoMatchingManifest, match="no manifest for this node"):
        store.ensure(index, accelerators=[{"backend": "hip", "arch": "gfx90a"}])
    info = inspect(index, opts)
    assert info["index"] == index.split("@")[1] and [m["kind"] for m in info["manifests"]] == ["triton", "jax"]


def test_pinned_index_resolves_offline_once_installed(registry, tmp_path):
    built = build(triton_tree(tmp_path / "src"), f"{registry.host}/store/offline:a", options=registry.options())
    proxy = FaultProxy(registry.host)
    try:
        index = push_index(f"{proxy.host}/store/offline:idx", [
            {"digest": built.digest, "size": built.manifest_size, "targets": [{"backend": "cuda", "arch": "90"}]}],
            options=registry.options())
        store = CacheStore(tmp_path / "store", registry=registry.options(timeout=3))
        first = store.ensure(index, accelerators=[{"backend": "cuda", "arch": "sm_90"}])
    finally:
        proxy.close()
    assert store.ensure(index, accelerators=[{"backend": "cuda", "arch": "sm_90"}]) == first


def _layer_digests(registry, image):
    from accelnode.oci.reference import Reference
    from accelnode.oci.registry import Deadline, Registry

    ref = Reference.parse(image)
    body, _, _ = Registry(ref.host, registry.options(), Deadline(10)).get_manifest(ref, image)
    return [d["digest"] for d in json.loads(body)["layers"]]


def test_concurrent_threads_download_once(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src", nbytes=2_000_000), "store/threads")
    layer = _layer_digests(registry, image)[0]
    before = registry.blob_gets(layer)
    store = CacheStore(tmp_path / "store", registry=registry.options())
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: store.ensure(image), range(6)))
    assert len({r.digest for r in results}) == 1
    assert registry.blob_gets(layer) - before == 1


def test_concurrent_processes_download_once(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src", nbytes=4_000_000), "store/procs")
    layer = _layer_digests(registry, image)[0]
    before = registry.blob_gets(layer)
    cmd = accelnode_cmd() + ["cache", "pull", image, "--plain-http", "--store", str(tmp_path / "store")]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    assert len({o[0] for o in outs}) == 1
    assert registry.blob_gets(layer) - before == 1


def test_killed_pull_leaves_nothing_visible_and_is_cleaned_at_start(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src", nbytes=3_000_000), "store/killed")
    proxy = FaultProxy(registry.host, cut_after=500_000, cut_digest=_layer_digests(registry, image)[0], stall=True)
    store_dir = tmp_path / "store"
    try:
        cmd = accelnode_cmd() + ["cache", "pull", image.replace(registry.host, proxy.host), "--plain-http",
                                 "--store", str(store_dir), "--timeout", "60"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):  # until the pull is mid-layer (bounded: 30 s)
            if proxy.cuts and any((store_dir / "tmp").glob("*/layers/0")):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proxy.close()
    assert list((store_dir / "caches").iterdir()) == []
    assert list((store_dir / "tmp").iterdir()) != []  # the leftover of the killed pull...
    store = CacheStore(store_dir, registry=registry.options())
    assert list((store_dir / "tmp").iterdir()) == []  # ...is removed at the next start
    assert store.list() == [] and store.ensure(image).kind == "triton"


def test_references_are_durable_and_gc_never_removes_them(registry, tmp_path):
    store = CacheStore(tmp_path / "store", registry=registry.options())
    installed = []
    for i in range(3):
        installed.append(store.ensure(registry.push(triton_tree(tmp_path / f"src{i}", nbytes=10_000 * (i + 1)),
                                                    f"store/gc{i}")))
    for i, inst in enumerate(installed):  # last use: 0 oldest, 2 newest
        os.utime(inst.path.parent, (1_000_000 + i, 1_000_000 + i))
    store.acquire(installed[0].digest, "csi-vol-1", {"pod_namespace": "ns", "pod_name": "p", "pod_uid": "u1"})
    with pytest.raises(ImageNotFound):
        store.acquire("sha256:" + "0" * 64, "csi-vol-2", {})
    reopened = CacheStore(tmp_path / "store", registry=registry.options())
    assert reopened.references() == {"csi-vol-1": {"digest": installed[0].digest, "pod_namespace": "ns",
                                                   "pod_name": "p", "pod_uid": "u1"}}
    # LRU order among the unreferenced: 1 goes before 2; stop once under the limit
    assert reopened.gc(max_bytes=installed[0].size_bytes + installed[2].size_bytes) == [installed[1].digest]
    assert reopened.gc(max_bytes=0) == [installed[2].digest]
    assert [i.digest for i in reopened.list()] == [installed[0].digest]
    reopened.release("csi-vol-1")
    reopened.release("csi-vol-1")
    assert reopened.references() == {}
    assert reopened.gc() == [installed[0].digest] and reopened.list() == []


def test_verify_finds_tampering(registry, tmp_path):
    src = triton_tree(tmp_path / "src")
    (src / C / "ksm_90" / "other.bin").write_bytes(b"o")
    (src / C / "link").symlink_to("ksm_90/kernel.bin")
    store = CacheStore(tmp_path / "store", registry=registry.options())
    inst = store.ensure(registry.push(src, "store/verify"))
    assert store.verify(inst.digest) == []
    kernel = inst.path / C / "ksm_90" / "kernel.bin"
    kernel.write_bytes(b"tampered")
    (inst.path / C / "extra").write_text("x")
    (inst.path / C / "ksm_90" / "kernel.json").unlink()
    (inst.path / C / "link").unlink()
    (inst.path / C / "link").symlink_to("ksm_90/kernel.json")
    (inst.path / C / "ksm_90" / "other.bin").unlink()
    (inst.path / C / "ksm_90" / "other.bin").symlink_to("kernel.bin")
    problems = store.verify(inst.digest)
    assert f"{inst.digest}: {C}/ksm_90/kernel.bin: content changed" in problems
    assert f"{inst.digest}: {C}/extra: not part of the image" in problems
    assert f"{inst.digest}: {C}/ksm_90/kernel.json: missing" in problems
    assert f"{inst.digest}: {C}/link: type, mode or target changed" in problems
    assert f"{inst.digest}: {C}/ksm_90/other.bin: type, mode or target changed" in problems
    assert len(problems) == 5
    with pytest.raises(ImageNotFound):
        store.verify("sha256:" + "1" * 64)


def test_ensure_and_gc_race_never_deletes_an_acquired_cache(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src"), "store/race")
    store = CacheStore(tmp_path / "store", registry=registry.options())
    stop = threading.Event()

    def collector():
        while not stop.is_set():
            store.gc()

    t = threading.Thread(target=collector)
    t.start()
    try:
        for i in range(20):
            for _ in range(50):  # gc may win between ensure and acquire: then ensure again
                inst = store.ensure(image)
                try:
                    store.acquire(inst.digest, f"vol{i}", {})
                    break
                except ImageNotFound:
                    continue
            assert store.installed(inst.digest) is not None and (inst.path / C).is_dir()
            store.release(f"vol{i}")
    finally:
        stop.set()
        t.join()


def test_reference_meta_cannot_override_the_digest_and_corrupt_refs_stop_gc(registry, tmp_path):
    store = CacheStore(tmp_path / "store", registry=registry.options())
    kept = store.ensure(registry.push(triton_tree(tmp_path / "a"), "store/refmeta-a"))
    other = store.ensure(registry.push(triton_tree(tmp_path / "b"), "store/refmeta-b"))
    store.acquire(kept.digest, "vol-1", {"digest": other.digest, "pod_name": "p"})
    assert store.references() == {"vol-1": {"digest": kept.digest, "pod_name": "p"}}
    assert store.gc() == [other.digest]
    # a reference file that cannot be read: gc refuses to guess and removes nothing
    store.release("vol-1")
    (tmp_path / "store" / "refs" / "broken.json").write_text('{"holder": "vol-2", "dig')
    with pytest.raises(StoreCorrupt, match="broken.json is unreadable"):
        store.gc()
    assert [i.digest for i in store.list()] == [kept.digest]


def test_store_files_are_decoded_under_the_stores_limits(registry, tmp_path):
    """Issue 33: the store's own files are decoded under what the store writes within its Limits
    (agent.store: REFERENCE, meta_budget, files_budget), never parsed whole whatever they hold:
    a reference padded with {} stops gc by its name, as a garbled one does; a file list longer
    than max_files allows is a problem verify names, not a parse of it."""
    store = CacheStore(tmp_path / "store", registry=registry.options(), limits=Limits(max_files=40))
    inst = store.ensure(registry.push(triton_tree(tmp_path / "a"), "store/budgets"))
    assert store.verify(inst.digest) == []
    files = tmp_path / "store" / "caches" / inst.digest.replace(":", "-", 1) / "files.json"
    listed = json.loads(files.read_text())
    files.write_text(json.dumps({**listed, **{f"pad/{i}": ["dir", 0o755, 0, ""] for i in range(40)}}))
    (problem,) = store.verify(inst.digest)
    assert problem.startswith(f"{inst.digest}: file list unreadable: {files} holds ") and "over the budget" in problem
    store.acquire(inst.digest, "vol-1", {"pod_name": "p"})
    ref = next((tmp_path / "store" / "refs").glob("*.json"))
    ref.write_text(json.dumps({**json.loads(ref.read_text()), "pad": [{}] * 100_000}))
    with pytest.raises(StoreCorrupt, match=rf"{ref.name} is unreadable \(DocumentError: .* over the budget"):
        store.references()
    assert [i.digest for i in store.list()] == [inst.digest]


def test_strays_and_interrupted_gc_leftovers_are_ignored_or_cleaned(registry, tmp_path):
    store_dir = tmp_path / "store"
    store = CacheStore(store_dir, registry=registry.options())
    inst = store.ensure(registry.push(triton_tree(tmp_path / "src"), "store/strays"))
    (store_dir / "caches" / "lost+found").mkdir()
    (store_dir / "tmp" / "stray-file").write_text("x")
    (store_dir / "tmp" / "trash.x1y2" / "c" / "content").mkdir(parents=True)  # an interrupted gc
    (store_dir / "tmp" / ("ab" * 32 + ".partial")).write_text("x")  # a file where a staging dir would be
    reopened = CacheStore(store_dir, registry=registry.options())
    assert os.listdir(store_dir / "tmp") == []
    assert reopened.list() == [inst]
