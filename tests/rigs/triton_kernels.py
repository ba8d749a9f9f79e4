"""Real Triton kernels compiled ahead of time for a GPU target, no GPU needed.

Run as ``python -m tests.rigs.triton_kernels --target cuda:90:32 [--count N | --kernels a,b]``
with ``TRITON_CACHE_DIR`` set: compiles each kernel with ``triton.compile(ASTSource(...),
target=GPUTarget(...))`` and prints one JSON report on stdout - per kernel whether Triton's own
compilation listener saw a cache hit, how many files its cache manager wrote (``put`` calls),
the error a compile raised (``errno`` name included) - and the wall time of the whole run.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; part of its cache key

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def softmax_kernel(out_ptr, in_ptr, in_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(in_ptr + row * in_stride + cols, mask=cols < n_cols, other=-float("inf"))
    num = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_stride + cols, num / tl.sum(num, axis=0), mask=cols < n_cols)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * sam + (k + rk)[None, :] * sak)
        b = tl.load(b_ptr + (k + rk)[:, None] * sbk + rn[None, :] * sbn)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(tl.float16))


_ADD_SIG = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
_SOFTMAX_SIG = {"out_ptr": "*fp32", "in_ptr": "*fp32", "in_stride": "i32", "out_stride": "i32", "n_cols": "i32",
                "BLOCK": "constexpr"}
_MM_SIG = {**{p: "*fp16" for p in ("a_ptr", "b_ptr", "c_ptr")},
           **{p: "i32" for p in ("M", "N", "K", "sam", "sak", "sbk", "sbn", "scm", "scn")},
           **{p: "constexpr" for p in ("BM", "BN", "BK")}}


def variants() -> dict[str, tuple]:
    """name -> (jit function, signature, constexprs, options); matmul variants first (they
    differ in constexprs only), then softmax and vector add at several block sizes and warps."""
    out = {}
    for bm in (16, 32, 64, 128):
        for bn in (16, 32, 64):
            for bk in (16, 32):
                out[f"matmul_{bm}x{bn}x{bk}"] = (matmul_kernel, _MM_SIG, {"BM": bm, "BN": bn, "BK": bk}, {})
    for block in (64, 128, 256, 512, 1024, 2048, 4096):
        for warps in (4, 8):
            out[f"softmax_{block}_w{warps}"] = (softmax_kernel, _SOFTMAX_SIG, {"BLOCK": block}, {"num_warps": warps})
            out[f"add_{block}_w{warps}"] = (add_kernel, _ADD_SIG, {"BLOCK": block}, {"num_warps": warps})
    return out


# A small set that covers the three kernels and constexpr variants of one of them.
BASIC = ["add_1024_w4", "softmax_256_w4", "matmul_32x32x32", "matmul_64x64x32"]


def parse_target(text: str):
    """``cuda:90:32`` / ``hip:gfx942:64`` -> GPUTarget."""
    from triton.backends.compiler import GPUTarget

    backend, arch, warp = text.split(":")
    return GPUTarget(backend, int(arch) if arch.isdigit() else arch, int(warp))


def watch_cache() -> tuple[list[bool] | None, list[int]]:
    """Triton's own evidence from here on: (``hits``, ``puts``). ``hits`` gets the compilation
    listener's ``cache_hit`` for every compile (None where this Triton has no listener);
    ``puts[0]`` counts the files its cache manager writes."""
    from triton.runtime import cache

    hits: list[bool] | None = []
    try:
        from triton import knobs
        knobs.compilation.listener = lambda **kw: hits.append(bool(kw.get("cache_hit")))
    except (ImportError, AttributeError):
        hits = None
    puts = [0]
    real_put = cache.FileCacheManager.put

    def counting_put(self, *a, **kw):
        puts[0] += 1
        return real_put(self, *a, **kw)

    cache.FileCacheManager.put = counting_put
    return hits, puts


def run_each(names: list[str], action) -> dict:
    """``action(name)`` for each variant (it returns more fields for the kernel's entry), with
    Triton's own evidence around it: ``cache_hit`` (None where Triton has no listener), ``puts``
    (files its cache manager wrote), an OSError as ``error`` and ``errno``, and the time."""
    hits, puts = watch_cache()
    kernels = {}
    start = time.monotonic()
    for name in names:
        if hits is not None:
            hits.clear()
        before, t0 = puts[0], time.monotonic()
        entry: dict = {}
        try:
            entry.update(action(name))
            entry["cache_hit"] = hits == [True] if hits is not None else None
        except OSError as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["errno"] = errno.errorcode.get(e.errno or 0)
        entry["puts"] = puts[0] - before
        entry["seconds"] = round(time.monotonic() - t0, 4)
        kernels[name] = entry
    return {"kernels": kernels, "seconds": round(time.monotonic() - start, 4)}


def compile_all(names: list[str], target) -> dict:
    from triton.compiler import ASTSource

    table = variants()

    def compile_one(name: str) -> dict:
        fn, sig, constexprs, options = table[name]
        triton.compile(ASTSource(fn, signature=sig, constexprs=constexprs), target=target, options=options)
        return {}

    return {"triton_version": triton.__version__, "cache_dir": os.environ.get("TRITON_CACHE_DIR"),
            **run_each(names, compile_one)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="cuda:90:32", help="BACKEND:ARCH:WARP (default: %(default)s)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--kernels", help="comma-separated variant names (default: the basic four)")
    group.add_argument("--count", type=int, help="the first N variants")
    args = ap.parse_args(argv)
    names = list(variants())[: args.count] if args.count else (args.kernels.split(",") if args.kernels else BASIC)
    json.dump(compile_all(names, parse_target(args.target)), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
