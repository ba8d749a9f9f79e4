"""Memory of a running process as every benchmark reports it: RSS, PSS and USS in MiB, read from
``/proc/PID/smaps_rollup`` in one go (the kernel's own sums, the same figures ``smem`` shows).

* RSS: every resident page the process maps, shared ones in full;
* PSS: shared pages divided among the processes that map them (summed over daemons: what they
  cost the node together);
* USS: pages no other process maps (Private_Clean + Private_Dirty): what stopping it gives back.

Not a benchmark group of its own (``bench/run.py`` runs ``bench_*.py`` only).
"""

from __future__ import annotations

import os
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


# where a process's memory lies: each mapping of /proc/PID/smaps put under one of these, by
# the first pattern its path contains (anonymous mappings: their kernel name, or "anon")
KINDS = (
    ("grpc", ("cygrpc", "grpc")),
    ("protobuf", ("google/_upb", "protobuf")),
    ("crypto", ("libcrypto", "libssl", "_ssl", "_hashlib", "cryptography", "_cffi")),
    ("zstd", ("zstandard", "zstd")),
    ("isal", ("isal",)),
    ("python", ("python3", "libpython")),
    ("libc", ("libc.so", "libm.so", "ld-linux", "libstdc++", "libgcc")),
    ("other .so", (".so",)),
    ("heap", ("[heap]",)),
    ("stack", ("[stack",)),
)
THREAD_STACK_KIB = 8192  # glibc's default thread stack (ulimit -s): an anonymous mapping of exactly this size


def by_mapping(pid: int) -> dict[str, Memory]:
    """RSS, PSS and USS of ``pid`` now, in MiB, by kind of mapping (:data:`KINDS`): which
    library, the C heap, the threads' stacks (``stacks``: anonymous mappings of
    :data:`THREAD_STACK_KIB`), or other anonymous memory (``anon``: Python's own arenas, mostly)."""
    out: dict[str, list[float]] = {}
    kind = "anon"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 6)
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's first line
                path = head[5].strip() if len(head) > 5 else ""
                start, end = (int(x, 16) for x in head[0].split("-"))
                kind = next((k for k, pats in KINDS if any(p in path for p in pats)),
                            "other file" if path.startswith("/") else
                            "stacks" if not path and end - start == THREAD_STACK_KIB << 10 else "anon")
                continue
            key = head[0].rstrip(":")
            if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
                row = out.setdefault(kind, [0.0, 0.0, 0.0])
                mib = int(head[1]) / 1024
                row[0 if key == "Rss" else 1 if key == "Pss" else 2] += mib
    return {k: Memory(*v) for k, v in sorted(out.items(), key=lambda kv: -kv[1][0])}


def threads(pid: int) -> int:
    """How many threads ``pid`` runs now."""
    return len(os.listdir(f"/proc/{pid}/task"))


def breakdown(name: str, pid: int) -> str:
    """One line per kind of mapping of ``pid``, for a benchmark's stderr, and its thread count."""
    rows = (f"memory {name} {kind:<11} rss={m.rss_mb:6.1f} pss={m.pss_mb:6.1f} uss={m.uss_mb:6.1f}"
            for kind, m in by_mapping(pid).items())
    return "\n".join((f"memory {name} threads={threads(pid)}", *rows))
