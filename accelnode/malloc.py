"""glibc malloc settings for the long-running node daemons (device plugin, CSI driver, agent).

glibc gives each thread that allocates its own arena (up to 8 per core) and raises its mmap
threshold the first time a large block is freed; the agent's pulls allocate MiB-sized buffers on
a few threads, and what those arenas keep afterwards stayed resident: about 6 MB RSS after one
512 MiB pull, never given back (bench/bench_csi.py, bench/bench_e2e.py measure it). One arena
is enough for these daemons: their Python code runs one thread at a time under the GIL and the
few allocations made outside it (gRPC's threads, zstd) are short. Elsewhere than glibc this does
nothing. The same as ``MALLOC_ARENA_MAX=1`` in the environment, which it does not override.

Freed memory also stays with the process until glibc is asked to give it back: the imports at
start free much of what they allocated (sources read, code compiled), and a pull frees its
buffers, but the heap only shrinks from its top. :func:`trim` gives every free page back
(``malloc_trim``); the daemons call it once serving and then in their main loop (at most every
:data:`TRIM_SECONDS` when idle), and the agent after each pull (about 2 MB per daemon, bench/bench_e2e.py).
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # glibc's malloc.h
TRIM_SECONDS = 60.0  # how often an idle daemon's main loop gives freed memory back


def _libc(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc (musl has neither mallopt nor malloc_trim)
        return None


def limit_arenas(arenas: int = 1) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` (call before starting threads); True when applied."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_ARENA_MAX, arenas) == 1


def trim() -> bool:
    """Give the C heap's free pages back to the kernel; True when glibc released any."""
    malloc_trim = _libc("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return malloc_trim(0) == 1
