"""The node as users run it (tests/rigs/nodedemo.py's rig: a real kubelet, containerd, our
image, ``kubectl apply -k daemonsets/``):

- ``suite_ready_s``: apply -> every accelnode pod Ready (the image already in containerd);
- ``pod_running_cold_s``: a workload pod created -> Running, its 512 MiB cache not yet on the node
  (the agent pulls, verifies and unpacks it during NodePublishVolume);
- ``ctr_pull_s``: ``ctr images pull`` (pull + unpack into containerd's snapshotter) of that same
  image from the same registry, the anchor; ``cold_vs_ctr_ratio`` = pod_running_cold_s / ctr_pull_s
  (the pod's figure also holds scheduling, the sandbox and the container start);
- ``pod_running_warm_s``: a second pod with the same cache (already on the node) -> Running;
- ``node_daemons_rss_mb``: RSS of the node daemons (device plugin, CSI driver, agent) together as
  pods, idle after the pulls (target: 130 MB RSS, 95 MB PSS); PSS and USS beside it, and each daemon's own
  (``<daemon>_rss_mb``, ``_pss_mb``, ``_uss_mb``; bench/memory.py says what each figure counts).
The cache layer is uncompressed (``--compression none``), so neither side spends the time on gzip.
Needs root and the tools of ``make tools``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import memory  # noqa: E402

G = "e2e"
CACHE_MIB = 512
TARGETS = {"node_daemons_rss_mb": "<=130", "node_daemons_pss_mb": "<=95", "cold_vs_ctr_ratio": "<=0.4"}


def emit(metric: str, value, fmt: str = ".2f") -> None:
    print(f"BENCH {G} {metric}={value:{fmt}}", flush=True)
    if metric in TARGETS:
        print(f"BENCH {G} target_{metric}{TARGETS[metric]}", flush=True)


def until(predicate, timeout: float = 300.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(interval)
    return value


DAEMONS = ("device-plugin", "csi", "agent")


def daemons() -> dict[str, psutil.Process]:
    """The node daemons' processes, by subcommand."""
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if len(cmd) >= 3 and cmd[1].endswith("/opt/accelnode/bin/accelnode") and cmd[2] in DAEMONS:
            out[cmd[2]] = p
    return out


def main() -> None:
    from tests.rigs.node import inline, workload
    from tests.rigs.nodedemo import NS, Demo

    tools = Path(os.environ.get("ACCELNODE_TOOLS_BIN", ROOT / ".tools/bin"))
    workdir = Path(tempfile.mkdtemp(prefix="accelnode-bench-e2e-"))
    demo = Demo(workdir, tools)
    load_start = os.getloadavg()[0]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            demo.up()
            emit_later = {"suite_ready_s": demo.timings["suite_ready_s"]}
            reg = demo.reg_host = demo.start_registry()
            src = workdir / "big"
            src.mkdir()
            for i in range(CACHE_MIB // 64):
                (src / f"module-{i}.bin").write_bytes(os.urandom(64 << 20))
            ref = f"{reg}/bench/jax-512m:v1"
            subprocess.run([sys.executable, "-m", "accelnode", "cache", "build", str(src), ref, "--kind", "jax",
                            "--target", "backend=tpu,arch=v5e", "--plain-http", "--compression", "none",
                            "--layers", "4"], check=True, capture_output=True)
            shutil.rmtree(src)
            demo.kubectl("create", "namespace", NS)
            until(lambda: subprocess.run([str(tools / "kubectl"), f"--kubeconfig={demo.cp.kubeconfig('admin')}",
                                          "get", "sa", "default", "-n", NS], capture_output=True).returncode == 0)
            demo.kubectl("apply", "-f", "-", stdin=json.dumps({
                "apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": "big", "namespace": NS},
                "spec": {"image": ref}}))
            until(lambda: demo.get("gkmcache", "big", "-n", NS).get("status", {}).get("resolvedDigest"))
            sleep = ["python3", "-c", "import time; time.sleep(3600)"]

            def start(name: str) -> float:
                t0 = time.monotonic()
                demo.kubectl("apply", "-f", "-", stdin=json.dumps(workload(name, NS, inline("big", NS), chips=1,
                                                                           command=sleep)))
                until(lambda: demo.get("pod", name, "-n", NS)["status"].get("phase") == "Running", 600, 0.05)
                return time.monotonic() - t0

            cold = start("cold")
            warm = start("warm")
            t0 = time.monotonic()
            pulled = demo.node.ctr("images", "pull", "--plain-http", ref, check=False)
            anchor = time.monotonic() - t0
            if pulled.returncode != 0:
                raise RuntimeError(f"ctr images pull: {pulled.stderr[-500:]}")
            time.sleep(5)  # idle after the pulls
            procs = daemons()
            mems = {name: memory.of(p.pid) for name, p in procs.items()}
            for name, p in procs.items():  # where each daemon's megabytes lie, by mapping
                print(memory.breakdown(name, p.pid), file=sys.stderr, flush=True)
        emit("loadavg_1min_start", load_start)
        emit("loadavg_1min_end", os.getloadavg()[0])
        emit("suite_ready_s", emit_later["suite_ready_s"])
        emit("pod_running_cold_s", cold)
        emit("ctr_pull_s", anchor)
        emit("cold_vs_ctr_ratio", cold / anchor)
        emit("pod_running_warm_s", warm)
        emit("node_daemons", len(procs), "d")
        for name in DAEMONS:
            if name in mems:
                memory.emit_all(emit, name.replace("-", "_") + "_", mems[name])
        memory.emit_all(emit, "node_daemons_", sum(mems.values(), memory.NONE))
    finally:
        with contextlib.redirect_stdout(sys.stderr):
            demo.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
