"""Triton kernels ready from a pulled cache vs compiled cold (triton from the ``triton`` extra).

N=50 real kernels (tests/rigs/triton_kernels.py: matmul, softmax and vector-add variants),
compiled ahead of time for ``cuda:90`` with no GPU, each round in a fresh Python process:

- cold: an empty ``TRITON_CACHE_DIR``;
- cached: the same kernels after ``accelnode cache build`` -> local registry -> the store's pull,
  with ``TRITON_CACHE_DIR`` on the installed cache seen read-only at the build's ``--pod-path``
  (a read-only bind mount as the CSI driver makes, when root; a copy otherwise).

Printed: the time until all 50 are ready inside the process (``ready_50_*_s``, what the ratio
compares) and the whole process wall time including interpreter and ``import triton``
(``process_50_*_s``); the median of 3 rounds, cold and cached interleaved. The pull itself
happens before a pod starts and is printed on its own (``pull_s``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
N = 50
ROUNDS = 3


def _rig(cache_dir: Path) -> tuple[dict, float]:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tests.rigs.triton_kernels", "--count", str(N)], env=env,
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(proc.stdout), time.monotonic() - t0


def main() -> None:
    from accelnode.oci.build import build
    from accelnode.oci.registry import RegistryOptions
    from agent.store import CacheStore
    from tests.fixtures.registry import RunningRegistry

    work = Path(tempfile.mkdtemp(prefix="bench-triton.", dir=os.environ.get("ACCELNODE_BENCH_DIR")))
    (work / "registry").mkdir()
    reg = RunningRegistry(work / "registry")
    pod = work / "pod" / "cache"
    mounted = False
    try:
        src = work / "build-cache"
        report, _ = _rig(src)
        assert not any(k.get("cache_hit") for k in report["kernels"].values()), "a fresh cache dir hit"
        opts = RegistryOptions(plain_http=True)
        built = build(src, f"{reg.host}/bench/triton:n{N}", options=opts, pod_path=str(pod / "io.triton.cache"))
        t0 = time.monotonic()
        inst = CacheStore(work / "store", registry=opts).ensure(built.reference)
        pull_s = time.monotonic() - t0
        shutil.rmtree(src)
        pod.mkdir(parents=True)
        if os.geteuid() == 0:
            subprocess.run(["mount", "--bind", str(inst.path), str(pod)], check=True)
            mounted = True
            subprocess.run(["mount", "-o", "remount,bind,ro", str(pod)], check=True)
        else:
            shutil.rmtree(pod)
            shutil.copytree(inst.path, pod)
        cold, warm, cold_wall, warm_wall = [], [], [], []
        for i in range(ROUNDS):
            for which in (("cold", "cached") if i % 2 == 0 else ("cached", "cold")):
                if which == "cold":
                    r, wall = _rig(work / f"cold-{i}")
                    assert not any(k.get("cache_hit") for k in r["kernels"].values())
                    cold.append(r["seconds"])
                    cold_wall.append(wall)
                else:
                    r, wall = _rig(pod / "io.triton.cache")
                    misses = [n for n, k in r["kernels"].items() if not k.get("cache_hit") or k["puts"]]
                    assert not misses, f"not served from the cache: {misses}"
                    warm.append(r["seconds"])
                    warm_wall.append(wall)
        c, w = statistics.median(cold), statistics.median(warm)
        print(f"BENCH triton triton_version={r['triton_version']} kernels={N} "
              f"cache_bytes={built.labels['cache.triton.image/cache-size-bytes']} pull_s={pull_s:.3f}", flush=True)
        print(f"BENCH triton ready_{N}_cold_s={c:.3f} ready_{N}_cached_s={w:.3f}", flush=True)
        print(f"BENCH triton process_{N}_cold_s={statistics.median(cold_wall):.3f} "
              f"process_{N}_cached_s={statistics.median(warm_wall):.3f}", flush=True)
        print(f"BENCH triton ready_{N}_cached_vs_cold_ratio={w / c:.3f} target_ready_{N}_cached_vs_cold_ratio<=0.1",
              flush=True)
    finally:
        if mounted:
            subprocess.run(["umount", str(pod)], check=False)
        reg.stop()
        if not mounted or not any(str(pod) in line for line in open("/proc/self/mountinfo")):
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
