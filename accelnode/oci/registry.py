"""OCI distribution client: the HTTP protocol with one registry, blob streaming included, on top
of oras-py's session and auth backends (docs/registries.md, docs/cache-format.md).

Invariants: every request goes through :meth:`Registry.request`, so one deadline bounds the
whole operation (oras-py's own path retries for minutes without timeouts), and every read
returns what one ``recv`` brought, so a dripping server cannot hold a pull past it; blobs are
checked for size and digest as they flow (:class:`BlobStream`); no credential-helper program is
ever run; the Authorization header never follows a redirect to another host; a token realm is
asked only over https, or over http at the very host:port contacted with ``--plain-http``
(:class:`_TokenAuth`), so credentials never cross a network in clear to a host the registry
names; which hosts a registry's requests go to (mirrors, then the server) is the hosts.toml's
(:mod:`accelnode.oci.hosts`), and a mirror gets none of the registry's credentials.
"""

from __future__ import annotations

import hashlib
import logging
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.cookiejar import DefaultCookiePolicy
from types import MappingProxyType

from ._textless import requests  # noqa: I001 - before oras, which imports requests too

import oras.auth
import oras.auth.utils
import requests.adapters
import urllib3

from accelnode.decode import TOKEN, decode
from accelnode.log import kv

from .credentials import docker_credentials
from .errors import AuthError, ImageNotFound, IntegrityError, RegistryUnavailable
from .hosts import DEFAULT_MIRROR_DIAL_TIMEOUT, Host, HostsConfig, HostsConfigError
from .mirrors import check_mirrors, registry_host
from .reference import Reference, check_digest

log = logging.getLogger("accelnode.oci.registry")

MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
MAX_MANIFEST_BYTES = 4 << 20
CHUNK = 1 << 20
_RETRY_STATUS = {429, 500, 502, 503, 504}
# One request is tried at most this many times in a row (backoff 0.2 s, doubling): a registry
# that refuses connections fails in about 3 s whatever the pull's total deadline, which only
# bounds how long a pull that is making progress may take.
MAX_ATTEMPTS = 5
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 30.0
MIRROR_READ_TIMEOUT = 5.0  # a mirror (not the last host asked) that stalls this long is passed over
# A host whose answer brings fewer than MIN_TRANSFER_BYTES per RATE_WINDOW seconds spent waiting
# on it is left: a mirror for the next host, the server with an error. A drip of a byte a second
# never trips a read timeout, and would otherwise hold a pull until its whole deadline (30 min).
MIN_TRANSFER_BYTES = 64 * 1024
RATE_WINDOW = 10.0
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_NET_ERRORS = (requests.RequestException, urllib3.exceptions.HTTPError, OSError)
_TOKEN = re.compile(r"[\x21-\x7e]{1,65536}")  # what may follow "Bearer " in a header



@dataclass(frozen=True)
class RegistryOptions:
    plain_http: bool = False  # talk HTTP instead of HTTPS (only when asked for)
    config_file: str | None = None  # Docker config JSON with credentials
    anonymous: bool = False  # send no credentials at all: neither config_file nor ~/.docker/config.json
    # (name, Docker config JSON) of a tenant's pull secrets: used instead of config_file and
    # ~/.docker/config.json (docs/security.md)
    pull_secrets: tuple[tuple[str, str], ...] = ()
    timeout: float = 1800.0  # total deadline of one pull or push, seconds
    # registry host as images name it (quay.io, registry.example.com:5000) -> HOST[:PORT] that
    # every request for its images goes to (--registry-mirror: the hosts.toml ``server`` for
    # that host); checked and normalised on creation (ValueError)
    mirrors: Mapping[str, str] = field(default_factory=dict, hash=False)
    # containerd's certs.d directory (hosts.toml files); None: no mirrors but ``mirrors``
    hosts_dir: str | None = None
    mirror_dial_timeout: float = DEFAULT_MIRROR_DIAL_TIMEOUT  # connect timeout of a mirror whose file sets none
    # made from the four fields above on creation; kept by dataclasses.replace() while they are
    # unchanged, so the mirrors found down stay known across the pulls of one process
    hosts: HostsConfig | None = field(default=None, hash=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "mirrors", MappingProxyType(check_mirrors(self.mirrors)))
        h = self.hosts
        if h is None or (h.directory, dict(h.mirrors), h.plain_http, h.mirror_dial_timeout) != (
                self.hosts_dir, dict(self.mirrors), self.plain_http, self.mirror_dial_timeout):
            object.__setattr__(self, "hosts", HostsConfig(self.hosts_dir, self.mirrors, self.plain_http,
                                                          self.mirror_dial_timeout))



class Deadline:
    """One monotonic deadline shared by every request of an operation."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def check(self, image: str, doing: str) -> float:
        left = self.remaining()
        if left <= 0:
            raise RegistryUnavailable(f"gave up {doing} after the {self.seconds:g}s deadline", image)
        return left


class _Session(requests.Session):
    """A session whose requests (including oras-py's token requests) never outlive the deadline,
    and whose redirects to another host, port or scheme carry neither our Authorization header
    (requests' own rule) nor the headers a hosts.toml configures for the host (``private_headers``)."""

    deadline: Deadline | None = None
    private_headers: set[str] = frozenset()

    def rebuild_auth(self, prepared_request, response):
        super().rebuild_auth(prepared_request, response)
        if self.private_headers and self.should_strip_auth(response.request.url, prepared_request.url):
            for name in self.private_headers:
                prepared_request.headers.pop(name, None)

    def request(self, method, url, **kw):
        if self.deadline is not None and kw.get("timeout") is None:
            kw["timeout"] = _timeouts(max(self.deadline.remaining(), 0.05))
        if self.verify is False:  # skip_verify: requests lets REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE in the
            kw.setdefault("verify", False)  # environment override the session's verify=False, not a request's
        return super().request(method, url, **kw)


def _timeouts(left: float, connect: float = None, read: float = READ_TIMEOUT) -> tuple[float, float]:
    """(connect, read) socket timeouts for a request with ``left`` seconds of deadline."""
    return (min(left, connect or CONNECT_TIMEOUT), min(left, read))


class _Backoff:
    """Pauses between failed attempts in a row: 0.2 s, doubling up to 5 s, at most MAX_ATTEMPTS
    attempts, and never a pause that would end past the deadline."""

    def __init__(self, deadline: Deadline, attempts: str = "attempts"):
        self.deadline = deadline
        self.attempts = attempts  # what the message calls them
        self.delay = 0.2
        self.failures = 0

    def give_up(self) -> str | None:
        """Count a failure; why to stop trying (for the error message), or None to pause and retry."""
        self.failures += 1
        if self.failures == MAX_ATTEMPTS:
            return f"gave up after {MAX_ATTEMPTS} {self.attempts}"
        if self.deadline.remaining() <= self.delay:
            return f"gave up within the {self.deadline.seconds:g}s deadline"
        return None

    def pause(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 5.0)


class _Client:
    """What we use of an oras-py client (``oras.provider.Registry``): its auth backend and the
    session the backend sends token requests with, made as that class makes them (the
    ``oras.auth`` backend for ``backend``, cookies refused) without importing ``oras.provider``,
    which loads jsonschema and the rest of oras-py for the agent's pulls (about 4 MB RSS)."""

    def __init__(self, auth, session: requests.Session):
        session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))  # as oras-py: some registries
        self.auth, self.session = auth, session  # take a cookie for a browser and ask for CSRF tokens


class _TokenAuth(oras.auth.TokenAuth):
    """oras-py's token backend, strict where it trusts what the registry says. The realm of a
    Bearer challenge must be https (any host, as Docker Hub's auth.docker.io), or http only at the
    very host:port contacted when the operator chose plain HTTP (``http_host``); anything else is
    refused before a byte goes there, credentials or not. The answer must be a JSON object within
    :data:`accelnode.decode.TOKEN` whose token is one header-safe word. Refusals are ValueError,
    which :meth:`Registry.request` reports as a failed token request."""

    def __init__(self, session: requests.Session, http_host: str | None):
        super().__init__()
        self.session, self._tls_verify = session, True
        self.prefix = "http" if http_host else "https"  # for a realm written without a scheme
        self.http_host = http_host

    def request_token(self, h):
        return self._fetch(h, getattr(self, "_basic_auth", None))

    def request_anonymous_token(self, h):
        return self._fetch(h, None)

    def _realm(self, h) -> str:
        if not isinstance(h.realm, str) or not h.realm:
            raise ValueError("the registry's Bearer challenge names no realm")
        realm = h.realm if "://" in h.realm else f"{self.prefix}://{h.realm}"
        try:
            url = urllib.parse.urlsplit(realm)
            where = _netloc(url)
        except ValueError:
            raise ValueError(f"token realm {h.realm!r} is not a URL") from None
        if url.scheme == "https" or (url.scheme == "http" and self.http_host is not None
                                     and where == _netloc(urllib.parse.urlsplit(f"http://{self.http_host}"))):
            return realm
        raise ValueError(f"token realm {h.realm!r} refused: a token is asked for only over https, or over "
                         "http at the registry's own host:port with --plain-http")

    def _fetch(self, h, basic: str | None) -> str | None:
        realm = self._realm(h)
        params = {k: v for k in ("service", "scope") if (v := getattr(h, k, None))}
        headers = {"Accept": "application/json"} | ({"Authorization": f"Basic {basic}"} if basic else {})
        with self.session.get(realm, headers=headers, params=params, stream=True) as resp:
            if resp.status_code != 200:
                log.debug("token request refused", extra=kv(realm=realm, status=resp.status_code))
                return None
            body, pace = bytearray(), _Pace()
            try:
                while len(body) <= TOKEN.max_bytes and (chunk := pace.read(resp.raw, 65536, decode=True)):
                    body += chunk
            except _TooSlow as e:
                raise ValueError(f"the token server is {e}") from None
        info = decode(body, TOKEN, "the token answer")  # DocumentError is a ValueError
        token = info.get("token") or info.get("access_token")
        if token is not None and not (isinstance(token, str) and _TOKEN.fullmatch(token)):
            raise ValueError("the token answer's token is not a header-safe string")
        return token


def _netloc(url: urllib.parse.SplitResult) -> tuple[str, int]:
    """(host, port) of an http(s) URL, the scheme's default port filled in; ValueError if none."""
    if not url.hostname:
        raise ValueError("no host")
    return url.hostname.lower(), url.port or {"http": 80, "https": 443}.get(url.scheme, 0)


class _TLSAdapter(requests.adapters.HTTPAdapter):
    """Connections to one host with the TLS settings its hosts.toml gives: extra CAs besides the
    system's, a client certificate, or no verification at all (``skip_verify``)."""

    def __init__(self, context: ssl.SSLContext):
        self._context = context
        super().__init__()

    def init_poolmanager(self, *args, **kw):
        kw["ssl_context"] = self._context
        return super().init_poolmanager(*args, **kw)


class Registry:
    """Requests for the images of one registry host with a deadline, auth and retries. They go
    to the hosts :meth:`HostsConfig.hosts` names (docs/registries.md#mirrors-hoststoml): each
    mirror able to do what is asked, in order, then the server; a mirror that cannot connect,
    errs, refuses or lacks the content is skipped after one attempt (a short dial timeout) and
    content whose digest does not match is asked of the next host (:meth:`verified`). The
    server gets the retries. Credentials are those kept under the name of the host contacted:
    a registry's never go to a mirror unless kept under the mirror's own name."""

    def __init__(self, host: str, options: RegistryOptions, deadline: Deadline | None = None, *,
                 only_server: bool = False):
        self.host = host  # as the image names it
        self.only_server = only_server  # ask the server alone, no mirror (proofs, a retry of hostile content)
        self.options = options
        self.deadline = deadline or Deadline(options.timeout)
        self._hosts: list[Host] | None = None
        self._clients: dict[Host, _Client] = {}
        self._refused: dict[Host, str] = {}  # mirrors whose API root refused us: not asked again
        self.served: dict[Host, int] = {}  # blob bytes read, by the host that sent them
        self._served_lock = threading.Lock()  # layers stream in parallel
        self._connect_lock = threading.Lock()  # ... and would each ping a host not yet connected
        self.manifest_hosts: set[Host] = set()  # the hosts that served a manifest in this operation

    def hosts(self, image: str | None = None) -> list[Host]:
        """The hosts of this registry, read once per Registry (one operation)."""
        if self._hosts is None:
            hosts = self.options.hosts.hosts(self.host, image)
            self._hosts = hosts[-1:] if self.only_server else hosts
        return self._hosts

    @property
    def last(self) -> Host:
        """The server: the host asked last (a --registry-mirror endpoint, or the registry)."""
        return self.hosts()[-1]

    @property
    def manifests_from_server(self) -> bool:
        """Whether every manifest of this operation came from the server: a mirror's answer
        proves nothing about who may have a digest (a pull-through cache serves anyone; Spegel
        serves a digest under any repository name)."""
        return self.manifest_hosts <= {self.last}

    def candidates(self, caps: tuple[str, ...], image: str, exclude=()) -> list[Host]:
        """The hosts that may do ``caps``, in order; a push goes to the first one only."""
        found = [h for h in self.hosts(image) if all(h.can(c) for c in caps) and h not in exclude]
        return found[:1] if "push" in caps else found

    def server(self, h: Host) -> str:
        """The server contacted, as messages name it."""
        return f"registry {self.host}" if h.is_registry else f"mirror {h.netloc} of {self.host}"

    @staticmethod
    def through(h: Host) -> str:
        """What an error message about a request adds: the mirror it went to, if any."""
        return "" if h.is_registry else f" (through mirror {h.netloc})"

    @staticmethod
    def _mirror_kv(h: Host | None) -> dict:
        """The ``mirror=`` a log line about a request adds when it went to a mirror."""
        return {"mirror": h.netloc} if h is not None and not h.is_registry else {}

    # -- connection and auth -------------------------------------------------------------

    def _client(self, h: Host, image: str, last: bool) -> _Client:
        """Ping the host's API root once and pick the oras-py auth backend its challenge asks for."""
        with self._connect_lock:
            if (client := self._clients.get(h)) is not None:
                return client
            try:
                client = self._connect(h, image, last)
            except AuthError as e:
                self._refused[h] = e.detail
                raise
            self._clients[h] = client
            return client

    def _connect(self, h: Host, image: str, last: bool) -> _Client:
        session = _Session()
        session.deadline = self.deadline
        session.private_headers = {name for name, _ in h.header}
        if h.scheme == "https" and (h.ca or h.client or h.skip_verify):
            session.mount(f"https://{h.netloc}/", _TLSAdapter(h.tls_context(image)))
            session.verify = not h.skip_verify
        resp = self._send(h, session, "GET", self._url(h, ""), image, "contacting the registry", self._headers(h),
                          last, stream=True)
        resp.close()  # only the status and the challenge matter: a body is never read
        challenge = resp.headers.get("Www-Authenticate", "")
        backend = "basic" if resp.status_code == 401 and challenge.lower().startswith("basic") else "token"
        auth = (oras.auth.get_auth_backend("basic", session, h.scheme == "http") if backend == "basic"
                else _TokenAuth(session, h.netloc if h.scheme == "http" else None))
        client = _Client(auth, session)
        key = self.host if h.is_registry else h.netloc
        creds = None if self.options.anonymous else docker_credentials(
            key, self.options.config_file, image, inline=self.options.pull_secrets)
        if creds is not None:
            client.auth.set_basic_auth(*creds)
        elif backend == "basic" and self.options.anonymous:
            raise AuthError(f"{self.server(h)} requires credentials and this pull is anonymous (sends none)", image)
        elif backend == "basic":
            raise AuthError(f"{self.server(h)} requires credentials and none were found under {key}"
                            + (f" in the pull secrets {', '.join(n for n, _ in self.options.pull_secrets)}"
                               if self.options.pull_secrets else f" in {self.options.config_file}"
                               if self.options.config_file else " (use --registry-config)"), image)
        return client

    def _url(self, h: Host, path: str) -> str:
        """``path`` under the host's API root; a mirror's requests name the registry (``ns=``)."""
        url = f"{h.scheme}://{h.netloc}{h.path}/{path}"
        if not h.is_registry:
            url += ("&" if "?" in path else "?") + urllib.parse.urlencode({"ns": h.registry})
        return url

    @staticmethod
    def _headers(h: Host) -> dict:
        out: dict[str, str] = {}
        for name, value in h.header:  # a name given several values: one comma-joined header
            out[name] = f"{out[name]}, {value}" if name in out else value
        return out

    def _send(self, h: Host, session, method, url, image, doing, headers, last: bool, **kw) -> requests.Response:
        """One request with retries on connection errors and retryable statuses, within the
        deadline: only one attempt at a host that is not the last one to try."""
        backoff = _Backoff(self.deadline)
        connect = h.dial_timeout or (CONNECT_TIMEOUT if h.is_registry or last else self.options.hosts.mirror_dial_timeout)
        read = READ_TIMEOUT if last else MIRROR_READ_TIMEOUT
        while True:
            left = self.deadline.check(image, doing)
            try:
                resp = session.request(method, url, headers=headers, timeout=_timeouts(left, connect, read), **kw)
                if resp.status_code not in _RETRY_STATUS:
                    return resp
                problem = f"HTTP {resp.status_code}"
                resp.close()
            except requests.RequestException as e:
                problem = _describe(e)
            if not last:
                self.options.hosts.mark_down(h)
                raise RegistryUnavailable(f"{doing}: {problem}{self.through(h)}", image)
            if (why := backoff.give_up()) is not None:
                raise RegistryUnavailable(f"{doing}: {problem} ({why}){self.through(h)}", image)
            log.info("registry request failed, retrying", extra=kv(image=image, doing=doing, problem=problem,
                                                                  retry_in=round(backoff.delay, 2),
                                                                  **self._mirror_kv(h)))
            backoff.pause()

    def request(self, method: str, path: str, image: str, doing: str, *, headers=None, ok=(200,),
                caps: tuple[str, ...] = ("pull",), exclude=(), **kw) -> requests.Response:
        """An authenticated request for ``/<api root>/<path>`` at the first host that answers it
        (``resp.served_by``); maps 401/403/404 to our errors. Hosts that failed are named in the
        error of the last one, or logged when a later host answers."""
        hosts = self.candidates(caps, image, exclude)
        if not hosts:
            raise RegistryUnavailable(f"{doing}: no host of {self.host} may {'+'.join(caps)}"
                                      + (" (the others served bad content)" if exclude else "")
                                      + f" ({self.options.hosts.file(registry_host(self.host)) or 'no hosts.toml'})",
                                      image)
        failed: list[str] = []
        for i, h in enumerate(hosts):
            last = i == len(hosts) - 1
            if not last and (wait := self.options.hosts.down(h)):
                failed.append(f"{h}: skipped, failed to connect lately (again in {wait:.0f}s)")
                continue
            if not last and h in self._refused:
                failed.append(f"{h}: skipped, {self._refused[h]}")
                continue
            try:
                resp = self._request_at(h, method, path, image, doing, dict(headers or {}), ok, last, **kw)
            except HostsConfigError:  # the operator's file is wrong (a TLS file): as if it could not be read
                raise
            except (RegistryUnavailable, AuthError, ImageNotFound) as e:
                if last:
                    if failed:
                        e.add_detail(f"tried first: {'; '.join(failed)}")
                    raise
                failed.append(f"{h}: {e.detail}")
                log.info("mirror failed, trying the next host", extra=kv(image=image, doing=doing, mirror=str(h),
                                                                        problem=e.detail))
                continue
            if failed or not h.is_registry:
                self.options.hosts.mark_up(h)
            resp.served_by = h
            return resp
        raise AssertionError("unreachable: the last host returns or raises")

    def _request_at(self, h: Host, method, path, image, doing, headers, ok, last, **kw) -> requests.Response:
        kw["stream"] = True  # a body is read by its caller, within a cap: never preloaded whole
        client = self._client(h, image, last)
        url = self._url(h, path)
        headers = self._headers(h) | headers
        for attempt in range(2):
            if _has_creds(client.auth):
                headers.update(client.auth.get_auth_header())
            resp = self._send(h, client.session, method, url, image, doing, headers, last, **kw)
            if resp.status_code not in (401, 403) or attempt:
                break
            try:
                headers, changed = client.auth.authenticate_request(resp, headers, refresh=True)
            except (*_NET_ERRORS, ValueError) as e:
                raise AuthError(f"{doing}: token request failed: {_describe(e)}{self.through(h)}", image) from None
            resp.close()
            if not changed:
                break
        if resp.status_code in ok:
            return resp
        try:  # what one recv brings of an error body (at most 300 bytes), for the message
            body = resp.raw.read1(300, decode_content=True).decode(errors="replace")
        except (*_NET_ERRORS, ValueError):
            body = ""
        resp.close()
        where = self.through(h)
        if resp.status_code in (401, 403):
            raise AuthError(f"{doing}: registry refused our credentials (HTTP {resp.status_code}){where}", image)
        if resp.status_code == 404:
            raise ImageNotFound(f"{doing}: not found in the registry (HTTP 404){where}", image)
        raise RegistryUnavailable(f"{doing}: unexpected HTTP {resp.status_code}{where}: {body.strip()}", image)

    def verified(self, fetch, image: str, caps: tuple[str, ...] = ("pull",)):
        """``fetch(exclude)`` again without the host whose content did not match its digest
        (``IntegrityError.served_by``), or the mirror that sent it too slowly
        (``RegistryUnavailable.served_by``), while another host may do ``caps``."""
        exclude: list[Host] = []
        first: IntegrityError | None = None
        while True:
            try:
                return fetch(tuple(exclude))
            except (IntegrityError, RegistryUnavailable) as e:
                source = getattr(e, "served_by", None)  # a RegistryUnavailable has one when a mirror was too slow
                bad = isinstance(e, IntegrityError)
                first = first or (e if bad else None)
                if source is None or (not bad and source is self.last) or \
                        not self.candidates(caps, image, (*exclude, source)):
                    if bad or first is None:
                        raise
                    first.add_detail(f"the other hosts: {e.detail}")
                    raise first from None
                exclude.append(source)
                log.warning("content failed verification, trying the next host" if bad else
                            "mirror too slow, trying the next host",
                            extra=kv(image=image, problem=e.detail,
                                     **{("registry" if source.is_registry else "mirror"): str(source)}))
            except (AuthError, ImageNotFound) as e:
                if first is None:
                    raise
                # the bad content is the news, not that the hosts left could not make up for it
                first.add_detail(f"the other hosts: {e.detail}")
                raise first from None

    # -- reading ----------------------------------------------------------------------------

    def get_manifest(self, ref: Reference, image: str, *, limit: int = MAX_MANIFEST_BYTES,
                     digest: str | None = None) -> tuple[bytes, str, str]:
        """Fetch a manifest or index: (raw bytes, media type, digest), digest- and size-checked.
        By tag only hosts that may resolve are asked; by digest, any that may pull."""
        want = digest or ref.digest
        caps = ("pull",) if want else ("pull", "resolve")
        return self.verified(lambda exclude: self._get_manifest(ref, image, limit, want, caps, exclude), image, caps)

    def _get_manifest(self, ref, image, limit, want, caps, exclude) -> tuple[bytes, str, str]:
        accept = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
        doing = "fetching the manifest"
        resp = self.request("GET", f"{ref.repository}/manifests/{want or ref.ref}", image, doing,
                            headers={"Accept": accept}, stream=True, caps=caps, exclude=exclude)
        source = resp.served_by
        try:
            with resp:
                declared = _content_length(resp, image, "manifest")
                if declared > limit:
                    raise IntegrityError(f"manifest is {declared} bytes, over the {limit}-byte limit", image)
                body = self.read_capped(resp, limit, image, doing, "manifest")
            actual = "sha256:" + hashlib.sha256(body).hexdigest()
            if want and actual != want:
                raise IntegrityError(f"manifest digest mismatch: asked for {want}, content is {actual}"
                                     f"{self.through(source)}", image)
        except IntegrityError as e:
            e.served_by = source
            raise
        media_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
        self.manifest_hosts.add(source)
        return body, media_type, actual

    def read_capped(self, resp, limit: int, image: str, doing: str, what: str) -> bytes:
        """The body of a streamed answer, at most ``limit`` bytes (IntegrityError past it), read
        within the deadline whatever the server's pace."""
        body, pace = bytearray(), _Pace()
        try:
            while self.deadline.check(image, doing) and (chunk := pace.read(resp.raw, 65536)):
                body += chunk
                if len(body) > limit:
                    raise IntegrityError(f"{what} is over the {limit}-byte limit", image)
        except _TooSlow as e:
            if resp.served_by is not self.last:
                self.options.hosts.mark_down(resp.served_by)
            err = RegistryUnavailable(f"{doing}: {e}{self.through(resp.served_by)}", image)
            err.served_by = resp.served_by  # :meth:`verified` asks the next host
            raise err from None
        except _NET_ERRORS as e:
            raise RegistryUnavailable(f"{doing}: {_describe(e)}{self.through(resp.served_by)}", image) from None
        return bytes(body)

    def open_blob(self, repository: str, descriptor: dict, image: str, *, limit: int | None = None,
                  exclude=()) -> BlobStream:
        return BlobStream(self, repository, descriptor, image, limit, exclude)

    def read_blob(self, repository: str, descriptor: dict, image: str, *, limit: int) -> bytes:
        """A small blob (a config) read whole, verified."""
        def fetch(exclude):
            with self.open_blob(repository, descriptor, image, limit=limit, exclude=exclude) as blob:
                return blob.read_all()
        return self.verified(fetch, image)

    # -- writing (build/push) ----------------------------------------------------------------

    def blob_exists(self, repository: str, digest: str, image: str) -> bool:
        resp = self.request("HEAD", f"{repository}/blobs/{digest}", image, "checking a blob", ok=(200, 404),
                            caps=("push",))
        resp.close()
        return resp.status_code == 200

    def mount_blob(self, repository: str, digest: str, source: str, image: str) -> bool:
        """Ask the registry to mount blob ``digest`` of ``source`` (a repository of the same
        registry) into ``repository`` without sending it; False when it did not (it then opened
        an upload session, which is left to expire)."""
        resp = self.request("POST", f"{repository}/blobs/uploads/?mount={digest}&from={source}", image,
                            "mounting a blob", ok=(201, 202), caps=("push",))
        resp.close()
        return resp.status_code == 201

    def upload_blob(self, repository: str, digest: str, data, image: str) -> None:
        """Monolithic upload (POST then PUT) of bytes or a binary file object."""
        if self.blob_exists(repository, digest, image):
            return
        resp = self.request("POST", f"{repository}/blobs/uploads/", image, "starting a blob upload", ok=(202,),
                            caps=("push",))
        location, root = resp.headers.get("Location", ""), resp.served_by.path + "/"
        resp.close()
        # the upload URL's path under the host's API root, asked of the same host (request()
        # puts the root back in front; a registry behind a proxy may name itself otherwise)
        url = urllib.parse.urlsplit(location)
        if not url.path.startswith(root):
            raise RegistryUnavailable(f"starting a blob upload: the registry's upload location {location[:200]!r} "
                                      f"is not under {resp.served_by}{root}", image)
        location = url.path[len(root):] + (f"?{url.query}" if url.query else "")
        sep = "&" if "?" in location else "?"
        if hasattr(data, "seek"):
            data.seek(0)
        self.request("PUT", f"{location}{sep}digest={digest}", image, f"uploading blob {digest}", ok=(201,),
                     data=data, headers={"Content-Type": "application/octet-stream"}, caps=("push",)).close()

    def put_manifest(self, repository: str, ref: str, body: bytes, media_type: str, image: str) -> str:
        self.request("PUT", f"{repository}/manifests/{ref}", image, "uploading the manifest", ok=(201,),
                     data=body, headers={"Content-Type": media_type}, caps=("push",)).close()
        return "sha256:" + hashlib.sha256(body).hexdigest()


def _content_length(resp, image: str, what: str, default=0) -> int | None:
    """The answer's Content-Length, ``default`` when it has none; IntegrityError when it is not
    one decimal number (``2, 2`` is legal HTTP for a repeated header, and no length we trust)."""
    text = resp.headers.get("Content-Length")
    if text is None:
        return default
    if not text.strip().isdigit():
        raise IntegrityError(f"{what}: Content-Length {text[:40]!r} is not a number", image)
    return int(text)


def _has_creds(auth) -> bool:
    return bool(getattr(auth, "token", None) or (isinstance(auth, oras.auth.BasicAuth)
                                                 and getattr(auth, "_basic_auth", None)))


def _describe(e: BaseException) -> str:
    """A short cause for a requests/urllib3 exception (their str() nests several reprs)."""
    text = str(e)
    for key in ("Connection refused", "timed out", "Name or service not known", "Connection reset",
                "IncompleteRead", "Connection broken", "Max retries exceeded"):
        if key in text:
            return f"{type(e).__name__}: {key}"
    return f"{type(e).__name__}: {text[:200]}"


class _TooSlow(Exception):
    """A host sends under MIN_TRANSFER_BYTES per RATE_WINDOW (the message says how little)."""


class _Pace:
    """Reads of one answer, timed: the bytes it brings against the time spent waiting for them
    (not the time a consumer spends between reads), checked every RATE_WINDOW seconds waited."""

    def __init__(self):
        self.waited, self.got = 0.0, 0

    def read(self, raw, n: int, decode: bool = False) -> bytes:
        """What one ``recv`` brings (at most ``n`` bytes; transfer decoding only with ``decode``);
        :class:`_TooSlow` when the window just ended under the minimum."""
        started = time.monotonic()
        data = raw.read1(n, decode_content=decode)
        self.waited += time.monotonic() - started
        self.got += len(data)
        if self.waited >= RATE_WINDOW:
            if data and self.got < MIN_TRANSFER_BYTES:
                raise _TooSlow(f"too slow: {self.got} bytes in {self.waited:.0f}s, under the minimum of "
                               f"{MIN_TRANSFER_BYTES // 1024} KiB per {RATE_WINDOW:g}s")
            self.waited, self.got = 0.0, 0
        return data


class BlobStream:
    """A file-like reader of one blob that verifies it as it streams.

    ``read(n)`` returns raw (still compressed) blob bytes. A connection cut or a retryable
    status mid-blob reopens the blob with ``Range: bytes=<offset>-`` (or skips ahead when the
    registry ignores ranges) after a backoff, within the registry's deadline. Reading past the
    declared size, a short stream, or a digest mismatch raise :class:`IntegrityError`.
    """

    def __init__(self, registry: Registry, repository: str, descriptor: dict, image: str, limit: int | None,
                 exclude=()):
        self.registry = registry
        self.exclude = tuple(exclude)  # hosts not to ask (they served bad content)
        self.source: Host | None = None  # the host the bytes come from now
        self._senders: list[Host] = []  # every host that sent bytes of it, first first (resumes may go elsewhere)
        self.repository = repository
        self.image = image
        self.digest = check_digest(descriptor.get("digest"), image)
        size = descriptor.get("size")
        if not isinstance(size, int) or size < 0:
            raise IntegrityError(f"blob {self.digest}: descriptor has no valid size", image)
        if limit is not None and size > limit:
            raise IntegrityError(f"blob {self.digest} is {size} bytes, over the {limit}-byte limit", image)
        self.size = size
        self.offset = 0
        self._hash = hashlib.sha256()
        self._resp: requests.Response | None = None
        self._pace = _Pace()
        self._verified = False
        self.on_read = None  # called with the byte count of every chunk (progress)

    def _open(self) -> None:
        # identity: the digest is over the stored bytes, never over a transfer re-encoding
        headers = {"Accept-Encoding": "identity"} | ({"Range": f"bytes={self.offset}-"} if self.offset else {})
        resp = self.registry.request("GET", f"{self.repository}/blobs/{self.digest}", self.image,
                                     f"downloading blob {self.digest}", headers=headers, ok=(200, 206), stream=True,
                                     exclude=self.exclude)
        self._resp, self.source, self._pace = resp, resp.served_by, _Pace()
        try:
            length = _content_length(resp, self.image, f"blob {self.digest}", None)
        except IntegrityError as e:
            self.close()
            raise self._bad(e.detail) from None
        expect = self.size - (self.offset if resp.status_code == 206 else 0)
        if length is not None and length != expect:
            self.close()
            raise self._bad(f"blob {self.digest}: registry sends {length} bytes, manifest says {self.size}"
                            + (f" (resuming at {self.offset})" if self.offset else ""))
        if resp.status_code == 206:
            got = resp.headers.get("Content-Range", "")
            m = _CONTENT_RANGE.match(got)
            if not m or int(m[1]) != self.offset or m[3] not in ("*", str(self.size)):
                self.close()
                raise self._bad(f"blob {self.digest}: asked for bytes {self.offset}- of {self.size}, "
                                f"the registry sent the range {got!r}")
        elif self.offset:  # range ignored, the whole blob again: skip what we already have
            skip = self.offset
            while skip:
                self.registry.deadline.check(self.image, f"downloading blob {self.digest}")
                got = self._pace.read(resp.raw, min(skip, CHUNK))
                if not got:
                    raise ConnectionError("the connection ended while skipping to the resume offset")
                skip -= len(got)

    def read(self, n: int = CHUNK) -> bytes:
        want = min(n if n and n > 0 else CHUNK, self.size - self.offset + 1)
        backoff = _Backoff(self.registry.deadline, "attempts without progress")  # failures with no byte between
        while True:
            self.registry.deadline.check(self.image, f"downloading blob {self.digest}")
            try:
                if self._resp is None:
                    self._open()
                data = self._pace.read(self._resp.raw, want)
                break
            except _TooSlow as e:
                if self.source is self.registry.last:  # no host left to ask: an error, not a retry
                    self.close()
                    raise RegistryUnavailable(f"blob {self.digest}: {e} at byte {self.offset}"
                                              f"{self.registry.through(self.source)}", self.image) from None
                problem = str(e)
                self.registry.options.hosts.mark_down(self.source)  # the resume asks the next host
            except _NET_ERRORS as e:
                problem = _describe(e)
                if self.source is not None and self.source is not self.registry.last:
                    self.registry.options.hosts.mark_down(self.source)  # the resume asks the next host
            self.close()
            if (why := backoff.give_up()) is not None:
                raise RegistryUnavailable(f"blob {self.digest}: {problem} at byte {self.offset} ({why})"
                                          f"{self.registry.through(self.source) if self.source else ''}", self.image)
            log.info("blob download interrupted, resuming", extra=kv(image=self.image, digest=self.digest,
                                                                     offset=self.offset, problem=problem,
                                                                     **self.registry._mirror_kv(self.source)))
            backoff.pause()
        if not data:
            self._finish()
            return b""
        self.offset += len(data)
        if self.offset > self.size:
            raise self._bad(f"blob {self.digest} is longer than the {self.size} bytes its descriptor says")
        self._hash.update(data)
        if self.source not in self._senders:
            self._senders.append(self.source)
        with self.registry._served_lock:
            self.registry.served[self.source] = self.registry.served.get(self.source, 0) + len(data)
        if self.on_read is not None:
            self.on_read(len(data))
        return data

    def _finish(self) -> None:
        if self._verified:
            return
        if self.offset != self.size:
            raise self._bad(f"blob {self.digest} truncated: got {self.offset} of {self.size} bytes")
        actual = "sha256:" + self._hash.hexdigest()
        if actual != self.digest:
            raise self._bad(f"blob digest mismatch: expected {self.digest}, content is {actual}", whole=True)
        self._verified = True

    def _bad(self, message: str, whole: bool = False) -> IntegrityError:
        """The error for content that is not what the descriptor says, naming the host that sent
        it (``served_by``: :meth:`Registry.verified` asks the next host). A digest that fails
        (``whole``) may be over bytes of several hosts, when a resume went to the next one: a
        mirror among them is blamed before the registry, which would otherwise be left out of
        the next try for the good part it sent."""
        source = next((h for h in self._senders if not h.is_registry), self.source) if whole else self.source
        e = IntegrityError(message + (self.registry.through(source) if source else ""), self.image)
        e.served_by = source
        return e

    def read_all(self) -> bytes:
        parts = []
        while chunk := self.read(CHUNK):
            parts.append(chunk)
        return b"".join(parts)

    def drain(self) -> None:
        """Read and verify whatever is left (trailing bytes after a tar's end blocks count too)."""
        while self.read(CHUNK):
            pass

    def close(self) -> None:
        if self._resp is not None:
            self._resp.close()
            self._resp = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
