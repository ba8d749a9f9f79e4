"""A small Kubernetes API client for the node agent: JSON over HTTPS, and watches that survive.

The agent needs a handful of verbs on a few resources, so it speaks the REST API directly
with urllib3 (already loaded for registries) instead of the official client, whose generated
models cost about 20 MB of memory on every node.

* :class:`Client` - ``request()`` for GET/POST/PUT/PATCH, raising :class:`KubeError` (with the
  Status ``code``/``reason``/``message`` of the answer) or :class:`Unreachable`.
* :class:`Reflector` - a local copy of one collection (or one named object): list, then watch
  from the list's resourceVersion; a dropped watch resumes from the last resourceVersion seen
  (bookmarks included); ``410 Gone`` re-lists; any other failure retries with capped
  exponential backoff. It never raises out of :meth:`Reflector.run`.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote, urlencode

import urllib3
import yaml

from accelnode.log import kv

log = logging.getLogger("accelnode.agent.kube")
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(Exception):
    """The API server answered with an error Status."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message = code, reason, message


class Unreachable(Exception):
    """No answer from the API server (connection refused, reset, timed out)."""


@dataclass(frozen=True)
class Config:
    server: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token_file: str | None = None

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike) -> "Config":
        """The current context of a kubeconfig file (file paths or inline ``*-data``)."""
        doc = yaml.safe_load(Path(path).read_text()) or {}
        base = Path(path).resolve().parent

        def named(kind: str, name: str) -> dict:
            for entry in doc.get(kind + "s") or []:
                if entry.get("name") == name:
                    return entry.get(kind) or {}
            raise ValueError(f"{path}: no {kind} named {name!r}")

        current = doc.get("current-context")
        if not current:
            raise ValueError(f"{path}: no current-context")
        ctx = named("context", current)
        cluster, user = named("cluster", ctx.get("cluster", "")), named("user", ctx.get("user", ""))
        if not cluster.get("server"):
            raise ValueError(f"{path}: cluster {ctx.get('cluster')!r} has no server")
        if user.get("token"):
            raise ValueError(f"{path}: inline user tokens are not supported; use tokenFile or a client certificate")

        def file(section: dict, key: str) -> str | None:
            if section.get(key + "-data"):
                return _private_file(base64.b64decode(section[key + "-data"]))
            return str(base / section[key]) if section.get(key) else None

        return cls(cluster["server"].rstrip("/"), file(cluster, "certificate-authority"),
                   file(user, "client-certificate"), file(user, "client-key"),
                   str(base / user["tokenFile"]) if user.get("tokenFile") else None)

    @classmethod
    def in_cluster(cls) -> "Config":
        """The pod's service account, as kubelet mounts it."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ValueError("not in a pod: KUBERNETES_SERVICE_HOST/PORT are not set (give --kubeconfig)")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", str(SA_DIR / "ca.crt"), token_file=str(SA_DIR / "token"))


def _private_file(data: bytes) -> str:
    fd, path = tempfile.mkstemp(prefix="accelnode-kube-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


class Client:
    def __init__(self, config: Config, *, timeout: float = 30.0):
        self.config = config
        self.timeout = timeout
        ctx = ssl.create_default_context(cafile=config.ca_file)
        if config.cert_file:
            ctx.load_cert_chain(config.cert_file, config.key_file)
        self._http = urllib3.PoolManager(num_pools=2, maxsize=8, ssl_context=ctx, retries=False)

    def _headers(self, content_type: str | None) -> dict:
        h = {"Accept": "application/json", "User-Agent": "accelnode-agent"}
        if content_type:
            h["Content-Type"] = content_type
        if self.config.token_file:  # re-read: kubelet rotates projected tokens
            h["Authorization"] = "Bearer " + Path(self.config.token_file).read_text().strip()
        return h

    def _open(self, method: str, path: str, query: dict | None, body, content_type: str | None,
              timeout, stream: bool) -> urllib3.BaseHTTPResponse:
        url = self.config.server + path + ("?" + urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        try:
            resp = self._http.request(method, url, body=data, headers=self._headers(content_type), timeout=timeout,
                                      preload_content=not stream)
        except urllib3.exceptions.HTTPError as e:
            raise Unreachable(f"{method} {path}: {e}") from None
        if resp.status >= 400:
            raise _status_error(resp.status, resp.read() if stream else resp.data)
        return resp

    def request(self, method: str, path: str, *, query: dict | None = None, body=None,
                content_type: str = "application/json") -> dict:
        resp = self._open(method, path, query, body, content_type if body is not None else None,
                          self.timeout, stream=False)
        return json.loads(resp.data)

    def watch(self, path: str, query: dict, timeout_seconds: int, on_open=None):
        """Watch events (dicts) until the server ends the watch; ERROR events raise KubeError.
        ``on_open(response)`` gets the open response (``response.shutdown()`` ends the watch)."""
        query = dict(query, watch="1", allowWatchBookmarks="true", timeoutSeconds=str(timeout_seconds))
        resp = self._open("GET", path, query, None, None,
                          urllib3.Timeout(connect=self.timeout, read=timeout_seconds + 30), stream=True)
        if on_open is not None:
            on_open(resp)
        buf = b""
        try:
            for chunk in resp.stream(64 * 1024, decode_content=True):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        obj = event.get("object") or {}
                        raise KubeError(obj.get("code", 500), obj.get("reason", ""), obj.get("message", ""))
                    yield event
        except urllib3.exceptions.HTTPError as e:
            raise Unreachable(f"watch {path}: {e}") from None
        finally:
            resp.release_conn()


def _status_error(code: int, body: bytes) -> KubeError:
    try:
        st = json.loads(body)
        return KubeError(code, st.get("reason", ""), st.get("message", ""))
    except ValueError:
        return KubeError(code, "", body[:300].decode(errors="replace"))


def custom_path(group: str, version: str, plural: str, namespace: str | None = None, name: str | None = None,
                sub: str | None = None) -> str:
    """The REST path of a custom resource collection or object (any namespace when None)."""
    parts = ["/apis", group, version] + (["namespaces", namespace] if namespace else []) + [plural]
    parts += [name] if name else []
    parts += [sub] if sub else []
    return "/".join(quote(p, safe="") if i else p for i, p in enumerate(parts))


class Reflector:
    """A local copy of the objects at ``path`` (``query`` may hold field/label selectors),
    kept current by watching; ``on_change()`` runs after every change.

    With ``name`` set, the reflector follows that one object: GET instead of list (for
    identities that may get and watch but not list), watch with ``metadata.name=<name>``.
    ``keep(obj)`` trims an object before it is stored (memory: keep what you read).
    """

    def __init__(self, client: Client, path: str, *, on_change: Callable[[], None], query: dict | None = None,
                 name: str | None = None, keep: Callable[[dict], dict] = lambda o: o,
                 watch_seconds: int = 300, max_backoff: float = 30.0):
        self.client, self.path, self.name = client, path, name
        self.query = dict(query or {})
        if name:
            self.query["fieldSelector"] = f"metadata.name={name}"
        self.on_change, self.keep = on_change, keep
        self.watch_seconds, self.max_backoff = watch_seconds, max_backoff
        self.items: dict[str, dict] = {}
        self.synced = threading.Event()
        self.resource_version: str | None = None
        self.relists = 0  # lists done (the first one included)
        self._resp = None

    def snapshot(self) -> list[dict]:
        return list(self.items.values())

    def interrupt(self) -> None:
        """End the watch in flight (after setting :meth:`run`'s ``stop``, so it returns promptly)."""
        resp = self._resp
        if resp is not None:
            try:
                resp.shutdown()
            except (RuntimeError, ValueError, OSError):  # the watch ended on its own meanwhile
                pass

    def run(self, stop: threading.Event) -> None:
        delay = 0.0
        while not stop.wait(delay):
            try:
                if self.resource_version is None:
                    self._list()
                self._watch(stop)
                delay = 0.0  # the server ended the watch normally: resume at once
            except KubeError as e:
                if e.code == 410:  # our resourceVersion was compacted away: start over
                    log.info("watch expired, re-listing", extra=kv(path=self.path, message=e.message))
                    self.resource_version, delay = None, 0.0
                    continue
                delay = self._backoff(delay, e)
            except (Unreachable, ValueError, OSError) as e:
                if stop.is_set():
                    return
                delay = self._backoff(delay, e)

    def _backoff(self, delay: float, err: Exception) -> float:
        delay = min(self.max_backoff, max(0.5, delay * 2))
        log.warning("watch failed, retrying", extra=kv(path=self.path, error=str(err), retry_in=delay))
        return delay

    def _key(self, obj: dict) -> str:
        md = obj.get("metadata") or {}
        return f"{md.get('namespace', '')}/{md.get('name', '')}"

    def _list(self) -> None:
        if self.name:  # a missing object is an error like any other: retried with backoff
            obj = self.client.request("GET", f"{self.path}/{quote(self.name, safe='')}")
            items, rv = [obj], obj["metadata"]["resourceVersion"]
        else:
            doc = self.client.request("GET", self.path, query=self.query)
            items, rv = doc.get("items") or [], doc["metadata"]["resourceVersion"]
        self.items = {self._key(o): self.keep(o) for o in items}
        self.resource_version = rv
        self.relists += 1
        self.synced.set()
        self.on_change()

    def _watch(self, stop: threading.Event) -> None:
        query = dict(self.query, resourceVersion=self.resource_version)
        try:
            self._follow(self.client.watch(self.path, query, self.watch_seconds,
                                           on_open=lambda r: setattr(self, "_resp", r)), stop)
        finally:
            self._resp = None

    def _follow(self, events, stop: threading.Event) -> None:
        for event in events:
            obj = event.get("object") or {}
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            kind = event.get("type")
            if kind in ("ADDED", "MODIFIED"):
                self.items[self._key(obj)] = self.keep(obj)
            elif kind == "DELETED":
                self.items.pop(self._key(obj), None)
            if rv:
                self.resource_version = rv
            if kind != "BOOKMARK":
                self.on_change()
            if stop.is_set():
                return
