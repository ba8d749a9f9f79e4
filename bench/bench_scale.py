"""Scale benchmark: N hollow node agents (tests/rigs/hollow.py: the agent's real core, status
reporter, prefetcher, watches and pull-secret reader, many per process, each its own node, over a
simulated store) against a real kube-apiserver + etcd with the real ``accelnode controller`` and
its webhooks, as kubemark measures kubelets (docs/scale.md). Needs nothing but .tools/bin.

For each N of ``BENCH_SCALE_NODES`` (default 500,1000,2000,5000; the fleet of the previous N is
stopped, N Node objects are registered, and N agents start in processes of
``BENCH_SCALE_PER_PROC`` agents (125), ``BENCH_SCALE_START_RATE`` a second in each (5), as a
rollout does; ``BENCH_SCALE_SWITCH_S``: their interpreters' switch interval, 0.05 s;
``BENCH_SCALE_NICE``: their nice value, 10, below the control plane's) with
``BENCH_SCALE_CACHES`` (default 50) caches meant for every node (a fifth
ClusterGKMCaches, the rest GKMCaches in 4 namespaces; every node holds them at start, as after
an agent restart):

* ``nN_base_apiserver_cpu`` / ``_rss_mb``: the API server's CPU (cores) and RSS over an idle
  window before the agents start (nodes, caches and controller there, no agent watch);
* ``nN_start_s``, ``nN_start_writes_per_node``, ``nN_start_hollow_cpu_ms_per_node``: until every
  cache's status counts all N nodes, the agents' writes and CPU meanwhile; the writes apart for
  the nodes new to this N (``_per_new_node``: a first start) and those a previous N's fleet
  wrote (``_per_known_node``: a restart, the objects read back);
* idle (``BENCH_SCALE_IDLE_S``, default 300 s): ``nN_idle_agent_writes_per_s`` (target 0),
  ``nN_idle_agent_reads_per_s`` by verb and resource (audit log: the API server's own record),
  ``nN_idle_controller_writes_per_s`` (its Lease apart), ``nN_apiserver_cpu`` / ``_rss_mb`` with
  the agents' watches open, the hollow processes' and the controller's RSS;
* 5 rolls of one ClusterGKMCache (``BENCH_SCALE_ROLLS``): ``nN_roll_nodes_p50_s`` / ``_p99_s``
  until every node's own object reports the new digest Extracted (a watch of the node kind),
  ``nN_roll_status_p50_s`` / ``_p99_s`` until the cache's status says so (N of N hold the
  pinned digest, none downloading or pending) after having said otherwise during the roll,
  ``nN_roll_premature`` (rolls whose status said "N of N hold" the new digest at once, before
  any node had it; target 0: a node counts as holding the pin only by an entry for that
  digest, docs/cache-controller.md), ``nN_roll_status_writes_per_s``
  (the controller's status writes of that cache per second, from its first write of the roll
  to its last) and its most in one second (``_max_in_1s``, target 1), ``nN_roll_cache_watch_events`` / ``_mb`` (what the API server sent to the watchers of
  ClusterGKMCaches during one roll: every agent watches every cache, status included), the agents' writes per node per roll, the controller's CPU seconds per roll;
* pod churn: 20 pods/s for ``BENCH_SCALE_CHURN_S`` (default 30 s), Indexed-Job worker pods
  bound to the hollow nodes, through the controller's pod webhook: ``nN_admission_p99_ms`` as
  the API server measures the webhook (target 25), ``nN_pod_create_p99_ms`` the API server's
  POST pods latency (SLO 1 s), ``nN_churn_agent_writes`` (target 0);
* ``nN_unpaged_lists`` (target 0) over the whole N: lists by the agent or the controller without
  ``limit``; ``nN_idle_lists`` (target 0).

Slopes over the Ns reached: ``controller_rss_mb_per_1k_nodes``, ``agent_rss_kb_per_node`` (the
hollow processes' RSS per agent), ``apiserver_rss_mb_per_1k_watching_nodes``. A N whose fleet
does not start or converge within ``BENCH_SCALE_TIMEOUT_S`` (default 900) stops the curve there
(``stopped_at_nodes``, and why on stderr). ``load1`` beside each N: the machine is shared.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from accelnode.kube.reflector import Reflector
from bench.bench_controller import _samples, apiserver_metrics, histogram_quantile, paced, stamp, webhook_histogram
from tests.conftest import ROOT
from tests.rigs.hollow import (AGENT_USER, CONTROLLER_USER, GV, WRITES, ScaleCluster, by, cache_body, cache_path,
                               churn_pod, node_names, register_nodes, unpaged_lists, until)

G = "scale"
NODES = [int(n) for n in os.environ.get("BENCH_SCALE_NODES", "500,1000,2000,5000").split(",") if n.strip()]
IDLE_S = float(os.environ.get("BENCH_SCALE_IDLE_S", "300"))
BASE_S = float(os.environ.get("BENCH_SCALE_BASE_S", str(min(IDLE_S, 60.0))))
ROLLS = int(os.environ.get("BENCH_SCALE_ROLLS", "5"))
CHURN_S = float(os.environ.get("BENCH_SCALE_CHURN_S", "30"))
CHURN_RATE = 20.0
PER_PROC = int(os.environ.get("BENCH_SCALE_PER_PROC", "125"))  # agents a hollow process (docs/scale.md)
SWITCH_S = float(os.environ.get("BENCH_SCALE_SWITCH_S", "0.05"))  # their interpreter's switch interval
# The hollow agents run below the control plane's priority: on a cluster they run on other
# machines than the API server, etcd and the controller, whose CPU they must not take here.
NICE = int(os.environ.get("BENCH_SCALE_NICE", "10"))
PULL_S = float(os.environ.get("BENCH_SCALE_PULL_S", "2.0"))
TIMEOUT_S = float(os.environ.get("BENCH_SCALE_TIMEOUT_S", "900"))
START_RATE = float(os.environ.get("BENCH_SCALE_START_RATE", "5"))  # agents a second, per process
NAMESPACES = [f"team-{i}" for i in range(4)]
CACHES = int(os.environ.get("BENCH_SCALE_CACHES", "50"))  # a fifth ClusterGKMCaches, the rest over 4 namespaces
CLUSTER_CACHES, NS_CACHES = max(1, CACHES // 5), max(1, (CACHES - max(1, CACHES // 5)) // len(NAMESPACES))
ROLLED = "cc0"
POD_HOOK = "pod-job.tpu-env.accelnode.io"
TARGETS = {"idle_agent_writes_per_s": "==0", "idle_controller_writes_per_s": "==0", "roll_status_writes_max_in_1s": "<=1",
           "admission_p99_ms": "<=25", "pod_create_p99_ms": "<=1000", "unpaged_lists": "==0", "idle_lists": "==0",
           "churn_agent_writes": "==0", "controller_restarts": "==0", "roll_premature": "==0"}


def emit(metric: str, value, fmt: str = ".2f", n: int | None = None) -> None:
    name = f"n{n}_{metric}" if n is not None else metric
    line = f"BENCH {G} {name}={value:{fmt}}"
    if metric in TARGETS:
        line += f" target_{name}{TARGETS[metric]}"
    print(line, flush=True)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)]


class Proc:
    """CPU seconds and RSS of one process, sampled between marks."""

    def __init__(self, pid: int):
        self.p = psutil.Process(pid)

    def cpu(self) -> float:
        t = self.p.cpu_times()
        return t.user + t.system

    def rss_mb(self) -> float:
        return self.p.memory_info().rss / 2**20


class Controller(Proc):
    """The controller process, whichever the supervisor runs now (CPU counts from its start)."""

    def __init__(self, cluster: ScaleCluster):
        self.cluster = cluster

    @property
    def p(self):
        return psutil.Process(self.cluster.controller.pid)


class Fleet:
    """N hollow agents in processes of PER_PROC (``python -m tests.rigs.hollow``)."""

    def __init__(self, cluster: ScaleCluster, n: int, installed: list[str], logdir: Path):
        self.procs: list[subprocess.Popen] = []
        kubeconfig = cluster.cp.kubeconfig("agent")
        for first in range(0, n, PER_PROC):
            log = open(logdir / f"hollow-{n}-{first}.log", "ab")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.rigs.hollow", "--kubeconfig", str(kubeconfig), "--first", str(first),
                 "--count", str(min(PER_PROC, n - first)), "--pull-seconds", str(PULL_S),
                 "--start-rate", str(START_RATE), "--switch-interval", str(SWITCH_S),
                 *[a for image in installed for a in ("--installed", image)]],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                preexec_fn=lambda: os.nice(NICE)))

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for p in self.procs:  # each prints one line once all its agents listed
            line = []
            t = threading.Thread(target=lambda: line.append(p.stdout.readline()), daemon=True)
            t.start()
            t.join(max(0.0, end - time.monotonic()))
            if not line or not line[0].startswith("HOLLOW ready"):
                raise RuntimeError(f"a hollow process did not get ready in {timeout:.0f}s (exit {p.poll()})")

    def rss_mb(self) -> float:
        return sum(Proc(p.pid).rss_mb() for p in self.procs if p.poll() is None)

    def cpu(self) -> float:
        return sum(Proc(p.pid).cpu() for p in self.procs if p.poll() is None)

    def threads(self) -> int:
        return sum(psutil.Process(p.pid).num_threads() for p in self.procs if p.poll() is None)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class NodeReports:
    """Every ClusterGKMCacheNode's entries of the rolled cache (a watch as the admin): when the
    count of nodes whose entry is {digest: Extracted} reached a number, per digest."""

    def __init__(self, cluster: ScaleCluster):
        self.cond = threading.Condition()
        self.state: dict[str, dict] = {}
        self.stop = threading.Event()
        self.r = Reflector(cluster.admin, f"{GV}/clustergkmcachenodes", on_event=self._event)
        threading.Thread(target=self.r.run, args=(self.stop,), daemon=True).start()

    def _event(self, kind: str, obj: dict) -> None:
        entries = ((obj.get("status") or {}).get("caches") or {}).get(ROLLED) or {}
        with self.cond:
            self.state[obj["metadata"]["name"]] = {d: e.get("state") for d, e in entries.items()}
            self.cond.notify_all()

    def holding(self, digest: str) -> int:
        return sum(s == {digest: "Extracted"} for s in self.state.values())

    def wait(self, digest: str, n: int, timeout: float) -> float:
        end = time.monotonic() + timeout
        with self.cond:
            while self.holding(digest) < n:
                if not self.cond.wait(max(0.0, min(1.0, end - time.monotonic()))) and time.monotonic() > end:
                    raise RuntimeError(f"{self.holding(digest)} of {n} nodes hold {digest} after {timeout:.0f}s")
        return time.monotonic()

    def close(self) -> None:
        self.stop.set()
        self.r.interrupt()


class CacheStatus:
    """The rolled cache's status as a watch brings it: (monotonic time, status) per event."""

    def __init__(self, cluster: ScaleCluster):
        self.cond = threading.Condition()
        self.history: list[tuple[float, dict]] = []
        self.stop = threading.Event()
        self.r = Reflector(cluster.admin, f"{GV}/clustergkmcaches", query={"fieldSelector": f"metadata.name={ROLLED}"},
                           on_event=self._event)
        threading.Thread(target=self.r.run, args=(self.stop,), daemon=True).start()

    def _event(self, kind: str, obj: dict) -> None:
        with self.cond:
            self.history.append((time.monotonic(), obj.get("status") or {}))
            self.cond.notify_all()

    @staticmethod
    def says_all(st: dict, digest: str, n: int) -> bool:
        msg = next((c.get("message", "") for c in st.get("conditions") or () if c.get("type") == "Ready"), "")
        return st.get("resolvedDigest") == digest and msg.startswith(f"{n} of {n} nodes hold {digest}") and \
            "downloading" not in msg and "pending" not in msg

    def _claims(self, digest: str, n: int, start: float) -> tuple[float | None, float | None]:
        """(when the status pinned to ``digest`` first said all N hold it before it ever said
        otherwise: a claim made before the nodes reported the roll; when it said so after saying
        otherwise)."""
        early, seen_other = None, False
        for t, st in self.history:
            if t < start:
                continue
            if st.get("resolvedDigest") != digest:
                continue  # the roll not pinned yet
            if not self.says_all(st, digest, n):
                seen_other = True
            elif seen_other:
                return early, t
            elif early is None:
                early = t
        return early, None

    def wait(self, digest: str, n: int, start: float, timeout: float) -> tuple[float, bool]:
        """(when the cache's status said every node holds ``digest`` after the roll went
        through the nodes, whether it had said so before they had it)."""
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                early, at = self._claims(digest, n, start)
                if at is not None:
                    return at, early is not None
                if time.monotonic() > end:
                    raise RuntimeError(f"the cache's status did not count {n} nodes on {digest} in {timeout:.0f}s")
                self.cond.wait(1.0)

    def close(self) -> None:
        self.stop.set()
        self.r.interrupt()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        run(Path(tmp))


def run(tmp: Path) -> None:
    cluster = ScaleCluster(tmp).start()
    fleet = reports = status = None
    try:
        admin = cluster.admin
        apiserver = Proc(cluster.cp._apiserver.popen.pid)
        for ns in NAMESPACES + ["churn"]:
            admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
        cluster.wait_webhooks("churn")
        images = {}
        for i in range(CLUSTER_CACHES):
            images[(None, f"cc{i}")] = cluster.push(f"scale/cc{i}", "v1")
        for ns in NAMESPACES:
            for i in range(NS_CACHES):
                images[(ns, f"c{i}")] = cluster.push(f"scale/{ns}-c{i}", "v1")
        roll_images = [images[(None, ROLLED)], cluster.push(f"scale/{ROLLED}", "v2")]
        for (ns, name), image in images.items():
            admin.request("POST", cache_path(ns), body=cache_body(ns, name, image))
        until(lambda: all((admin.request("GET", cache_path(ns, name)).get("status") or {}).get("resolvedDigest")
                          for ns, name in images), "every cache pinned", timeout=120)
        controller = Controller(cluster)
        reports, status = NodeReports(cluster), CacheStatus(cluster)
        audit = cluster.audit()
        curve: dict[int, dict] = {}
        current = roll_images[0]
        known = 0  # nodes whose status objects a previous N's fleet created (they are kept)
        for n in NODES:
            emit("load1", os.getloadavg()[0], n=n)
            if fleet is not None:
                fleet.stop()
                fleet = None
            phase = audit.mark()
            register_nodes(admin, node_names("hollow-", 0, n))
            # without the agents: nodes, caches and the controller only
            time.sleep(5)
            c0, t0 = apiserver.cpu(), time.monotonic()
            time.sleep(BASE_S)
            emit("base_apiserver_cpu", (apiserver.cpu() - c0) / (time.monotonic() - t0), ".3f", n)
            emit("base_apiserver_rss_mb", apiserver.rss_mb(), ".0f", n)
            # the fleet starts; every node already holds the current digests
            installed = [img for k, img in images.items() if k != (None, ROLLED)] + [current]
            start, mark = time.monotonic(), audit.mark()
            try:
                fleet = Fleet(cluster, n, installed, tmp)
                fleet.wait_ready(TIMEOUT_S)
                until(lambda: all(((admin.request("GET", cache_path(ns, name)).get("status") or {}).get("counts") or {})
                                  .get("nodeNotInUseCnt") == n for ns, name in images),
                      f"every cache's status to count {n} nodes", timeout=TIMEOUT_S, interval=2.0)
            except RuntimeError as e:
                print(f"scale: stopped at {n} nodes: {e}", file=sys.stderr, flush=True)
                stalled(audit, mark, n, apiserver, controller, fleet, start)
                emit("stopped_at_nodes", n, "d")
                break
            emit("start_s", time.monotonic() - start, ".1f", n)
            emit("start_hollow_cpu_ms_per_node", fleet.cpu() / n * 1000, ".0f", n)
            start_writes(by(audit.events(mark), AGENT_USER, WRITES), n, known)
            known = max(known, n)
            time.sleep(10)  # the last resyncs of the start
            # idle
            mark, c0, cc0, h0, t0 = audit.mark(), apiserver.cpu(), controller.cpu(), fleet.cpu(), time.monotonic()
            time.sleep(IDLE_S)
            window = time.monotonic() - t0
            idle = audit.events(mark)
            emit("idle_window_s", window, ".0f", n)
            emit("idle_agent_writes_per_s", len(by(idle, AGENT_USER, WRITES)) / window, ".3f", n)
            reads = by(idle, AGENT_USER, {"get", "list", "watch"})
            emit("idle_agent_reads_per_s", len(reads) / window, ".2f", n)
            for (verb, res), k in sorted(Counter((e["verb"], e["objectRef"].get("resource", "")) for e in reads).items()):
                emit(f"idle_agent_{verb}_{res}_per_s", k / window, ".2f", n)
            cw = [e for e in by(idle, CONTROLLER_USER, WRITES) if e["objectRef"].get("resource") != "leases"]
            emit("idle_controller_writes_per_s", len(cw) / window, ".3f", n)
            emit("idle_controller_reads_per_s", len(by(idle, CONTROLLER_USER, {"get", "list", "watch"})) / window,
                 ".2f", n)
            emit("idle_lists", len(by(idle, AGENT_USER, {"list"})) + len(by(idle, CONTROLLER_USER, {"list"})), "d", n)
            emit("apiserver_cpu", (apiserver.cpu() - c0) / window, ".3f", n)
            emit("apiserver_rss_mb", apiserver.rss_mb(), ".0f", n)
            emit("controller_cpu", max(0.0, controller.cpu() - cc0) / window, ".3f", n)
            emit("controller_rss_mb", controller.rss_mb(), ".0f", n)
            emit("hollow_rss_mb", fleet.rss_mb(), ".0f", n)
            emit("hollow_cpu", (fleet.cpu() - h0) / window, ".3f", n)
            emit("hollow_threads", fleet.threads(), "d", n)
            curve[n] = {"controller": controller.rss_mb(), "hollow": fleet.rss_mb(), "apiserver": apiserver.rss_mb()}
            # rolls
            nodes_s, status_s, premature, writes_s, burst, agent_w, ctl_cpu, fanout, agent_cpu = [], [], 0, [], [], [], [], [], []
            for r in range(ROLLS):
                current = roll_images[(roll_images.index(current) + 1) % 2]
                digest = current.rsplit("@", 1)[1]
                mark, cc0, h0, start = audit.mark(), controller.cpu(), fleet.cpu(), time.monotonic()
                events0 = watch_events(apiserver_metrics(cluster.cp))
                admin.request("PATCH", cache_path(None, ROLLED), body={"spec": {"image": current}})
                try:
                    at_nodes = reports.wait(digest, n, TIMEOUT_S)
                    at_status, early = status.wait(digest, n, start, TIMEOUT_S)
                except RuntimeError as e:
                    print(f"scale: roll {r} at {n} nodes: {e}", file=sys.stderr, flush=True)
                    stalled(audit, mark, n, apiserver, controller, fleet, start)
                    break
                nodes_s.append(at_nodes - start)
                status_s.append(at_status - start)
                premature += early
                ctl_cpu.append(max(0.0, controller.cpu() - cc0))
                agent_cpu.append((fleet.cpu() - h0) / n)
                time.sleep(2)
                events1 = watch_events(apiserver_metrics(cluster.cp))
                fanout.append(tuple(b - a for a, b in zip(events0, events1)))
                ev = audit.events(mark)
                sw = [e for e in by(ev, CONTROLLER_USER, WRITES) if e["objectRef"].get("resource") == "clustergkmcaches"
                      and e["objectRef"].get("subresource") == "status" and e["objectRef"].get("name") == ROLLED]
                span = (stamp(sw[-1]) - stamp(sw[0]) + 1.0) if sw else 1.0  # from its first write to its last
                writes_s.append(len(sw) / span)
                per_s = Counter(int(stamp(e)) for e in sw)
                burst.append(max(per_s.values(), default=0))
                agent_w.append(len(by(ev, AGENT_USER, WRITES)) / n)
            if status_s:
                emit("roll_nodes_p50_s", pct(nodes_s, 0.5), ".1f", n)
                emit("roll_nodes_p99_s", pct(nodes_s, 0.99), ".1f", n)
                emit("roll_status_p50_s", pct(status_s, 0.5), ".1f", n)
                emit("roll_status_p99_s", pct(status_s, 0.99), ".1f", n)
                emit("roll_premature", premature, "d", n)
                emit("roll_status_writes_per_s", max(writes_s), ".2f", n)
                emit("roll_status_writes_max_in_1s", max(burst), "d", n)
                emit("roll_agent_writes_per_node", statistics.mean(agent_w), ".2f", n)
                emit("roll_controller_cpu_s", statistics.mean(ctl_cpu), ".2f", n)
                emit("roll_agent_cpu_ms_per_node", statistics.mean(agent_cpu) * 1000, ".1f", n)
                emit("roll_cache_watch_events", statistics.mean(f[0] for f in fanout), ".0f", n)
                emit("roll_cache_watch_mb", statistics.mean(f[1] for f in fanout) / 1e6, ".1f", n)
                emit("rolls", len(status_s), "d", n)
            # pod churn through the pod webhook, bound to the hollow nodes
            churn(cluster, apiserver, audit, n)
            emit("unpaged_lists", len(unpaged_lists(audit.events(phase))), "d", n)
            emit("controller_rss_mb_after", controller.rss_mb(), ".0f", n)
            emit("controller_restarts", cluster.restarts, "d", n)
        slopes(curve)
    finally:
        for w in (reports, status):
            if w is not None:
                w.close()
        if fleet is not None:
            fleet.stop()
        cluster.stop()


def stalled(audit, mark: int, n: int, apiserver: Proc, controller: Proc, fleet: "Fleet | None", start: float) -> None:
    """What the machine and the API server did while a phase did not finish: the load, the
    processes' CPU over it, the agents' and the controller's calls by verb and answer code."""
    window = time.monotonic() - start
    emit("stall_load1", os.getloadavg()[0], n=n)
    emit("stall_s", window, ".0f", n)
    if fleet is not None:
        emit("stall_hollow_threads", fleet.threads(), "d", n)
        emit("stall_hollow_cpu_s", fleet.cpu(), ".0f", n)
    emit("stall_apiserver_cpu_s", apiserver.cpu(), ".0f", n)
    calls = Counter((e["user"]["username"].rsplit(":", 1)[-1], e.get("verb"), e["objectRef"].get("resource", ""),
                     (e.get("responseStatus") or {}).get("code", 0))
                    for e in audit.events(mark) if e.get("stage") == "ResponseComplete")
    for (user, verb, res, code), k in calls.most_common(15):
        print(f"scale: stalled at {n}: {k} {user} {verb} {res} -> {code}", file=sys.stderr, flush=True)


def start_writes(writes: list[dict], n: int, known: int) -> None:
    """The agents' writes during a fleet start, per node: all, and apart for the nodes new to
    this N (their objects created, then written as the caches are proved: a node's first start)
    and those a previous N's fleet already wrote (a restart: the objects read back, written
    only where a state moves). Each object is named after its node (hollow-NNNNN)."""
    per = Counter(e["objectRef"].get("name", "") for e in writes)
    old = set(node_names("hollow-", 0, min(known, n)))
    emit("start_writes_per_node", len(writes) / n, ".1f", n)
    if n > known:
        emit("start_writes_per_new_node", sum(k for name, k in per.items() if name not in old) / (n - known), ".1f", n)
    if known:
        emit("start_writes_per_known_node", sum(k for name, k in per.items() if name in old) / min(known, n), ".1f", n)


def churn(cluster: ScaleCluster, apiserver: Proc, audit, n: int) -> None:
    admin = cluster.admin
    count = int(CHURN_S * CHURN_RATE)
    names = [f"w-{n}-{i}" for i in range(count)]
    nodes = node_names("hollow-", 0, n)
    before, mark = apiserver_metrics(cluster.cp), audit.mark()
    create = lambda i: admin.request("POST", "/api/v1/namespaces/churn/pods",  # noqa: E731
                                     body=churn_pod(names[i], nodes[i % n], i))
    delete = lambda i: admin.request("DELETE", f"/api/v1/namespaces/churn/pods/{names[i]}",  # noqa: E731
                                     body={"gracePeriodSeconds": 0})
    with ThreadPoolExecutor(8) as pool:
        paced(pool, create, list(range(count)), CHURN_RATE)
        after = apiserver_metrics(cluster.cp)
        paced(pool, delete, list(range(count)), CHURN_RATE)
    buckets, total, k = webhook_histogram(after, before, POD_HOOK)
    emit("admission_p99_ms", histogram_quantile(0.99, buckets) * 1000 if k else float("nan"), ".1f", n)
    emit("admission_mean_ms", total / k * 1000 if k else float("nan"), ".1f", n)
    emit("pod_create_p99_ms", histogram_quantile(0.99, request_histogram(after, before, "POST", "pods")) * 1000,
         ".1f", n)
    time.sleep(3)
    emit("churn_agent_writes", len(by(audit.events(mark), AGENT_USER, WRITES)), "d", n)
    emit("churn_pods", count, "d", n)


def request_histogram(after: str, before: str, verb: str, resource: str) -> dict[float, float]:
    """apiserver_request_duration_seconds of one verb and resource between two scrapes."""
    def read(text: str):
        b = defaultdict(float)
        for name, lab, v in _samples(text, "apiserver_request_duration_seconds_bucket"):
            if lab.get("verb") == verb and lab.get("resource") == resource and not lab.get("subresource"):
                b[float(lab["le"])] += v
        return b
    a, b = read(after), read(before)
    return {le: a[le] - b.get(le, 0.0) for le in a}


def watch_events(metrics: str) -> tuple[float, float]:
    """(events, bytes) the API server sent to watchers of ClusterGKMCaches so far (every agent
    and the controller watch them: the fan-out of one cache write)."""
    ev = sum(v for _, lab, v in _samples(metrics, "apiserver_watch_events_total") if lab.get("resource") == "clustergkmcaches")
    size = sum(v for _, lab, v in _samples(metrics, "apiserver_watch_events_sizes_sum")
               if lab.get("resource") == "clustergkmcaches")
    return ev, size


def slopes(curve: dict[int, dict]) -> None:
    ns = sorted(curve)
    if len(ns) < 2:
        return
    lo, hi = ns[0], ns[-1]
    d = hi - lo
    emit("controller_rss_mb_per_1k_nodes", (curve[hi]["controller"] - curve[lo]["controller"]) / d * 1000, ".1f")
    emit("agent_rss_kb_per_node", curve[hi]["hollow"] * 1024 / hi, ".0f")
    emit("agent_rss_kb_per_node_slope", (curve[hi]["hollow"] - curve[lo]["hollow"]) * 1024 / d, ".0f")
    emit("apiserver_rss_mb_per_1k_watching_nodes", (curve[hi]["apiserver"] - curve[lo]["apiserver"]) / d * 1000, ".1f")


if __name__ == "__main__":
    main()
