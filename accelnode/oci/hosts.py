"""Where a registry's requests go: containerd's ``certs.d/<host>/hosts.toml``, read as containerd
reads it, plus ``--registry-mirror`` entries (docs/registries.md#mirrors-hoststoml).

For an image on ``host[:port]`` the directory ``<hosts-dir>/host_port_``, then
``<hosts-dir>/host:port``, then ``<hosts-dir>/_default`` is looked up; the first that exists
gives the hosts: each ``[host."URL"]`` table in file order, then ``server`` (by default the
registry itself). A ``--registry-mirror HOST=ENDPOINT`` is the file ``server = "<scheme>://ENDPOINT"``
for HOST and wins over the directory. Files are read at every :meth:`HostsConfig.hosts` call
(a pull), so a mirror set up after the agent started (Spegel writes its files at its own
start) is used without a restart; a malformed file is refused with a message naming it.

Parsing only: no requests here. :class:`HostsConfig` also remembers which mirrors failed to
connect lately (:meth:`HostsConfig.down`), so a pull's next request and the next pulls skip a
dead mirror instead of waiting for it again.
"""

from __future__ import annotations

import errno
import os
import re
import ssl
import stat
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .errors import RegistryUnavailable
from .mirrors import check_mirrors, host_problem, registry_host

CAPABILITIES = ("pull", "resolve", "push")
DEFAULT_HOSTS_DIR = "/etc/containerd/certs.d"
DEFAULT_MIRROR_DIAL_TIMEOUT = 1.0
DOWN_FOR = 30.0  # seconds a mirror that failed to connect is skipped while another host is left
MAX_HOSTS_FILE = 1 << 20
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
# printable, no leading white space (requests refuses those, quoting the value in its error)
_HEADER_VALUE = re.compile(r"^(?:[\x21-\x7e\x80-\xff][\t\x20-\x7e\x80-\xff]*)?$")


class HostsConfigError(RegistryUnavailable):
    """A hosts.toml (or the directory it is in) cannot be used as it is written."""


@dataclass(frozen=True)
class Host:
    """One place a registry's requests may go, as containerd's ``RegistryHost``."""

    scheme: str  # "https" | "http"
    netloc: str  # host[:port], lower case
    path: str = "/v2"  # the API root; override_path keeps what the URL says
    capabilities: frozenset[str] = frozenset(CAPABILITIES)
    ca: tuple[str, ...] = ()  # extra CA files, trusted besides the system's
    client: tuple[tuple[str, str | None], ...] = ()  # (certificate, key or None: in the same file)
    skip_verify: bool = False
    header: tuple[tuple[str, str], ...] = ()  # (name, value), a name repeated for several values
    dial_timeout: float | None = None  # connect timeout; None: the caller's default
    registry: str = ""  # the registry host images name: the ns= of mirror requests
    source: str = ""  # where this entry came from (a file, a flag), for messages

    @property
    def url(self) -> str:
        """The API root's URL."""
        return f"{self.scheme}://{self.netloc}{self.path}"

    @property
    def is_registry(self) -> bool:
        """Whether this is the registry itself (no ``ns=``; its own credentials): containerd's
        ``!isProxy``, Docker Hub's API host counting as docker.io."""
        return self.netloc == self.registry or (self.registry == "docker.io"
                                                and self.netloc == "registry-1.docker.io")

    def can(self, capability: str) -> bool:
        return capability in self.capabilities

    def tls_context(self, image: str | None = None) -> ssl.SSLContext:
        """TLS as the file says: extra CAs besides the system's, a client certificate (Python's
        TLS presents one: the first listed), or no verification; HostsConfigError naming the
        file when a TLS file is missing or unusable (as containerd, which fails the host)."""
        ctx = ssl.create_default_context()
        try:
            for ca in self.ca:
                ctx.load_verify_locations(cafile=ca)
            if self.client:
                cert, key = self.client[0]
                ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise HostsConfigError(f"{self.source}: TLS files for {self} are not usable "
                                   f"({getattr(e, 'strerror', None) or e}; this process reads them: the "
                                   "agent's pod sees the node's files only under the hosts directory)",
                                   image) from None
        if self.skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def __str__(self) -> str:
        return f"{self.scheme}://{self.netloc}"


@dataclass(frozen=True, eq=False)
class HostsConfig:
    """The hosts of every registry: ``directory`` (containerd's certs.d; None or missing: none),
    ``mirrors`` (``--registry-mirror``: registry host -> HOST[:PORT], checked on creation),
    the scheme of hosts written without one (``plain_http``) and the connect timeout of a
    mirror whose file sets no ``dial_timeout``."""

    directory: str | None = None
    mirrors: Mapping[str, str] = field(default_factory=dict)
    plain_http: bool = False
    mirror_dial_timeout: float = DEFAULT_MIRROR_DIAL_TIMEOUT
    _down: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "mirrors", check_mirrors(self.mirrors))
        if not self.mirror_dial_timeout > 0:
            raise ValueError(f"mirror dial timeout must be positive, got {self.mirror_dial_timeout!r}")

    def hosts(self, registry: str, image: str | None = None) -> list[Host]:
        """Where requests for images on ``registry`` go, in the order to try them; the last is
        the server. :class:`HostsConfigError` when the file that applies is unusable."""
        key = registry_host(registry)
        scheme = "http" if self.plain_http else "https"
        if key in self.mirrors:
            return [Host(scheme, self.mirrors[key], registry=key, source="--registry-mirror")]
        found = self.file(key)
        if found is None:
            return [_default_server(key, scheme, {}, None, "")]
        return parse_hosts_file(found, key, scheme, image)

    def file(self, registry: str) -> Path | None:
        """The hosts.toml that applies to ``registry`` (containerd's lookup order), or None.
        A directory without hosts.toml counts as found (containerd then reads Docker-style
        certificate files there, which we do not: it yields the default server)."""
        if not self.directory or host_problem(registry) is not None:  # never certs.d/.. nor certs.d/.
            return None
        root = Path(self.directory)
        candidates = [registry]
        if ":" in registry:
            name, _, port = registry.rpartition(":")
            candidates.insert(0, f"{name}_{port}_")
        for name in (*candidates, "_default"):
            d = root / name
            if d.is_dir():
                return d / "hosts.toml"
        return None

    # -- mirrors that failed lately ---------------------------------------------------------

    def down(self, host: Host) -> float:
        """Seconds ``host`` is still to be skipped (0: try it)."""
        with self._lock:
            until = self._down.get((host.scheme, host.netloc), 0.0)
        return max(0.0, until - time.monotonic())

    def mark_down(self, host: Host) -> None:
        with self._lock:
            self._down[(host.scheme, host.netloc)] = time.monotonic() + DOWN_FOR

    def mark_up(self, host: Host) -> None:
        with self._lock:
            self._down.pop((host.scheme, host.netloc), None)

    def check(self) -> list[str]:
        """Every problem of every hosts.toml in the directory (for a start-up log line)."""
        problems = []
        if not self.directory or not os.path.isdir(self.directory):
            return problems
        for d in sorted(Path(self.directory).iterdir()):
            if d.is_dir() and (d / "hosts.toml").exists():
                name = d.name
                if name.endswith("_") and name.count("_") >= 2:
                    base, _, port = name[:-1].rpartition("_")
                    name = f"{base}:{port}"
                try:
                    for host in parse_hosts_file(d / "hosts.toml", registry_host(name), "https", None):
                        if host.scheme == "https" and (host.ca or host.client):
                            host.tls_context()
                except HostsConfigError as e:
                    problems.append(str(e))
        return problems


def _default_server(registry: str, scheme: str, table: dict, path: Path | None, source: str) -> Host:
    """The registry itself, as containerd appends it when ``server`` is not given: Docker Hub's
    API host for docker.io (always https), every capability, the file's top-level TLS and
    headers (containerd keeps those; it ignores top-level capabilities here, and so do we)."""
    if registry == "docker.io":
        scheme, netloc = "https", "registry-1.docker.io"
    else:
        netloc = registry
    base = _host_fields(table, path, source, with_capabilities=False) if path is not None else {}
    return Host(scheme, netloc, registry=registry, source=source or "default", **base)


def parse_hosts_file(path: Path, registry: str, scheme: str, image: str | None) -> list[Host]:
    """The hosts of one hosts.toml for ``registry`` (see the module docstring)."""
    where = str(path)
    try:
        data = _read_regular(path)
    except FileNotFoundError:
        return [_default_server(registry, scheme, {}, None, "")]
    except OSError as e:
        raise HostsConfigError(f"mirror configuration {where} is not readable ({e.strerror})", image) from None
    if len(data) > MAX_HOSTS_FILE:
        raise HostsConfigError(f"mirror configuration {where} is over {MAX_HOSTS_FILE} bytes", image)
    import tomllib  # only where a hosts.toml exists (0.4 MB resident otherwise, for nothing)

    try:
        doc = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise HostsConfigError(f"mirror configuration {where} is not valid TOML ({e})", image) from None
    except RecursionError:
        raise HostsConfigError(f"mirror configuration {where} nests too deeply", image) from None
    try:
        hosts = []
        table = doc.get("host", {})
        if not isinstance(table, dict):
            raise ValueError('"host" must be a table of [host."URL"] tables')
        for url, entry in table.items():  # tomllib keeps the file's order
            if not isinstance(entry, dict):
                raise ValueError(f'[host."{url}"] must be a table')
            hosts.append(_host(url, entry, path, registry, where))
        server = doc.get("server")
        if server is None or server == "":
            hosts.append(_default_server(registry, scheme, doc, path, where))
        elif not isinstance(server, str):
            raise ValueError('"server" must be a string')
        else:
            hosts.append(_host(server, doc, path, registry, where))
    except ValueError as e:
        raise HostsConfigError(f"mirror configuration {where}: {e}", image) from None
    return hosts


def _read_regular(path: Path) -> bytes:
    """At most MAX_HOSTS_FILE + 1 bytes of a regular file: never blocks on a FIFO or a device."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_HOSTS_FILE + 1)
    finally:
        os.close(fd)


def _host(url: str, table: dict, path: Path, registry: str, source: str) -> Host:
    """One host of a file: ``url`` as containerd takes it (https:// when no scheme is given; not
    containerd's test of an "http" prefix, which takes ``ftp://m`` for a host ``ftp:`` and
    ``httpcache.local`` for a scheme)."""
    if "://" not in url:
        url = "https://" + url
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment or u.username:
        raise ValueError(f"host {url!r} is not an http(s)://HOST[:PORT][/PATH] URL")
    try:
        u.port  # noqa: B018 - validates the port
    except ValueError:
        raise ValueError(f"host {url!r} has an invalid port") from None
    override = table.get("override_path", False)
    if not isinstance(override, bool):
        raise ValueError(f"{url}: override_path must be true or false")
    api = os.path.normpath(u.path) if u.path not in ("", "/") else ""
    if not override and not api.endswith("/v2"):
        api += "/v2"
    return Host(u.scheme, u.netloc.lower(), api, registry=registry, source=source,
                **_host_fields(table, path, f"{url}", with_capabilities=True))


def _host_fields(table: dict, path: Path, what: str, *, with_capabilities: bool) -> dict:
    out: dict = {}
    caps = table.get("capabilities")
    if with_capabilities and caps is not None:
        if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
            raise ValueError(f"{what}: capabilities must be a list of strings")
        if caps:
            unknown = [c for c in caps if c.lower() not in CAPABILITIES]
            if unknown:
                raise ValueError(f"{what}: unknown capability {unknown[0]!r} (pull, resolve, push)")
            out["capabilities"] = frozenset(c.lower() for c in caps)
    base = path.parent
    if (ca := table.get("ca")) is not None:
        out["ca"] = tuple(_abs(p, base) for p in _strings(ca, what, "ca"))
    if (client := table.get("client")) is not None:
        out["client"] = _client(client, base, what)
    if (skip := table.get("skip_verify")) is not None:
        if not isinstance(skip, bool):
            raise ValueError(f"{what}: skip_verify must be true or false")
        out["skip_verify"] = skip
    if (header := table.get("header")) is not None:
        out["header"] = _headers(header, what)
    if (dial := table.get("dial_timeout")) is not None:
        out["dial_timeout"] = parse_duration(dial, what)
    return out


def _strings(value, what: str, key: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"{what}: {key} must be a string or a list of strings")


def _abs(p: str, base: Path) -> str:
    """A path of the file, relative ones against the file's directory (as containerd)."""
    if not p:
        raise ValueError("an empty path")
    return p if os.path.isabs(p) else str(base / p)


def _client(value, base: Path, what: str) -> tuple[tuple[str, str | None], ...]:
    """``client``: a file with certificate and key, a list of such files, or [cert, key] pairs."""
    if isinstance(value, str):
        return ((_abs(value, base), None),)
    if not isinstance(value, list):
        raise ValueError(f"{what}: client must be a path, a list of paths or of [certificate, key] pairs")
    out = []
    for item in value:
        if isinstance(item, str):
            out.append((_abs(item, base), None))
        elif isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item):
            out.append((_abs(item[0], base), _abs(item[1], base)))
        else:
            raise ValueError(f"{what}: client entry {item!r} is neither a path nor a [certificate, key] pair")
    return tuple(out)


def _headers(value, what: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise ValueError(f"{what}: header must be a table of names to strings or lists of strings")
    out = []
    for name, v in value.items():
        if not _HEADER_NAME.match(name):
            raise ValueError(f"{what}: header name {name!r} is not a valid HTTP header name")
        for one in _strings(v, what, f"header {name!r}"):
            if not _HEADER_VALUE.match(one):
                raise ValueError(f"{what}: header {name!r} has a value with control characters or that starts "
                                 "with white space")
            out.append((name, one))
    return tuple(out)


def parse_duration(value, what: str = "dial_timeout") -> float | None:
    """A Go duration (``"200ms"``, ``"1.5s"``, ``"1m30s"``, ``"0"``, a sign) in seconds, as
    Go's time.ParseDuration reads it; None for zero or less (no timeout of its own: the
    caller's default). ValueError if it is not one."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what}: dial_timeout must be a duration string such as \"500ms\"")
    sign, body = (-1.0, value[1:]) if value[0] == "-" else (1.0, value[1:] if value[0] == "+" else value)
    if body == "0":
        return None
    if not body:
        raise ValueError(f"{what}: dial_timeout {value!r} is not a duration such as \"500ms\" or \"2s\"")
    pos, total, value = 0, 0.0, body
    while pos < len(value):
        m = _DURATION.match(value, pos)
        if not m:
            raise ValueError(f"{what}: dial_timeout {value!r} is not a duration such as \"500ms\" or \"2s\"")
        total += float(m[1]) * _UNITS[m[2]]
        pos = m.end()
    total *= sign
    return total if total > 0 else None
