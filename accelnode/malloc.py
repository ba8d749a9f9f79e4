"""glibc malloc settings for the long-running node daemons (device plugin, CSI driver, agent).

glibc gives each thread that allocates its own arena (up to 8 per core) and raises its mmap
threshold the first time a large block is freed; the agent's pulls allocate MiB-sized buffers on
a few threads, and what those arenas keep afterwards stayed resident: about 6 MB RSS after one
512 MiB pull, never given back (bench/bench_csi.py, bench/bench_e2e.py measure it). One arena
is enough for these daemons: their Python code runs one thread at a time under the GIL and the
few allocations made outside it (gRPC's threads, zstd) are short. Elsewhere than glibc this does
nothing. The same as ``MALLOC_ARENA_MAX=1`` in the environment, which it does not override.
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # glibc's malloc.h


def limit_arenas(arenas: int = 1) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` (call before starting threads); True when applied."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_ARENA_MAX, arenas) == 1
