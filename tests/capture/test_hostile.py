"""A pod's writable layer and a pushed contribution are hostile input: each rule of capture, with
the attack that breaks it. Every refusal refuses the whole contribution (Poisoned) and names the
rule; what is merely not a cache entry is dropped and counted."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import stat
import tarfile
import threading
from pathlib import Path

import pytest

from accelnode.capture import entries, layer, publish, reader
from accelnode.capture.errors import Poisoned
from accelnode.capture.reader import CaptureLimits
from tests.cache.test_triton import compiled
from tests.conftest import require_root

POD = "/pod/cache/io.triton.cache"
T = "io.triton.cache"


@pytest.fixture(scope="module")
def kernel_tree(tmp_path_factory) -> Path:
    """A real Triton cache tree: one kernel compiled for sm_90 (no GPU)."""
    return compiled(tmp_path_factory.mktemp("triton") / "cache", kernels=["add_1024_w4"])


@pytest.fixture
def upper(tmp_path, kernel_tree) -> Path:
    """A writable layer as a Triton pod leaves it: io.triton.cache/<key>/... of one real kernel."""
    up = tmp_path / "upper"
    shutil.copytree(kernel_tree, up / T)
    return up


def kernel_dir(up: Path) -> Path:
    return next(p for p in (up / T).iterdir() if not p.name.startswith("tmp."))


def refused(up, limits=CaptureLimits(), kind="triton") -> str:
    with pytest.raises(Poisoned) as e:
        layer.contribute(str(up), kind, POD, limits=limits)
    return str(e.value)


def test_a_real_kernel_is_kept_with_its_group_rebased(upper):
    lay, sel = layer.contribute(str(upper), "triton", POD)
    (key,) = sel.keys
    d = kernel_dir(upper)
    assert key == f"{T}/{d.name}" and sel.dropped == {}
    group = json.loads(sel.files[f"{key}/" + next(p.name for p in d.iterdir() if p.name.startswith("__grp__"))])
    assert all(v == f"{POD}/{d.name}/{c}" for c, v in group["child_paths"].items())
    assert layer.read(lay.blob) == sel.files  # the layer holds exactly what was kept


def test_the_layer_is_deterministic_across_nodes(upper, tmp_path):
    other = tmp_path / "other-node"
    shutil.copytree(upper, other)
    for p in other.rglob("*"):  # another node: other times, owners and modes
        os.utime(p, (12345, 12345))
        os.chown(p, 1000, 1000)
    a, _ = layer.contribute(str(upper), "triton", POD)
    b, _ = layer.contribute(str(other), "triton", POD)
    assert a.digest == b.digest and a.diff_id == b.diff_id


def test_symlink_out_of_the_layer(upper, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host file")
    os.symlink(secret, kernel_dir(upper) / "add_kernel.cubin.bak")
    assert "symlink" in refused(upper)


def test_symlinked_directory_is_not_walked(upper, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", upper / T / "link")
    assert "symlink" in refused(upper)


def test_the_layer_root_itself_a_symlink(upper, tmp_path):
    os.symlink(upper, tmp_path / "root-link")
    assert "cannot be opened as a directory" in refused(tmp_path / "root-link")


def test_device_node(upper):
    require_root()
    os.mknod(kernel_dir(upper) / "mem", 0o600 | stat.S_IFCHR, os.makedev(1, 1))
    assert "device node" in refused(upper)


def test_overlay_whiteout_is_skipped_not_contributed(upper):
    require_root()
    os.mknod(upper / T / "deleted-by-pod", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    _, sel = layer.contribute(str(upper), "triton", POD)
    assert not any("deleted-by-pod" in p for p in sel.files)


def test_fifo(upper):
    os.mkfifo(kernel_dir(upper) / "pipe")
    assert "FIFO" in refused(upper)


@pytest.mark.parametrize("bit", [stat.S_ISUID, stat.S_ISGID])
def test_setuid_and_setgid(upper, bit):
    victim = next(kernel_dir(upper).glob("*.cubin"))
    os.chmod(victim, 0o755 | bit)
    assert "set-uid, set-gid" in refused(upper)


def test_hard_link(upper, tmp_path):
    os.link(next(kernel_dir(upper).glob("*.cubin")), tmp_path / "outside")
    assert "hard links" in refused(upper)


def test_too_many_files(upper):
    for i in range(20):
        (upper / T / f"junk{i}").write_bytes(b"")
    assert "more than 10 entries" in refused(upper, CaptureLimits(max_files=10))


def test_too_large(upper):
    (upper / T / "big").write_bytes(b"\0" * 5000)
    assert "more than 4096 (one file's limit)" in refused(upper, CaptureLimits(max_file_bytes=4096))
    assert "capture size limit" in refused(upper, CaptureLimits(max_bytes=4096))


def test_too_deep(upper):
    deep = upper / T
    for i in range(10):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    assert "directories deep" in refused(upper, CaptureLimits(max_depth=5))


def test_directory_swapped_for_a_symlink_while_read(upper, tmp_path):
    """The walk opens every directory with O_NOFOLLOW relative to its parent: a directory
    replaced by a symlink between the listing and the open is never entered."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host")
    d = kernel_dir(upper)
    real_stat = os.stat

    def swapping_stat(path, *a, **kw):
        st = real_stat(path, *a, **kw)
        if path == d.name and kw.get("dir_fd") is not None and not swapped.is_set():
            swapped.set()
            shutil.rmtree(d)
            os.symlink(outside, d)
        return st

    swapped = threading.Event()
    os.stat = swapping_stat
    try:
        message = refused(upper)
    finally:
        os.stat = real_stat
    assert swapped.is_set() and "changed while read" in message


def test_mismatched_triton_key(upper):
    """A kernel filed under a key that is not its metadata's hash: what a pod poisoning the
    cache for a kernel it did not compile would write."""
    d = kernel_dir(upper)
    other = "A" * 52
    d.rename(upper / T / other)
    assert "is not the key of its kernel" in refused(upper)


def test_metadata_hash_edited(upper):
    d = kernel_dir(upper)
    meta = next(p for p in d.glob("*.json") if not p.name.startswith("__grp__"))
    doc = json.loads(meta.read_text())
    doc["hash"] = "0" * 64
    meta.write_text(json.dumps(doc))
    assert "is not the key of its kernel" in refused(upper)


def test_bad_triton_entries(upper):
    d = kernel_dir(upper)
    grp = next(d.glob("__grp__*.json"))
    doc = json.loads(grp.read_text())
    grp.write_text(json.dumps({"child_paths": {**doc["child_paths"], "../../etc/passwd": "/etc/passwd"}}))
    assert "not a file beside it" in refused(upper)
    grp.write_text("{not json")
    assert "not JSON" in refused(upper)
    grp.write_text(json.dumps(doc))
    meta = next(p for p in d.glob("*.json") if not p.name.startswith("__grp__"))
    original = meta.read_text()
    m = json.loads(original)
    m["target"] = {"backend": "cuda"}
    meta.write_text(json.dumps(m))
    assert "bad Triton target" in refused(upper)
    meta.write_text(original)
    (upper / T / "not-a-key").mkdir()
    (upper / T / "not-a-key" / "x.json").write_text("{}")
    assert "not a Triton cache key" in refused(upper)


def test_what_is_not_an_entry_is_dropped(upper):
    d = kernel_dir(upper)
    (upper / T / "tmp.pid_1_2").mkdir()
    (upper / T / "tmp.pid_1_2" / "half.cubin").write_bytes(b"x")
    (d / "stray.bin").write_bytes(b"x")
    (upper / "outside-cache").write_bytes(b"x")
    (upper / T / "loose-file").write_bytes(b"x")
    incomplete = upper / T / ("B" * 52)
    incomplete.mkdir()
    (incomplete / "k.cubin").write_bytes(b"x")  # Triton writes the group file last
    _, sel = layer.contribute(str(upper), "triton", POD)
    assert len(sel.keys) == 1 and sel.dropped == {
        "Triton temporary directory": 1, "file in a kernel directory its group does not list": 1,
        f"outside {T}/": 1, "not in a Triton kernel directory": 1,
        "incomplete Triton kernel directory (no group file)": 1}


def test_an_entry_the_base_has_is_not_contributed(upper, tmp_path):
    base = tmp_path / "base"
    (base / T / kernel_dir(upper).name).mkdir(parents=True)
    lay, sel = layer.contribute(str(upper), "triton", POD, base_root=base)
    assert lay is None and sel.dropped == {"already in the base cache": 1}


def test_jax_entries(tmp_path):
    import zstandard

    up = tmp_path / "upper" / "io.jax.cache"
    up.mkdir(parents=True)
    good = "jit_step-" + "a" * 64 + "-cache"
    (up / good).write_bytes(zstandard.ZstdCompressor().compress(b"executable" * 100))
    (up / ("jit_step-" + "a" * 64 + "-atime")).write_bytes(b"123")
    (up / "notes.txt").write_bytes(b"x")
    _, sel = layer.contribute(str(up.parent), "jax", "/pod/io.jax.cache")
    assert list(sel.files) == [f"io.jax.cache/{good}"]
    assert sel.dropped == {"JAX access-time file": 1, "not a JAX cache entry name": 1}
    (up / ("jit_evil-" + "b" * 64 + "-cache")).write_bytes(b"#!/bin/sh\nnot what JAX writes")
    assert "not what JAX writes" in refused(up.parent, kind="jax")


def _tar(members) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return gzip.compress(raw.getvalue(), mtime=0)


def _member(name, type=tarfile.REGTYPE, data=b"x", mode=0o644, link=""):
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.linkname = type, mode, link
    ti.size = len(data) if type == tarfile.REGTYPE else 0
    return ti, data if type == tarfile.REGTYPE else None


@pytest.mark.parametrize("member, reason", [
    (_member("../escape"), "contains '..'"),
    (_member("/etc/cron.d/x"), "is absolute"),
    (_member("io.triton.cache/l", tarfile.SYMTYPE, link="/etc"), "not a regular file or directory"),
    (_member("io.triton.cache/h", tarfile.LNKTYPE, link="io.triton.cache/a"), "not a regular file or directory"),
    (_member("io.triton.cache/dev", tarfile.CHRTYPE), "not a regular file or directory"),
    (_member("io.triton.cache/s", mode=0o4755), "set-uid"),
])
def test_a_pushed_layer_is_read_as_hostile_input(member, reason):
    """Whoever holds the push credentials can push any blob: the controller reads it again."""
    with pytest.raises(Poisoned, match=reason):
        layer.read(_tar([member]))


def test_a_layer_bomb_and_garbage():
    with pytest.raises(Poisoned, match="decompression bomb"):
        ti, data = _member("io.jax.cache/a")
        ti.pax_headers = {"comment": "x" * (4 << 20)}  # tarfile reads a pax header whole
        layer.read(_tar([(ti, data)]), CaptureLimits(max_files=1, max_bytes=0))
    with pytest.raises(Poisoned, match="not a gzip-compressed tar"):
        layer.read(b"not gzip at all")
    twice = _tar([_member("io.jax.cache/a"), _member("io.jax.cache/a")])
    with pytest.raises(Poisoned, match="appears twice"):
        layer.read(twice)


def test_merge_dedups_refuses_poison_and_reports_conflicts(upper, tmp_path):
    good, sel = layer.contribute(str(upper), "triton", POD)
    (key,) = sel.keys
    # the same kernel from another node: one copy
    a = publish.Contribution(good.blob, "node-a", "ns/pod-a", "2026-11-28T05:00:00Z")
    b = publish.Contribution(good.blob, "node-b", "ns/pod-b", "2026-11-28T05:00:01Z")
    # a poisoned layer pushed straight to the registry (never through a node's reader)
    files = dict(layer.read(good.blob))
    renamed = {p.replace(key, f"{T}/{'C' * 52}"): v for p, v in files.items()}
    poison = publish.Contribution(layer.build(renamed).blob, "node-c", "ns/pod-c", "2026-11-28T05:00:02Z")
    # conflicting bytes for the same key
    cubin = next(p for p in files if p.endswith(".cubin"))
    conflict = publish.Contribution(layer.build({**files, cubin: b"other bytes"}).blob, "node-d", "ns/pod-d",
                                    "2026-11-28T05:00:03Z")
    m = publish.merge([a, b, poison], "triton", POD)
    assert set(m.sources) == {key} and [c.node for c in m.sources[key]] == ["node-a", "node-b"]
    assert m.files == files and [(c.node, "is not the key" in r) for c, r in m.refused] == [("node-c", True)]
    m = publish.merge([a, conflict], "triton", POD)
    assert m.files == {} and [c.node for c in m.conflicts[key]] == ["node-a", "node-d"]
    ok, why = publish.promotable("auto", 1, m, True)
    assert not ok and "conflicting" in why
