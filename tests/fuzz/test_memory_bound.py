"""Memory is a property of the process (issue 33): under JSON bombs a hostile registry serves (a
4 MiB manifest of ``{}``, an index of eight of them; :mod:`tests.fuzz.bombs`), the real
``accelnode cache pull`` and ``accelnode cache inspect`` processes and the real ``accelnode
agent`` stay under RSS_BOUND_KIB peak resident memory and refuse with a message naming the
document; and whatever bomb hypothesis draws (its values, where it sits: manifest, index,
config, token answer, signature manifest, bundle), what parsing the answers allocates stays
within a bound of its own."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelnode.oci import manifest
from accelnode.oci import signatures as sg
from accelnode.oci.errors import ImageError
from accelnode.oci.registry import INDEX_TYPES, MANIFEST_TYPES, RegistryOptions
from tests.conftest import ROOT

from . import bombs
from .fuzzing import fuzz_settings
from .test_registry_answers import HostileRegistry

REFUSAL = r"manifest sha256:[0-9a-f]{64} holds \d+ JSON values in \d+ bytes, over the budget of 100000"


@pytest.fixture(scope="module")
def bomb_registry():
    reg = HostileRegistry()
    reg.world = bombs.world()
    yield reg
    reg.stop()


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


# The CLI as ``python -m accelnode`` runs it, reporting its VmHWM as it exits: a child's rusage
# (ru_maxrss) would count the forking test process's own resident set, which the exec keeps.
_WITH_PEAK = ("import atexit, runpy, sys; atexit.register(lambda: sys.stdout.write(next(line for line in "
              "open('/proc/self/status') if line.startswith('VmHWM:')))); sys.argv[0] = 'accelnode'; "
              "runpy.run_module('accelnode', run_name='__main__', alter_sys=True)")


def _peak_of(args: list[str]) -> tuple[int, int, str]:
    """(exit status, peak RSS in KiB, output) of ``accelnode ARGS`` run to its end."""
    proc = subprocess.run([sys.executable, "-c", _WITH_PEAK, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=_env(), cwd="/", timeout=120)
    out = proc.stdout.decode(errors="replace")
    peak = re.search(r"VmHWM:\s+(\d+) kB", out)
    assert peak, out
    return proc.returncode, int(peak[1]), out


@pytest.mark.parametrize("command", ["pull", "inspect"])
@pytest.mark.parametrize("tag", ["manifest", "index", "fat-index"])
def test_the_cache_cli_refuses_a_bomb_within_the_bound(bomb_registry, tmp_path, command, tag):
    image = f"{bomb_registry.host}/{bombs.REPO}:{tag}"
    store = ["--store", str(tmp_path / "store")] if command == "pull" else []
    code, peak, out = _peak_of(["cache", command, *store, "--plain-http", image])
    assert code != 0, out
    assert re.search(REFUSAL, out), out
    assert peak < bombs.RSS_BOUND_KIB, f"accelnode cache {command} {tag}: peak RSS {peak} KiB"


def test_the_agent_refuses_a_bomb_within_the_bound(bomb_registry, tmp_path):
    from accelnode import grpcutil
    from agent.api import agent as api
    from agent.api import agent_grpc
    from tests.csi.conftest import Daemon

    sock = tmp_path / "agent.sock"
    daemon = Daemon("agent", ["agent", "--store", str(tmp_path / "store"), "--socket", str(sock), "--plain-http",
                              "--registry-timeout", "30", "--metrics-address", "127.0.0.1:0", "--log-format", "text"],
                    sock, tmp_path).start()
    channel = grpcutil.unix_channel(sock)
    try:
        image = bombs.pinned_index(bomb_registry.host)
        for _ in range(3):  # again and again: what one refusal held is not kept
            answer = agent_grpc.AgentStub(channel).EnsureCache(api.EnsureCacheRequest(image=image, wait_seconds=60),
                                                               timeout=90)
            assert (answer.state, answer.failure) == (api.EnsureCacheResponse.FAILED,
                                                      api.EnsureCacheResponse.BAD_CONTENT), answer
            assert re.search(REFUSAL, answer.message), answer.message
        peak = bombs.vm_hwm(daemon.proc.pid)
    finally:
        channel.close()
        assert daemon.stop() == 0, daemon.log()
    assert peak < bombs.RSS_BOUND_KIB, f"the agent's peak RSS {peak} KiB"


# -- any bomb, in-process: what parsing allocates ---------------------------------------------------

PARSE_BOUND = 48 << 20  # bytes traced at the peak of one inspection or verification (the bodies included)
REPO = bombs.REPO
SIGNED = "sha256:" + "5" * 64


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


fillers = st.sampled_from([b"{}", b"[]", b"0", b'""', b'{"a":{}}', b"[[]]", b'"x"', b"null", b"[0,[0]]"])


@st.composite
def bomb_world(draw) -> dict:
    """A registry whose documents are valid but one of them, ``where``, pads a list with ``filler``
    to ``size`` bytes (at most the 4 MiB every cap allows)."""
    filler, size = draw(fillers), draw(st.sampled_from([4 << 20, 1 << 20, 64 << 10]))
    where = draw(st.sampled_from(["manifest", "index", "config", "token", "signature", "referrers", "bundle"]))

    def padded(doc: dict, key: str = "pad") -> bytes:
        head = json.dumps({**doc, key: []}).encode()[:-2]
        return head + (filler + b",") * ((size - len(head) - 2 - len(filler)) // (len(filler) + 1)) + filler + b"]}"

    config = json.dumps({"config": {"Labels": {}}}).encode()
    blobs = {_digest(config): config}
    cdesc = {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _digest(config), "size": len(config)}
    doc = {"schemaVersion": 2, "mediaType": MANIFEST_TYPES[0], "config": cdesc, "layers": []}
    if where == "config":
        config = padded({"config": {"Labels": {}}})
        blobs[_digest(config)] = config
        doc["config"] = {**cdesc, "digest": _digest(config), "size": len(config)}
    body = padded(doc) if where == "manifest" else json.dumps(doc).encode()
    manifests = {"t": body, _digest(body): body}
    if where == "index":
        index = {"schemaVersion": 2, "mediaType": INDEX_TYPES[0],
                 "manifests": [{"mediaType": MANIFEST_TYPES[0], "digest": _digest(body), "size": len(body)}]}
        manifests["t"] = padded(index, "annotations_list")
    bundle = padded({"mediaType": sg.BUNDLE_TYPES[0]}) if where == "bundle" else b"{}"
    blobs[_digest(bundle)] = bundle
    art = json.dumps({"subject": {"digest": SIGNED}, "layers": [
        {"mediaType": sg.BUNDLE_TYPES[0], "digest": _digest(bundle), "size": len(bundle)}]}).encode()
    manifests[_digest(art)] = art
    referrers = {"manifests": [{"artifactType": sg.BUNDLE_TYPES[0], "digest": _digest(art)}]}
    referrers = padded(referrers, "more") if where == "referrers" else json.dumps(referrers).encode()
    sig = {"layers": []}
    manifests[SIGNED.replace(":", "-") + ".sig"] = padded(sig) if where == "signature" else json.dumps(sig).encode()
    token = padded({"token": "t0k3n"}) if where == "token" else b'{"token": "t0k3n"}'
    challenge = f'Bearer realm="http://{{self}}/token",service="registry"' if where == "token" else None
    return {"challenge": challenge, "token_status": 200, "token": token, "manifest_status": 200,
            "content_type": MANIFEST_TYPES[0], "manifests": manifests, "blobs": blobs, "referrers": referrers,
            "anonymous": True, "where": where, "filler": filler, "size": size}


@pytest.fixture(scope="module")
def hostile():
    reg = HostileRegistry()
    yield reg
    reg.stop()


@fuzz_settings(ci_examples=30)
@given(w=bomb_world())
def test_parsing_any_bomb_stays_within_a_bound(hostile, w):
    hostile.world = w
    options = RegistryOptions(plain_http=True, anonymous=True, timeout=20.0)
    tracemalloc.start()
    try:
        for run in (lambda: manifest.inspect(f"{hostile.host}/{REPO}:t", options),
                    lambda: sg.verify(f"{hostile.host}/{REPO}:t", SIGNED, [], options)):
            try:
                run()
            except ImageError:
                pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PARSE_BOUND, f"{w['where']} padded with {w['filler']!r} to {w['size']} bytes: {peak} bytes traced"
