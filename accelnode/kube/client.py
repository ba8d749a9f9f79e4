"""A small Kubernetes API client: JSON over HTTPS (docs/controller.md, "Kubernetes client").

Written against urllib3 instead of the official client, whose generated models cost about 20 MB
of memory on every node. Invariants: https only, the server certificate always verified; a user
whose credentials we cannot send (``exec``, ``auth-provider``, basic auth) is refused, not sent
out anonymous; tokens and keys stay out of errors, logs and ``repr`` (a client key touches disk
only in a private file while ``ssl`` loads it); a token file is re-read every minute and after
a 401. :class:`Client` raises :class:`KubeError` (``is_not_found(e)`` and friends say what it
means) or :class:`Unreachable`; ``list()`` pages (``limit``/``continue``, 500 a page) and a
``429`` with ``Retry-After`` is waited out a bounded number of times, as client-go does; watches
are :class:`accelnode.kube.reflector.Reflector`. Every answer is decoded under a budget
(:mod:`accelnode.decode`: KUBE_OBJECT for an object or a watch event, KUBE_LIST_PAGE for a list
page, which is asked again with fewer items while it is over), so that what an answer can make
the process hold is bounded whatever the objects in the cluster weigh.
"""

from __future__ import annotations

import base64
import http
import itertools
import json
import logging
import os
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import quote, urlencode

import urllib3

from accelnode.decode import KUBE_LIST_PAGE, KUBE_OBJECT, SMALL, Budget, DocumentError, decode
from accelnode.log import kv

log = logging.getLogger("accelnode.kube")
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


# An answer of the object's metadata alone (the API server's PartialObjectMetadata), for any verb
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
WATCH_READ_SLACK = 30  # seconds a watch may stay silent past its server-side timeout before it is dropped

class KubeError(Exception):
    """The API server answered with an error Status."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message = code, reason, message


# What an API server error means, by its HTTP status, as client-go's apierrors.IsNotFound and
# friends; each is false for anything that is not a KubeError.
def is_unauthorized(e: BaseException) -> bool:
    return isinstance(e, KubeError) and e.code == 401


def is_forbidden(e: BaseException) -> bool:
    return isinstance(e, KubeError) and e.code == 403


def is_not_found(e: BaseException) -> bool:
    return isinstance(e, KubeError) and e.code == 404


def is_conflict(e: BaseException) -> bool:
    return isinstance(e, KubeError) and e.code == 409


def is_gone(e: BaseException) -> bool:
    """410: a resourceVersion or continue token older than what the server still keeps."""
    return isinstance(e, KubeError) and e.code == 410


def is_precondition_failed(e: BaseException) -> bool:
    return isinstance(e, KubeError) and e.code == 412


def is_invalid(e: BaseException) -> bool:
    return isinstance(e, KubeError) and e.code == 422


def is_too_many_requests(e: BaseException) -> bool:
    return isinstance(e, KubeError) and e.code == 429


class NoConfig(ValueError):
    """No kubeconfig and not in a pod: nowhere to find an API server (:meth:`Config.load`)."""


class Unreachable(Exception):
    """No answer from the API server (connection refused, reset, timed out)."""


@dataclass(frozen=True)
class Config:
    """Where the API server is and who we are. Inline secrets (``*_data``, ``token``) stay in
    memory and out of ``repr``; TLS is always verified (no insecure-skip-tls-verify)."""

    server: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token_file: str | None = None
    ca_data: bytes | None = field(default=None, repr=False)
    cert_data: bytes | None = field(default=None, repr=False)
    key_data: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if not self.server.startswith("https://"):
            raise ValueError(f"API server {self.server!r}: only https:// is supported (credentials would travel "
                             "in clear text)")

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike) -> "Config":
        """The current context of a kubeconfig file (file paths or inline ``*-data``)."""
        return cls._from_files([Path(path)])

    @classmethod
    def load(cls, kubeconfig: str | os.PathLike | None = None, environ=os.environ) -> "Config":
        """The API server as kubectl finds it: ``kubeconfig`` (a flag) when given; else the files of
        ``$KUBECONFIG`` (``:``-separated, merged: the first file to name a cluster, user or
        context, or to set current-context, wins; missing files are skipped); else
        ``~/.kube/config``; and when none of these exists, the pod's service account (when its token is
        mounted). Raises :class:`NoConfig` when there is none of these."""
        if kubeconfig:
            return cls.from_kubeconfig(kubeconfig)
        if environ.get("KUBECONFIG"):
            paths = [Path(p) for p in environ["KUBECONFIG"].split(os.pathsep) if p]
        else:
            paths = [Path(environ.get("HOME") or Path.home()) / ".kube" / "config"]
        found = [p for p in paths if p.is_file()]
        if found:
            return cls._from_files(found)
        if environ.get("KUBERNETES_SERVICE_HOST") and (SA_DIR / "token").is_file():  # as client-go: both
            return cls.in_cluster(environ)
        raise NoConfig(f"no kubeconfig ({', '.join(map(str, paths))} not found; give --kubeconfig or set KUBECONFIG) "
                       f"and not in a pod with a service account token ({SA_DIR / 'token'})")

    @classmethod
    def _from_files(cls, paths: list[Path]) -> "Config":
        import yaml  # only here: an agent in its pod (in_cluster) never loads it

        named_entries: dict[tuple[str, str], tuple[dict, Path]] = {}  # (kind, name) -> (entry, its file's dir)
        current = None
        for path in paths:
            doc = yaml.safe_load(path.read_text()) or {}
            if not isinstance(doc, dict):
                raise ValueError(f"{path}: not a kubeconfig")
            current = current or doc.get("current-context")
            for kind in ("cluster", "user", "context"):
                for entry in doc.get(kind + "s") or []:
                    named_entries.setdefault((kind, entry.get("name")), (entry.get(kind) or {}, path.resolve().parent))
        where = str(paths[0]) if len(paths) == 1 else "KUBECONFIG " + os.pathsep.join(map(str, paths))

        def named(kind: str, name: str) -> tuple[dict, Path]:
            if (kind, name) not in named_entries:
                raise ValueError(f"{where}: no {kind} named {name!r}")
            return named_entries[(kind, name)]

        if not current:
            raise ValueError(f"{where}: no current-context")
        ctx, _ = named("context", current)
        (cluster, cbase), (user, ubase) = named("cluster", ctx.get("cluster", "")), named("user", ctx.get("user", ""))
        if not cluster.get("server"):
            raise ValueError(f"{where}: cluster {ctx.get('cluster')!r} has no server")
        if cluster.get("insecure-skip-tls-verify"):
            raise ValueError(f"{where}: cluster {ctx.get('cluster')!r} sets insecure-skip-tls-verify; accelnode always "
                             "verifies the API server (give certificate-authority)")

        plugin = next((k for k in ("exec", "auth-provider") if user.get(k)), None)
        if plugin:
            raise ValueError(f"{where}: user {ctx.get('user')!r} authenticates with {plugin!r}, which this client "
                             "does not run (requests would go out anonymous); give a token, tokenFile or client "
                             "certificate instead")
        if user.get("username") or user.get("password"):
            raise ValueError(f"{where}: user {ctx.get('user')!r} uses basic auth (username/password), which this "
                             "client does not support; give a token, tokenFile or client certificate instead")

        def file(section: dict, base: Path, key: str) -> str | None:
            return str(base / section[key]) if section.get(key) else None

        def data(section: dict, key: str) -> bytes | None:
            return base64.b64decode(section[key + "-data"]) if section.get(key + "-data") else None

        return cls(cluster["server"].rstrip("/"), file(cluster, cbase, "certificate-authority"),
                   file(user, ubase, "client-certificate"), file(user, ubase, "client-key"),
                   file(user, ubase, "tokenFile"), data(cluster, "certificate-authority"),
                   data(user, "client-certificate"), data(user, "client-key"), user.get("token") or None)

    @classmethod
    def in_cluster(cls, environ=os.environ) -> "Config":
        """The pod's service account, as kubelet mounts it."""
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ValueError("not in a pod: KUBERNETES_SERVICE_HOST/PORT are not set (give --kubeconfig)")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", str(SA_DIR / "ca.crt"), token_file=str(SA_DIR / "token"))


def _ssl_context(config: Config) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=config.ca_file,
                                     cadata=config.ca_data.decode() if config.ca_data else None)
    if config.cert_data or config.key_data:
        # the ssl module loads keys from files only: a private file that lives just long enough
        with tempfile.TemporaryDirectory(prefix="accelnode-kube-") as d:
            cert, key = Path(d) / "cert", Path(d) / "key"
            for path, inline, named in ((cert, config.cert_data, config.cert_file),
                                        (key, config.key_data, config.key_file)):
                if not (inline or named):
                    raise ValueError("a client certificate needs both a certificate and a key")
                path.write_bytes(inline if inline else Path(named).read_bytes())
            ctx.load_cert_chain(cert, key)
    elif config.cert_file:
        ctx.load_cert_chain(config.cert_file, config.key_file)
    return ctx


class Client:
    TOKEN_TTL = 60.0  # re-read a token file this often (kubelet rotates projected tokens)
    PAGE_SIZE = 500  # items per list page (client-go's pager default)
    THROTTLE_RETRIES = 10  # 429s with Retry-After waited out per call (client-go's rest client: 10)
    RETRY_AFTER_CAP = 10.0  # seconds: the longest one Retry-After is waited

    def __init__(self, config: Config, *, timeout: float = 30.0, user_agent: str = "accelnode-agent",
                 max_connections: int = 8, page_size: int = PAGE_SIZE, throttle_retries: int = THROTTLE_RETRIES,
                 retry_after_cap: float = RETRY_AFTER_CAP, sleep: Callable[[float], None] = time.sleep):
        """``max_connections``: kept open at once; each long-lived watch holds one. ``page_size``:
        items per page of :meth:`list`. ``throttle_retries``/``retry_after_cap``: how often and
        how long (each time, seconds) a ``429`` with ``Retry-After`` is waited out before the call
        fails; ``sleep`` does the waiting."""
        _positive_int("page_size", page_size)
        if isinstance(throttle_retries, bool) or not isinstance(throttle_retries, int) or throttle_retries < 0:
            raise ValueError(f"throttle_retries must be an integer >= 0, not {throttle_retries!r}")
        if isinstance(retry_after_cap, bool) or not isinstance(retry_after_cap, (int, float)) or \
                not retry_after_cap >= 0:
            raise ValueError(f"retry_after_cap must be a number of seconds >= 0, not {retry_after_cap!r}")
        self.config = config
        self.timeout = timeout
        self.user_agent = user_agent
        self.page_size, self.throttle_retries, self.retry_after_cap = page_size, throttle_retries, retry_after_cap
        self._sleep = sleep
        self._http = urllib3.PoolManager(num_pools=2, maxsize=max_connections, ssl_context=_ssl_context(config),
                                         retries=False)
        self._token: tuple[str, float] | None = None  # (token, monotonic time read)
        self._count = threading.Lock()
        self.sent = 0  # HTTP requests sent (retries and list pages each count)
        self.throttled = 0  # 429s waited out

    def _bearer(self) -> str | None:
        if not self.config.token_file:
            return self.config.token
        cached = self._token
        if cached is None or time.monotonic() - cached[1] > self.TOKEN_TTL:
            cached = self._token = (Path(self.config.token_file).read_text().strip(), time.monotonic())
        return cached[0]

    def _headers(self, has_body: bool, method: str = "GET", metadata_only: bool = False) -> dict:
        h = {"Accept": METADATA_ONLY if metadata_only else "application/json", "User-Agent": self.user_agent}
        if has_body:  # a PATCH body is a JSON merge patch (RFC 7386)
            h["Content-Type"] = "application/merge-patch+json" if method == "PATCH" else "application/json"
        token = self._bearer()
        if token:
            h["Authorization"] = "Bearer " + token
        return h

    def _open(self, method: str, path: str, query: dict | None, body, timeout,
              stream: bool, deadline: float | None = None, metadata_only: bool = False) -> urllib3.BaseHTTPResponse:
        url = self.config.server + path + ("?" + urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        for retry in itertools.count():
            with self._count:
                self.sent += 1
            try:  # the body is read by the caller, within its budget (never preloaded whole)
                resp = self._http.request(method, url, body=data, headers=self._headers(body is not None, method, metadata_only),
                                          timeout=timeout, preload_content=False)
            except urllib3.exceptions.HTTPError as e:
                raise Unreachable(f"{method} {path}: {e}") from None
            if resp.status < 400:
                return resp
            if resp.status == 401:
                self._token = None  # a rotated token: read the file again next time
            try:
                err = _status_error(resp.status, _read(resp, SMALL.max_bytes, f"{method} {path}"))
            except urllib3.exceptions.HTTPError as e:
                raise Unreachable(f"{method} {path}: {e}") from None
            if resp.status != 429:
                raise err
            wait = _retry_after(resp.headers.get("Retry-After"))
            if wait is None:
                raise KubeError(429, err.reason, f"{err.message} ({method} {path}: no Retry-After, not retried)")
            if retry >= self.throttle_retries:
                raise KubeError(429, err.reason, f"{err.message} ({method} {path}: still throttled after "
                                                 f"{retry} retries)")
            wait = min(wait, self.retry_after_cap)
            if deadline is not None and time.monotonic() + wait > deadline:
                raise KubeError(429, err.reason, f"{err.message} ({method} {path}: Retry-After {wait:g}s is past "
                                                 f"the call's timeout)")
            log.info("throttled by the API server, retrying", extra=kv(method=method, path=path, retry_in=wait,
                                                                       retry=retry + 1))
            with self._count:
                self.throttled += 1
            self._sleep(wait)
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, *, query: dict | None = None, body=None,
                timeout: float | None = None, budget: Budget = KUBE_OBJECT, metadata_only: bool = False) -> dict:
        """One call with an optional JSON body; the answer's JSON object, decoded under ``budget``
        (:class:`accelnode.decode.DocumentError`, a ValueError, past it). ``timeout`` (seconds)
        bounds this call instead of the client's default, Retry-After waits included.
        ``metadata_only``: the answer is the object's metadata alone (a ``PartialObjectMetadata``,
        whatever the rest weighs), for a write whose caller keeps only what it reads."""
        deadline = None if timeout is None else time.monotonic() + timeout
        resp = self._open(method, path, query, body, self.timeout if timeout is None else timeout,
                          stream=False, deadline=deadline, metadata_only=metadata_only)
        what = f"the answer to {method} {path}"
        try:
            data = _read(resp, budget.max_bytes, what)
        except urllib3.exceptions.HTTPError as e:
            raise Unreachable(f"{method} {path}: {e}") from None
        try:
            return decode(data, budget, what)
        except DocumentError as e:
            # how many objects the answer holds (at least those read): one resourceVersion each,
            # and the list's own; what a list asks for next (_page)
            e.objects = max(1, data.count(b'"resourceVersion":') - 1)
            raise

    def list(self, path: str, *, query: dict | None = None, page_size: int | None = None,
             timeout: float | None = None, each: Callable[[dict], object] | None = None) -> dict:
        """The whole collection at ``path`` as one list (``items``, ``metadata.resourceVersion``),
        fetched ``page_size`` items at a time (``limit``/``continue``; default the client's
        ``page_size``). The pages are one consistent snapshot: every continue reads at the first
        page's resourceVersion. A continue token the server no longer honours (410, compacted
        away) restarts the list in a single unpaginated request, as client-go's pager does.
        ``timeout`` bounds each request. ``each(item)`` is what ``items`` holds of each item, made
        as its page arrives (a reflector's trim: the whole objects of one page at most are held)."""
        query = dict(query or {})
        for key in ("limit", "continue", "watch"):
            if key in query:
                raise ValueError(f"list({path!r}): {key!r} is not a query parameter of list() (page_size "
                                 f"sets the page size; continue tokens are its own)")
        limit = self.page_size if page_size is None else _positive_int("page_size", page_size)
        first, limit = self._page(path, query, limit, None, timeout)
        doc, each = first, each or (lambda item: item)
        items = [each(o) for o in first.get("items") or []]
        first["items"] = None  # the page's objects as they came are not kept
        while (token := (doc.get("metadata") or {}).get("continue")):
            try:
                doc, limit = self._page(path, query, limit, token, timeout)
            except KubeError as e:
                if not is_gone(e):
                    raise
                log.info("list continue token expired, listing again in one request",
                         extra=kv(path=path, message=e.message))
                whole = self.request("GET", path, query=query, timeout=timeout, budget=KUBE_LIST_PAGE)
                return {**whole, "items": [each(o) for o in whole.get("items") or []]}
            items.extend(each(o) for o in doc.get("items") or [])
            doc["items"] = None
        meta = {k: v for k, v in (first.get("metadata") or {}).items() if k not in ("continue", "remainingItemCount")}
        return {**first, "metadata": meta, "items": items}

    def _page(self, path: str, query: dict, limit: int, token: str | None,
              timeout: float | None) -> tuple[dict, int]:
        """(one page of a list, the page size it took): decoded under KUBE_LIST_PAGE, a page over
        it is asked again with fewer items (at most half, and what would fit were its objects
        alike), down to one (held to KUBE_OBJECT, which any object fits), so that memory holds one
        page of bounded size whatever the objects weigh. The pages after it are asked with that
        size."""
        while True:
            try:
                return self.request("GET", path, query={**query, "limit": str(limit)} | (
                    {"continue": token} if token else {}), timeout=timeout,
                    budget=KUBE_LIST_PAGE if limit > 1 else KUBE_OBJECT), limit
            except DocumentError as e:
                if not e.over_budget or limit == 1:
                    raise
                limit = max(1, min(limit // 2, int(getattr(e, "objects", limit) / max(e.over, 1.0))))
                log.info("list page over its budget, asking for fewer items", extra=kv(path=path, limit=limit,
                                                                                       problem=e.problem))

    def watch(self, path: str, query: dict, timeout_seconds: int, on_open=None):
        """Watch events (dicts) until the server ends the watch; ERROR events raise KubeError.
        ``on_open(response)`` gets the open response (``response.shutdown()`` ends the watch)."""
        query = dict(query, watch="1", allowWatchBookmarks="true", timeoutSeconds=str(timeout_seconds))
        timeout = urllib3.Timeout(connect=self.timeout, read=timeout_seconds + WATCH_READ_SLACK)
        resp = self._open("GET", path, query, None, timeout, stream=True)
        if on_open is not None:
            on_open(resp)
        buf = b""
        what = f"a watch event of {path}"
        try:
            for chunk in resp.stream(64 * 1024, decode_content=True):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > KUBE_OBJECT.max_bytes:  # a line (one event) that never ends
                    raise DocumentError(what, f"is over the {KUBE_OBJECT.max_bytes // 2**20} MiB budget "
                                              "without its end of line", over_budget=True)
                for line in lines:
                    if not line.strip():
                        continue
                    event = decode(line, KUBE_OBJECT, what)
                    if event.get("type") == "ERROR":
                        obj = event.get("object") or {}
                        raise KubeError(obj.get("code", 500), obj.get("reason", ""), obj.get("message", ""))
                    yield event
                    event = None  # not held while the next one is parsed
        except urllib3.exceptions.HTTPError as e:
            raise Unreachable(f"watch {path}: {e}") from None
        finally:
            resp.release_conn()


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
    return value


def _retry_after(value: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header as the API server writes it (whole seconds); None when
    absent or not a number of seconds."""
    try:
        seconds = int((value or "").strip())
    except ValueError:
        return None
    return float(seconds) if seconds >= 0 else None


def _read(resp: urllib3.BaseHTTPResponse, cap: int, what: str) -> bytes:
    """An answer's body, at most ``cap + 1`` bytes read (more is left unread and the connection
    closed: :func:`accelnode.decode.decode` refuses it by its size)."""
    data = resp.read(cap + 1, decode_content=True)
    if len(data) > cap:
        resp.close()
    else:
        resp.release_conn()
    return data


def _status_error(code: int, body: bytes) -> KubeError:
    try:
        st = decode(body, SMALL, "an error Status")
    except ValueError:
        st = None
    if isinstance(st, dict):
        return KubeError(code, st.get("reason", ""), st.get("message", ""))
    # not a Status (APF's 429 is plain text): the HTTP reason phrase
    return KubeError(code, _phrase(code), body[:300].decode(errors="replace").strip())


def _phrase(code: int) -> str:
    try:
        return http.HTTPStatus(code).phrase.replace(" ", "")
    except ValueError:
        return ""


def custom_path(group: str, version: str, plural: str, namespace: str | None = None, name: str | None = None,
                sub: str | None = None) -> str:
    """The REST path of a custom resource collection or object (any namespace when None)."""
    parts = ["/apis", group, version] + (["namespaces", namespace] if namespace else []) + [plural]
    parts += [name] if name else []
    parts += [sub] if sub else []
    return "/".join(quote(p, safe="") if i else p for i, p in enumerate(parts))
