"""Triton on a real GPU through the CSI driver's copy-on-write view (a device check, not a CI test).

Run as root on a machine with an NVIDIA GPU, PyTorch and Triton (the device machine of
docs/development.md), from the repository root: ``python3 bench/gpu_triton_view.py``. Each step
that stands for a pod is a fresh Python process that launches real kernels and checks their
results against PyTorch; Triton's own evidence says hit or miss (its compilation listener, where
the version has it, and the writes of its cache manager):

1. fill: a cold run writes Triton's cache tree under ``<target>/io.triton.cache`` (the pod path);
2. the tree becomes the store's immutable copy (moved, made read-only, every file hashed);
3. a read-only bind of it at the target: the cached kernels hit, a kernel it lacks fails with
   EROFS (what a read-only mount does to a Triton user today);
4. pod A: a view made by :class:`csi_driver.views.Views` (overlay, tmpfs upper) at the target:
   every cached kernel hits, the missing one compiles into A's private layer;
5. pod B: a new view at the same target: the cached kernels hit, A's new kernel is not there;
6. the store's copy is byte for byte what it was.

``--aot`` compiles ahead of time for ``cuda:90`` instead of launching (no GPU needed), to check
the steps here. Prints one JSON report and ``BENCH gpu_triton_view ...`` lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHED = ["add_1024_w4", "add_256_w8", "softmax_256_w4", "softmax_1024_w8", "matmul_32x32x32", "matmul_64x64x32"]
MISSING = "add_512_w4"


# -- one "pod": a fresh process ------------------------------------------------------------------

def launch(names: list[str]) -> dict:
    """Launch each variant on the GPU, check it against PyTorch; Triton's hit/miss evidence."""
    import torch
    import triton

    from tests.rigs.triton_kernels import add_kernel, matmul_kernel, run_each, softmax_kernel, variants

    table = variants()

    def launch_one(name: str) -> dict:
        fn, _sig, constexprs, options = table[name]
        if fn is add_kernel:
            n = 100_000
            x, y = torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
            out = torch.empty_like(x)
            fn[(triton.cdiv(n, constexprs["BLOCK"]),)](x, y, out, n, **constexprs, **options)
            ok = torch.allclose(out, x + y)
        elif fn is softmax_kernel:
            rows, cols = 64, constexprs["BLOCK"] - 3
            inp = torch.randn(rows, cols, device="cuda")
            out = torch.empty_like(inp)
            fn[(rows,)](out, inp, inp.stride(0), out.stride(0), cols, **constexprs, **options)
            ok = torch.allclose(out, torch.softmax(inp, dim=1), atol=1e-5)
        else:
            assert fn is matmul_kernel
            m = n = k = 128
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            b = torch.randn(k, n, device="cuda", dtype=torch.float16)
            c = torch.empty(m, n, device="cuda", dtype=torch.float16)
            fn[(m // constexprs["BM"], n // constexprs["BN"])](
                a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                **constexprs, **options)
            ok = torch.allclose(c.float(), (a.float() @ b.float()), atol=0.1, rtol=0.01)
        torch.cuda.synchronize()
        return {"correct": bool(ok)}

    return {"triton": triton.__version__, "device": torch.cuda.get_device_name(), **run_each(names, launch_one)}


def compile_aot(names: list[str]) -> dict:
    from tests.rigs.triton_kernels import compile_all, parse_target

    return compile_all(names, parse_target("cuda:90:32"))


def pod(names: list[str], target: Path, aot: bool) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(target / "io.triton.cache"),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, __file__, "--pod", ",".join(names)] + (["--aot"] if aot else []),
                         env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"failed": out.stderr[-3000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the orchestration -------------------------------------------------------------------------

def listing(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def summary(rep: dict) -> dict:
    ks = rep.get("kernels", {})
    return {"hits": sum(1 for e in ks.values() if e.get("cache_hit")), "kernels": len(ks),
            "puts": sum(e.get("puts", 0) for e in ks.values()),
            "correct": sum(1 for e in ks.values() if e.get("correct")),
            "errors": {k: e["error"][:160] for k, e in ks.items() if "error" in e}, "seconds": rep.get("seconds"),
            **({"failed": rep["failed"][-600:]} if "failed" in rep else {})}


def drop_view(views, target: Path) -> None:
    """As unpublish does: the overlay at the target first, then the view's tmpfs and directory."""
    from csi_driver import mounts

    mounts.unmount(target)
    views.remove(str(target))


def main(aot: bool, work: Path) -> dict:
    from csi_driver import mounts
    from csi_driver.views import Views

    if work.exists():
        shutil.rmtree(work)
    target, content, views = work / "cache", work / "store" / "content", Views(str(work / "views"))
    target.mkdir(parents=True)
    content.mkdir(parents=True)
    views.start()
    out: dict = {"aot": aot}
    out["fill"] = summary(pod(CACHED, target, aot))
    shutil.move(str(target / "io.triton.cache"), content / "io.triton.cache")
    for p in content.rglob("*"):
        p.chmod(p.stat().st_mode & ~0o222)
    before = listing(content)
    out["store_files"] = len(before)

    subprocess.run(["mount", "--bind", str(content), str(target)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
    try:
        out["read_only_bind"] = summary(pod(CACHED + [MISSING], target, aot))
    finally:
        mounts.unmount(target)

    try:
        views.create(str(target), str(content), 64 << 20, 0, "sha256:" + "0" * 64)
    except OSError as e:
        out["view"] = f"cannot make a view here: {e}"
        return out
    try:
        out["pod_a"] = summary(pod(CACHED + [MISSING], target, aot))
        out["pod_a_again"] = summary(pod([MISSING], target, aot))
        upper = Path(views.dir_of(str(target))) / "upper" / "io.triton.cache"
        out["pod_a_private_entries"] = sorted(p.name for p in upper.iterdir()) if upper.is_dir() else []
    finally:
        drop_view(views, target)
    views.create(str(target), str(content), 64 << 20, 0, "sha256:" + "0" * 64)
    try:
        out["pod_b"] = summary(pod(CACHED + [MISSING], target, aot))
    finally:
        drop_view(views, target)
    out["store_unchanged"] = listing(content) == before
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aot", action="store_true", help="compile for cuda:90 ahead of time instead of launching")
    ap.add_argument("--pod", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="/tmp/gpu-triton-view", help="scratch directory (default: %(default)s)")
    args = ap.parse_args()
    if args.pod:
        names = args.pod.split(",")
        print(json.dumps(compile_aot(names) if args.aot else launch(names)))
        sys.exit(0)
    sys.path.insert(0, str(ROOT))
    result = main(args.aot, Path(args.work))
    print(json.dumps(result, indent=1))
    fill, a = result.get("fill", {}), result.get("pod_a", {})
    print(f"BENCH gpu_triton_view cached={len(CACHED)} fill_s={fill.get('seconds')} pod_a_s={a.get('seconds')} "
          f"pod_a_hits={a.get('hits')} store_unchanged={int(bool(result.get('store_unchanged')))}")
