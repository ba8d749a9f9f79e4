"""Registry credentials from Docker config files (also the content of a
``kubernetes.io/dockerconfigjson`` Secret), read by us: no credential-helper program is ever run."""

from __future__ import annotations

import base64
import binascii
import os

from accelnode.decode import DOCKER_CONFIG, DocumentError, decode

from .errors import AuthError

_HOST_ALIASES = {"index.docker.io": "docker.io", "registry-1.docker.io": "docker.io", "localhost": "127.0.0.1"}


def docker_credentials(host: str, config_file: str | None, image: str, *,
                       inline: tuple[tuple[str, str], ...] = ()) -> tuple[str, str] | None:
    """(username, password) for ``host`` from ``config_file`` (a Docker config JSON or
    dockerconfigjson Secret content), then ``~/.docker/config.json``; None when neither has any.
    ``inline``: (name, content) of configs held in memory (a tenant's pull secrets), which
    replace both files. Keys are matched as Docker does (``https://host:port/v1/`` is
    ``host:port``). Credential helpers (``credsStore``/``credHelpers``) are not run, and OAuth2
    ``identitytoken``s are refused with a clear error. Messages never contain credential values."""
    want = _config_host(host)
    for path, cfg in inline or _files(config_file, image):
        if isinstance(cfg, (str, bytes)):
            cfg = parse_config(cfg, path, image)
        auths = cfg.get("auths", cfg) if isinstance(cfg, dict) else None  # no "auths": the legacy .dockercfg shape
        if not isinstance(auths, dict):
            raise AuthError(f"registry config {path} has no auths object", image)
        keys = [k for k, v in auths.items() if isinstance(v, dict) and _config_host(k) == want]
        for key in sorted(keys, key=lambda k: (k != host, k)):  # an exact key first
            creds = _entry_credentials(auths[key], path, key, image)
            if creds is not None:
                return creds
    return None


def _files(config_file: str | None, image: str):
    """(path, parsed config) of ``config_file``, then ``~/.docker/config.json`` if present."""
    files = [config_file] if config_file else []
    home = os.path.expanduser("~/.docker/config.json")
    if os.path.isfile(home):
        files.append(home)
    for path in files:
        try:
            with open(path, "rb") as f:
                data = f.read(DOCKER_CONFIG.max_bytes + 1)  # more is refused by its size
        except FileNotFoundError:
            raise AuthError(f"registry config {path} does not exist", image) from None
        except OSError as e:
            raise AuthError(f"registry config {path} is not readable ({type(e).__name__})", image) from None
        yield path, parse_config(data, path, image)


def parse_config(data: str | bytes, name: str, image: str = "") -> dict:
    """A Docker config JSON (or the content of a dockerconfigjson Secret) as a dict;
    :class:`AuthError` naming ``name`` (never the content) when it is not one."""
    try:
        return decode(data, DOCKER_CONFIG, f"registry config {name}")
    except DocumentError as e:  # the problem, never the content
        raise AuthError(f"registry config {name} {e.problem.split(':')[0]}", image) from None


def _config_host(key: str) -> str:
    host = key.strip().lower().removeprefix("https://").removeprefix("http://").split("/", 1)[0]
    name, _, port = host.partition(":")
    name = _HOST_ALIASES.get(name, name)
    return f"{name}:{port}" if port else name


def _entry_credentials(entry: dict, path: str, key: str, image: str) -> tuple[str, str] | None:
    if entry.get("auth"):
        try:
            user, sep, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError, TypeError, ValueError):
            sep = ""
        if not sep or not user:
            raise AuthError(f"registry config {path}: the auth of {key!r} is not base64 of USER:PASSWORD", image)
        return user, password
    if entry.get("username"):
        return str(entry["username"]), str(entry.get("password") or "")
    if entry.get("identitytoken"):
        raise AuthError(f"registry config {path}: {key!r} has only an identitytoken (OAuth2 refresh token), "
                        "which is not supported; give username and password or auth", image)
    return None
