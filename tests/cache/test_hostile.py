"""The hostile-image corpus: every image is pushed to the real registry and must be refused with
an error naming the image and the problem, nothing published, nothing left in the staging area
and nothing written outside the store."""

from __future__ import annotations

import gzip
import json
import os
import stat

import pytest

from accelnode.oci.errors import HostileContent, IntegrityError
from accelnode.oci.limits import Limits
from agent.store import CacheStore
from tests.cache.helpers import GZ, TAR, TRITON_CONFIG, ZST, tar

C = "io.triton.cache"


def layers(*blobs):
    return {"layers": [(GZ, b) for b in blobs], "config": TRITON_CONFIG}


def corrupt_blob(registry, ref_digest_holder, mutate):
    """Edit the registry's on-disk copy of a pushed blob (a registry serving bad bytes)."""

    def edit(manifest):
        path = registry.blob_file(manifest["layers"][0]["digest"])
        data = path.read_bytes()
        os.chmod(path, 0o644)
        path.write_bytes(mutate(data))
        ref_digest_holder.append(manifest["layers"][0]["digest"])
    return edit


# id -> (push kwargs or callable(registry) -> push kwargs, error class, message fragment, limits)
CASES = {
    "dotdot": (layers(tar(("../evil", "file", b"x"))), HostileContent, "contains '..'", None),
    "dotdot-nested": (layers(tar((f"{C}/../../evil", "file", b"x"))), HostileContent, "contains '..'", None),
    "absolute": (layers(tar(("/etc/evil", "file", b"x"))), HostileContent, "absolute member name", None),
    "symlink-absolute": (layers(tar((f"{C}/l", "symlink", "/etc"))), HostileContent, "absolute", None),
    "symlink-escape": (layers(tar((f"{C}/l", "symlink", "../../../etc"))), HostileContent, "outside the cache", None),
    "write-through-symlink": (layers(tar((f"{C}/l", "symlink", "."), (f"{C}/l/f", "file", b"x"))), HostileContent,
                              "written through symlink", None),
    "write-through-symlink-across-layers": (
        layers(tar((C, "dir"), (f"{C}/l", "symlink", ".")), tar((f"{C}/l/f", "file", b"x"))),
        HostileContent, "writes through it", None),
    "symlink-chain-escape": (layers(tar((f"{C}/d", "dir"), (f"{C}/d/s", "symlink", "../.."), (f"{C}/x", "symlink", "d/s/.."))),
                             HostileContent, "resolves outside the cache through other symlinks", None),
    "symlink-chain-escape-across-layers": (
        layers(tar((C, "dir"), (f"{C}/up", "symlink", "..")), tar((C, "dir"), (f"{C}/x", "symlink", "up/.."))),
        HostileContent, "resolves outside the cache through other symlinks", None),
    "symlink-loop": (layers(tar((f"{C}/a", "symlink", "b"), (f"{C}/b", "symlink", "a/x"))), HostileContent,
                     "too many levels of symlinks", None),
    "hardlink-escape": (layers(tar((f"{C}/h", "hardlink", "../../etc/passwd"))), HostileContent, "contains '..'", None),
    "hardlink-absolute": (layers(tar((f"{C}/h", "hardlink", "/etc/passwd"))), HostileContent, "absolute", None),
    "hardlink-to-symlink": (layers(tar((f"{C}/l", "symlink", "x"), (f"{C}/h", "hardlink", f"{C}/l"))),
                            HostileContent, "does not name a regular file", None),
    "hardlink-to-lower-layer": (layers(tar((f"{C}/f", "file", b"x")), tar((f"{C}/h", "hardlink", f"{C}/f"))),
                                HostileContent, "does not name a regular file", None),
    "char-device": (layers(tar((f"{C}/null", "chr"))), HostileContent, "device node", None),
    "block-device": (layers(tar((f"{C}/sda", "blk"))), HostileContent, "device node", None),
    "fifo": (layers(tar((f"{C}/p", "fifo"))), HostileContent, "FIFO", None),
    "socket-or-unknown-type": (layers(tar((f"{C}/s", b"Z"))), HostileContent, "unsupported tar entry type", None),
    "too-many-files": (layers(tar(*[(f"{C}/f{i}", "file", b"x") for i in range(40)])), HostileContent,
                       "more than 30 entries", Limits(max_files=30)),
    "too-many-bytes": (layers(tar((f"{C}/big", "file", os.urandom(300_000)))), HostileContent,
                       "more than 200000 bytes", Limits(max_bytes=200_000)),
    "gzip-bomb": (layers(tar((f"{C}/zeros", "file", bytes(64 << 20)))), HostileContent, "decompression bomb", None),
    "zstd-bomb": ({"layers": [(ZST, tar((f"{C}/zeros", "file", bytes(64 << 20)), compression="zstd"))],
                   "config": TRITON_CONFIG}, HostileContent, "decompression bomb", None),
    "pax-header-bomb": (layers(tar((f"{C}/f", "file", b"x"))), None, None, None),  # replaced below
    "not-gzip": ({"layers": [(GZ, os.urandom(4096))], "config": TRITON_CONFIG}, HostileContent,
                 "not a valid gzip stream", None),
    "not-a-tar": ({"layers": [(GZ, gzip.compress(os.urandom(8192)))], "config": TRITON_CONFIG}, HostileContent,
                  "not a valid tar stream", None),
    "bad-whiteout": (layers(tar((f"{C}/.wh..", "file"))), HostileContent, "malformed whiteout", None),
    "unknown-layer-type": ({"layers": [("application/x-evil", tar((f"{C}/f", "file", b"x")))],
                            "config": TRITON_CONFIG}, HostileContent, "unsupported media type", None),
    "unknown-config-type": ({"layers": [(GZ, tar((f"{C}/f", "file", b"x")))], "config": TRITON_CONFIG,
                             "config_type": "application/x-evil"}, HostileContent, "unsupported config media type",
                            None),
    "config-not-json": ({"layers": [(GZ, tar((f"{C}/f", "file", b"x")))], "config": b"\x00not json"},
                        HostileContent, "is not valid JSON", None),
    "oversized-manifest": ({**layers(tar((f"{C}/f", "file", b"x"))),
                            "edit": lambda m: m.update(annotations={"pad": "x" * 70_000})},
                           IntegrityError, "over the 65536-byte limit", Limits(max_manifest_bytes=65536)),
    "size-mismatch": ({**layers(tar((f"{C}/f", "file", b"x"))),
                       "edit": lambda m: m["layers"][0].update(size=m["layers"][0]["size"] + 100)},
                      IntegrityError, "manifest says", None),
    "digest-mismatch": (None, IntegrityError, "blob digest mismatch", None),
    "truncated-blob": (None, IntegrityError, "manifest says", None),
}


def _pax_bomb() -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo(f"{C}/f")
        ti.pax_headers = {"comment": "x" * (2 << 20)}
        tf.addfile(ti)
    return gzip.compress(buf.getvalue())


CASES["pax-header-bomb"] = (layers(_pax_bomb()), HostileContent, "tar metadata header", None)


def _raw_tar(write) -> bytes:
    """A gzip layer whose tar bytes ``write(buf)`` produces by hand (headers tarfile won't write)."""
    import io

    buf = io.BytesIO()
    write(buf)
    return gzip.compress(buf.getvalue() + bytes(1024))


def _pax_chain(buf):
    import tarfile

    record = b"18 comment=aaaaaa\n"
    hdr = tarfile.TarInfo("pax")
    hdr.type, hdr.size = tarfile.XHDTYPE, len(record)
    for _ in range(2000):  # tarfile recurses once per header: RecursionError unless refused
        buf.write(hdr.tobuf(format=tarfile.USTAR_FORMAT) + record.ljust(512, b"\0"))
    buf.write(tarfile.TarInfo(f"{C}/f").tobuf(format=tarfile.USTAR_FORMAT))


def _pax_member(name, pax, data=b""):
    def write(buf):
        import io
        import tarfile

        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            ti = tarfile.TarInfo(name)
            ti.size, ti.pax_headers = len(data), pax
            tf.addfile(ti, io.BytesIO(data))
    return _raw_tar(write)


def _gnu_sparse(buf):
    import tarfile

    ti = tarfile.TarInfo(f"{C}/sparse")
    ti.type, ti.size = tarfile.GNUTYPE_SPARSE, 4
    b = bytearray(ti.tobuf(format=tarfile.GNU_FORMAT))
    b[386:410] = b"%011o\0%011o\0" % (0, 4)  # one data region: 4 bytes at offset 0
    b[483:495] = b"%011o\0" % (1 << 30)  # real size 1 GiB, the rest a hole
    b[148:156] = b" " * 8
    b[148:156] = b"%06o\0 " % sum(b)
    buf.write(bytes(b) + b"abcd".ljust(512, b"\0"))


def _index_of(n):
    def make(registry):
        one = registry.push_raw("hostile/index-child", "v1", **layers(tar((f"{C}/f", "file", b"x"))))
        body = _manifest_size(registry, one)
        desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": one.split("@")[1], "size": body}
        return {"manifest": {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                             "manifests": [desc] * n},
                "media_type": "application/vnd.oci.image.index.v1+json", "repo": "hostile/index-child"}
    return make


def _manifest_size(registry, image):
    from accelnode.oci.reference import Reference
    from accelnode.oci.registry import Deadline, Registry

    ref = Reference.parse(image)
    return len(Registry(ref.host, registry.options(), Deadline(10)).get_manifest(ref, image)[0])


_TRITON_LABELS = TRITON_CONFIG["config"]["Labels"]
CASES.update({
    "pax-header-chain": (layers(_raw_tar(_pax_chain)), HostileContent, "tar metadata headers in a row", None),
    "long-name-component": (layers(tar((f"{C}/" + "a" * 300, "file", b"x"))), HostileContent,
                            "has a component longer than 255 bytes", None),
    "long-path": (layers(tar(("/".join(["b" * 200] * 25), "file", b"x"))), HostileContent,
                  "longer than 4095 bytes", None),
    "long-symlink-target": (layers(tar((f"{C}/l", "symlink", "./" * 3000))), HostileContent,
                            "longer than 4095 bytes", None),
    "pax-negative-size": (layers(_pax_member(f"{C}/f", {"size": "-100"})), HostileContent, "negative size", None),
    "pax-huge-size": (layers(_pax_member(f"{C}/f", {"size": str(1 << 50)})), HostileContent,
                      "bytes of file content", None),
    "pax-path-escape": (layers(_pax_member(f"{C}/innocent", {"path": "../../escaped"}, b"x")), HostileContent,
                        "contains '..'", None),
    "pax-sparse": (layers(_pax_member(f"{C}/sparse", {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                                                      "GNU.sparse.name": f"{C}/sparse",
                                                      "GNU.sparse.realsize": str(1 << 30)},
                                      b"1\n0\n4\n".ljust(512, b"\0") + b"abcd")),
                   HostileContent, "sparse file", None),
    "gnu-sparse": (layers(_raw_tar(_gnu_sparse)), HostileContent, "sparse file", None),
    "implied-dirs-count": (layers(tar(("/".join(["d"] * 40) + "/f", "file", b"x"))), HostileContent,
                           "more than 30 entries", Limits(max_files=30)),
    "whiteouts-count": (layers(tar(*[(f"{C}/.wh.f{i}", "file") for i in range(40)])), HostileContent,
                        "more than 30 entries", Limits(max_files=30)),
    "too-many-layers": (layers(*[tar((f"{C}/f{i}", "file", b"x")) for i in range(5)]), HostileContent,
                        "5 layers (limit 4)", Limits(max_layers=4)),
    "layer-size-overstated": ({**layers(tar((f"{C}/f", "file", b"x"))),
                               "edit": lambda m: m["layers"][0].update(size=1 << 60)},
                              HostileContent, "the limits allow", None),
    "config-nested-json": ({**layers(tar((f"{C}/f", "file", b"x"))), "config": b"[" * 200_000 + b"]" * 200_000},
                           HostileContent, "JSON values in 400000 bytes, over the budget of 100000", None),
    # issue 33: a config of 4 MiB of {} (1.4 million empty objects, ~100 MB parsed) is refused
    # before it is parsed; it used to be parsed, and then installed (it has no labels to refuse)
    "config-bomb": ({**layers(tar((f"{C}/f", "file", b"x"))),
                     "config": b'{"pad":[' + b"{}," * ((4 << 20) // 3 - 8) + b"{}]}"},
                    HostileContent, "JSON values in 4194291 bytes, over the budget of 100000", None),
    "config-too-deep": ({**layers(tar((f"{C}/f", "file", b"x"))), "config": b'{"a":' + b"[" * 40 + b"]" * 40 + b"}"},
                        HostileContent, "nests arrays and objects 41 deep, over the budget of 32", None),
    # a label holding a JSON bomb: one string in the config, 64 KiB at most when parsed as JSON
    "summary-bomb": ({**layers(tar((f"{C}/f", "file", b"x"))), "config": {"config": {"Labels": {
                         **_TRITON_LABELS, "cache.triton.image/summary": "[" + "{}," * 300_000 + "{}]"}}}},
                     HostileContent, "over the 64 KiB budget", None),
    "summary-nested-json": ({**layers(tar((f"{C}/f", "file", b"x"))), "config": {"config": {"Labels": {
                                **_TRITON_LABELS, "cache.triton.image/summary": "[" * 100_000 + "]" * 100_000}}}},
                            HostileContent, "config labels are malformed", None),
    "summary-not-an-object": ({**layers(tar((f"{C}/f", "file", b"x"))), "config": {"config": {"Labels": {
                                  "cache.triton.image/summary": "[1, 2]"}}}},
                              HostileContent, "config labels are malformed", None),
    "index-too-many-entries": (_index_of(300), HostileContent, "lists 300 manifests (limit 256)", None),
})


def _push(registry, name: str, spec):
    repo = f"hostile/{name}"
    if callable(spec):
        spec = spec(registry)
        repo = spec.pop("repo", repo)
    if name in ("digest-mismatch", "truncated-blob"):
        held = []
        flip = (lambda d: d[:-1] + bytes([d[-1] ^ 1])) if name == "digest-mismatch" else (lambda d: d[: len(d) // 2])
        spec = {**layers(tar((f"{C}/f", "file", os.urandom(5000)))), "edit": corrupt_blob(registry, held, flip)}
    kw = dict(spec)
    return registry.push_raw(repo, "v1", **kw)


def test_corpus_is_big_enough():
    assert len(CASES) >= 20


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_image_is_refused(registry, tmp_path, name):
    spec, error, fragment, limits = CASES[name]
    image = _push(registry, name, spec)
    store = CacheStore(tmp_path / "store", registry=registry.options(), limits=limits)
    with pytest.raises(error) as info:
        store.ensure(image)
    message = str(info.value)
    assert message.startswith(image), message
    assert fragment in message, message
    assert info.value.image == image
    # nothing published, staging cleaned, nothing outside the store
    assert store.list() == []
    assert list((tmp_path / "store" / "caches").iterdir()) == []
    assert list((tmp_path / "store" / "tmp").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_setuid_and_world_writable_bits_are_stripped(registry, tmp_path):
    image = registry.push_raw("hostile/setuid", "v1", **layers(tar(
        (C, "dir", None, 0o7777), (f"{C}/suid", "file", b"#!/bin/sh\n", 0o6777), (f"{C}/plain", "file", b"x", 0o666))))
    inst = CacheStore(tmp_path / "store", registry=registry.options()).ensure(image)
    assert stat.S_IMODE(os.lstat(inst.path / C / "suid").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(inst.path / C / "plain").st_mode) == 0o644
    assert stat.S_IMODE(os.lstat(inst.path / C).st_mode) == 0o755


def test_legitimate_links_inside_the_tree_are_kept(registry, tmp_path):
    image = registry.push_raw("hostile/links-ok", "v1", **layers(tar(
        (f"{C}/a/k.bin", "file", b"kernel"), (f"{C}/b/l", "symlink", "../a/k.bin"), (f"{C}/h", "hardlink", f"{C}/a/k.bin"))))
    inst = CacheStore(tmp_path / "store", registry=registry.options()).ensure(image)
    assert os.readlink(inst.path / C / "b/l") == "../a/k.bin"
    assert (inst.path / C / "h").read_bytes() == b"kernel"
    assert os.lstat(inst.path / C / "h").st_ino == os.lstat(inst.path / C / "a/k.bin").st_ino
    assert json.loads(json.dumps(inst.targets)) == [{"backend": "cuda", "arch": "90", "warp_size": 32}]


# Escapes that reach OUTSIDE the store unless the extractor's view of a layer matches the disk:
# ``a`` is a directory, then (same layer) a symlink whose chain really resolves to the directory
# holding the store (lexically it stays inside: ``d/s -> ..`` turns every ``d/s`` into the root).
# A later whiteout, opaque whiteout or hardlink naming ``a/...`` must never follow it. The chain
# climbs the five levels from the staging layer dir (store/tmp/<pull>/layers/0) to tmp_path; each
# image is refused whatever the staging depth, this one just makes the old bug hit the victim.
_UP = "d/s/d/s/d/s/../../../../../victim"
_ESCAPES = {
    "whiteout-through-replaced-dir": [
        tar(("a", "dir"), ("a/sub", "dir"), ("d", "dir"), ("d/s", "symlink", ".."), ("a", "symlink", _UP)),
        tar(("a/.wh.sub", "file"))],
    "opaque-whiteout-through-replaced-dir": [
        tar(("a", "dir"), ("a/sub", "dir"), ("d", "dir"), ("d/s", "symlink", ".."), ("a", "symlink", _UP)),
        tar(("a/sub/.wh..wh..opq", "file"))],
    "hardlink-through-replaced-dir": [
        tar(("a", "dir"), ("a/sub/precious", "file", b"decoy"), ("d", "dir"), ("d/s", "symlink", ".."),
            ("a", "symlink", _UP), ("h", "hardlink", "a/sub/precious"), ("a", "dir"), ("d/s", "file", b""))],
}


@pytest.mark.parametrize("name", sorted(_ESCAPES))
def test_nothing_outside_the_store_is_touched(registry, tmp_path, name):
    victim = tmp_path / "victim" / "sub"
    victim.mkdir(parents=True)
    (victim / "precious").write_text("host data")
    image = registry.push_raw(f"hostile/{name}", "v1", **layers(*_ESCAPES[name]))
    store = CacheStore(tmp_path / "store", registry=registry.options())
    with pytest.raises(HostileContent) as info:
        store.ensure(image)
    assert str(info.value).startswith(image)
    assert (victim / "precious").read_text() == "host data"
    assert os.stat(victim / "precious").st_nlink == 1  # never hardlinked into a cache
    assert store.list() == [] and list((tmp_path / "store" / "tmp").iterdir()) == []


def test_replaced_entries_and_late_directory_entries_install_cleanly(registry, tmp_path):
    """Not hostile, just unusual: the same name as file, dir, file; a directory replaced by a
    file and back with new children; a directory's own entry after its children."""
    image = registry.push_raw("hostile/replaced-ok", "v1", **layers(tar(
        (f"{C}/x", "file", b"1"), (f"{C}/x", "dir"), (f"{C}/x", "file", b"3"),
        (f"{C}/d/e/old", "file", b"o"), (f"{C}/d", "file", b"f"), (f"{C}/d", "dir"), (f"{C}/d/e/new", "file", b"n"),
        (f"{C}/late/k", "file", b"k"), (f"{C}/late", "dir"))))
    store = CacheStore(tmp_path / "store", registry=registry.options())
    inst = store.ensure(image)
    tree = sorted(str(p.relative_to(inst.path)) for p in inst.path.rglob("*"))
    assert tree == [C, f"{C}/d", f"{C}/d/e", f"{C}/d/e/new", f"{C}/late", f"{C}/late/k", f"{C}/x"]
    assert (inst.path / C / "x").read_bytes() == b"3"
    assert store.verify() == []


def test_modes_and_owners_do_not_come_from_the_tar_or_the_umask(registry, tmp_path):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, mode, data in ((f"{C}/dir", tarfile.DIRTYPE, 0o700, b""), (f"{C}/exe", tarfile.REGTYPE, 0o4700, b"#!"),
                                       (f"{C}/data", tarfile.REGTYPE, 0o600, b"x")):
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.size, ti.uid, ti.gid, ti.uname = kind, mode, len(data), 4242, 4242, "mallory"
            tf.addfile(ti, io.BytesIO(data))
    image = registry.push_raw("hostile/umask", "v1", **layers(gzip.compress(buf.getvalue())))
    store = CacheStore(tmp_path / "store", registry=registry.options())
    old = os.umask(0o077)
    try:
        inst = store.ensure(image)
    finally:
        os.umask(old)
    modes = {p: stat.S_IMODE(os.lstat(inst.path / C / p).st_mode) for p in ("exe", "data", "dir")}
    assert modes == {"exe": 0o755, "data": 0o644, "dir": 0o755}
    assert stat.S_IMODE(os.lstat(inst.path).st_mode) == 0o755
    assert {(os.lstat(p).st_uid, os.lstat(p).st_gid) for p in inst.path.rglob("*")} == {(os.getuid(), os.getgid())}
    assert store.verify() == []
