"""Device plugin benchmarks against the real ``accelnode device-plugin`` on a simulated v5e-8 host,
seen through the kubelet harness (needs root: the simulated host has real device nodes).

The plugin runs with its default ``--health-interval`` (the sysfs tick, 5 s). Metrics:
health-change propagation on both paths - the event path (a chip's device node removed or
restored -> kubelet holds the new health) and the tick path (the chip's AER fatal counter bumped
or reset, which gives no event -> seen on the next tick, so within the interval) -, the idle CPU
of the plugin process over a quiet window (streams open, nothing changing), kubelet-restart
re-registration (harness restart -> plugin registered again and its list received), Allocate
latency, steady RSS, PSS and USS (bench/memory.py: USS is the part not shared with other
processes; much of the rest are grpcio's and libpython's library pages).
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import memory
from tests.rigs.kubelet_harness import KubeletHarness
from tests.rigs.simhost import SimHost

G = "device_plugin"
EVENT_TRIALS = 60
TICK_TRIALS = 10
TICK_S = 5.0  # the plugin's default --health-interval
IDLE_S = float(os.environ.get("BENCH_DEVICE_PLUGIN_IDLE_S", "30"))
RESTART_TRIALS = 10
ALLOCATE_CALLS = 1000
TARGETS = {"health_event_p99_ms": "<=100", "health_tick_max_ms": f"<={TICK_S * 1000 + 100:.0f}",
           "idle_cpu_percent": "<=0.5", "reregister_max_ms": "<=1000", "allocate_p99_ms": "<=5",
           "rss_mb": "<=40"}  # bench/run.py's format


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def emit(metric: str, value: float, fmt: str = ".2f") -> None:
    print(f"BENCH {G} {metric}={value:{fmt}}", flush=True)
    if metric in TARGETS:
        print(f"BENCH {G} target_{metric}{TARGETS[metric]}", flush=True)


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench device_plugin needs root (the simulated host has real device nodes)")
    with tempfile.TemporaryDirectory(prefix="accelnode-bench-") as td:
        host = SimHost.preset(Path(td) / "host", "v5e-8")
        kubelet = KubeletHarness(Path(td) / "device-plugins").start()
        proc = subprocess.Popen(
            [sys.executable, "-m", "accelnode", "device-plugin", "--sysfs-root", str(host.sysfs_root),
             "--dev-root", str(host.dev_root), "--kubelet-dir", str(kubelet.dir), "--metrics-address", "",
             "--log-level", "warning"])
        try:
            kubelet.wait(lambda k: len(k.devices()) == 8, what="8 chips listed")
            run(host, kubelet, proc.pid)
        finally:
            proc.terminate()
            proc.wait(10)
            kubelet.stop()


def flips(host: SimHost, kubelet: KubeletHarness, trials: int, breaks, heals, jitter: float) -> list[float]:
    """Milliseconds from each break/heal of chip 3 to kubelet holding its new health."""
    chip = host.chips()[3]
    dev_id = f"tpu-{chip}"
    lat = []
    rng = random.Random(2)
    for i in range(trials):
        time.sleep(rng.uniform(0, jitter))  # changes arrive at random moments, not in step with the tick
        want = "Unhealthy" if i % 2 == 0 else "Healthy"
        seen = len(kubelet.updates)
        t0 = time.monotonic()
        (breaks if want == "Unhealthy" else heals)(chip)
        t1 = kubelet.wait(lambda k: next((t for t, _, d in k.updates[seen:] if d[dev_id].health == want), None),
                          timeout=TICK_S * 3, what=f"{dev_id} {want}")
        lat.append((t1 - t0) * 1000)
    return lat


def run(host: SimHost, kubelet: KubeletHarness, pid: int) -> None:
    lat = flips(host, kubelet, EVENT_TRIALS, host.remove_dev_node, host.restore_dev_node, 0.06)
    emit("health_event_p50_ms", statistics.median(lat))
    emit("health_event_p99_ms", pct(lat, 99))
    lat = flips(host, kubelet, TICK_TRIALS, host.bump_aer_fatal, host.reset_aer, TICK_S)
    emit("health_tick_p50_ms", statistics.median(lat))
    emit("health_tick_max_ms", max(lat))

    proc = psutil.Process(pid)
    time.sleep(1.0)  # streams open, nothing changing
    before, t0 = proc.cpu_times(), time.monotonic()
    time.sleep(IDLE_S)
    after, elapsed = proc.cpu_times(), time.monotonic() - t0
    busy = (after.user - before.user) + (after.system - before.system)
    emit("idle_cpu_percent", busy / elapsed * 100)

    restarts = []
    for _ in range(RESTART_TRIALS):
        n = len(kubelet.registrations)
        t0 = time.monotonic()
        kubelet.restart()
        kubelet.wait(lambda k: len(k.registrations) > n and len(k.devices()) == 8, what="re-registration")
        restarts.append((time.monotonic() - t0) * 1000)
    emit("reregister_p50_ms", statistics.median(restarts))
    emit("reregister_max_ms", max(restarts))

    ids = sorted(kubelet.devices())
    calls = []
    for i in range(ALLOCATE_CALLS):
        t0 = time.perf_counter()
        kubelet.allocate([ids[i % 4 * 2], ids[i % 4 * 2 + 1]])
        calls.append((time.perf_counter() - t0) * 1000)
    emit("allocate_p50_ms", statistics.median(calls))
    emit("allocate_p99_ms", pct(calls, 99))

    time.sleep(1.0)  # steady state: streams open, nothing changing
    memory.emit_all(emit, "", memory.of(pid), ".2f")


if __name__ == "__main__":
    main()
