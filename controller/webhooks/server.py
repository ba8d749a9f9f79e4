"""The HTTPS server every admission webhook of the suite is served by (admission.k8s.io/v1;
docs/controller.md, "Admission server"; what it withstands: docs/security.md).

One asyncio event loop owns every connection (TLS handshake, reading, writing); handlers run on a
small fixed pool of threads. Whatever clients do, the server holds at most
``Limits.max_connections`` connections (a new one evicts the longest-idle), ``Limits.workers``
handler threads, and bodies within two byte budgets; a connection that does not finish its TLS
handshake, its request or its next request in time is closed.

Invariants: hostile or broken input never crashes the server or hangs a connection (bad body:
400, too large: 413, a handler that raises: ``allowed: false`` with code 500); a changed
certificate pair is picked up on the next connection without a restart, and one that fails to
load keeps the previous pair. :class:`AdmissionMetrics` is made once per process so the metrics
exist before the server starts (docs/monitoring.md).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import ssl
import threading
import time
from asyncio import sslproto
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from accelnode.decode import ADMISSION_REVIEW, DocumentError, decode, values_at_most
from accelnode.httpserve import parse_address
from accelnode.log import kv

log = logging.getLogger("accelnode.controller.admission")

API_VERSION = "admission.k8s.io/v1"
# The API server accepts a write of at most 3 MiB (MaxRequestBodyBytes, k8s.io/apiserver
# pkg/server/config.go: twice etcd's 1.5 MiB request limit); an AdmissionReview carries at most
# two such objects (object, oldObject) and less than 1 MiB besides: 7 MiB, as controller-runtime
# caps it (pkg/webhook/admission/http.go maxRequestSize).
MAX_BODY = ADMISSION_REVIEW.max_bytes  # 7 MiB
SMALL_BODY = 64 * 1024  # a review of our kinds is 1-20 KiB: bodies up to this are read outside the budget
VALUE_COST = 100  # bytes a parsed JSON value may take in Python (an empty dict: 64, a short str: ~55, + its slot)


@dataclass(frozen=True)
class Limits:
    """What one server may hold at once, and how long a client may take (docs/security.md)."""

    max_connections: int = 512  # beyond this a new connection evicts the longest-idle one
    workers: int = 8  # handler threads (a cache webhook may wait on a registry)
    handshake_timeout: float = 5.0  # TCP accept to TLS handshake done
    request_timeout: float = 10.0  # a request's head and body, from its first byte (the first: from accept)
    idle_timeout: float = 60.0  # between requests on a kept-alive connection (client-go closes idle ones at 90 s)
    write_timeout: float = 10.0  # a client that does not read its answer
    max_head: int = 16 * 1024  # request line and headers
    body_budget: int = 16 * 1024 * 1024  # bytes of bodies over SMALL_BODY being read at once
    parse_budget: int = 64 * 1024 * 1024  # estimated parsed size of the reviews being answered at once

    def check(self) -> None:
        if min(self.max_connections, self.workers, self.max_head, self.body_budget, self.parse_budget) < 1 or \
                min(self.handshake_timeout, self.request_timeout, self.idle_timeout, self.write_timeout) <= 0:
            raise ValueError(f"admission server limits must be positive: {self}")


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
        doc = decode(body, ADMISSION_REVIEW, "body")
    except DocumentError as e:
        raise BadReview(str(e)) from None
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


class AdmissionMetrics:
    def __init__(self, registry):
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter("accelnode_controller_admission_requests", "Admission requests answered, by webhook "
                                "path and answer (allowed, patched, denied, error, malformed, too_large, no_route)", ["path", "answer"], registry=registry)
        self.seconds = Histogram("accelnode_controller_admission_seconds", "Time from a request's body read to its "
                                 "answer written, by webhook path", ["path"], registry=registry,
                                 buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        self.connections = Gauge("accelnode_controller_admission_connections", "Connections the admission server "
                                 "holds open", registry=registry)
        self.closed = Counter("accelnode_controller_admission_connections_closed", "Connections the admission server "
                              "closed itself, by reason (handshake, idle, slow, evicted, too_large, bad_request)",
                              ["reason"], registry=registry)

    def answered(self, path: str, answer: str, started: float | None = None) -> None:
        self.requests.labels(path, answer).inc()
        if started is not None:
            self.seconds.labels(path).observe(time.monotonic() - started)


class _Budget:
    """Bytes that requests may hold at once; a request waits for its share (only in the event loop)."""

    def __init__(self, total: int):
        self.total, self.free = total, total
        self._changed = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= n)
            self.free -= n

    async def release(self, n: int) -> None:
        async with self._changed:
            self.free += n
            self._changed.notify_all()


class _Closed(Exception):
    """The connection was answered and must close; ``reason`` labels the close in the metrics."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Conn(sslproto.SSLProtocol):
    """One accepted connection: asyncio's TLS protocol (its handshake deadline included) under a
    stream reader and writer, counted by the server from accept to close."""

    # asyncio reads TLS records into a buffer of 256 KiB per connection: 140 MiB for 550 idle
    # connections. A TLS record is at most 16 KiB; the buffer only needs to take one.
    max_size = 32 * 1024

    def __init__(self, server: "AdmissionServer", loop: asyncio.AbstractEventLoop):
        self.server, self.since, self.busy, self.raw = server, time.monotonic(), False, None
        self.made = self.served = False  # held by the server; TLS handshake done
        reader = asyncio.StreamReader(limit=server.limits.max_head, loop=loop)
        app = asyncio.StreamReaderProtocol(reader, lambda r, w: server._serve(self, r, w), loop=loop)
        super().__init__(loop, app, server.certs.context(), None, server_side=True,
                         ssl_handshake_timeout=server.limits.handshake_timeout,
                         ssl_shutdown_timeout=server.limits.write_timeout)

    def connection_made(self, transport):
        self.raw = transport
        # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP, not on those
        # accepted from socket.create_server's: without it the answer waits behind the session
        # tickets for the client's delayed ACK (Nagle), ~40 ms on every new connection
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.server._admit(self):
            self.made = True
            super().connection_made(transport)
        else:
            transport.abort()

    def connection_lost(self, exc):
        self.server._forget(self)
        if self.made:
            if not self.served and self.server.metrics is not None:  # no TLS handshake: timed out, refused, gone
                self.server.metrics.closed.labels("handshake").inc()
            super().connection_lost(exc)


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
            413: "Content Too Large", 431: "Request Header Fields Too Large"}


class AdmissionServer:
    def __init__(self, address: str, cert_file: str, key_file: str, routes: dict[str, Handler], *,
                 max_body: int = MAX_BODY, metrics: AdmissionMetrics | None = None, limits: Limits = Limits()):
        limits.check()
        self.routes = dict(routes)
        self.metrics = metrics
        self.certs = CertReloader(cert_file, key_file)
        self.max_body = max_body
        self.limits = limits
        host, port = parse_address(address)
        # bound here, so that a taken address fails the caller; a deep backlog: the API server opens
        # connections in bursts, and each dropped SYN costs it a 1 s retransmit
        self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                          backlog=1024)
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="admission-handler")
        self._loop = asyncio.new_event_loop()
        self._conns: dict[_Conn, None] = {}  # insertion-ordered: the oldest first; only the loop touches it
        self._thread = threading.Thread(target=self._loop.run_forever, name="admission", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    @property
    def connections(self) -> int:
        """Connections held open now (accepted, not yet closed)."""
        return len(self._conns)

    def start(self) -> "AdmissionServer":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result()
        log.info("admission server listening", extra=kv(address=f"{self._sock.getsockname()[0]}:{self.port}",
                                                        routes=sorted(self.routes)))
        return self

    async def _listen(self) -> asyncio.base_events.Server:
        self._body_budget = _Budget(self.limits.body_budget)
        self._parse_budget = _Budget(self.limits.parse_budget)
        loop = asyncio.get_running_loop()
        return await loop.create_server(lambda: _Conn(self, loop), sock=self._sock)

    def stop(self) -> None:
        async def close():
            if self._server is not None:
                self._server.close()
            for c in list(self._conns):
                c.raw.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
        self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- one connection ------------------------------------------------------------------------

    async def _serve(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Requests of one connection whose TLS handshake is done, one after the other."""
        conn.served = True
        lim = self.limits
        why = ""
        try:
            wait_until = conn.since + lim.request_timeout  # the first request comes at once
            while True:
                why = "idle"
                async with asyncio.timeout_at(self._at(wait_until)):
                    first = await reader.read(1)
                if not first:
                    why = ""
                    return  # the client closed
                why = "slow"
                if not await self._request(conn, first, reader, writer, time.monotonic() + lim.request_timeout):
                    why = ""
                    return
                conn.since = time.monotonic()
                wait_until = conn.since + lim.idle_timeout
                if self._conns.pop(conn, False) is None:  # now the most recently active: evicted last
                    self._conns[conn] = None
        except TimeoutError:
            log.debug("admission connection timed out", extra=kv(reason=why, peer=_peer(writer)))
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            why = ""  # the client went away
        except _Closed as c:
            why = c.reason
        except asyncio.CancelledError:
            why = ""  # the server stops
            raise
        except Exception:
            log.error("admission connection failed", exc_info=True, extra=kv(peer=_peer(writer)))
            why = ""
        finally:
            if why and self.metrics is not None:
                self.metrics.closed.labels(why).inc()
            conn.raw.abort()  # what was answered is in the kernel's send buffer: it still goes out

    def _admit(self, conn: _Conn) -> bool:
        """Hold ``conn``; at the limit, close the longest-idle connection that is not being answered
        (or, when every one is, ``conn`` itself: False)."""
        if len(self._conns) >= self.limits.max_connections:
            victim = next((c for c in self._conns if not c.busy), None)
            if victim is None:  # every connection is being answered: this one waits for none of them
                victim = conn
            else:
                self._conns.pop(victim)
                victim.raw.abort()
            if self.metrics is not None:
                self.metrics.closed.labels("evicted").inc()
            if victim is conn:
                return False
        self._conns[conn] = None
        self._gauge()
        return True

    def _forget(self, conn: _Conn) -> None:
        self._conns.pop(conn, None)
        self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.connections.set(len(self._conns))

    def _at(self, deadline: float) -> float:
        return self._loop.time() + (deadline - time.monotonic())

    # -- one request ---------------------------------------------------------------------------

    async def _request(self, conn: _Conn, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       deadline: float) -> bool:
        """Read (by ``deadline``), answer and write one request; whether the connection stays open."""
        async with asyncio.timeout_at(self._at(deadline)):
            head = await self._head(first, reader, writer)
        method, path, version, headers = head
        close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
        if method != "POST":
            # no body is expected; a GET's Content-Length would desynchronise us: close after
            await self._send(writer, 405, b"admission reviews are POSTed\n", close=True)
            return False
        length = headers.get("content-length")
        if "transfer-encoding" in headers or length is None or not length.isdigit():
            await self._send(writer, 411, b"a Content-Length is required\n", close=True)
            return False
        n = int(length)
        if n > self.max_body:
            await self._send(writer, 413, f"body of {n} bytes is over the limit of {self.max_body}\n".encode(),
                             close=True)
            self._count(path, "too_large")
            # read past the body without keeping it (a bounded while), so that the client, still
            # sending, reads the answer rather than a reset
            await _discard(reader, min(n, 2 * self.max_body), self.limits.write_timeout)
            raise _Closed("too_large")
        async with asyncio.timeout_at(self._at(deadline)):
            body, cost = await self._body(n, reader)
        started = time.monotonic()
        if path not in self.routes:
            code, out, what = 404, f"no webhook at {path}\n".encode(), "no_route"
        elif cost > self.limits.parse_budget:
            code, out, what = 413, (f"body of {n} bytes holds more JSON values than this server parses (about "
                                    f"{cost // 2**20} MiB parsed, limit {self.limits.parse_budget // 2**20} MiB)\n"
                                    ).encode(), "too_large"
        else:
            # the handler runs as long as it needs (the API server gives up at the webhook's
            # timeoutSeconds); meanwhile this connection is never evicted
            conn.busy = True
            try:
                async with asyncio.timeout_at(self._at(deadline)):
                    await self._parse_budget.acquire(cost)
                try:
                    code, out, what = await self._loop.run_in_executor(self._pool, self._answer, path, body)
                finally:
                    await self._parse_budget.release(cost)
            finally:
                conn.busy = False
        del body
        await self._send(writer, code, out, ctype="application/json" if code == 200 else _TEXT, close=close)
        self._count(path, what, started if code == 200 or what == "malformed" else None)
        return not close

    async def _head(self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """(method, path without query, version, headers) of the request that starts with ``first``."""
        try:
            head = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            await self._send(writer, 431, b"request head over the limit of %d bytes\n" % self.limits.max_head,
                             close=True)
            raise _Closed("bad_request") from None
        try:
            method, target, version, headers = _parse_head(head)
        except ValueError as e:
            await self._send(writer, 400, f"bad request: {e}\n".encode(), close=True)
            raise _Closed("bad_request") from None
        return method, target.split("?", 1)[0], version, headers

    async def _body(self, n: int, reader: asyncio.StreamReader) -> tuple[bytes, int]:
        """The body of ``n`` bytes, read within the read budget, and what parsing it may take at most."""
        held = min(n, self.limits.body_budget) if n > SMALL_BODY else 0
        if held:
            await self._body_budget.acquire(held)
        try:
            body = await reader.readexactly(n)
        finally:
            if held:
                await self._body_budget.release(held)
        return body, n + VALUE_COST * values_at_most(body)

    def _answer(self, path: str, body: bytes) -> tuple[int, bytes, str]:
        """On a handler thread: (HTTP code, body, answer label)."""
        try:
            request = parse_review(body)
        except BadReview as e:
            return 400, f"malformed AdmissionReview: {e}\n".encode(), "malformed"
        del body
        answer = "error"
        try:
            resp = self.routes[path](request)
            if not isinstance(resp, Response):
                raise TypeError(f"handler returned {type(resp).__name__}, not an admission Response")
            answer = "denied" if not resp.allowed else "patched" if resp.patch else "allowed"
        except Exception as e:
            log.error("admission handler failed", exc_info=True,
                      extra=kv(path=path, uid=request["uid"], error=f"{type(e).__name__}: {e}"))
            resp = Response(False, message=f"internal error in webhook {path}: {type(e).__name__}", code=500)
        return 200, json.dumps(review_response(request["uid"], resp)).encode(), answer

    def _count(self, path: str, answer: str, started: float | None = None) -> None:
        if self.metrics is not None:
            self.metrics.answered(path if path in self.routes else "other", answer, started)

    async def _send(self, writer: asyncio.StreamWriter, code: int, body: bytes, *, ctype: str = "",
                    close: bool = False) -> None:
        head = (f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nContent-Type: {ctype or _TEXT}\r\n"
                f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n")
        writer.write(head.encode() + body)
        async with asyncio.timeout(self.limits.write_timeout):
            await writer.drain()


_TEXT = "text/plain; charset=utf-8"


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """(method, target, version, lower-cased headers) of an HTTP/1.x request head, or ValueError."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not parts[1].startswith("/"):
        raise ValueError(f"not an HTTP/1.1 request line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"malformed header line {line[:80]!r}")
        name = name.lower()
        if name in headers and name in ("content-length", "transfer-encoding"):
            raise ValueError(f"{name} given twice")
        headers[name] = value.strip()
    return parts[0], parts[1], parts[2], headers


async def _discard(reader: asyncio.StreamReader, n: int, seconds: float) -> None:
    try:
        async with asyncio.timeout(seconds):
            while n > 0:
                chunk = await reader.read(min(n, 64 * 1024))
                if not chunk:
                    return
                n -= len(chunk)
    except TimeoutError:
        pass


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername") or ("?", 0)
    return f"{peer[0]}:{peer[1]}"


def _not_after(cert_file: str) -> float:
    """Unix time the first certificate of a PEM file expires (0 if it cannot be read)."""
    from cryptography import x509

    try:
        with open(cert_file, "rb") as f:
            return x509.load_pem_x509_certificate(f.read()).not_valid_after_utc.timestamp()
    except (OSError, ValueError):
        return 0.0
