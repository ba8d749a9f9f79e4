"""Mirrors that misbehave on purpose (issue 28, the review of the hosts.toml change): a mirror can
withhold content, never make a pull hang past its deadline, fail content that is sound, hide the
real problem, or prove a tenant's right to a digest. Each test runs the attack against the test
registry (distribution) and a small Python mirror in front of it (``Forwarder`` with a ``serve``
hook that misbehaves); each failed before its fix."""

from __future__ import annotations

import hashlib
import socket
import tarfile
import threading
import time

import pytest

from accelnode.oci.errors import AuthError, IntegrityError
from accelnode.oci.registry import RegistryOptions
from agent.store import CacheStore
from tests.cache.helpers import TAR, TRITON_CONFIG, Forwarder, tar
from tests.cache.test_hosts_toml import certs_d, key, mirror, options, push


@pytest.fixture
def hosts(tmp_path):
    """Writes ``hosts.toml`` for the registry naming one mirror first; returns the directory."""
    def write(registry, mirror_host: str, caps=("pull",)) -> str:
        return certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{mirror_host}", caps)})
    return write


def test_a_mirror_dripping_its_api_root_is_not_waited_for(registry, tmp_path, hosts):
    """The mirror answers ``/v2/`` 200 with a body it sends a byte a second, forever, and 404 to
    the rest: only the status and the challenge of the API root are read, never its body, so the
    pull moves on to the registry well within its 20 s deadline (it used to read the body, past
    any deadline, or until memory ran out when the body came fast)."""
    stop = threading.Event()

    def drip(handler, path):
        if path != "/v2/":
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return True
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        return _drip(handler, stop, b"1\r\nx\r\n")

    _pulled_past_the_mirror(registry, tmp_path, hosts, "hostile/drip", drip, stop, timeout=20)


def _pulled_past_the_mirror(registry, tmp_path, hosts, repo: str, serve, stop: threading.Event, timeout: float):
    """A cache pushed under ``repo`` is pulled whole through a mirror misbehaving as ``serve``
    says, within ``timeout``; ``stop`` is set at the end (what ``serve`` waits on)."""
    pinned = push(registry, tmp_path, repo)
    m = Forwarder(registry.host, serve=serve)
    try:
        store = CacheStore(tmp_path / "store", registry=options(registry, hosts(registry, m.host), timeout=timeout))
        assert store.ensure(pinned).digest == pinned.split("@")[1]
    finally:
        stop.set()
        m.close()


def test_a_content_length_no_digest_covers_moves_to_the_next_host(registry, tmp_path, hosts):
    """``Content-Length: 2, 2`` (legal HTTP for a repeated header) on a blob: the mirror is passed
    over like one that sent bad bytes (it was an internal error, and the registry never asked)."""
    pinned = push(registry, tmp_path, "hostile/length")

    def answer(method, path, headers):
        if "/blobs/sha256:" in path:
            return 200, {"Content-Length": "2, 2"}, b"xx"
        return None

    front = Forwarder(registry.host, answer=answer)
    try:
        store = CacheStore(tmp_path / "store", registry=options(registry, hosts(registry, front.host)))
        assert store.ensure(pinned).digest == pinned.split("@")[1]
    finally:
        front.close()
    assert store.verify() == []


def test_a_stalled_corrupt_layer_does_not_fail_a_sound_one(registry, tmp_path, hosts, caplog):
    """The mirror sends layer A's first tar header claiming a 100 GiB file, stalls, then the rest;
    meanwhile layer B, sound, crosses the image's size limit because A's claim still counts. A
    refusal of content a mirror served part of is not the last word: the image is pulled again
    from the server alone, and installs (it failed as BAD_CONTENT of layer B)."""
    a = tar(("io.triton.cache/a/x", "file", b"a" * 1000), compression="none")
    b = tar(("io.triton.cache/b/y", "file", b"b" * 300_000), compression="none")
    pinned = registry.push_raw("hostile/race", "v1", config=TRITON_CONFIG, layers=[(TAR, a), (TAR, b)])
    a_digest = "sha256:" + hashlib.sha256(a).hexdigest()
    info = tarfile.TarInfo("io.triton.cache/a/x")
    info.size = 100 << 30
    header = info.tobuf(format=tarfile.PAX_FORMAT)
    bad = (header + b"\0" * len(a))[:len(a)]

    def stall(handler, path):
        if not path.endswith(f"/blobs/{a_digest}"):
            return False
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(bad)))
        handler.end_headers()
        handler.wfile.write(bad[:len(header)])
        handler.wfile.flush()
        time.sleep(2)
        handler.wfile.write(bad[len(header):])
        return True

    m = Forwarder(registry.host, serve=stall)
    try:
        store = CacheStore(tmp_path / "store", registry=options(registry, hosts(registry, m.host)))
        assert store.ensure(pinned).digest == pinned.split("@")[1]
    finally:
        m.close()
    assert store.verify() == []
    assert any(r.getMessage().startswith("content refused after a mirror served part of it") for r in caplog.records)


def test_when_no_host_has_a_blob_right_the_mismatch_is_the_error(tmp_path_factory, tmp_path, hosts):
    """The mirror has nothing (404) and the registry's copy of a layer is corrupt: the error is the
    digest mismatch (BAD_CONTENT), with what the mirror answered after it, not the mirror's 404
    from asking it again once the registry was left out."""
    from tests.fixtures.registry import _start

    own = _start(tmp_path_factory)  # a registry of its own: this one's storage is damaged on purpose
    try:
        pinned = push(own, tmp_path, "hostile/lost")
        layer = own.blob_file(next(iter(_layers(own, pinned))))
        data = bytearray(layer.read_bytes())
        data[len(data) // 2] ^= 0xFF
        layer.write_bytes(bytes(data))
        front = Forwarder(own.host, answer=lambda m, p, h: (404, {}, b"") if "/blobs/" in p else None)
        try:
            store = CacheStore(tmp_path / "store", registry=options(own, hosts(own, front.host)))
            with pytest.raises(IntegrityError, match=r"blob digest mismatch: .*; the other hosts: .*HTTP 404"):
                store.ensure(pinned)
        finally:
            front.close()
    finally:
        own.stop()


def _layers(reg, pinned: str) -> list[str]:
    import json

    manifest = json.loads(reg.blob_file(pinned.split("@")[1]).read_bytes())
    return [d["digest"] for d in manifest["layers"]]


def test_a_mirror_answering_a_digest_under_any_name_proves_nothing(registry, tmp_path, hosts):
    """Spegel serves a digest whatever repository the request names. A tenant's pull (options of
    its own) names a repository that does not hold the digest; the mirror answers it anyway. The
    proof is asked of the server alone, which says no: nothing is handed out (it used to be)."""
    pinned = push(registry, tmp_path, "hostile/private")
    digest = pinned.split("@")[1]

    def any_name(handler, path):  # /v2/<any repo>/(manifests|blobs)/<digest> -> the private repo's
        if "/manifests/sha256:" in path or "/blobs/sha256:" in path:
            kind, ref = path.rsplit("/", 2)[1:]
            handler.path = f"/v2/hostile/private/{kind}/{ref}"
        return False

    m = Forwarder(registry.host, serve=any_name)
    try:
        d = hosts(registry, m.host)
        store = CacheStore(tmp_path / "store", registry=options(registry, d))
        tenant = RegistryOptions(plain_http=True, timeout=30, hosts_dir=d, anonymous=True)
        with pytest.raises(AuthError, match="does not serve"):
            store.ensure(f"{registry.host}/hostile/elsewhere@{digest}", options=tenant)
    finally:
        m.close()


def test_a_mirror_that_accepts_and_never_answers_is_passed(registry, tmp_path, hosts):
    """A mirror that accepts connections and never answers is given the mirror read timeout (5 s),
    not the server's 30 s, and the pull goes on at the registry within its 20 s deadline."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    done = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not done.is_set():
            try:
                accepted.append(listener.accept()[0])  # held open, never answered
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    pinned = push(registry, tmp_path, "hostile/silent")
    try:
        host = f"127.0.0.1:{listener.getsockname()[1]}"
        store = CacheStore(tmp_path / "store", registry=options(registry, hosts(registry, host), timeout=20))
        assert store.ensure(pinned).digest == pinned.split("@")[1]
    finally:
        done.set()
        for c in accepted:
            c.close()
        listener.close()
    assert accepted, "the silent mirror was never asked"


def _dripping(stop: threading.Event, part: str):
    """A ``serve`` hook: answers requests whose path holds ``part`` with 200 and a body of zeros
    (no length: it ends when the connection does) sent a byte a second, so that no read timeout
    ever trips; forwards the rest."""
    def drip(handler, path):
        if part not in path:
            return False
        handler.send_response(200)
        handler.end_headers()
        return _drip(handler, stop, b"\0")
    return drip


def _drip(handler, stop: threading.Event, piece: bytes) -> bool:
    """Write ``piece`` a second until ``stop`` is set or the client hangs up; True: answered."""
    while not stop.is_set():
        try:
            handler.wfile.write(piece)
            handler.wfile.flush()
        except OSError:
            break
        time.sleep(1)
    return True


@pytest.mark.parametrize("part", ["/manifests/", "/blobs/"])
def test_a_mirror_dripping_content_is_left_for_the_next_host(registry, tmp_path, hosts, part):
    """Issue 33: the mirror answers manifests (then blobs) at a byte a second. It is left once it
    has sent under MIN_TRANSFER_BYTES in RATE_WINDOW (10 s) of waiting, and the registry serves
    the pull within its 40 s deadline (the pull used to wait on the mirror until the deadline,
    then fail)."""
    stop = threading.Event()
    _pulled_past_the_mirror(registry, tmp_path, hosts, "hostile/drip-content", _dripping(stop, part), stop, timeout=40)


def test_a_registry_dripping_a_blob_fails_the_pull_before_its_deadline(registry, tmp_path):
    """The server itself drips a blob: the pull fails naming the rate after RATE_WINDOW, not
    after its 60 s deadline (nor after retries at the same pace)."""
    from accelnode.oci.errors import RegistryUnavailable
    from accelnode.oci.registry import MIN_TRANSFER_BYTES

    stop = threading.Event()
    pinned = push(registry, tmp_path, "hostile/drip-server")
    server = Forwarder(registry.host, serve=_dripping(stop, "/blobs/"))
    try:
        opts = RegistryOptions(plain_http=True, timeout=60, anonymous=True, mirrors={registry.host: server.host})
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=f"too slow: .* under the minimum of "
                                                      f"{MIN_TRANSFER_BYTES // 1024} KiB per 10s"):
            CacheStore(tmp_path / "store", registry=opts).ensure(pinned)
        assert time.monotonic() - started < 45  # a bound well under the deadline, not a timing
    finally:
        stop.set()
        server.close()


@pytest.mark.parametrize("host", ["..", "."])
def test_a_registry_host_of_dots_is_refused_before_any_file_or_request(registry, tmp_path, host):
    """Issue 33: an image on registry ``..`` made the hosts lookup read ``<hosts dir>/../hosts.toml``
    (``.``: ``<hosts dir>/hosts.toml``), a file outside any registry's directory, and pull from
    the server it names. ``.``, ``..`` and empty labels are no host name: the reference is refused
    (InvalidReference naming the host) and nothing is asked of anyone."""
    from accelnode.oci.errors import InvalidReference

    pinned = push(registry, tmp_path, "hostile/dots")
    attacker = Forwarder(registry.host)
    try:
        d = certs_d(tmp_path / "etc" / "certs.d", {"registry.example.com": mirror(f"http://{attacker.host}")})
        outside = tmp_path / "etc" / "certs.d" if host == "." else tmp_path / "etc"
        (outside / "hosts.toml").write_text(f'server = "http://{attacker.host}"\n')
        store = CacheStore(tmp_path / "store", registry=options(registry, d, timeout=20))
        image = f"{host}/hostile/dots@{pinned.split('@')[1]}"
        with pytest.raises(InvalidReference, match=f"registry host '{host}' has an empty label"):
            store.ensure(image)
    finally:
        attacker.close()
    assert attacker.seen == []
