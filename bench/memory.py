"""Memory of a running process as every benchmark reports it: RSS, PSS and USS in MiB, read from
``/proc/PID/smaps_rollup`` in one go (the kernel's own sums, the same figures ``smem`` shows).

* RSS: every resident page the process maps, shared ones in full;
* PSS: shared pages divided among the processes that map them (summed over daemons: what they
  cost the node together);
* USS: pages no other process maps (Private_Clean + Private_Dirty): what stopping it gives back.

Not a benchmark group of its own (``bench/run.py`` runs ``bench_*.py`` only).
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class Memory(NamedTuple):
    rss_mb: float
    pss_mb: float
    uss_mb: float

    def __add__(self, other):  # Memory + Memory: the sum of each figure (a tuple would concatenate)
        return Memory(*(a + b for a, b in zip(self, other)))


NONE = Memory(0.0, 0.0, 0.0)


def of(pid: int) -> Memory:
    """RSS, PSS and USS of ``pid`` now, in MiB."""
    kib: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                kib[key] = int(parts[0])
    return Memory(kib["Rss"] / 1024, kib["Pss"] / 1024, (kib["Private_Clean"] + kib["Private_Dirty"]) / 1024)


def emit_all(emit: Callable[..., None], prefix: str, mem: Memory, fmt: str = ".1f") -> None:
    """``<prefix>rss_mb``, ``<prefix>pss_mb`` and ``<prefix>uss_mb`` through a group's ``emit``."""
    emit(f"{prefix}rss_mb", mem.rss_mb, fmt)
    emit(f"{prefix}pss_mb", mem.pss_mb, fmt)
    emit(f"{prefix}uss_mb", mem.uss_mb, fmt)
