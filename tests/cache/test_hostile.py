"""The hostile-image corpus: every image is pushed to the real registry and must be refused with
an error naming the image and the problem, nothing published, nothing left in the staging area
and nothing written outside the store."""

from __future__ import annotations

import gzip
import json
import os
import stat

import pytest

from agent.errors import HostileContent, IntegrityError
from agent.extract import Limits
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
                        HostileContent, "config is not valid JSON", None),
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


def _push(registry, name: str, spec):
    repo = f"hostile/{name}"
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
