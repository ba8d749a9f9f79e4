"""gzip layers inflate through ISA-L (the optional ``isal`` package) when it is installed, and
through zlib when it is not: both give the same bytes and the same refusals."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import zlib

import pytest

from agent import extract
from agent.extract import Refused, _Gunzip

LIBS = [zlib] + ([extract.inflater()] if extract.inflater() is not zlib else [])


def _all(stream) -> bytes:
    out = []
    while chunk := stream.read(1000):
        out.append(chunk)
    return b"".join(out)


@pytest.mark.parametrize("lib", LIBS, ids=lambda m: m.__name__)
def test_multi_member_gzip_inflates_whole(lib):
    first, second = os.urandom(300_000), b"kernel " * 50_000
    raw = io.BytesIO(gzip.compress(first) + gzip.compress(second, 9))
    assert _all(_Gunzip(raw, lib)) == first + second


@pytest.mark.parametrize("lib", LIBS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("blob, fragment", [
    (os.urandom(4096), "not a valid gzip stream"),
    (gzip.compress(os.urandom(100_000))[:50_000], "gzip stream ends before its end marker"),
    (gzip.compress(b"x" * 1000) + b"trailing garbage", "not a valid gzip stream"),
], ids=["garbage", "truncated", "trailing-garbage"])
def test_a_broken_stream_is_refused_alike(lib, blob, fragment):
    with pytest.raises(Refused, match=fragment):
        _all(_Gunzip(io.BytesIO(blob), lib))


def test_the_fast_inflate_is_in_use_where_installed():
    pytest.importorskip("isal")
    assert extract.inflater().__name__ == "isal.isal_zlib"


def test_without_isal_a_gzip_cache_pulls_through_zlib(registry, tmp_path):
    """The package missing (an import that fails): the agent falls back to zlib and a real pull
    of a gzip image installs it whole."""
    src = tmp_path / "src" / "io.triton.cache" / "k"
    src.mkdir(parents=True)
    (src / "kernel.cubin").write_bytes(os.urandom(200_000) + b"ptx " * 100_000)
    (src / "kernel.json").write_text('{"target": {"backend": "cuda", "arch": 90, "warp_size": 32}}')
    image = registry.push(tmp_path / "src", "inflate/fallback", compression="gzip")
    code = ("import sys; sys.modules['isal'] = None\n"  # what `import isal` meets when it is not installed
            "import zlib\nfrom agent import extract\nassert extract.inflater() is zlib, extract.inflater()\n"
            "from accelnode.oci.registry import RegistryOptions\nfrom agent.store import CacheStore\n"
            "got = CacheStore(sys.argv[1], registry=RegistryOptions(plain_http=True)).ensure(sys.argv[2])\n"
            "print(got.path)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store"), image], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    cache = next((tmp_path / "store" / "caches").iterdir())
    assert (cache / "content" / "io.triton.cache" / "k" / "kernel.cubin").read_bytes() == \
        (src / "kernel.cubin").read_bytes()
