#!/usr/bin/env python3
"""Run benchmark groups and judge their targets: ``bench/run.py [--report-only] [GROUP...]``.

Each group is ``bench/bench_<group>.py`` with a ``main()`` that prints lines of tokens::

    BENCH <group> <metric>=<value>               a measurement
    BENCH <group> target_<metric><=<value>       the measurement must be at most <value>
    BENCH <group> target_<metric>>=<value>       ... at least <value>
    BENCH <group> target_<metric>==<value>       ... exactly <value>

A line may hold several tokens (``BENCH cache x_ms=3.1 target_x_ms<=20``); values are numbers.
A target is judged against the last value its group printed for ``<metric>``; a target whose
metric was never printed is missed, and so is one written without an operator
(``target_x=5`` says no direction, and is reported as malformed).

After all groups ran, one ``TARGET <group> <metric> <value> <op> <limit> ok|MISSED`` line per
target goes to stdout. Exit status: 0 when every group ran and every target was met; 1 when a
group crashed (printed as ``BENCH <group> error=1``) or, unless ``--report-only``, a target was
missed or malformed; 2 on bad arguments. ``make bench BENCH_ARGS=--report-only`` passes the flag.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MEASURE = re.compile(r"^(?!target_)([A-Za-z0-9_.]+)=(\S+)$")
TARGET = re.compile(r"^target_([A-Za-z0-9_.]+?)(<=|>=|==|=)(\S+)$")
OPS = {"<=": lambda v, t: v <= t, ">=": lambda v, t: v >= t, "==": lambda v, t: v == t}


def groups() -> list[str]:
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))


class Tee(io.TextIOBase):
    """Passes writes through to ``out`` and keeps the ``BENCH`` lines among them."""

    def __init__(self, out):
        self.out, self.lines, self._partial = out, [], ""

    def write(self, s: str) -> int:
        self.out.write(s)
        *done, self._partial = (self._partial + s).split("\n")
        self.lines += [ln for ln in done if ln.startswith("BENCH ")]
        return len(s)

    def flush(self) -> None:
        self.out.flush()


def judge(lines: list[str]) -> list[tuple[str, str, str, str, str, bool]]:
    """(group, metric, value, op, limit, met) for every target among ``lines``."""
    values: dict[tuple[str, str], str] = {}
    targets: list[tuple[str, str, str, str]] = []
    for line in lines:
        _, group, *tokens = line.split()
        for tok in tokens:
            if m := TARGET.match(tok):
                targets.append((group, m.group(1), m.group(2), m.group(3)))
            elif m := MEASURE.match(tok):
                values[(group, m.group(1))] = m.group(2)
    out = []
    for group, metric, op, limit in targets:
        value = values.get((group, metric), "unmeasured")
        try:
            met = op in OPS and OPS[op](float(value), float(limit))
        except ValueError:
            met = False
        out.append((group, metric, value, op if op in OPS else f"{op} (malformed: no direction)", limit, met))
    return out


def run_group(g: str) -> bool:
    spec = importlib.util.spec_from_file_location(f"bench_{g}", HERE / f"bench_{g}.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        mod.main()
        return True
    except Exception:
        traceback.print_exc()
        print(f"BENCH {g} error=1", flush=True)
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--report-only", action="store_true",
                    help="print missed targets but exit 0 for them (a crashed group still exits 1)")
    ap.add_argument("groups", nargs="*", metavar="GROUP", help=f"groups to run (default: all of {', '.join(groups())})")
    args = ap.parse_args(argv)
    names = [g for g in args.groups if g] or groups()
    unknown = [g for g in names if g not in groups()]
    if unknown:
        print(f"unknown benchmark group(s): {', '.join(unknown)}; have: {', '.join(groups())}", file=sys.stderr)
        return 2
    tee, real = Tee(sys.stdout), sys.stdout
    sys.stdout = tee
    try:
        crashed = [g for g in names if not run_group(g)]
    finally:
        sys.stdout = real
    verdicts = judge(tee.lines)
    for group, metric, value, op, limit, met in verdicts:
        print(f"TARGET {group} {metric} {value} {op} {limit} {'ok' if met else 'MISSED'}", flush=True)
    missed = [v for v in verdicts if not v[5]]
    if missed:
        print(f"{len(missed)} of {len(verdicts)} targets missed"
              + (" (--report-only: not failing)" if args.report_only else ""), file=sys.stderr)
    if crashed:
        print(f"benchmark group(s) crashed: {', '.join(crashed)}", file=sys.stderr)
    return 1 if crashed or (missed and not args.report_only) else 0


if __name__ == "__main__":
    sys.exit(main())
