"""The admission server (controller/webhooks/server.py) against hostile clients, over real TLS
sockets on loopback: idle and slow-loris connections are closed, connections and threads stay
bounded however many clients connect, an oversize body or one that would parse into too much
memory is refused with a clear answer, and legitimate reviews are answered throughout.

The server runs in a process of its own where the test counts what it holds (threads, peak
memory from /proc). No assertion here is on time: deadlines in the tests are generous upper
bounds on waiting for something that must happen."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from controller.webhooks.server import MAX_BODY, AdmissionMetrics, AdmissionServer, Limits, allow
from tests.controller.admission_proc import AdmissionProc
from tests.controller.test_webhook_server import CA, client_ctx, post, review

WORKERS = Limits().workers


@pytest.fixture
def pair(tmp_path):
    ca = CA()
    cert, key, _ = ca.serving(tmp_path, "webhook-attacks")
    return ca, cert, key


@pytest.fixture
def proc(pair):
    ca, cert, key = pair
    p = AdmissionProc(cert, key)
    yield p
    p.stop()


class Client:
    """Raw sockets to the server, closed at the end."""

    def __init__(self, port: int, ca: CA):
        self.port, self.ctx, self.socks = port, client_ctx(ca), []

    def tcp(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        self.socks.append(s)
        return s

    def tls(self, session=None) -> ssl.SSLSocket:
        s = self.ctx.wrap_socket(self.tcp(), server_hostname="127.0.0.1", session=session)
        self.socks.append(s)
        return s

    def slow_loris(self) -> ssl.SSLSocket:
        """A connection that has sent the start of a request head and never finishes it."""
        s = self.tls()
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: webhook\r\n")
        return s

    def close(self) -> None:
        for s in self.socks:
            s.close()


@pytest.fixture
def client(request):
    made = []

    def make(port, ca):
        made.append(Client(port, ca))
        return made[-1]
    yield make
    for c in made:
        c.close()


def trickle(socks, stop: threading.Event, every: float = 0.2) -> threading.Thread:
    """Send one more header byte on each socket every ``every`` seconds, as slow-loris does."""
    def run():
        while not stop.wait(every):
            for s in list(socks):
                try:
                    s.send(b"X")
                except (OSError, ValueError):
                    socks.remove(s)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def closed_by_server(s: socket.socket, within: float) -> bool:
    """Whether the server closes ``s`` (EOF or reset) before ``within`` seconds pass."""
    s.settimeout(within)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (ConnectionError, ssl.SSLError):
        return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


def request_bytes(body: bytes, path: str = "/mutate") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_idle_and_slow_connections_are_closed(pair, client):
    """Each way of holding a connection without finishing a request: never a TLS handshake, a
    handshake and nothing more, a request head sent a byte at a time (slow-loris), a body sent a
    byte at a time, a kept-alive connection left idle after its answer."""
    ca, cert, key = pair
    registry = CollectorRegistry()
    server = AdmissionServer("127.0.0.1:0", cert, key, {"/mutate": lambda r: allow()},
                             limits=Limits(handshake_timeout=1, request_timeout=2, idle_timeout=2),
                             metrics=AdmissionMetrics(registry)).start()
    try:
        c = client(server.port, ca)
        no_handshake = c.tcp()
        no_request = c.tls()
        head = c.slow_loris()
        body = c.tls()
        body.sendall(request_bytes(b"{" * 1000)[:-990])
        kept = c.tls()
        kept.sendall(request_bytes(json.dumps(review()).encode()))
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        stop = threading.Event()
        trickle([head, body], stop)
        try:
            for name, s in (("no handshake", no_handshake), ("no request", no_request), ("slow head", head),
                            ("slow body", body), ("idle after an answer", kept)):
                assert closed_by_server(s, within=20), f"{name}: still open"
        finally:
            stop.set()
        deadline = time.monotonic() + 10
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.connections == 0
        assert post(server, ca, "/mutate", json.dumps(review()).encode())[0] == 200
    finally:
        server.stop()
    closed = {reason: registry.get_sample_value("accelnode_controller_admission_connections_closed_total",
                                                {"reason": reason}) for reason in ("handshake", "idle", "slow")}
    assert closed == {"handshake": 1, "idle": 2, "slow": 2}, closed  # what an operator sees in the metrics


def test_connections_over_the_limit_evict_the_longest_idle(pair, client):
    ca, cert, key = pair
    server = AdmissionServer("127.0.0.1:0", cert, key, {"/mutate": lambda r: allow()},
                             limits=Limits(max_connections=20)).start()
    try:
        c = client(server.port, ca)
        oldest = [c.tcp() for _ in range(10)]
        for _ in range(30):
            c.tcp()
        assert all(closed_by_server(s, within=20) for s in oldest)
        assert post(server, ca, "/mutate", json.dumps(review()).encode())[0] == 200
        assert server.connections <= 20
    finally:
        server.stop()


def test_under_500_idle_and_50_slow_loris_connections_threads_stay_bounded_and_reviews_are_answered(pair, proc,
                                                                                                   client):
    ca = pair[0]
    c = client(proc.port, ca)
    rss_before = proc.status("VmRSS")
    idle = [c.tcp() for _ in range(450)] + [c.tls() for _ in range(50)]
    slow = [c.slow_loris() for _ in range(50)]
    stop = threading.Event()
    trickle(slow, stop, every=0.5)
    try:
        answers = []
        for i in range(20):
            status, body = post(proc, ca, "/mutate", json.dumps(review(uid=f"u-{i}")).encode())
            answers.append((status, json.loads(body)["response"]["allowed"] if status == 200 else body))
        threads = proc.status("Threads")
        rss = proc.status("VmRSS")
    finally:
        stop.set()
    assert answers == [(200, True)] * 20
    # the main thread, the event loop's and the handler pool's: never one per connection
    assert threads <= 2 + WORKERS, threads
    print(f"threads={threads} rss_before_kib={rss_before} rss_kib={rss}")
    assert rss - rss_before < 96 * 1024, (rss_before, rss)  # KiB: the connections cost buffers, not threads
    assert len(idle) == 500


def test_an_oversize_body_is_refused_clearly_and_memory_does_not_grow(pair, proc):
    """One byte over the API server's bound, and a body within it that would parse into ~170 MiB of
    Python objects (a list of empty objects): both 413 with a message, and the server's peak
    memory does not move by the body's size, let alone its parse."""
    ca = pair[0]
    assert post(proc, ca, "/mutate", json.dumps(review()).encode())[0] == 200  # warm: imports, handler thread
    peak = proc.status("VmHWM")
    status, body = post(proc, ca, "/mutate", b" " * (MAX_BODY + 1))
    assert status == 413 and f"over the limit of {MAX_BODY}".encode() in body, (status, body[:200])
    doc = review(obj={"metadata": {"name": "p"}, "items": []})
    bomb = json.dumps(doc).replace('"items": []', '"items": [' + "{}," * ((MAX_BODY - 4096) // 3) + "{}]").encode()
    assert len(bomb) <= MAX_BODY
    status, body = post(proc, ca, "/mutate", bomb)
    assert status == 413 and b"more JSON values than this server parses" in body, (status, body[:200])
    grown = proc.status("VmHWM") - peak
    assert grown < 32 * 1024, f"peak memory grew {grown} KiB"
    assert post(proc, ca, "/mutate", json.dumps(review()).encode())[0] == 200


def test_a_client_resumes_its_tls_session(pair, client):
    """Session tickets: a client that kept its session skips the full handshake on a new connection."""
    ca, cert, key = pair
    server = AdmissionServer("127.0.0.1:0", cert, key, {"/mutate": lambda r: allow()}).start()
    try:
        c = client(server.port, ca)
        first = c.tls()
        first.sendall(request_bytes(json.dumps(review()).encode()))
        assert first.recv(65536).startswith(b"HTTP/1.1 200")  # TLS 1.3 tickets arrive after the handshake
        again = c.tls(session=first.session)
        assert again.session_reused and not first.session_reused
        again.sendall(request_bytes(json.dumps(review()).encode()))
        assert again.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_a_slow_handler_is_answered_past_the_read_deadline(pair):
    """The read deadline bounds the client, not the webhook: a handler waiting on a registry
    answers when it is done (the API server gives up at the webhook's timeoutSeconds)."""
    ca, cert, key = pair

    def slow(request):
        time.sleep(2.5)
        return allow()
    server = AdmissionServer("127.0.0.1:0", cert, key, {"/slow": slow}, limits=Limits(request_timeout=1)).start()
    try:
        status, body = post(server, ca, "/slow", json.dumps(review(uid="u-slow")).encode())
        assert status == 200 and json.loads(body)["response"] == {"uid": "u-slow", "allowed": True}
    finally:
        server.stop()
