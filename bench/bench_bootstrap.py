"""Pull-model join benchmark, in two parts against one real control plane (etcd, kube-apiserver,
kube-controller-manager whose bootstrap signer signs cluster-info, kube-scheduler).

**Real joins** (the issue's measure): per join a fresh VM (tests/rigs/joinnode.py: containerd,
the VM's own ``/etc/kubernetes`` and ``/var/lib/kubelet``, kubelet started from the shipped units
by kubeadm) and the real ``accelnode bootstrap`` parked in its long poll on the metadata server
emulator; the clock starts when the token is written to the metadata and stops when the Node is
Ready (polled every 50 ms). Beside each, in the same run and alternating which goes first, the
same token typed by hand: ``kubeadm join <endpoint> --token ... --discovery-token-ca-cert-hash
...`` with the same node settings on another fresh VM, from the moment it is started to Node
Ready. 5 joins of each (``ACCELNODE_BENCH_BOOTSTRAP_JOINS``). Needs the real-kubelet rig (root,
containerd, runc, kubelet): run it under ``flock /tmp/kubelet.lock``.

Metrics: ``token_to_ready_p50_s`` / ``token_to_ready_p99_s``, ``by_hand_to_ready_p50_s`` /
``by_hand_to_ready_p99_s`` and ``ready_ratio_p50`` (ours over by hand; target <= 1.1).

**Dry runs** (what bootstrap itself adds): per run one ``accelnode bootstrap --dry-run`` (the
real kubeadm behind a wrapper that notes the moment it is started); each run writes the three
attributes and measures until the kubeadm process starts: the long poll's wake-up, discovery
against the API server (two cluster-info reads, the JWS check, the CA pin) and writing the
JoinConfiguration. 20 runs (``ACCELNODE_BENCH_BOOTSTRAP_RUNS``).

Metrics: ``token_to_join_p50_ms`` / ``token_to_join_p99_ms`` (target p99 <= 1000 ms),
``wake_p50_ms`` (token written -> bootstrap's log line saying it saw it; ms resolution),
``discovery_p50_ms`` (that line -> discovery verified, from the log's timestamps),
``dry_run_join_p50_s`` (token written -> kubeadm's dry run done and bootstrap exited 0) and
``sign_delay_s`` (a new token's Secret created -> the bootstrap signer's signature in
cluster-info: what a VM would wait in discovery if the controller wrote an unsigned token).

The token is the controller's (controller/nodegroups/jointokens.py), made once and signed before
the runs, as the controller hands it out (``JoinTokens.signed``).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accelnode.kube.bootstraptoken import METADATA_KEYS  # noqa: E402
from accelnode.kube.client import Client, Config, KubeError, is_not_found  # noqa: E402
from tests.rigs.devcluster import ControlPlane  # noqa: E402
from tests.rigs.metadata import MetadataServer  # noqa: E402
from controller.nodegroups.jointokens import JoinTokens  # noqa: E402
from tests.conftest import TOOLS_BIN, accelnode_cmd, tool  # noqa: E402

G = "bootstrap"
RUNS = int(os.environ.get("ACCELNODE_BENCH_BOOTSTRAP_RUNS", "20"))
JOINS = int(os.environ.get("ACCELNODE_BENCH_BOOTSTRAP_JOINS", "5"))
TARGETS = {"token_to_join_p99_ms": "<=1000", "ready_ratio_p50": "<=1.1"}


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
        cp = ControlPlane(tmp / "cp", TOOLS_BIN, kubelets=True)
        cp.start()
        try:
            admin = Client(Config.from_kubeconfig(cp.kubeconfig("admin")))
            jt = JoinTokens(admin, ca_pem=cp.ca_file.read_bytes())
            info = jt.ensure("bench", f"127.0.0.1:{cp.port}")
            emit("sign_delay_s", wait_signed(jt, info), ".2f")
            real_joins(cp, admin, info, tmp)
            dry_runs(info, tmp)
        finally:
            cp.stop()


def wait_ready(admin: Client, name: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> float:
    """time.time() when Node ``name`` is first seen Ready (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            node = admin.request("GET", f"/api/v1/nodes/{name}")
        except KubeError as e:
            if not is_not_found(e):
                raise
            node = {}
        if any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions") or []):
            return time.time()
        if proc.poll() not in (None, 0):
            raise RuntimeError(f"{name}: the join exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"{name}: Node not Ready in {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def one_join(cp: ControlPlane, admin: Client, info, tmp: Path, name: str, by_hand: bool) -> float:
    """Seconds from the token written (by hand: kubeadm started) to Node ``name`` Ready."""
    from tests.rigs.joinnode import JoinNode

    vm = JoinNode(tmp / name, TOOLS_BIN, cp, name=name)
    log = tmp / f"{name}.log"
    proc = None
    try:
        vm.start()
        if by_hand:
            token, endpoint, ca_hash = (info.metadata_items()[k] for k in METADATA_KEYS)
            t0 = time.time()
            proc = vm.kubeadm_join(token, endpoint, ca_hash, log)
            ready = wait_ready(admin, name, proc, log)
        else:
            with MetadataServer(name=name) as md:
                proc = vm.bootstrap(md.host, log)
                md.wait_for_waiters(1, timeout=60)
                t0 = time.time()
                md.set_attributes(info.metadata_items())
                ready = wait_ready(admin, name, proc, log)
        if proc.wait(120) != 0:
            raise RuntimeError(f"{name}: the join exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        return ready - t0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        vm.stop()
        try:
            admin.request("DELETE", f"/api/v1/nodes/{name}")
        except KubeError:
            pass
        shutil.rmtree(tmp / name, ignore_errors=True)


def real_joins(cp: ControlPlane, admin: Client, info, tmp: Path) -> None:
    ours, by_hand = [], []
    for i in range(JOINS):
        order = (False, True) if i % 2 == 0 else (True, False)
        for hand in order:
            took = one_join(cp, admin, info, tmp, f"bench-{'hand' if hand else 'boot'}-{i}", hand)
            (by_hand if hand else ours).append(took)
            print(f"join {i} {'by hand' if hand else 'accelnode bootstrap'}: Node Ready {took:.2f}s after the "
                  f"{'command' if hand else 'token'}", flush=True)
    emit("joins", JOINS, "d")
    emit("token_to_ready_p50_s", pct(ours, 50), ".2f")
    emit("token_to_ready_p99_s", pct(ours, 99), ".2f")
    emit("by_hand_to_ready_p50_s", pct(by_hand, 50), ".2f")
    emit("by_hand_to_ready_p99_s", pct(by_hand, 99), ".2f")
    emit("ready_ratio_p50", pct(ours, 50) / pct(by_hand, 50), ".3f")


def dry_runs(info, tmp: Path) -> None:
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
