"""OCI distribution client: the HTTP protocol with one registry, blob streaming included, on top
of oras-py's session and auth backends (docs/registries.md, docs/cache-format.md).

Invariants: every request goes through :meth:`Registry.request`, so one deadline bounds the
whole operation (oras-py's own path retries for minutes without timeouts), and every read
returns what one ``recv`` brought, so a dripping server cannot hold a pull past it; blobs are
checked for size and digest as they flow (:class:`BlobStream`); no credential-helper program is
ever run; the Authorization header never follows a redirect to another host; a token realm is
asked only over https, or over http at the very host:port contacted with ``--plain-http``
(:class:`_TokenAuth`), so credentials never cross a network in clear to a host the registry
names; a mirrored host is talked to only at its mirror, never falling back to the original.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.cookiejar import DefaultCookiePolicy
from types import MappingProxyType

import oras.auth
import oras.auth.utils
import requests
import urllib3

from accelnode.log import kv

from .credentials import docker_credentials
from .errors import AuthError, ImageNotFound, IntegrityError, RegistryUnavailable
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
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_NET_ERRORS = (requests.RequestException, urllib3.exceptions.HTTPError, OSError)
MAX_TOKEN_ANSWER = 1 << 20  # a token server's JSON answer (JWTs are a few KiB)
_TOKEN = re.compile(r"[\x21-\x7e]{1,65536}")  # what may follow "Bearer " in a header



@dataclass(frozen=True)
class RegistryOptions:
    plain_http: bool = False  # talk HTTP instead of HTTPS (only when asked for)
    config_file: str | None = None  # Docker config JSON with credentials
    anonymous: bool = False  # send no credentials at all: neither config_file nor ~/.docker/config.json
    timeout: float = 1800.0  # total deadline of one pull or push, seconds
    # registry host as images name it (quay.io, registry.example.com:5000) -> mirror HOST[:PORT]
    # that every request for its images goes to; checked and normalised on creation (ValueError)
    mirrors: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "mirrors", MappingProxyType(check_mirrors(self.mirrors)))

    def endpoint(self, host: str) -> str:
        """Where requests for images on registry ``host`` go: its mirror, else ``host`` itself."""
        return self.mirrors.get(registry_host(host), host)


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
    """A session whose requests (including oras-py's token requests) never outlive the deadline."""

    deadline: Deadline | None = None

    def request(self, method, url, **kw):
        if self.deadline is not None and kw.get("timeout") is None:
            kw["timeout"] = _timeouts(max(self.deadline.remaining(), 0.05))
        return super().request(method, url, **kw)


def _timeouts(left: float) -> tuple[float, float]:
    """(connect, read) socket timeouts for a request with ``left`` seconds of deadline."""
    return (min(left, CONNECT_TIMEOUT), min(left, READ_TIMEOUT))


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
    refused before a byte goes there, credentials or not. The answer must be a JSON object of at
    most MAX_TOKEN_ANSWER bytes whose token is one header-safe word. Refusals are ValueError,
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
            body = resp.raw.read(MAX_TOKEN_ANSWER + 1, decode_content=True)
        if len(body) > MAX_TOKEN_ANSWER:
            raise ValueError(f"the token answer is over {MAX_TOKEN_ANSWER} bytes")
        try:
            info = json.loads(body)
        except RecursionError:
            raise ValueError("the token answer nests too deeply") from None
        token = (info.get("token") or info.get("access_token")) if isinstance(info, dict) else None
        if token is not None and not (isinstance(token, str) and _TOKEN.fullmatch(token)):
            raise ValueError("the token answer's token is not a header-safe string")
        return token


def _netloc(url: urllib.parse.SplitResult) -> tuple[str, int]:
    """(host, port) of an http(s) URL, the scheme's default port filled in; ValueError if none."""
    if not url.hostname:
        raise ValueError("no host")
    return url.hostname.lower(), url.port or {"http": 80, "https": 443}.get(url.scheme, 0)


class Registry:
    """Requests for the images of one registry host with a deadline, auth and retries. They go
    to ``endpoint``: the host's mirror when the options give one, else the host itself."""

    def __init__(self, host: str, options: RegistryOptions, deadline: Deadline | None = None):
        self.host = host  # as the image names it
        self.endpoint = options.endpoint(host)  # what is contacted
        self.mirrored = self.endpoint != host
        self.options = options
        self.deadline = deadline or Deadline(options.timeout)
        self.scheme = "http" if options.plain_http else "https"
        self._oras: _Client | None = None

    @property
    def server(self) -> str:
        """The server contacted, as messages name it."""
        return f"mirror {self.endpoint} of {self.host}" if self.mirrored else f"registry {self.host}"

    @property
    def through(self) -> str:
        """What an error message about a request adds: the mirror it went to, if any."""
        return f" (through mirror {self.endpoint})" if self.mirrored else ""

    # -- connection and auth -------------------------------------------------------------

    def _client(self, image: str) -> _Client:
        """Ping /v2/ once and pick the oras-py auth backend the registry's challenge asks for."""
        if self._oras is not None:
            return self._oras
        url = f"{self.scheme}://{self.endpoint}/v2/"
        resp = self._send(requests.Session(), "GET", url, image, "contacting the registry", {})
        challenge = resp.headers.get("Www-Authenticate", "")
        backend = "basic" if resp.status_code == 401 and challenge.lower().startswith("basic") else "token"
        session = _Session()
        session.deadline = self.deadline
        auth = (oras.auth.get_auth_backend("basic", session, self.options.plain_http) if backend == "basic"
                else _TokenAuth(session, self.endpoint if self.options.plain_http else None))
        client = _Client(auth, session)
        creds = None if self.options.anonymous else self._credentials(image)
        if creds is not None:
            client.auth.set_basic_auth(*creds)
        elif backend == "basic" and self.options.anonymous:
            raise AuthError(f"{self.server} requires credentials and this pull is anonymous (sends none)",
                            image)
        elif backend == "basic":
            raise AuthError(f"{self.server} requires credentials and none were found"
                            + (f" under {self.endpoint} or {self.host}" if self.mirrored else "")
                            + (f" in {self.options.config_file}" if self.options.config_file
                               else " (use --registry-config)"), image)
        self._oras = client
        return client

    def _credentials(self, image: str) -> tuple[str, str] | None:
        """Credentials for the endpoint; through a mirror, those kept under the mirror's own
        name first (they are for the server that checks them), then the original host's (a pull
        secret written for the images' registry keeps working with a mirror that accepts it)."""
        creds = docker_credentials(self.endpoint, self.options.config_file, image)
        if creds is None and self.mirrored:
            creds = docker_credentials(self.host, self.options.config_file, image)
        return creds

    def _send(self, session, method, url, image, doing, headers, **kw) -> requests.Response:
        """One request with retries on connection errors and retryable statuses, within the deadline."""
        backoff = _Backoff(self.deadline)
        while True:
            left = self.deadline.check(image, doing)
            try:
                resp = session.request(method, url, headers=headers, timeout=_timeouts(left), **kw)
                if resp.status_code not in _RETRY_STATUS:
                    return resp
                problem = f"HTTP {resp.status_code}"
                resp.close()
            except requests.RequestException as e:
                problem = _describe(e)
            if (why := backoff.give_up()) is not None:
                raise RegistryUnavailable(f"{doing}: {problem} ({why}){self.through}", image)
            log.info("registry request failed, retrying", extra=kv(image=image, doing=doing, problem=problem,
                                                                  retry_in=round(backoff.delay, 2),
                                                                  **self._mirror_kv()))
            backoff.pause()

    def request(self, method: str, path: str, image: str, doing: str, *, headers=None, ok=(200,), **kw):
        """An authenticated request to ``/v2/<path>``; maps 401/403/404 to our errors."""
        client = self._client(image)
        url = f"{self.scheme}://{self.endpoint}/v2/{path}"
        headers = dict(headers or {})
        for attempt in range(2):
            headers.update(client.auth.get_auth_header() if _has_creds(client.auth) else {})
            resp = self._send(client.session, method, url, image, doing, headers, **kw)
            if resp.status_code not in (401, 403) or attempt:
                break
            try:
                headers, changed = client.auth.authenticate_request(resp, headers, refresh=True)
            except (*_NET_ERRORS, ValueError) as e:
                raise AuthError(f"{doing}: token request failed: {_describe(e)}", image) from None
            resp.close()
            if not changed:
                break
        if resp.status_code in ok:
            return resp
        body = resp.text[:300] if not kw.get("stream") else ""
        resp.close()
        where = self.through
        if resp.status_code in (401, 403):
            raise AuthError(f"{doing}: registry refused our credentials (HTTP {resp.status_code}){where}", image)
        if resp.status_code == 404:
            raise ImageNotFound(f"{doing}: not found in the registry (HTTP 404){where}", image)
        raise RegistryUnavailable(f"{doing}: unexpected HTTP {resp.status_code}{where}: {body.strip()}", image)

    def _mirror_kv(self) -> dict:
        """The ``mirror=`` a log line about this registry adds when it goes through a mirror."""
        return {"mirror": self.endpoint} if self.mirrored else {}

    # -- reading ----------------------------------------------------------------------------

    def get_manifest(self, ref: Reference, image: str, *, limit: int = MAX_MANIFEST_BYTES,
                     digest: str | None = None) -> tuple[bytes, str, str]:
        """Fetch a manifest or index: (raw bytes, media type, digest), digest- and size-checked."""
        want = digest or ref.digest
        accept = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
        doing = "fetching the manifest"
        resp = self.request("GET", f"{ref.repository}/manifests/{want or ref.ref}", image, doing,
                            headers={"Accept": accept}, stream=True)
        with resp:
            declared = int(resp.headers.get("Content-Length") or 0)
            if declared > limit:
                raise IntegrityError(f"manifest is {declared} bytes, over the {limit}-byte limit", image)
            body = bytearray()
            try:
                while self.deadline.check(image, doing) and (chunk := resp.raw.read1(65536)):
                    body += chunk
                    if len(body) > limit:
                        raise IntegrityError(f"manifest is over the {limit}-byte limit", image)
            except _NET_ERRORS as e:
                raise RegistryUnavailable(f"{doing}: {_describe(e)}{self.through}", image) from None
        body = bytes(body)
        actual = "sha256:" + hashlib.sha256(body).hexdigest()
        if want and actual != want:
            raise IntegrityError(f"manifest digest mismatch: asked for {want}, content is {actual}", image)
        media_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
        return body, media_type, actual

    def open_blob(self, repository: str, descriptor: dict, image: str, *, limit: int | None = None) -> BlobStream:
        return BlobStream(self, repository, descriptor, image, limit)

    def read_blob(self, repository: str, descriptor: dict, image: str, *, limit: int) -> bytes:
        """A small blob (a config) read whole, verified."""
        with self.open_blob(repository, descriptor, image, limit=limit) as blob:
            return blob.read_all()

    # -- writing (build/push) ----------------------------------------------------------------

    def blob_exists(self, repository: str, digest: str, image: str) -> bool:
        resp = self.request("HEAD", f"{repository}/blobs/{digest}", image, "checking a blob", ok=(200, 404))
        resp.close()
        return resp.status_code == 200

    def upload_blob(self, repository: str, digest: str, data, image: str) -> None:
        """Monolithic upload (POST then PUT) of bytes or a binary file object."""
        if self.blob_exists(repository, digest, image):
            return
        resp = self.request("POST", f"{repository}/blobs/uploads/", image, "starting a blob upload", ok=(202,))
        location = resp.headers["Location"]
        resp.close()
        sep = "&" if "?" in location else "?"
        if location.startswith("/v2/"):
            location = location[len("/v2/"):]
        elif "://" in location:
            location = location.split("/v2/", 1)[1]
        if hasattr(data, "seek"):
            data.seek(0)
        self.request("PUT", f"{location}{sep}digest={digest}", image, f"uploading blob {digest}", ok=(201,),
                     data=data, headers={"Content-Type": "application/octet-stream"}).close()

    def put_manifest(self, repository: str, ref: str, body: bytes, media_type: str, image: str) -> str:
        self.request("PUT", f"{repository}/manifests/{ref}", image, "uploading the manifest", ok=(201,),
                     data=body, headers={"Content-Type": media_type}).close()
        return "sha256:" + hashlib.sha256(body).hexdigest()


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


class BlobStream:
    """A file-like reader of one blob that verifies it as it streams.

    ``read(n)`` returns raw (still compressed) blob bytes. A connection cut or a retryable
    status mid-blob reopens the blob with ``Range: bytes=<offset>-`` (or skips ahead when the
    registry ignores ranges) after a backoff, within the registry's deadline. Reading past the
    declared size, a short stream, or a digest mismatch raise :class:`IntegrityError`.
    """

    def __init__(self, registry: Registry, repository: str, descriptor: dict, image: str, limit: int | None):
        self.registry = registry
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
        self._verified = False
        self.on_read = None  # called with the byte count of every chunk (progress)

    def _open(self) -> None:
        # identity: the digest is over the stored bytes, never over a transfer re-encoding
        headers = {"Accept-Encoding": "identity"} | ({"Range": f"bytes={self.offset}-"} if self.offset else {})
        resp = self.registry.request("GET", f"{self.repository}/blobs/{self.digest}", self.image,
                                     f"downloading blob {self.digest}", headers=headers, ok=(200, 206), stream=True)
        self._resp = resp
        length = resp.headers.get("Content-Length")
        expect = self.size - (self.offset if resp.status_code == 206 else 0)
        if length is not None and int(length) != expect:
            self.close()
            raise IntegrityError(f"blob {self.digest}: registry sends {length} bytes, manifest says {self.size}"
                                 + (f" (resuming at {self.offset})" if self.offset else ""), self.image)
        if resp.status_code == 206:
            got = resp.headers.get("Content-Range", "")
            m = _CONTENT_RANGE.match(got)
            if not m or int(m[1]) != self.offset or m[3] not in ("*", str(self.size)):
                self.close()
                raise IntegrityError(f"blob {self.digest}: asked for bytes {self.offset}- of {self.size}, "
                                     f"the registry sent the range {got!r}", self.image)
        elif self.offset:  # range ignored, the whole blob again: skip what we already have
            skip = self.offset
            while skip:
                self.registry.deadline.check(self.image, f"downloading blob {self.digest}")
                got = resp.raw.read1(min(skip, CHUNK), decode_content=False)
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
                data = self._resp.raw.read1(want, decode_content=False)
                break
            except _NET_ERRORS as e:
                problem = _describe(e)
            self.close()
            if (why := backoff.give_up()) is not None:
                raise RegistryUnavailable(f"blob {self.digest}: {problem} at byte {self.offset} ({why})"
                                          f"{self.registry.through}", self.image)
            log.info("blob download interrupted, resuming", extra=kv(image=self.image, digest=self.digest,
                                                                     offset=self.offset, problem=problem,
                                                                     **self.registry._mirror_kv()))
            backoff.pause()
        if not data:
            self._finish()
            return b""
        self.offset += len(data)
        if self.offset > self.size:
            raise IntegrityError(f"blob {self.digest} is longer than the {self.size} bytes its descriptor says",
                                 self.image)
        self._hash.update(data)
        if self.on_read is not None:
            self.on_read(len(data))
        return data

    def _finish(self) -> None:
        if self._verified:
            return
        if self.offset != self.size:
            raise IntegrityError(f"blob {self.digest} truncated: got {self.offset} of {self.size} bytes", self.image)
        actual = "sha256:" + self._hash.hexdigest()
        if actual != self.digest:
            raise IntegrityError(f"blob digest mismatch: expected {self.digest}, content is {actual}", self.image)
        self._verified = True

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
