"""Pull-model join benchmark: the join token written to a VM's metadata -> ``kubeadm join``
started on the VM.

A real control plane (etcd, kube-apiserver, kube-controller-manager whose bootstrap signer signs
cluster-info), the metadata server emulator, and per run one real ``accelnode bootstrap``
process (``--dry-run``, the real kubeadm behind a wrapper that notes the moment it is started)
parked in its long poll on the attributes directory. The token is the controller's
(controller/nodegroups/jointokens.py), made once and signed before the runs, as the controller hands it out
(``JoinTokens.signed``). Each run writes the three attributes and measures until the kubeadm
process starts: the long poll's wake-up, discovery against the API server (two cluster-info
reads, the JWS check, the CA pin) and writing the JoinConfiguration. 20 runs
(``ACCELNODE_BENCH_BOOTSTRAP_RUNS``).

Metrics: ``token_to_join_p50_ms`` / ``token_to_join_p99_ms`` (target p99 <= 1000 ms),
``wake_p50_ms`` (token written -> bootstrap's log line saying it saw it; ms resolution),
``discovery_p50_ms`` (that line -> discovery verified, from the log's timestamps),
``dry_run_join_p50_s`` (token written -> kubeadm's dry run done and bootstrap exited 0) and
``sign_delay_s`` (a new token's Secret created -> the bootstrap signer's signature in
cluster-info: what a VM would wait in discovery if the controller wrote an unsigned token).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accelnode.kube.client import Client, Config  # noqa: E402
from tests.rigs.devcluster import ControlPlane  # noqa: E402
from tests.rigs.metadata import MetadataServer  # noqa: E402
from controller.nodegroups.jointokens import JoinTokens  # noqa: E402
from tests.conftest import TOOLS_BIN, accelnode_cmd, tool  # noqa: E402

G = "bootstrap"
RUNS = int(os.environ.get("ACCELNODE_BENCH_BOOTSTRAP_RUNS", "20"))
TARGETS = {"token_to_join_p99_ms": "<=1000"}


def emit(metric: str, value, fmt: str = ".1f") -> None:
    print(f"BENCH {G} {metric}={value:{fmt}}", flush=True)
    if metric in TARGETS:
        print(f"BENCH {G} target_{metric}{TARGETS[metric]}", flush=True)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def wait_signed(jt: JoinTokens, info, timeout: float = 120) -> float:
    start = time.monotonic()
    while not jt.signed(info):
        if time.monotonic() - start > timeout:
            raise RuntimeError("the bootstrap signer did not sign cluster-info")
        time.sleep(0.05)
    return time.monotonic() - start


def log_time(log: Path, msg: str) -> float | None:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("msg") == msg:
                return dt.datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                    tzinfo=dt.timezone.utc).timestamp()
    return None


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-bootstrap-") as tmpdir:
        tmp = Path(tmpdir)
        cp = ControlPlane(tmp / "cp", TOOLS_BIN)
        cp.start()
        try:
            run_all(cp, tmp)
        finally:
            cp.stop()


def run_all(cp: ControlPlane, tmp: Path) -> None:
    admin = Client(Config.from_kubeconfig(cp.kubeconfig("admin")))
    jt = JoinTokens(admin, ca_pem=cp.ca_file.read_bytes())
    info = jt.ensure("bench", f"127.0.0.1:{cp.port}")
    emit("sign_delay_s", wait_signed(jt, info), ".2f")

    stamp = tmp / "kubeadm-started"
    wrapper = tmp / "kubeadm"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = join ]; then date +%s.%N > {stamp}; fi\nexec {tool("kubeadm")} "$@"\n')
    wrapper.chmod(0o755)
    dryrun = tmp / "dryrun"
    dryrun.mkdir()
    latencies, wakes, discoveries, totals = [], [], [], []
    for i in range(RUNS):
        stamp.unlink(missing_ok=True)
        log = tmp / f"bootstrap-{i}.log"
        with MetadataServer(name=f"bench-{i}") as md, open(log, "wb") as out:
            env = dict(os.environ, GCE_METADATA_HOST=md.host, KUBEADM_JOIN_DRYRUN_DIR=str(dryrun))
            proc = subprocess.Popen(accelnode_cmd() + ["bootstrap", "--kubeadm", str(wrapper), "--dry-run",
                                                       "--ignore-preflight-errors", "all", "--log-format", "json"],
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                md.wait_for_waiters(1, timeout=60)
                t0 = time.time()
                md.set_attributes(info.metadata_items())
                rc = proc.wait(120)
                totals.append(time.time() - t0)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if rc != 0 or not stamp.exists():
            raise RuntimeError(f"run {i}: accelnode bootstrap exited {rc}:\n{log.read_text()[-3000:]}")
        latencies.append((float(stamp.read_text()) - t0) * 1000)
        seen = log_time(log, "join values found in the metadata")
        verified = log_time(log, "discovery verified: cluster-info signed by the token, CA pinned by its hash")
        if seen is not None:
            wakes.append(max(0.0, (seen - t0) * 1000))
            if verified is not None:
                discoveries.append((verified - seen) * 1000)
    emit("runs", RUNS, "d")
    emit("token_to_join_p50_ms", pct(latencies, 50))
    emit("token_to_join_p99_ms", pct(latencies, 99))
    emit("token_to_join_max_ms", max(latencies))
    if wakes:
        emit("wake_p50_ms", pct(wakes, 50))
    if discoveries:
        emit("discovery_p50_ms", pct(discoveries, 50))
    emit("dry_run_join_p50_s", pct(totals, 50), ".2f")


if __name__ == "__main__":
    main()
