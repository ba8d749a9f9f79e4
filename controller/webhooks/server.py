"""The HTTPS server every admission webhook of the suite is served by (admission.k8s.io/v1;
docs/controller.md, "Admission server").

Invariants: hostile or broken input never crashes the server or hangs a connection (bad body:
400, too large: 413, a handler that raises: ``allowed: false`` with code 500, reads and the TLS
handshake time out); a changed certificate pair is picked up on the next connection without a
restart, and one that fails to load keeps the previous pair. :class:`AdmissionMetrics` is made
once per process so the metrics exist before the server starts (docs/monitoring.md).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from accelnode.httpserve import parse_address
from accelnode.log import kv

log = logging.getLogger("accelnode.controller.admission")

API_VERSION = "admission.k8s.io/v1"
MAX_BODY = 8 * 1024 * 1024  # an object is at most ~1.5 MiB in etcd; object + oldObject, JSON-encoded
DRAIN_LIMIT = 64 * 1024 * 1024  # an oversized body is read and dropped up to this much, then the connection closed
IO_TIMEOUT = 30.0  # the API server waits for a webhook at most 30 s


@dataclass(frozen=True)
class Response:
    allowed: bool
    message: str = ""
    code: int | None = None
    patch: list | None = None  # JSON Patch operations (RFC 6902)
    warnings: tuple[str, ...] = field(default_factory=tuple)


def allow(patch: list | None = None, warnings=()) -> Response:
    return Response(True, patch=patch or None, warnings=tuple(warnings))


def deny(message: str, code: int = 403) -> Response:
    return Response(False, message=message, code=code)


Handler = Callable[[dict], Response]


class BadReview(ValueError):
    """The body is not an AdmissionReview this server answers (HTTP 400)."""


def parse_review(body: bytes) -> dict:
    """The ``request`` of an admission.k8s.io/v1 AdmissionReview, or :class:`BadReview`."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadReview(f"body is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadReview("body is not a JSON object")
    if doc.get("kind") != "AdmissionReview" or doc.get("apiVersion") != API_VERSION:
        raise BadReview(f"expected kind AdmissionReview, apiVersion {API_VERSION}; got kind {doc.get('kind')!r}, "
                        f"apiVersion {doc.get('apiVersion')!r}")
    request = doc.get("request")
    if not isinstance(request, dict):
        raise BadReview("AdmissionReview has no request object")
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        raise BadReview("AdmissionReview request has no uid")
    return request


def review_response(uid: str, resp: Response) -> dict:
    out: dict = {"uid": uid, "allowed": bool(resp.allowed)}
    if resp.message or resp.code is not None:
        out["status"] = {k: v for k, v in (("code", resp.code), ("message", resp.message)) if v}
    if resp.patch:
        out["patchType"] = "JSONPatch"
        out["patch"] = base64.b64encode(json.dumps(resp.patch, separators=(",", ":")).encode()).decode()
    if resp.warnings:
        out["warnings"] = list(resp.warnings)
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": out}


class CertReloader:
    """The server's TLS context, rebuilt when the certificate or key file changes."""

    def __init__(self, cert_file: str, key_file: str):
        self.cert_file, self.key_file = cert_file, key_file
        self._lock = threading.Lock()
        self._stamp = self._files_stamp()
        self._ctx = self._load()  # the first pair must load: raise otherwise
        self.reloads = 0

    def _files_stamp(self):
        out = []
        for f in (self.cert_file, self.key_file):
            st = os.stat(f)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def _load(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.set_alpn_protocols(["http/1.1"])
        self.not_after = _not_after(self.cert_file)
        return ctx

    def context(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._files_stamp()
            except OSError as e:
                log.warning("cannot stat the serving certificate; keeping the loaded one",
                            extra=kv(cert=self.cert_file, error=str(e)))
                return self._ctx
            if stamp != self._stamp:
                try:
                    self._ctx = self._load()
                except (ssl.SSLError, OSError) as e:
                    log.warning("serving certificate changed but does not load; keeping the previous one",
                                extra=kv(cert=self.cert_file, key=self.key_file, error=str(e)))
                else:
                    self.reloads += 1
                    log.info("serving certificate reloaded", extra=kv(cert=self.cert_file))
                # a pair that failed is retried once its files change again
                self._stamp = stamp
            return self._ctx


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # the listen backlog: socketserver's default of 5 drops SYNs when the API server opens
    # connections in a burst, and each dropped SYN costs the client a 1 s retransmit
    request_queue_size = 128

    def __init__(self, address, handler, certs: CertReloader):
        self.certs = certs
        super().__init__(address, handler)

    def get_request(self):
        sock, addr = self.socket.accept()
        # a response is two writes (headers, body): without this the body waits for the API
        # server's delayed ACK of the headers (Nagle), ~40 ms on every admission
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # the handshake happens in the connection's own thread (setup), never in the accept loop
        return self.certs.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def handle_error(self, request, client_address):
        log.debug("connection failed", exc_info=True, extra=kv(client=f"{client_address[0]}:{client_address[1]}"))


class AdmissionMetrics:
    def __init__(self, registry):
        from prometheus_client import Counter, Histogram

        self.requests = Counter("accelnode_controller_admission_requests", "Admission requests answered, by webhook "
                                "path and answer (allowed, patched, denied, error, malformed, too_large, no_route)",
                                ["path", "answer"], registry=registry)
        self.seconds = Histogram("accelnode_controller_admission_seconds", "Time from a request's body read to its "
                                 "answer written, by webhook path", ["path"], registry=registry,
                                 buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))

    def answered(self, path: str, answer: str, started: float | None = None) -> None:
        self.requests.labels(path, answer).inc()
        if started is not None:
            self.seconds.labels(path).observe(time.monotonic() - started)


class AdmissionServer:
    def __init__(self, address: str, cert_file: str, key_file: str, routes: dict[str, Handler], *,
                 max_body: int = MAX_BODY, metrics: AdmissionMetrics | None = None):
        self.routes = dict(routes)
        self.metrics = metrics
        self.certs = CertReloader(cert_file, key_file)
        self.max_body = max_body
        outer = self

        class Conn(BaseHTTPRequestHandler):
            timeout = IO_TIMEOUT
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()  # sets the socket timeout
                self.request.do_handshake()

            def do_POST(self):  # noqa: N802 (http.server naming)
                outer._post(self)

            def do_GET(self):  # noqa: N802
                self._plain(405, "admission reviews are POSTed\n")

            def _plain(self, code: int, text: str) -> None:
                outer._send(self, code, text.encode(), "text/plain; charset=utf-8")

            def log_message(self, *args):
                pass

        self._httpd = _Server(parse_address(address), Conn, self.certs)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="admission", daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> "AdmissionServer":
        self._thread.start()
        log.info("admission server listening", extra=kv(address=f"{self._httpd.server_address[0]}:{self.port}",
                                                        routes=sorted(self.routes)))
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- one request ---------------------------------------------------------------------------

    def _post(self, conn: BaseHTTPRequestHandler) -> None:
        path = conn.path.split("?", 1)[0]
        length = conn.headers.get("Content-Length")
        if length is None or not length.isdigit():
            conn.close_connection = True
            self._send(conn, 411, b"a Content-Length is required\n", "text/plain; charset=utf-8")
            return
        if int(length) > self.max_body:
            # read past the body without keeping it (up to a bound), so that the client, still
            # sending, gets the answer rather than a reset; then close
            _discard(conn.rfile, min(int(length), DRAIN_LIMIT))
            conn.close_connection = True
            self._send(conn, 413, f"body of {length} bytes is over the limit of {self.max_body}\n".encode(),
                       "text/plain; charset=utf-8")
            self._count(path, "too_large")
            return
        body = conn.rfile.read(int(length))
        started = time.monotonic()
        handler = self.routes.get(path)
        if handler is None:
            self._send(conn, 404, f"no webhook at {path}\n".encode(), "text/plain; charset=utf-8")
            self._count("other", "no_route")  # never a label per unknown path a client makes up
            return
        try:
            request = parse_review(body)
        except BadReview as e:
            self._send(conn, 400, f"malformed AdmissionReview: {e}\n".encode(), "text/plain; charset=utf-8")
            self._count(path, "malformed", started)
            return
        answer = "error"
        try:
            resp = handler(request)
            if not isinstance(resp, Response):
                raise TypeError(f"handler returned {type(resp).__name__}, not an admission Response")
            answer = "denied" if not resp.allowed else "patched" if resp.patch else "allowed"
        except Exception as e:
            log.error("admission handler failed", exc_info=True,
                      extra=kv(path=path, uid=request["uid"], error=f"{type(e).__name__}: {e}"))
            resp = Response(False, message=f"internal error in webhook {path}: {type(e).__name__}", code=500)
        self._send(conn, 200, json.dumps(review_response(request["uid"], resp)).encode(), "application/json")
        self._count(path, answer, started)

    def _count(self, path: str, answer: str, started: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.answered(path if path in self.routes else "other", answer, started)

    @staticmethod
    def _send(conn: BaseHTTPRequestHandler, code: int, body: bytes, ctype: str) -> None:
        conn.send_response(code)
        conn.send_header("Content-Type", ctype)
        conn.send_header("Content-Length", str(len(body)))
        if conn.close_connection:
            conn.send_header("Connection", "close")
        conn.end_headers()
        conn.wfile.write(body)


def _not_after(cert_file: str) -> float:
    """Unix time the first certificate of a PEM file expires (0 if it cannot be read)."""
    from cryptography import x509

    try:
        with open(cert_file, "rb") as f:
            return x509.load_pem_x509_certificate(f.read()).not_valid_after_utc.timestamp()
    except (OSError, ValueError):
        return 0.0


def _discard(stream, n: int) -> None:
    while n > 0:
        chunk = stream.read(min(n, 64 * 1024))
        if not chunk:
            return
        n -= len(chunk)
