#!/usr/bin/env python3
"""Run benchmark groups: ``bench/run.py [GROUP]``.

Each group is ``bench/bench_<group>.py`` with a ``main()`` that prints
``BENCH <group> <metric>=<value>`` lines (and may print targets as ``target_<metric>=...``).
Exit status is non-zero if a group crashed (a missed target is reported, not fatal).
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def groups() -> list[str]:
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))


def main() -> int:
    want = [g for g in sys.argv[1:] if g]
    names = want or groups()
    unknown = [g for g in names if g not in groups()]
    if unknown:
        print(f"unknown benchmark group(s): {', '.join(unknown)}; have: {', '.join(groups())}", file=sys.stderr)
        return 2
    failed = 0
    for g in names:
        spec = importlib.util.spec_from_file_location(f"bench_{g}", HERE / f"bench_{g}.py")
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
            mod.main()
        except Exception:
            traceback.print_exc()
            print(f"BENCH {g} error=1", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
