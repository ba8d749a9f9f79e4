"""Registry mirrors: which endpoint serves the images of a registry host (docs/registries.md).

A mirror maps a registry host as image references name it (``quay.io``,
``registry.example.com:5000``, ``docker.io``) to an endpoint ``HOST[:PORT]`` that answers the
distribution protocol for it. The image keeps its name; only where its requests go changes.
Parsing and checking live here, light enough for argparse: ``--help`` never loads requests.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"  # distribution's domain-component
_HOST = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*(?::(?P<port>[0-9]{{1,5}}))?$")
_ONE_LABEL = re.compile(_LABEL)
# Docker Hub's other names: an image reference says docker.io, a config or a mirror flag may not
_ALIASES = {"index.docker.io": "docker.io", "registry-1.docker.io": "docker.io"}
# the agent's flag naming the mirrors (as the server of a registry) whose answers prove what a
# tenant may have: those that enforce the registry's own access control (docs/registries.md)
ACCESS_FLAG = "--mirror-enforces-access"
FORMAT = ("HOST=ENDPOINT: a registry host as images name it, and the HOST[:PORT] of its mirror "
          "(e.g. quay.io=10.0.0.5:5000)")


def registry_host(host: str) -> str:
    """``host`` as mirrors are keyed: lower case, Docker Hub's aliases as ``docker.io``."""
    host = host.lower()
    name, sep, port = host.partition(":")
    return _ALIASES.get(name, name) + sep + port


def parse_mirror(text: str) -> tuple[str, str]:
    """``HOST=ENDPOINT`` -> (registry host, endpoint); ValueError saying what is wrong."""
    host, sep, endpoint = text.strip().partition("=")
    if not sep:
        raise ValueError(f"expected {FORMAT}, got {text!r}")
    return check_mirror(host.strip(), endpoint.strip())


def check_mirror(host: str, endpoint: str) -> tuple[str, str]:
    """One checked mirror entry: (normalised registry host, endpoint); ValueError if malformed."""
    if not _is_host(host):
        raise ValueError(f"{host!r} is not a registry host as image references name one "
                         "(HOST[:PORT] with a dot or a port, or localhost)")
    return registry_host(host), check_endpoint(endpoint)


def check_endpoint(endpoint: str) -> str:
    """A mirror endpoint ``HOST[:PORT]`` (no scheme, no path), lower case; ValueError if malformed."""
    if "://" in endpoint:
        raise ValueError(f"mirror endpoint {endpoint!r}: give HOST[:PORT] without a scheme "
                         "(--plain-http chooses HTTP for every registry and mirror)")
    if "/" in endpoint:
        raise ValueError(f"mirror endpoint {endpoint!r}: give HOST[:PORT] without a path "
                         "(the mirror serves the same repository paths under /v2/)")
    m = _HOST.match(endpoint)
    if not m or (m["port"] is not None and not 0 < int(m["port"]) < 65536):
        raise ValueError(f"mirror endpoint {endpoint!r} is not HOST[:PORT]")
    return endpoint.lower()


def check_mirrors(mirrors: Mapping[str, str] | None) -> dict[str, str]:
    """A mirror mapping checked and keyed by :func:`registry_host`; ValueError when an entry is
    malformed or two entries name the same registry host."""
    out: dict[str, str] = {}
    for host, endpoint in (mirrors or {}).items():
        if not isinstance(host, str) or not isinstance(endpoint, str):
            raise ValueError(f"mirror {host!r}={endpoint!r}: host and endpoint must be strings")
        key, endpoint = check_mirror(host, endpoint)
        if key in out and out[key] != endpoint:
            raise ValueError(f"registry host {key} has two mirrors: {out[key]} and {endpoint}")
        out[key] = endpoint
    return out


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a registry host as image references name one (``HOST[:PORT]``: host
    name labels of letters, digits and inner hyphens, with a dot or a port, or ``localhost``),
    or None when it is. ``.``, ``..`` and empty labels name no registry, and would name a
    directory outside the hosts directory (``certs.d/..``)."""
    name, sep, port = host.rpartition(":") if ":" in host else (host, "", "")
    labels = name.split(".")
    if "" in labels:
        return f"registry host {host!r} has an empty label"
    bad = next((x for x in labels if not _ONE_LABEL.fullmatch(x)), None)
    if bad is not None:
        return f"registry host {host!r}: {bad!r} is not a host name label (letters, digits, inner hyphens)"
    if sep and not (port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        return f"registry host {host!r}: {port!r} is not a port"
    if not sep and "." not in name and name.lower() != "localhost":
        return f"registry host {host!r} has neither a dot nor a port, nor is it localhost"
    return None


def _is_host(host: str) -> bool:
    return host_problem(host) is None
