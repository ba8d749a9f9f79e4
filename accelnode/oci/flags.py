"""Command-line flags for registry access, shared by every command that talks to a registry."""

from __future__ import annotations


def add_registry_flags(group, timeout_flag: str = "--timeout", timeout: float = 1800.0,
                       timeout_help: str = "deadline of one whole pull or push (every blob of the image)") -> None:
    """The registry flags of every command that talks to a registry (``accelnode cache``,
    ``accelnode agent``, ``accelnode controller``); a daemon names its deadline ``--registry-timeout``."""
    group.add_argument("--plain-http", action="store_true",
                       help="talk plain HTTP to the registry (only when asked: tests, trusted networks)")
    group.add_argument("--registry-config", metavar="FILE",
                       help="Docker config JSON with credentials (also a dockerconfigjson Secret's content)")
    group.add_argument(timeout_flag, dest="registry_timeout", type=float, default=timeout, metavar="SECONDS",
                       help=f"{timeout_help}; an unreachable "
                            "registry still fails after 5 quick attempts (default: %(default)s)")


def registry_options(args):
    from .registry import RegistryOptions  # here: --help never loads requests and oras

    return RegistryOptions(plain_http=args.plain_http, config_file=args.registry_config,
                           timeout=args.registry_timeout)
