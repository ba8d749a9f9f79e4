"""The node as users run it (tests/rigs/nodedemo.py's rig: a real kubelet, containerd, our
image, ``kubectl apply -k daemonsets/``):

- ``suite_ready_s``: apply -> every accelnode pod Ready (the image already in containerd);
- ``pod_running_cold_s``: a workload pod created -> Running, its 512 MiB cache not yet on the node
  (the agent pulls, verifies and unpacks it during NodePublishVolume);
- ``ctr_pull_s``: ``ctr images pull`` (pull + unpack into containerd's snapshotter) of that same
  image from the same registry, the anchor; ``cold_vs_ctr_ratio`` = pod_running_cold_s / ctr_pull_s
  (the pod's figure also holds scheduling, the sandbox and the container start);
- ``pod_running_warm_s``: a second pod with the same cache (already on the node) -> Running;
- ``cold_phase_*_s``, ``warm_phase_*_s``: where each of those two pods' time went, phase by phase, from
  kubelet's log (run at ``--v=4``) and the agent's (:func:`pod_phases`); they add up to the pod's figure;
- ``node_daemons_rss_mb``: RSS of the node daemons (device plugin, CSI driver, agent) together as
  pods, idle after the pulls (target: 130 MB RSS, 95 MB PSS); PSS and USS beside it, and each daemon's own
  (``<daemon>_rss_mb``, ``_pss_mb``, ``_uss_mb``; bench/memory.py says what each figure counts) and its
  thread count (``<daemon>_threads``); stderr has each daemon's breakdown by mapping.
The cache layer is uncompressed (``--compression none``), so neither side spends the time on gzip.
Needs root and the tools of ``make tools``.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import os
import re
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


# kubelet's --v for the run: 4 logs the NodePublishVolume call and the sandbox's creation (pod_phases)
KUBELET_V = 4
KLOG = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+)\s")


def _klog_time(line: str, year: int) -> float | None:
    """The wall time of a kubelet log line (klog writes local time without the year)."""
    m = KLOG.match(line)
    if m is None:
        return None
    day, clock = m.groups()
    whole, frac = clock.split(".")
    t = time.strptime(f"{year}{day} {whole}", "%Y%m%d %H:%M:%S")
    return time.mktime(t) + float(f"0.{frac}")


def _ours(node, container: str) -> list[dict]:
    """The JSON records one of the CSI node pod's containers logged (kubelet's CRI log files)."""
    out = []
    for f in sorted(node.pod_logs.glob(f"accelnode-system_accelnode-csi-node-*/{container}/*.log")):
        for line in f.read_text(errors="replace").splitlines():
            text = line.split(" ", 3)[-1]
            if text.startswith("{"):
                with contextlib.suppress(ValueError):
                    rec = json.loads(text)
                    rec["t"] = calendar.timegm(time.strptime(rec["ts"][:19], "%Y-%m-%dT%H:%M:%S")) + \
                        float(rec["ts"][19:-1] or 0)
                    out.append(rec)
    return out


def pod_phases(node, pod: str, created: float, running: float) -> tuple[dict[str, float], float, float]:
    """Where a workload pod's time from created to Running went, from the components' own logs:
    the API server and scheduler until kubelet has it (``to_kubelet``); kubelet's volume manager
    until it calls NodePublishVolume (``to_publish``); our NodePublishVolume as kubelet saw it,
    split into waiting for the agent's pull (``pull_wait``, 0 when the cache was there) and the
    rest (``publish_rest``: resolve, EnsureCache, reference, mount, gRPC); kubelet noticing the
    mount (``to_sandbox``, its 300 ms poll); the pod sandbox (``sandbox``); the container
    (``container``); the status reaching the API server and this poller (``to_running``).
    Also the pull's own seconds and how long it had run when NodePublishVolume came (its head
    start from the agent's pod watch), both 0 without a pull."""
    from tests.rigs.nodedemo import NS

    year = time.gmtime(created).tm_year
    ref = f'pod="{NS}/{pod}"'
    lines = (node.workdir / "kubelet.log").read_text(errors="replace").splitlines()
    uid = next((m.group(1) for ln in lines if ref in ln and (m := re.search(r'podUID="([0-9a-f-]+)"', ln))), None)

    def at(*needles: str) -> float | None:
        return next((_klog_time(ln, year) for ln in lines if all(n in ln for n in needles)), None)

    marks = {
        "kubelet": at('"SyncLoop ADD"', f'"{NS}/{pod}"'),
        "publish_call": at("calling NodePublishVolume rpc", f"/pods/{uid}/") if uid else None,
        "published": at("MountVolume.SetUp succeeded", "kernel-cache", ref),
        "mounted": at("All volumes are attached and mounted", ref),
        "sandbox": at("Created PodSandbox for pod", ref),
        "started": at('reason="Started"', f'object="{NS}/{pod}"'),
    }
    missing = [k for k, v in marks.items() if v is None]
    if missing:
        print(f"pod {pod}: no kubelet log line for {', '.join(missing)}; its phases are left out", file=sys.stderr)
        return {}, 0.0, 0.0
    finished = next((r for r in _ours(node, "agent")
                     if r.get("msg") == "pull finished" and created <= r["t"] <= marks["published"] + 0.01), None)
    publish = marks["published"] - marks["publish_call"]
    # the part of the publish spent waiting for the pull (one started early, at the pod's binding,
    # may be over by then: see head_start)
    pull_wait = 0.0 if finished is None else min(publish, max(0.0, finished["t"] - marks["publish_call"]))
    out = {
        "to_kubelet": marks["kubelet"] - created,
        "to_publish": marks["publish_call"] - marks["kubelet"],
        "pull_wait": pull_wait,
        "publish_rest": publish - pull_wait,
        "to_sandbox": marks["mounted"] - marks["published"],
        "sandbox": marks["sandbox"] - marks["mounted"],
        "container": marks["started"] - marks["sandbox"],
        "to_running": running - marks["started"],
    }
    if finished is None:
        return out, 0.0, 0.0
    return out, finished["seconds"], max(0.0, marks["publish_call"] - (finished["t"] - finished["seconds"]))


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
    demo = Demo(workdir, tools, kubelet_verbosity=KUBELET_V)
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

            created = {}

            def start(name: str) -> float:
                created[name] = time.time()
                t0 = time.monotonic()
                demo.kubectl("apply", "-f", "-", stdin=json.dumps(workload(name, NS, inline("big", NS), chips=1,
                                                                           command=sleep)))
                until(lambda: demo.get("pod", name, "-n", NS)["status"].get("phase") == "Running", 600, 0.05)
                return time.monotonic() - t0

            cold = start("cold")
            warm = start("warm")
            phases = {name: pod_phases(demo.node, name, created[name], created[name] + took)
                      for name, took in (("cold", cold), ("warm", warm))}
            pull_s, head_start = phases["cold"][1:]
            t0 = time.monotonic()
            pulled = demo.node.ctr("images", "pull", "--plain-http", ref, check=False)
            anchor = time.monotonic() - t0
            if pulled.returncode != 0:
                raise RuntimeError(f"ctr images pull: {pulled.stderr[-500:]}")
            time.sleep(5)  # idle after the pulls
            procs = daemons()
            mems = {name: memory.of(p.pid) for name, p in procs.items()}
            threads = {name: memory.threads(p.pid) for name, p in procs.items()}
            for name, p in procs.items():  # where each daemon's megabytes lie, by mapping
                print(memory.breakdown(name, p.pid), file=sys.stderr, flush=True)
        emit("loadavg_1min_start", load_start)
        emit("loadavg_1min_end", os.getloadavg()[0])
        emit("suite_ready_s", emit_later["suite_ready_s"])
        emit("pod_running_cold_s", cold)
        emit("ctr_pull_s", anchor)
        emit("cold_vs_ctr_ratio", cold / anchor)
        emit("pod_running_warm_s", warm)
        for name, (got, _, _) in phases.items():
            for phase, seconds in got.items():
                emit(f"{name}_phase_{phase}_s", seconds)
        emit("cold_pull_s", pull_s)
        emit("cold_pull_head_start_s", head_start)
        emit("node_daemons", len(procs), "d")
        for name in DAEMONS:
            if name in mems:
                memory.emit_all(emit, name.replace("-", "_") + "_", mems[name])
                emit(name.replace("-", "_") + "_threads", threads[name], "d")
        memory.emit_all(emit, "node_daemons_", sum(mems.values(), memory.NONE))
    finally:
        with contextlib.redirect_stdout(sys.stderr):
            demo.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
