"""Test helpers: hand-made tar layers and a loopback TCP proxy that injects real network faults."""

from __future__ import annotations

import gzip
import io
import json
import socket
import tarfile
import threading
import time

import zstandard

GZ = "application/vnd.oci.image.layer.v1.tar+gzip"
ZST = "application/vnd.oci.image.layer.v1.tar+zstd"
TAR = "application/vnd.oci.image.layer.v1.tar"
TRITON_CONFIG = {"config": {"Labels": {
    "cache.triton.image/summary": json.dumps({"targets": [{"backend": "cuda", "arch": "sm_90", "warp_size": 32}]}),
    "cache.triton.image/cache-size-bytes": "0", "cache.triton.image/entry-count": "1"}}}

_TYPES = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
          "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}


def tar(*entries, compression: str = "gzip") -> bytes:
    """A tar layer from (name, kind[, data or link target][, mode]) tuples; kind may also be a
    raw one-byte tar type."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, *rest in entries:
            ti = tarfile.TarInfo(name)
            ti.type = _TYPES.get(kind, kind if isinstance(kind, bytes) else None)
            ti.mode = rest[1] if len(rest) > 1 else (0o755 if kind == "dir" else 0o644)
            data = b""
            if kind in ("symlink", "hardlink"):
                ti.linkname = rest[0]
            elif kind == "file":
                data = rest[0] if rest else b""
                ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data) if data else None)
    raw = buf.getvalue()
    if compression == "gzip":
        return gzip.compress(raw, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor().compress(raw)
    return raw


class FaultProxy:
    """Forwards 127.0.0.1:<port> to a registry, with faults that are real TCP events:

    - ``fail_first``: answer the first N connections with ``503`` and close them;
    - ``cut_after``: on the first connection that fetches a blob whose digest contains
      ``cut_digest``, drop the connection after that many response bytes (once) - or, with
      ``stall``, stop forwarding and hold the connection open until the proxy is closed.
    """

    def __init__(self, upstream: str, *, fail_first: int = 0, cut_after: int | None = None, cut_digest: str = "/blobs/",
                 stall: bool = False):
        self.upstream = upstream.rsplit(":", 1)
        self.fail_left = fail_first
        self.cut_after, self.cut_digest = cut_after, cut_digest.encode()
        self.cuts = self.failures = 0
        self.stall = stall
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self._srv.getsockname()[1]}"
        self._stop = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            with self._lock:
                fail = self.fail_left > 0
                self.fail_left -= fail
            threading.Thread(target=self._serve, args=(client, fail), daemon=True).start()

    def _serve(self, client: socket.socket, fail: bool) -> None:
        self._socks.append(client)
        if fail:
            client.recv(65536)
            client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.failures += 1
            client.close()
            return
        up = socket.create_connection((self.upstream[0], int(self.upstream[1])))
        self._socks.append(up)
        armed = threading.Event()

        def upstream_to_client():
            sent = 0
            try:
                while data := up.recv(65536):
                    if armed.is_set() and self.cut_after is not None and sent + len(data) > self.cut_after:
                        with self._lock:
                            cut = self.cuts == 0
                            self.cuts += cut
                        if cut:
                            client.sendall(data[: max(self.cut_after - sent, 0)])
                            while self.stall and not self._stop:
                                time.sleep(0.05)
                            break
                    client.sendall(data)
                    sent += len(data) if armed.is_set() else 0
            except OSError:
                pass
            for s in (client, up):
                _close(s)

        threading.Thread(target=upstream_to_client, daemon=True).start()
        try:
            while data := client.recv(65536):
                if b"GET " in data and self.cut_digest in data:
                    armed.set()
                up.sendall(data)
        except OSError:
            pass
        _close(up)

    def close(self) -> None:
        self._stop = True
        self._srv.close()
        for s in self._socks:
            _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


class BlobRedirector:
    """A registry front on 127.0.0.1 that forwards every request to a real registry except blob
    GETs, which it answers with ``307`` to a blob server on another port - the way registries
    hand blobs to object storage or a CDN. The blob server serves the registry's own blob files,
    records the headers of every request (``seen``) and misbehaves on demand (``mode``):

    - ``"ok"``: honours ``Range: bytes=N-`` with 206;
    - ``"cut"``: ends its first response longer than ``cut_after`` bytes there, then honours ranges;
    - ``"ignore-range"``: like ``cut``, then answers ranged requests with 200 and the whole blob;
    - ``"wrong-range"``: like ``cut``, then answers ranged requests with a 206 that starts at 0;
    - ``"drip"``: sends the body one byte every 0.2 s;
    - ``"cut-forever"``: like ``cut``, then answers every request with headers and no body.
    """

    def __init__(self, registry, *, mode: str = "ok", cut_after: int = 100_000):
        import http.server
        import re

        front, self.mode, self.cut_after, self.seen, self.cuts = self, mode, cut_after, [], 0
        self._stop = threading.Event()

        class Blobs(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                front.seen.append(dict(self.headers))
                digest = self.path.rsplit("/", 1)[-1]
                data = registry.blob_file(digest).read_bytes()
                rng = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
                start = int(rng[1]) if rng else 0
                if rng and front.mode != "ignore-range":
                    shown = 0 if front.mode == "wrong-range" else start
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {shown}-{len(data) - 1}/{len(data)}")
                    body = data[start:]
                else:
                    self.send_response(200)
                    body = data
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if front.mode == "drip":
                    for i in range(len(body)):
                        if front._stop.wait(0.2):
                            return
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                elif front.mode != "ok" and not front.cuts and len(body) > front.cut_after:
                    front.cuts += 1
                    self.wfile.write(body[:front.cut_after])
                    self.close_connection = True
                elif front.mode == "cut-forever" and front.cuts:
                    front.cuts += 1
                    self.close_connection = True
                else:
                    self.wfile.write(body)

            def log_message(self, *a):
                pass

        def redirect(method, path, headers):
            if method == "GET" and "/blobs/sha256:" in path:
                digest = path.split("?", 1)[0].rsplit("/", 1)[-1]  # a mirror's requests carry ?ns=
                return 307, {"Location": f"http://{front.blob_host}/blobs/{digest}"}, b""
            return None

        self._front = Forwarder(registry.host, answer=redirect)
        self.front_seen = self._front.seen  # (method, path, headers) of every request to the front
        self._blobs = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Blobs)
        self._blobs.daemon_threads = True
        threading.Thread(target=self._blobs.serve_forever, daemon=True).start()
        self.host = self._front.host
        self.blob_host = "127.0.0.1:%d" % self._blobs.server_address[1]

    def close(self) -> None:
        self._stop.set()
        self._front.close()
        self._blobs.shutdown()
        self._blobs.server_close()


class Forwarder:
    """A registry front on 127.0.0.1: forwards every request to the plain-HTTP registry at
    ``upstream`` (HOST:PORT) and records ``(method, path, headers)`` of each in ``seen``.

    - ``prefix``: where its API root stands (a mirror under another path, for override_path);
      ``<prefix>/...`` is forwarded as ``/v2/...``, anything else is answered 404;
    - ``answer(method, path, headers)``: answers instead of the upstream when it returns
      ``(status, headers, body)`` (a 500, a redirect), forwards when it returns None;
    - ``mangle(path, body)``: what the client gets instead of the upstream's body (same length
      or not: Content-Length follows the body);
    - ``serve(handler, path)``: called first with the request handler and the path without its
      query; it has answered (written to ``handler.wfile`` at its own pace) when it returns True,
      else the request goes on as above (it may have rewritten ``handler.path``).
    """

    def __init__(self, upstream: str, *, prefix: str = "/v2", answer=None, mangle=None, serve=None):
        import http.client
        import http.server

        fwd, self.seen = self, []

        class Handler(http.server.BaseHTTPRequestHandler):  # HTTP/1.0: a connection per request
            def _reply(self, status, headers, body):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "content-length" not in {k.lower() for k in headers}:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _forward(self):
                if serve is not None and serve(self, self.path.split("?", 1)[0]):
                    return
                fwd.seen.append((self.command, self.path, dict(self.headers)))
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else None
                if answer is not None and (got := answer(self.command, self.path, self.headers)) is not None:
                    return self._reply(*got)
                if not (self.path == prefix or self.path.startswith((prefix + "/", prefix + "?"))):
                    return self._reply(404, {}, b"not under " + prefix.encode())
                conn = http.client.HTTPConnection(upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, "/v2" + self.path[len(prefix):], body=data, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                conn.close()
                if mangle is not None:
                    body = mangle(self.path, body)
                skip = ("transfer-encoding", "connection") + (() if self.command == "HEAD" else ("content-length",))
                self._reply(resp.status, {k: v for k, v in resp.getheaders() if k.lower() not in skip}, body)

            do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = _forward

            def log_message(self, *a):
                pass

        self._srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()
        self.host = "127.0.0.1:%d" % self._srv.server_address[1]

    def paths(self, method: str = "GET") -> list[str]:
        """The paths of the ``method`` requests it got, oldest first."""
        return [p for m, p, _ in self.seen if m == method]

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()
