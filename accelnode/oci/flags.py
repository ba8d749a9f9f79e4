"""Command-line flags for registry access, shared by every command that talks to a registry."""

from __future__ import annotations

import argparse

from accelnode import exitcodes

from .hosts import DEFAULT_HOSTS_DIR, DEFAULT_MIRROR_DIAL_TIMEOUT
from .mirrors import parse_mirror

MIRROR_FLAG = "--registry-mirror"


class _MirrorAction(argparse._AppendAction):  # argparse has no public base for "append, checked"
    """Appends a checked ``HOST=ENDPOINT``, failing like argparse (exit 2, naming the flag) when
    it is malformed. The first one on the command line replaces the entries an
    ACCELNODE_REGISTRY_MIRROR default brought: the command line wins, as for every other flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        given = [*([] if current is self.default else current or []), values]
        try:
            _mirror_map(given)
        except ValueError as e:
            parser.error(f"argument {MIRROR_FLAG}: {e}")
        setattr(namespace, self.dest, given)


def add_registry_flags(group, timeout_flag: str = "--timeout", timeout: float = 1800.0,
                       timeout_help: str = "deadline of one whole pull or push (every blob of the image)") -> None:
    """The registry flags of every command that talks to a registry (``accelnode cache``,
    ``accelnode agent``, ``accelnode controller``); a daemon names its deadline ``--registry-timeout``."""
    group.add_argument("--plain-http", action="store_true",
                       help="talk plain HTTP instead of HTTPS to registries and --registry-mirror endpoints "
                            "(only when asked: tests, trusted networks); a hosts.toml URL names its own scheme")
    group.add_argument("--registry-config", metavar="FILE",
                       help="Docker config JSON with credentials (also a dockerconfigjson Secret's content)")
    group.add_argument("--hosts-dir", default=DEFAULT_HOSTS_DIR, metavar="DIR",
                       help="containerd's registry host directory: DIR/<host>/hosts.toml (also host_port_ and "
                            "_default) names the mirrors tried before each registry, as containerd reads it; a "
                            "missing directory means none, '' turns it off (default: %(default)s)")
    group.add_argument("--mirror-dial-timeout", type=_positive, default=DEFAULT_MIRROR_DIAL_TIMEOUT,
                       metavar="SECONDS", help="connect timeout of a hosts.toml mirror that sets no dial_timeout; "
                       "one that fails is skipped for 30 s (default: %(default)s)")
    group.add_argument(MIRROR_FLAG, dest="registry_mirrors", action=_MirrorAction, metavar="HOST=ENDPOINT",
                       help="send every request for images on registry HOST to ENDPOINT (HOST[:PORT]) instead, "
                            "as a hosts.toml with server = ENDPOINT would, and ahead of --hosts-dir; images keep "
                            "their names, there is no fallback to HOST (repeatable; the environment variable "
                            "takes a comma-separated list)")
    group.add_argument(timeout_flag, dest="registry_timeout", type=float, default=timeout, metavar="SECONDS",
                       help=f"{timeout_help}; an unreachable "
                            "registry still fails after 5 quick attempts (default: %(default)s)")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def mirrors(values: list[str] | None) -> dict[str, str]:
    """``--registry-mirror`` values as the mapping of :attr:`RegistryOptions.mirrors`; a
    malformed value (one from the environment: the flag's own are checked as parsed) or a host
    given two different mirrors is a usage error (exit 2)."""
    try:
        return _mirror_map(values or [])
    except ValueError as e:
        raise exitcodes.CLIError(f"{MIRROR_FLAG} (or ACCELNODE_REGISTRY_MIRROR): {e}", exitcodes.USAGE) from None


def _mirror_map(values: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for text in values:
        host, endpoint = parse_mirror(text)
        if out.get(host, endpoint) != endpoint:
            raise ValueError(f"registry host {host} is given two mirrors, {out[host]} and {endpoint}")
        out[host] = endpoint
    return out


def registry_options(args):
    from .registry import RegistryOptions  # here: --help never loads requests and oras

    return RegistryOptions(plain_http=args.plain_http, config_file=args.registry_config,
                           mirrors=mirrors(args.registry_mirrors), timeout=args.registry_timeout,
                           hosts_dir=args.hosts_dir or None, mirror_dial_timeout=args.mirror_dial_timeout)
