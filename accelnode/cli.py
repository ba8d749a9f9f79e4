"""The ``accelnode`` command: one entry point, a subcommand per component.

Every long flag ``--foo-bar`` of a subcommand may also be given as the environment variable
``ACCELNODE_FOO_BAR``; a flag on the command line wins over the environment. Each component
module exposes ``register(subparsers)``, which adds its parser and sets ``func`` to a callable
taking the parsed namespace and returning an exit code. Components are imported only when
their subcommand runs (``--help`` imports only the light ``cli`` modules).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from . import __version__, exitcodes, log as alog

# subcommand -> module that registers it (in the order `--help` lists them). A daemon imports
# only its own: every module a process imports stays resident in it (tests/test_cli.py).
COMPONENTS = {
    "device-plugin": "device_plugin.cli",
    "tpu-selftest": "device_plugin.selftest",
    "dra": "device_plugin.dra.cli",
    "csi": "csi_driver.cli",
    "agent": "agent.cli",
    "cache": "agent.cache_cli",
    "bootstrap": "bootstrap.cli",
    "controller": "controller.cli",
}

# the daemons of every accelerator node: modules their libraries import but they do not use
# (grpc's asyncio API, prometheus_client's exposition, ...) run only if something uses them
# (accelnode/deferred.py DEFERRED)
NODE_DAEMONS = frozenset({"device-plugin", "dra", "csi", "agent"})

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(option: str) -> str:
    return "ACCELNODE_" + option.lstrip("-").replace("-", "_").upper()


def apply_env(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every long option of ``parser`` an ACCELNODE_* environment equivalent.

    The env value becomes the option's default (so the command line still wins) and the
    option's help text names the variable. A bad env value fails like a bad flag, but only when
    this parser's command runs: every subcommand's parser is built for ``--help``, and a variable
    meant for one command must not break another.
    """
    errors: list[str] = []
    for action in parser._actions:  # argparse has no public accessor
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest in ("help", "version"):
            continue
        name = env_name(longs[0])
        action.help = (action.help or "") + f" [env {name}]"
        raw = os.environ.get(name)
        if raw is None:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                errors.append(f"{name}={raw!r}: expected true or false")
                continue
            val = low in _TRUE
            action.default = val if isinstance(action, argparse._StoreTrueAction) else not val
        elif isinstance(action, argparse._AppendAction):
            try:
                action.default = [action.type(v) if action.type else v for v in raw.split(",") if v]
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                errors.append(f"{name}={raw!r}: {e}")
        else:
            try:
                val = action.type(raw) if action.type else raw
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                errors.append(f"{name}={raw!r}: {e}")
                continue
            if action.choices is not None and val not in action.choices:
                errors.append(f"{name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
                continue
            action.default = val
            action.required = False
    if errors:
        parser.set_defaults(_env_errors=(parser, errors))
    return parser


def check_env(args: argparse.Namespace) -> None:
    """Fail like argparse (exit 2) if the chosen command's ACCELNODE_* variables were bad."""
    parser, errors = getattr(args, "_env_errors", (None, []))
    if errors:
        parser.error("; ".join(errors))


def add_common(parser: argparse.ArgumentParser) -> None:
    """Flags every daemon shares: logging."""
    g = parser.add_argument_group("logging")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="minimum level to log (default: %(default)s)")
    g.add_argument("--log-format", default="json", choices=["json", "text"],
                   help="one JSON object per line, or key=value text (default: %(default)s)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` (a key of :data:`COMPONENTS`), only that
    subcommand's, so that running it imports no other component's module."""
    parser = argparse.ArgumentParser(
        prog="accelnode",
        description="Node-level software for Kubernetes accelerator nodes.",
        epilog="Every --flag of a subcommand can also be set as ACCELNODE_FLAG (upper case, '-' -> '_').\n\n"
        + exitcodes.HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"accelnode {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for modname in [COMPONENTS[command]] if command in COMPONENTS else COMPONENTS.values():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:  # component not built yet in this tree
                continue
            raise
        mod.register(sub)
    _own_errors(parser)
    return parser


def _own_errors(parser: argparse.ArgumentParser) -> None:
    """Record on every (sub)command's parser that it is the one that parsed, so that an unknown
    flag is reported with that command's usage, not the top-level one (argparse leaves the
    unknown arguments of a subcommand to the top-level parser)."""
    parser.set_defaults(_parser=parser)
    for action in parser._actions:  # argparse has no public accessor
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _own_errors(child)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in NODE_DAEMONS:
        from . import deferred

        deferred.install()  # before the component's modules import grpc
    parser = build_parser(argv[0] if argv else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    check_env(args)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return exitcodes.USAGE
    if hasattr(args, "log_level"):
        alog.setup(args.log_level, args.log_format)
    try:
        return int(args.func(args) or 0)
    except exitcodes.CLIError as e:
        print(f"accelnode {args.command}: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED
    except OSError as e:  # the node is not as the command needs it: path, socket, permission, port
        print(f"accelnode {args.command}: {e}", file=sys.stderr)
        return exitcodes.PREREQUISITE
    except Exception as e:  # last resort: the traceback once, as a structured record, and one line
        logging.getLogger("accelnode").critical("command died", exc_info=True,
                                                extra=alog.kv(command=args.command, error=f"{type(e).__name__}: {e}"))
        print(f"accelnode {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return exitcodes.FAILURE


if __name__ == "__main__":
    sys.exit(main())
