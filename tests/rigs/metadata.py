"""A GCE metadata server emulator on loopback, with the real server's long-poll semantics.

No Google emulator is installable here, so this follows the protocol the real server speaks
(docs/bootstrap.md, "The metadata server"), as far as a VM's pollers see it:

* ``GET /computeMetadata/v1/<path>``; every request must carry ``Metadata-Flavor: Google``
  (else 403) and one with ``X-Forwarded-For`` is refused (403: the real server's guard against
  requests relayed by a proxy); every response carries ``Metadata-Flavor: Google`` and an
  ``ETag`` (a digest of the answer's content: equal content, equal ETag).
* the tree: ``instance/{id,name,hostname,zone,attributes/<key>}``,
  ``project/{project-id,numeric-project-id,attributes/<key>}``; a leaf is text, a missing one
  404; a directory (trailing ``/``) lists its entries one a line, sub-directories with a ``/``;
  ``?recursive=true`` gives the whole directory as JSON (``alt=text``: ``key value`` lines
  instead; ``alt=json`` on a leaf: a JSON string); a directory without its ``/`` answers 301.
* ``?wait_for_change=true``: the answer waits until the content differs from ``last_etag``
  (at once when it already does) or, without ``last_etag``, until the next change; at most
  ``timeout_sec`` seconds, after which the unchanged content and ETag come back (200). A leaf
  that does not exist is 404 at once, not a wait: to wait for a key to appear a client watches
  its directory.

Tests change attributes with :meth:`MetadataServer.set_attributes`,
:meth:`MetadataServer.replace_attributes` (what Compute's ``instances.setMetadata`` does) and
:meth:`MetadataServer.remove_attributes` (one change, one new ETag, waiters woken at once), and
count requests in :attr:`MetadataServer.requests`. ``GCE_METADATA_HOST`` for a client is
:attr:`MetadataServer.host`. ``python -m tests.rigs.metadata`` runs one in the foreground.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

PREFIX = "/computeMetadata/v1/"
MAX_TIMEOUT_SEC = 3600  # a long poll without timeout_sec ends after this long anyway


class _Handler(BaseHTTPRequestHandler):
    server_version = "Metadata Server for VM"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no delayed-ACK stall
    server: "_HTTPServer"

    def log_message(self, *args) -> None:  # tests read MetadataServer.requests instead
        pass

    def _send(self, code: int, body: str, *, content_type: str = "application/text", etag: str | None = None,
              location: str | None = None) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if etag:
            self.send_header("ETag", etag)
        if location:
            self.send_header("Location", location)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.owner._handle(self)

    def _refuse_method(self) -> None:
        self._send(405, "Method not allowed\n")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_method


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: "MetadataServer"


class MetadataServer:
    """One VM's metadata server. ``start()`` listens on 127.0.0.1 (port 0: a free one)."""

    def __init__(self, *, instance_id: int = 4520031799277581759, name: str = "vm-0", zone: str = "us-central2-b",
                 project: str = "accelnode-test", project_number: int = 123456789012,
                 attributes: dict[str, str] | None = None, project_attributes: dict[str, str] | None = None,
                 port: int = 0):
        self._cond = threading.Condition()
        self._closed = False
        self.instance = {"id": instance_id, "name": name, "hostname": f"{name}.{zone}.c.{project}.internal",
                         "zone": f"projects/{project_number}/zones/{zone}", "attributes": dict(attributes or {})}
        self.project = {"project-id": project, "numeric-project-id": project_number,
                        "attributes": dict(project_attributes or {})}
        self.requests: list[tuple[str, int]] = []  # (path with query, status) of every answered request
        self.waiting = 0  # long polls parked right now
        self._port = port
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "MetadataServer":
        self._httpd = _HTTPServer(("127.0.0.1", self._port), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metadata-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "MetadataServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def host(self) -> str:
        """``host:port``: what ``GCE_METADATA_HOST`` names."""
        assert self._httpd is not None, "start() first"
        return f"127.0.0.1:{self._httpd.server_address[1]}"

    # -- what tests change ---------------------------------------------------------------------

    def set_attributes(self, items: dict[str, str], *, project: bool = False) -> None:
        """Set instance (or project) attributes in one change, waking every waiter."""
        self._check(items)
        with self._cond:
            (self.project if project else self.instance)["attributes"].update(items)
            self._cond.notify_all()

    def replace_attributes(self, items: dict[str, str], *, project: bool = False) -> None:
        """Make the attributes exactly ``items`` in one change, as Compute's
        ``instances.setMetadata`` (the whole item list) does."""
        self._check(items)
        with self._cond:
            (self.project if project else self.instance)["attributes"] = dict(items)
            self._cond.notify_all()

    def remove_attributes(self, *keys: str, project: bool = False) -> None:
        with self._cond:
            attrs = (self.project if project else self.instance)["attributes"]
            for k in keys:
                attrs.pop(k, None)
            self._cond.notify_all()

    @staticmethod
    def _check(items: dict[str, str]) -> None:
        for k, v in items.items():
            if not isinstance(k, str) or not k or "/" in k or not isinstance(v, str):
                raise ValueError(f"bad attribute {k!r}: keys are non-empty names without '/', values strings")

    def wait_for_waiters(self, n: int = 1, timeout: float = 30.0) -> None:
        """Return once at least ``n`` long polls are parked (AssertionError after ``timeout``)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.waiting >= n, timeout):
                raise AssertionError(f"{self.waiting} long polls parked after {timeout:g}s, wanted {n}")

    def attributes(self, *, project: bool = False) -> dict[str, str]:
        with self._cond:
            return dict((self.project if project else self.instance)["attributes"])

    # -- the protocol --------------------------------------------------------------------------

    def _lookup(self, parts: list[str]):
        node = {"instance": self.instance, "project": self.project}
        for p in parts:
            if not isinstance(node, dict) or p not in node:
                return None
            node = node[p]
        return node

    def _render(self, node, *, is_dir: bool, recursive: bool, alt: str | None, attrs: bool) -> tuple[str, str]:
        """(body, content type) of one answer."""
        if not is_dir:
            if alt == "json":
                return json.dumps(node if isinstance(node, (int, str)) else str(node)), "application/json"
            return str(node), "application/text"
        if recursive:
            if alt == "text":
                return "".join(f"{k} {v}\n" for k, v in _flatten(node, "")), "application/text"
            return json.dumps(node if attrs else _camel(node), separators=(",", ":")), "application/json"
        if alt == "json":
            return json.dumps([k + "/" if isinstance(v, dict) else k for k, v in node.items()]), "application/json"
        return "".join((k + "/" if isinstance(v, dict) else k) + "\n" for k, v in node.items()), "application/text"

    def _answer(self, parts: list[str], is_dir: bool, recursive: bool, alt: str | None):
        """(status, body, content type, etag) for the current content; call under the lock."""
        node = self._lookup(parts)
        if node is None or (is_dir and not isinstance(node, dict)):
            return 404, _not_found(), "text/html; charset=UTF-8", None
        if not is_dir and isinstance(node, dict):
            return 301, "", "application/text", None
        body, ctype = self._render(node, is_dir=is_dir, recursive=recursive, alt=alt,
                                   attrs=bool(parts) and parts[-1] == "attributes")
        return 200, body, ctype, hashlib.sha256(body.encode()).hexdigest()[:16]

    def _handle(self, h: _Handler) -> None:
        url = urlsplit(h.path)
        status = self._serve(h, url)
        with self._cond:
            self.requests.append((h.path, status))

    def _serve(self, h: _Handler, url) -> int:
        if h.headers.get("X-Forwarded-For") is not None:
            h._send(403, "Request had an X-Forwarded-For header and was rejected.\n")
            return 403
        if h.headers.get("Metadata-Flavor") != "Google":
            h._send(403, "Missing Metadata-Flavor:Google header.\n")
            return 403
        if not url.path.startswith(PREFIX):
            h._send(404, _not_found(), content_type="text/html; charset=UTF-8")
            return 404
        q = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        rest = url.path[len(PREFIX):]
        is_dir = rest.endswith("/") or rest == ""
        parts = [p for p in rest.split("/") if p]
        recursive = q.get("recursive", "").lower() == "true"
        alt = q.get("alt")
        if alt not in (None, "json", "text"):
            h._send(400, f"Invalid value for alt: {alt}\n")
            return 400
        wait = q.get("wait_for_change", "").lower() == "true"
        try:
            timeout = float(q["timeout_sec"]) if "timeout_sec" in q else MAX_TIMEOUT_SEC
            if timeout <= 0:
                raise ValueError
        except ValueError:
            h._send(400, "Invalid value for timeout_sec\n")
            return 400
        last = q.get("last_etag")
        with self._cond:
            status, body, ctype, etag = self._answer(parts, is_dir, recursive, alt)
            if wait and status == 200:
                start = etag if last is None else last
                deadline = time.monotonic() + min(timeout, MAX_TIMEOUT_SEC)
                self.waiting += 1
                self._cond.notify_all()
                try:
                    while etag == start and not self._closed:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                        status, body, ctype, etag = self._answer(parts, is_dir, recursive, alt)
                        if status != 200:
                            break
                finally:
                    self.waiting -= 1
        if status == 301:
            h._send(301, "", location=url.path + "/" + (f"?{url.query}" if url.query else ""))
        else:
            h._send(status, body, content_type=ctype, etag=etag)
        return status


def _camel(node):
    """The real server's JSON names directories' keys in camelCase (``projectId``) but keeps
    attribute keys as they are."""
    out = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out[k] = v if k == "attributes" else _camel(v)
        else:
            out[_to_camel(k)] = v
    return out


def _to_camel(k: str) -> str:
    head, *tail = k.split("-")
    return head + "".join(t[:1].upper() + t[1:] for t in tail)


def _flatten(node: dict, prefix: str):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _not_found() -> str:
    return "<!DOCTYPE html>\n<html><head><title>Error 404 (Not Found)</title></head><body>404. Not Found</body></html>\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.rigs.metadata",
                                description="Run a GCE metadata server emulator on 127.0.0.1 until Ctrl-C.")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    p.add_argument("--name", default="vm-0", help="instance/name")
    p.add_argument("--zone", default="us-central2-b", help="the zone in instance/zone")
    p.add_argument("--project", default="accelnode-test", help="project/project-id")
    p.add_argument("--attribute", action="append", default=[], metavar="KEY=VALUE", help="an instance attribute")
    args = p.parse_args(argv)
    attrs = {}
    for a in args.attribute:
        k, sep, v = a.partition("=")
        if not sep or not k:
            p.error(f"--attribute {a!r} is not KEY=VALUE")
        attrs[k] = v
    srv = MetadataServer(name=args.name, zone=args.zone, project=args.project, attributes=attrs, port=args.port)
    srv.start()
    print(f"metadata server emulator at http://{srv.host}/computeMetadata/v1/\n  export GCE_METADATA_HOST={srv.host}",
          flush=True)
    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
