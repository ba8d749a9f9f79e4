"""The HTTP endpoint every daemon exposes: ``/metrics`` (Prometheus), ``/healthz`` and ``/readyz``.

``/healthz`` answers 200 while the daemon's :class:`~accelnode.health.Health` finds every essential
thread alive and beating and every check passing, else 503 naming what is dead or stuck (a daemon
without a Health answers 200). ``/readyz`` answers 200 only while it is alive and its ``ready()``
callable returns True (for example: the device plugin is registered with kubelet and serving),
else 503 with the reason.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client.registry import CollectorRegistry  # not the package: accelnode/metricstext.py says why

from . import metricstext
from .health import Health
from .log import kv

log = logging.getLogger("accelnode.http")

# ready() returns (is_ready, reason)
ReadyFn = Callable[[], "tuple[bool, str]"]


def parse_address(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``:PORT`` → (host, port). An empty host means 127.0.0.1, never all interfaces."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"metrics address {addr!r} is not HOST:PORT")
    return (host.strip("[]") or "127.0.0.1", int(port))


class MetricsServer:
    def __init__(self, address: str, registry: CollectorRegistry, ready: ReadyFn, health: Health | None = None):
        self.registry = registry
        self.health = health or Health()
        self.ready = ready
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server naming)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = metricstext.render(outer.registry), metricstext.CONTENT_TYPE, 200
                elif path == "/healthz":
                    ok, reason = outer.health.liveness()
                    body = (b"ok\n" if ok else f"not alive: {reason}\n".encode())
                    ctype, code = "text/plain", (200 if ok else 503)
                elif path == "/readyz":
                    ok, reason = outer.readiness()
                    body = (b"ok\n" if ok else f"not ready: {reason}\n".encode())
                    ctype, code = "text/plain", (200 if ok else 503)
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # silence per-request stderr lines
                pass

        self._httpd = ThreadingHTTPServer(parse_address(address), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)

    def readiness(self) -> tuple[bool, str]:
        ok, reason = self.health.liveness()
        return (ok, reason) if not ok else self.ready()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> "MetricsServer":
        self._thread.start()
        log.info("metrics endpoint listening", extra=kv(address=f"{self._httpd.server_address[0]}:{self.port}"))
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
