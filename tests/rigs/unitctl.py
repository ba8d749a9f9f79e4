"""``systemctl`` for a rig without systemd: starts a unit's process as systemd would.

``kubeadm join`` drives kubelet through ``systemctl`` (``is-enabled``, ``status``, ``stop``,
``daemon-reload``, ``start``). On a VM that is systemd with our shipped units
(``daemonsets/systemd/kubelet.service`` and its drop-in ``kubelet.service.d/10-kubeadm.conf``).
In the rig (a container without systemd) this program stands in, put first on ``PATH`` as
``systemctl`` by :func:`install`: it reads the same unit files, applies the drop-ins the way
systemd does (``ExecStart=`` empty resets, ``Environment=``, ``EnvironmentFile=`` with the ``-``
prefix for optional files, ``$VAR`` split on white space, ``${VAR}`` one word) and starts
``ExecStart`` in its own session with its output in ``<state>/<unit>.log``, remembering the pid.

What it does not do: restart a unit that exits (``Restart=``); kubeadm starts kubelet only once
its configuration is written, so the first start is the one that counts, and a kubelet that
exits fails the test that waits on it. A program whose absolute path does not exist in the rig
is looked up by name in ``--bin-dir`` (the rig's binaries are not in ``/usr/local/bin``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def read_unit(units: Path, unit: str) -> dict[str, list[str]]:
    """The [Service] settings of ``unit`` with its drop-ins applied, in order (each key a list)."""
    files = [units / unit, *sorted((units / f"{unit}.d").glob("*.conf"))]
    settings: dict[str, list[str]] = {}
    for f in files:
        section = None
        for line in f.read_text().splitlines():
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            if section != "Service" or "=" not in line:
                continue
            key, value = line.split("=", 1)
            if key == "ExecStart" and value == "":
                settings[key] = []  # an empty assignment resets the list
                continue
            settings.setdefault(key, []).append(value)
    return settings


def environment(settings: dict[str, list[str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in settings.get("Environment", []):
        for word in shlex.split(value):
            k, _, v = word.partition("=")
            env[k] = v
    for value in settings.get("EnvironmentFile", []):
        optional = value.startswith("-")
        path = Path(value.lstrip("-"))
        if not path.exists():
            if optional:
                continue
            raise SystemExit(f"EnvironmentFile {path} is missing")
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and line[0] not in "#;" and "=" in line:
                k, _, v = line.partition("=")
                env[k.strip()] = _unquote(v)
    return env


def command(settings: dict[str, list[str]], env: dict[str, str], bin_dir: Path | None) -> list[str]:
    (exec_start,) = settings["ExecStart"][-1:]  # a simple service has one
    argv: list[str] = []
    for word in shlex.split(exec_start):
        m = re.fullmatch(r"\$(\w+)", word)
        if m:  # $VAR: split on white space, dropped when empty
            argv += env.get(m.group(1), "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    if not os.path.exists(argv[0]) and bin_dir is not None and (bin_dir / Path(argv[0]).name).exists():
        argv[0] = str(bin_dir / Path(argv[0]).name)
    return argv


class Units:
    def __init__(self, units: Path, state: Path, bin_dir: Path | None):
        self.units, self.state, self.bin_dir = units, state, bin_dir

    def _pid(self, unit: str) -> int | None:
        try:
            pid = int((self.state / f"{unit}.pid").read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        try:  # a zombie (our child, not reaped yet) is not running
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
                return None
        except OSError:
            return None
        return pid

    def start(self, unit: str) -> int:
        if self._pid(unit):
            return 0
        settings = read_unit(self.units, unit)
        argv = command(settings, environment(settings), self.bin_dir)
        self.state.mkdir(parents=True, exist_ok=True)
        with open(self.state / f"{unit}.log", "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        (self.state / f"{unit}.pid").write_text(str(proc.pid))
        (self.state / f"{unit}.argv").write_text("\n".join(argv) + "\n")
        return 0

    def stop(self, unit: str, timeout: float = 10.0) -> int:
        pid = self._pid(unit)
        if pid is None:
            return 0
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self._pid(unit) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._pid(unit):
            os.kill(pid, signal.SIGKILL)
        return 0

    def run(self, verb: str, unit: str | None) -> int:
        if verb == "daemon-reload":
            return 0
        if unit is None:
            print(f"systemctl (rig): {verb} needs a unit", file=sys.stderr)
            return 1
        unit = unit if "." in unit else f"{unit}.service"
        exists = (self.units / unit).exists()
        if verb == "status":
            print(f"  Loaded: {'loaded' if exists else 'not-found'} ({self.units / unit})")
            print(f"  Active: {'active (running)' if self._pid(unit) else 'inactive (dead)'}")
            return 0 if self._pid(unit) else 3
        if verb == "is-enabled":
            print("enabled" if exists else "not-found")
            return 0 if exists else 1
        if verb == "is-active":
            print("active" if self._pid(unit) else "inactive")
            return 0 if self._pid(unit) else 3
        if not exists:
            print(f"Unit {unit} could not be found.", file=sys.stderr)
            return 5
        if verb == "start":
            return self.start(unit)
        if verb == "stop":
            return self.stop(unit)
        if verb == "restart":
            self.stop(unit)
            return self.start(unit)
        if verb in ("enable", "disable", "unmask", "mask"):
            return 0
        print(f"systemctl (rig): {verb} is not supported", file=sys.stderr)
        return 1


def install(bin_dir: Path, units: Path, state: Path, tools_bin: Path | None) -> Path:
    """Write ``bin_dir/systemctl`` (this program for these units) and return it."""
    root = Path(__file__).resolve().parents[2]
    exe = bin_dir / "systemctl"
    bin_dir.mkdir(parents=True, exist_ok=True)
    args = f"--units {shlex.quote(str(units))} --state {shlex.quote(str(state))}"
    if tools_bin is not None:
        args += f" --bin-dir {shlex.quote(str(tools_bin))}"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(root))} exec {shlex.quote(sys.executable)} "
                   f"-m tests.rigs.unitctl {args} \"$@\"\n")
    exe.chmod(0o755)
    return exe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="systemctl", description=__doc__.splitlines()[0])
    p.add_argument("--units", type=Path, required=True)
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--bin-dir", type=Path, default=None)
    p.add_argument("verb")
    p.add_argument("unit", nargs="?")
    args, _ = p.parse_known_args(argv)
    return Units(args.units, args.state, args.bin_dir).run(args.verb, args.unit)


if __name__ == "__main__":
    sys.exit(main())
