"""Cluster-controller benchmark: the real ``accelnode controller`` (leader election, the
GKMCache/ClusterGKMCache reconcilers and the cache admission webhooks) as a subprocess with the
"controller" identity, a real registry, and a control plane of its own (etcd + kube-apiserver +
kube-controller-manager from ``.tools/bin``) whose audit log records every API write, and here
also the controller's list and watch calls (needs root).

The webhooks are daemonsets/webhooks-gkm.yaml as shipped, each ``clientConfig`` pointed at the
controller's --webhook-address on 127.0.0.1 with a test CA's ``caBundle``: every cache write
below goes through them, the controller's own status writes through the validating ones.
Node objects are written by the benchmark with the agent's identity, shaped as
agent/nodestatus.py writes them.

Metrics, each printed as soon as it is known:

1. ``idle_writes``: the controller's writes (create/update/patch/delete; its leader Lease
   renewals counted apart as ``idle_lease_writes``) over an idle window
   (``ACCELNODE_BENCH_IDLE_S``, default 300 s) with 100 caches (GKMCache in three namespaces,
   ClusterGKMCache) pinned and settled and 20 node objects naming them; ``idle_lists``: its
   list calls meanwhile. The controller runs with ``--resync`` a third of the window (at most
   its 300 s default), so resyncs happen inside it. Then ``rss_mb`` / ``pss_mb``.
2. ``resolve_p50_ms`` / ``resolve_p99_ms``: a GKMCache created by tag (webhooks on: pinned at
   admission) until ``status.resolvedDigest`` shows in a watch, 30 one after another; and
   ``resolve_nowebhook_*``: the same in ``kube-system`` (which the webhooks skip), where the
   reconciler asks the registry itself.
3. ``mutating_admission_p99_ms``: the mutating webhook's latency as the API server measures it
   (histogram ``apiserver_admission_webhook_admission_duration_seconds`` on its /metrics, the
   delta over 100 CREATEs of an image the Resolver has just resolved; p99 interpolated within
   the histogram's bucket as histogram_quantile does, the mean exact from _sum/_count); beside
   it the end-to-end create latency with webhooks and without (kube-system), interleaved.
4. Fleet roll: 1,000 ClusterGKMCacheNode objects move one ClusterGKMCache through Pending ->
   Downloading -> Extracted in three waves of ~20 s (a thread pool, paced): the controller's
   writes of that cache (``roll_status_writes``, ``writes_per_cache_per_s`` over the roll,
   ``max_writes_in_1s``), its CPU seconds, its reconciles of the kind and their mean time, ``lag_s`` from the last node write to the final
   aggregate in a watch, ``aggregate_correct``, and ``node_lists_during_roll`` (list calls on the
   node kinds: the reconciler must read its local copies, never list per event).
5. Signatures (docs/signatures.md): the 10 idle images are signed by the real cosign (even ones
   ``cosign-v3`` bundles, odd ones ``cosign-v2`` ``.sig``) and a ClusterCacheTrustPolicy covers
   the ClusterGKMCaches and namespace bench-a (``requireSignature``): 40 of the 100 idle caches
   are verified before the idle window, and ``idle_verifications`` counts the controller's
   verifications during it (target 0: once per digest and policy); the policy is deleted after the
   window (it would cover the unsigned fleet cache of 4.). ``verify_<format>_p50_ms`` /
   ``_p99_ms``: one cache's verification (fetch the signatures from the local registry, verify,
   check the digest), 20 images per format, each verified 3 times without a cached verdict.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import ssl
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

import psutil
import yaml

from accelnode.kube.client import Client, Config, KubeError
from accelnode.kube.reflector import Reflector
from tests.rigs import devcluster
from tests.rigs.devcluster import ControlPlane
from accelnode.oci import signatures as sg
from tests.cache.cosign import Cosign
from tests.cache.test_store import triton_tree
from tests.conftest import ROOT, TOOLS_BIN, accelnode_cmd, tool
from tests.controller.test_webhook_server import CA
from tests.csi.conftest import free_ports
from tests.fixtures.registry import RunningRegistry

G = "controller"
GV = "/apis/gkm.io/v1alpha1"
CONTROLLER_USER = next(i.user for i in devcluster.IDENTITIES if i.name == "controller")
IDLE_S = float(os.environ.get("ACCELNODE_BENCH_IDLE_S", "300"))
RESYNC_S = min(300.0, max(10.0, IDLE_S / 3))
NAMESPACES = ("bench-a", "bench-b", "bench-c")  # 30 GKMCaches each, plus 10 ClusterGKMCaches: 100
IDLE_NODES = 5  # x (1 ClusterGKMCacheNode + 3 GKMCacheNodes) = 20 node objects
RESOLVES = 30
ADMISSIONS = 100
FLEET = 1000
WAVE_S = 20.0  # one state change of the whole fleet
MUTATING_HOOK = "mgkmcache.accelnode.gkm.io"  # daemonsets/webhooks-gkm.yaml
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
NODE_KINDS = {"gkmcachenodes", "clustergkmcachenodes"}
SIGNED_PER_FORMAT = 20
TARGETS = {"idle_writes": "==0", "idle_verifications": "==0", "mutating_admission_p99_ms": "<=50", "writes_per_cache_per_s": "<=1",
           "node_lists_during_roll": "==0", "aggregate_correct": "==1"}  # bench/run.py's format


def emit(metric: str, value, fmt: str = ".1f") -> None:
    print(f"BENCH {G} {metric}={value:{fmt}}", flush=True)
    if metric in TARGETS:
        print(f"BENCH {G} target_{metric}{TARGETS[metric]}", flush=True)


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- the audit log ------------------------------------------------------------------------------


class Audit:
    """The API server's audit log, read by byte offset: ``mark()`` now, ``events(since)`` later."""

    def __init__(self, path: Path):
        self.path = path

    def mark(self) -> int:
        data = self.path.read_bytes()
        return data.rfind(b"\n") + 1

    def events(self, start: int, end: int | None = None) -> list[dict]:
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(end - start)
        return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


def by_controller(events: list[dict], verbs: set[str], stage: str = "ResponseComplete") -> list[dict]:
    return [e for e in events if e.get("stage") == stage and e["user"]["username"] == CONTROLLER_USER
            and e.get("verb") in verbs]


def resource(e: dict) -> str:
    ref = e.get("objectRef") or {}
    return ref.get("resource", "") + ("/" + ref["subresource"] if ref.get("subresource") else "")


def stamp(e: dict) -> float:
    return datetime.fromisoformat(e["stageTimestamp"].replace("Z", "+00:00")).timestamp()


# -- watching the caches ------------------------------------------------------------------------


class Caches:
    """Local copies of both cache kinds through our own Reflector (as the admin): when each
    cache first showed ``status.resolvedDigest`` (monotonic time of the watch event), and every
    status of the caches in :attr:`track`. Waiters wake on each event."""

    def __init__(self, client: Client):
        self.cond = threading.Condition()
        self.resolved_at: dict[tuple, float] = {}
        self.track: set[tuple] = set()
        self.history: dict[tuple, list[tuple[float, dict]]] = defaultdict(list)
        self.stop = threading.Event()
        self.reflectors = {p: Reflector(client, f"{GV}/{p}", on_event=lambda _t, o, p=p: self._event(p, o))
                           for p in ("gkmcaches", "clustergkmcaches")}
        for r in self.reflectors.values():
            threading.Thread(target=r.run, args=(self.stop,), daemon=True).start()

    def _event(self, plural: str, obj: dict) -> None:
        t = time.monotonic()
        key = (plural, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        status = obj.get("status") or {}
        with self.cond:
            if status.get("resolvedDigest") and key not in self.resolved_at:
                self.resolved_at[key] = t
            if key in self.track:
                self.history[key].append((t, status))
            self.cond.notify_all()

    def get(self, key: tuple) -> dict | None:
        return self.reflectors[key[0]].get(key[1], key[2])

    def all(self) -> list[dict]:
        return [o for r in self.reflectors.values() for o in r.snapshot()]

    def wait(self, check, what: str, timeout: float = 300.0):
        end = time.monotonic() + timeout
        with self.cond:
            while not (result := check()):
                left = end - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
                self.cond.wait(min(left, 1.0))
        return result

    def close(self) -> None:
        self.stop.set()
        for r in self.reflectors.values():
            r.interrupt()


# -- node objects, as the agent writes them -----------------------------------------------------


def entry(state: str, pods: tuple = (), message: str = "") -> dict:
    e = {"state": state, "lastUpdated": now_rfc3339()}
    if state in ("Extracted", "Running"):
        e.update(volumeSize=2048, compatibleGPUs=list(range(8)), incompatibleGPUs=[])
    if pods:
        e["pods"] = [{"podNamespace": ns, "podName": n, "volumeId": f"vol-{n}"} for ns, n in pods]
    if message:
        e["message"] = message
    return e


def node_status(node: str, caches: dict) -> dict:
    """One node object's status (docs/agent-status.md): ``caches`` is name -> digest -> entry."""
    entries = [e for by_digest in caches.values() for e in by_digest.values()]
    states = {e["state"] for e in entries}
    in_use = bool(states & {"Running", "Outdated", "Deleting"})

    def pods(state: str) -> int:
        return len({(p["podNamespace"], p["podName"]) for e in entries if e["state"] == state for p in e.get("pods", ())})

    return {"nodeName": node, "gpus": [{"gpuType": "cuda/sm_90", "ids": list(range(8))}],
            "counts": {"nodeCnt": 1, "nodeInUseCnt": int(in_use),
                       "nodeNotInUseCnt": int(not in_use and "Extracted" in states),
                       "nodeErrorCnt": int("Error" in states), "podRunningCnt": pods("Running"),
                       "podOutdatedCnt": pods("Outdated"), "podDeletingCnt": pods("Deleting")},
            "caches": caches}


class Nodes:
    """Node objects written with the agent's identity: POST once, then ``PUT .../status`` over
    the version last written (each object is written by one thread at a time)."""

    def __init__(self, client: Client):
        self.client = client
        self.objs: dict[tuple, dict] = {}

    def create(self, ns: str | None, node: str) -> None:
        plural = "gkmcachenodes" if ns else "clustergkmcachenodes"
        path = f"{GV}/namespaces/{ns}/{plural}" if ns else f"{GV}/{plural}"
        body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCacheNode" if ns else "ClusterGKMCacheNode",
                "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}}}
        self.objs[(ns, node)] = self.client.request("POST", path, body=body)

    def put(self, ns: str | None, node: str, caches: dict) -> None:
        if (ns, node) not in self.objs:
            self.create(ns, node)
        obj = self.objs[(ns, node)]
        plural = "gkmcachenodes" if ns else "clustergkmcachenodes"
        path = f"{GV}/namespaces/{ns}/{plural}/{node}" if ns else f"{GV}/{plural}/{node}"
        self.objs[(ns, node)] = self.client.request("PUT", path + "/status",
                                                    body={**obj, "status": node_status(node, caches)})


# -- the run ------------------------------------------------------------------------------------


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-controller-") as tmp:
        run(Path(tmp))


def run(tmp: Path) -> None:
    # the controller's reads are audited too (list/watch at Metadata level), to count its lists
    rules = [{"level": "Metadata", "users": [CONTROLLER_USER], "verbs": ["list", "watch"]},
             *devcluster._AUDIT_POLICY["rules"]]
    cp = ControlPlane(tmp / "cp", TOOLS_BIN)
    with mock.patch.dict(devcluster._AUDIT_POLICY, rules=rules):
        cp.start()
    (tmp / "registry").mkdir()
    reg = None
    proc = caches = None
    try:
        reg = RunningRegistry(tmp / "registry")
        kubectl = tool("kubectl")
        subprocess.run([kubectl, f"--kubeconfig={cp.kubeconfig('admin')}", "apply", *devcluster.crd_args(),
                        "-f", str(ROOT / "daemonsets/namespace.yaml"),
                        *[a for f in sorted((ROOT / "daemonsets").glob("rbac-controller*.yaml")) for a in ("-f", str(f))],
                        "-f", str(ROOT / "daemonsets/rbac-agent.yaml")], check=True, capture_output=True)
        admin = Client(Config.from_kubeconfig(cp.kubeconfig("admin")), user_agent="bench")
        agent = Client(Config.from_kubeconfig(cp.kubeconfig("agent")), user_agent="bench-agent")
        audit = Audit(cp.audit_log)
        wait_established(admin)
        for ns in (*NAMESPACES, "bench-resolve", "bench-hooks"):
            admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})

        def push(repo: str, tag: str = "v1") -> str:
            src = triton_tree(tmp / "src" / f"{repo.replace('/', '_')}-{tag}", seed=f"{repo}:{tag}".encode(), nbytes=2000)
            reg.push(src, repo, tag=tag)
            return f"{reg.host}/{repo}:{tag}"

        # the controller, serving the webhooks with a test CA's certificate
        ca = CA()
        (tmp / "tls").mkdir()
        cert, key, _ = ca.serving(tmp / "tls", "accelnode-controller")
        webhook_port, metrics_port = free_ports(2)
        log = open(tmp / "controller.log", "ab")
        proc = subprocess.Popen(accelnode_cmd() + [
            "controller", "--kubeconfig", str(cp.kubeconfig("controller")), "--identity", "bench",
            "--namespace", "accelnode-system", "--metrics-address", f"127.0.0.1:{metrics_port}",
            "--webhook-address", f"127.0.0.1:{webhook_port}", "--tls-cert-file", cert, "--tls-key-file", key,
            "--plain-http", "--resync", str(RESYNC_S)], cwd=ROOT, stdout=log, stderr=log)
        controller = psutil.Process(proc.pid)
        wait_for(lambda: controller_metric(metrics_port, "accelnode_controller_leader") == 1, "the controller to lead",
                 proc)
        register_webhooks(admin, webhook_port, ca.pem)
        wait_webhooks(admin, reg.push_raw("bench/probe", "v1"))
        caches = Caches(admin)
        caches.wait(lambda: all(r.synced.is_set() for r in caches.reflectors.values()), "the cache watches", 60)
        nodes = Nodes(agent)

        # -- 1. idle writes (and 5. idle verifications) -------------------------------------------
        idle_images = [push(f"bench/idle-{i}") for i in range(10)]
        cosign = Cosign(tmp)
        sign_key, pub = cosign.keypair("bench")
        for i, image in enumerate(idle_images):
            cosign.sign(f"{image.rsplit(':', 1)[0]}@{resolve_digest(reg, image)}", sign_key, sg.V3 if i % 2 == 0 else sg.V2)
        admin.request("POST", "/apis/accelnode.io/v1alpha1/clustercachetrustpolicies", body={
            "apiVersion": "accelnode.io/v1alpha1", "kind": "ClusterCacheTrustPolicy", "metadata": {"name": "bench"},
            "spec": {"clusterCaches": True, "namespaces": ["bench-a"], "requireSignature": True,
                     "keys": [{"name": "bench", "publicKey": pub}]}})
        keys = []
        for i in range(100):
            image = idle_images[i % 10]
            if i < 90:
                ns = NAMESPACES[i % 3]
                create_cache(admin, ns, f"c{i}", image)
                keys.append(("gkmcaches", ns, f"c{i}"))
            else:
                create_cache(admin, None, f"cluster-c{i}", image)
                keys.append(("clustergkmcaches", None, f"cluster-c{i}"))
        caches.wait(lambda: all(k in caches.resolved_at for k in keys), "100 caches resolved")
        signed = [k for k in keys if k[1] in (None, "bench-a")]
        caches.wait(lambda: all(any(c.get("type") == "Verified" and c.get("status") == "True"
                                    for c in ((caches.get(k) or {}).get("status") or {}).get("conditions") or ())
                                for k in signed), f"{len(signed)} signed caches verified")
        scopes = defaultdict(dict)  # node object namespace (None: cluster) -> cache name -> digest
        for k in keys:
            scopes[k[1]][k[2]] = caches.get(k)["status"]["resolvedDigest"]
        for n in range(IDLE_NODES):
            node = f"idle-node-{n}"
            for ns, named in scopes.items():
                by_name = {}
                for j, (name, digest) in enumerate(sorted(named.items())):
                    if n == 0 and j % 7 == 0:
                        e = entry("Running", pods=((ns or "default", f"pod-{name}"),))
                    elif n == 1 and j % 11 == 0:
                        e = entry("Downloading")
                    elif n == 2 and j % 13 == 0:
                        e = entry("Error", message="pull failed: registry answered 500")
                    else:
                        e = entry("Extracted")
                    by_name[name] = {digest: e}
                nodes.put(ns, node, by_name)
        caches.wait(lambda: all(((caches.get(k) or {}).get("status") or {}).get("counts", {}).get("nodeCnt")
                                == IDLE_NODES for k in keys), "100 caches counting 5 nodes")
        # the claims settle when kube-controller-manager binds the pairs (its PV sync runs every 15 s),
        # not within the 3 s quiet() waits for: steady state means every claim Bound
        caches.wait(lambda: all(claim_bound(caches.get(k), k[1]) for k in keys if k[1]), "90 claims Bound", 120)
        quiet(audit)
        start = audit.mark()
        verified_before = verifications(tmp / "controller.log")
        time.sleep(IDLE_S)
        events = audit.events(start)
        emit("idle_verified_caches", len(signed), "d")
        emit("idle_verifications", verifications(tmp / "controller.log") - verified_before, "d")
        writes = by_controller(events, WRITES)
        lease = [e for e in writes if resource(e) == "leases"]
        others = [e for e in writes if resource(e) != "leases"]
        emit("idle_window_s", IDLE_S, ".0f")
        emit("resync_s", RESYNC_S, ".0f")
        emit("idle_writes", len(others), "d")
        if others:
            print(f"# idle writes by verb/resource: {dict(_count(others))}", flush=True)
        emit("idle_lease_writes", len(lease), "d")
        emit("idle_lists", len(by_controller(events, {"list"})), "d")
        emit("idle_watches", len(by_controller(events, {"watch"}, stage="ResponseStarted")), "d")
        emit("rss_mb", controller.memory_info().rss / 2**20)
        emit("pss_mb", controller.memory_full_info().pss / 2**20)
        # the policy covers every ClusterGKMCache: gone before the unsigned fleet cache of 4. exists
        admin.request("DELETE", "/apis/accelnode.io/v1alpha1/clustercachetrustpolicies/bench")

        # -- 2. created by tag -> status.resolvedDigest -----------------------------------------
        for label, ns in (("resolve", "bench-resolve"), ("resolve_nowebhook", "kube-system")):
            images = [push(f"bench/{label.replace('_', '-')}-{i}") for i in range(RESOLVES)]
            samples = []
            for i, image in enumerate(images):
                k = ("gkmcaches", ns, f"r{i}")
                t0 = time.monotonic()
                create_cache(admin, ns, k[2], image)
                samples.append(caches.wait(lambda: caches.resolved_at.get(k), f"{k} resolved", 60) - t0)
            emit(f"{label}_p50_ms", statistics.median(samples) * 1000)
            emit(f"{label}_p99_ms", pct(samples, 0.99) * 1000)

        # -- 3. mutating admission of an already-resolved image ---------------------------------
        image = push("bench/hooks")
        create_cache(admin, "bench-hooks", "warm", image)  # the Resolver asks the registry once
        before = apiserver_metrics(cp)
        hooked, plain = [], []
        for i in range(ADMISSIONS):  # interleaved: both see the same load
            for ns, out in (("bench-hooks", hooked), ("kube-system", plain)):
                t0 = time.perf_counter()
                created = create_cache(admin, ns, f"a{i}", image)
                out.append(time.perf_counter() - t0)
                if ns == "bench-hooks" and "gkm.io/resolvedDigest" not in (created["metadata"].get("annotations") or {}):
                    raise RuntimeError(f"bench-hooks/a{i} was not pinned at admission")
        buckets, total, count = webhook_histogram(apiserver_metrics(cp), before, MUTATING_HOOK)
        if count < ADMISSIONS:
            raise RuntimeError(f"the API server recorded {count:.0f} mutating admissions, expected {ADMISSIONS}")
        # method: the API server's own histogram (delta over the run), p99 interpolated in its bucket
        emit("mutating_admission_p99_ms", histogram_quantile(0.99, buckets) * 1000)
        emit("mutating_admission_mean_ms", total / count * 1000)
        emit("mutating_admission_within_25ms_pct", 100 * buckets.get(0.025, 0) / count)
        emit("create_with_webhooks_p50_ms", statistics.median(hooked) * 1000)
        emit("create_with_webhooks_p99_ms", pct(hooked, 0.99) * 1000)
        emit("create_without_webhooks_p50_ms", statistics.median(plain) * 1000)
        emit("create_without_webhooks_p99_ms", pct(plain, 0.99) * 1000)

        # -- 4. fleet roll ------------------------------------------------------------------------
        fleet = ("clustergkmcaches", None, "fleet")
        caches.track.add(fleet)
        create_cache(admin, None, "fleet", push("bench/fleet"))
        caches.wait(lambda: fleet in caches.resolved_at, "the fleet cache resolved", 60)
        digest = caches.get(fleet)["status"]["resolvedDigest"]
        names = [f"node-{i:04d}" for i in range(FLEET)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: nodes.create(None, n), names))
        quiet(audit)
        want_counts = {"nodeCnt": FLEET, "nodeInUseCnt": 0, "nodeNotInUseCnt": FLEET, "nodeErrorCnt": 0,
                       "podRunningCnt": 0, "podOutdatedCnt": 0, "podDeletingCnt": 0}

        def final(status: dict) -> bool:
            conds = status.get("conditions") or [{}]
            return (status.get("resolvedDigest") == digest and status.get("counts") == want_counts
                    and conds[0].get("reason") == "Extracted"
                    and conds[0].get("message") == f"{FLEET} of {FLEET} nodes hold {digest}")

        done: list[float] = []
        lock = threading.Lock()

        def write(node: str, state: str) -> None:
            nodes.put(None, node, {"fleet": {digest: entry(state)}})
            with lock:
                done.append(time.monotonic())

        start = audit.mark()
        cpu0 = controller.cpu_times()
        reconcile_s0 = controller_metric(metrics_port, "accelnode_controller_reconcile_seconds_sum",
                                         reconciler="clustergkmcache")
        reconciles0 = controller_metric(metrics_port, "accelnode_controller_reconcile_seconds_count",
                                        reconciler="clustergkmcache")
        t_start = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            for state in ("Pending", "Downloading", "Extracted"):
                paced(pool, lambda n, s=state: write(n, s), names, FLEET / WAVE_S)
        t_last = max(done)
        emit("roll_s", t_last - t_start)
        t_final = caches.wait(lambda: next((t for t, st in caches.history[fleet] if final(st)), None),
                              "the fleet's final aggregate in a watch event", 120)
        cpu1 = controller.cpu_times()
        emit("lag_s", max(0.0, t_final - t_last), ".2f")
        emit("roll_cpu_s", (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), ".2f")
        time.sleep(5)  # anything still queued lands now, and must not change the answer
        events = audit.events(start)
        emit("aggregate_correct", int(final(caches.get(fleet).get("status") or {})), "d")
        mine = [e for e in by_controller(events, WRITES)
                if resource(e).startswith("clustergkmcaches") and e["objectRef"].get("name") == "fleet"]
        emit("roll_status_writes", len(mine), "d")
        emit("writes_per_cache_per_s", len(mine) / (t_final - t_start), ".2f")
        times = sorted(stamp(e) for e in mine)
        emit("max_writes_in_1s", max((sum(1 for u in times if t <= u < t + 1.0) for t in times), default=0), "d")
        reconciles = controller_metric(metrics_port, "accelnode_controller_reconcile_seconds_count",
                                       reconciler="clustergkmcache") - reconciles0
        emit("reconciles_during_roll", reconciles, ".0f")
        emit("reconcile_mean_ms_during_roll", (controller_metric(
            metrics_port, "accelnode_controller_reconcile_seconds_sum", reconciler="clustergkmcache")
            - reconcile_s0) / max(reconciles, 1) * 1000, ".2f")
        reads = [e for e in events if (e.get("objectRef") or {}).get("resource") in NODE_KINDS]
        emit("node_lists_during_roll", len(by_controller(reads, {"list"})), "d")
        emit("node_watches_during_roll", len(by_controller(reads, {"watch"}, stage="ResponseStarted")), "d")
        emit("rss_mb_after_roll", controller.memory_info().rss / 2**20)
        if proc.poll() is not None:
            raise RuntimeError(f"the controller exited with {proc.returncode}; see its log")

        # -- 5. verification time per cache and format ----------------------------------------------
        verify_times(tmp, reg)
    finally:
        if caches is not None:
            caches.close()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if reg is not None:
            reg.stop()
        cp.stop()


# -- helpers ------------------------------------------------------------------------------------


def resolve_digest(reg: RunningRegistry, image: str) -> str:
    from accelnode.oci.manifest import resolve

    return resolve(image, reg.options())[0]


def verifications(log: Path) -> int:
    """The controller's signature verifications so far (its "cache signature verified" lines)."""
    return sum(1 for line in log.read_text(errors="replace").splitlines() if "cache signature verified" in line)


def verify_times(tmp: Path, reg: RunningRegistry) -> None:
    """5. one cache's verification per format, in-process as the controller does it."""
    cosign = Cosign(tmp)
    sign_key, pub = cosign.keypair("bench-times")
    keys = [sg.TrustedKey.from_pem("bench", pub)]
    for fmt in sg.FORMATS:
        images = []
        for i in range(SIGNED_PER_FORMAT):
            pinned = reg.push_raw(f"bench/signed-{fmt}-{i}", "v1",
                                  layers=[("application/vnd.oci.image.layer.v1.tar", f"{fmt} {i}".encode())])
            cosign.sign(pinned, sign_key, fmt)
            images.append(pinned)
        samples = []
        for _ in range(3):
            for pinned in images:
                t0 = time.perf_counter()
                verdict = sg.verify(pinned, pinned.rsplit("@", 1)[1], keys, reg.options(), formats=(fmt,))
                samples.append(time.perf_counter() - t0)
                assert verdict.ok, verdict
        label = fmt.replace("-", "_")
        emit(f"verify_{label}_p50_ms", statistics.median(samples) * 1000)
        emit(f"verify_{label}_p99_ms", pct(samples, 0.99) * 1000)


def wait_for(check, what: str, proc=None, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the controller exited with {proc.returncode} while waiting for {what}")
        try:
            if result := check():
                return result
        except (OSError, KubeError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def wait_established(admin: Client) -> None:
    def established() -> bool:
        crds = admin.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")["items"]
        return all(any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"].get("conditions", ()))
                   for crd in crds if crd["spec"]["group"] == "gkm.io")
    wait_for(established, "the CRDs to be Established")


def create_cache(admin: Client, ns: str | None, name: str, image: str, **query) -> dict:
    plural, kind = ("gkmcaches", "GKMCache") if ns else ("clustergkmcaches", "ClusterGKMCache")
    path = f"{GV}/namespaces/{ns}/{plural}" if ns else f"{GV}/{plural}"
    return admin.request("POST", path, query=query or None, body={
        "apiVersion": "gkm.io/v1alpha1", "kind": kind, "metadata": {"name": name}, "spec": {"image": image}})


def register_webhooks(admin: Client, port: int, ca_pem: bytes) -> None:
    """daemonsets/webhooks-gkm.yaml with each Service reference replaced by our loopback URL."""
    for doc in yaml.safe_load_all((ROOT / "daemonsets/webhooks-gkm.yaml").read_text()):
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca_pem).decode()}
        plural = doc["kind"].lower() + "s"
        admin.request("POST", f"/apis/admissionregistration.k8s.io/v1/{plural}", body=doc)


def wait_webhooks(admin: Client, image: str) -> None:
    """The API server picks webhook configurations up asynchronously: dry-run creates of
    ``image`` (a digest the registry holds) until both kinds come back pinned."""

    def pinned() -> bool:
        return all("gkm.io/resolvedDigest" in (create_cache(admin, ns, "probe", image, dryRun="All")["metadata"]
                                               .get("annotations") or {}) for ns in ("bench-hooks", None))
    wait_for(pinned, "the webhooks to be called", timeout=60)


def claim_bound(cache: dict | None, namespace: str) -> bool:
    """The cache's claim in ``namespace`` is reported Bound (status.pvcStatus, docs/cache-claims.md)."""
    entry = (((cache or {}).get("status") or {}).get("pvcStatus") or {}).get(namespace) or {}
    return any(c.get("type") == "Bound" and c.get("status") == "True" for c in entry.get("conditions") or ())


def quiet(audit: Audit, still: float = 3.0, timeout: float = 120.0) -> None:
    """Until the controller has made no write but its Lease renewals for ``still`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        start = audit.mark()
        time.sleep(still)
        if not [e for e in by_controller(audit.events(start), WRITES) if resource(e) != "leases"]:
            return
    raise RuntimeError(f"the controller kept writing for {timeout:.0f}s")


def paced(pool: ThreadPoolExecutor, fn, items: list, rate: float) -> None:
    """Submit ``fn(item)`` at ``rate`` per second; return when all are done (errors raise)."""
    start, futures = time.monotonic(), []
    for i, item in enumerate(items):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(pool.submit(fn, item))
    for f in futures:
        f.result()


def _count(events: list[dict]) -> dict:
    out = defaultdict(int)
    for e in events:
        out[f"{e['verb']} {resource(e)}"] += 1
    return out


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$")


def _samples(text: str, name: str):
    for line in text.splitlines():
        if line.startswith(name):
            m = _SAMPLE.match(line)
            if m:
                yield m.group(1), dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or "")), float(m.group(3))


def controller_metric(port: int, name: str, **labels) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(v for n, lab, v in _samples(text, name) if n == name and all(lab.get(k) == w for k, w in labels.items()))


def apiserver_metrics(cp: ControlPlane) -> str:
    user = yaml.safe_load(cp.kubeconfig("admin").read_text())["users"][0]["user"]
    ctx = ssl.create_default_context(cafile=str(cp.ca_file))
    ctx.load_cert_chain(user["client-certificate"], user["client-key"])
    with urllib.request.urlopen(f"{cp.url}/metrics", context=ctx, timeout=30) as resp:
        return resp.read().decode()


def webhook_histogram(after: str, before: str, hook: str) -> tuple[dict, float, float]:
    """The CREATE admissions of one webhook between two scrapes: (cumulative bucket counts by
    upper bound, sum of seconds, count)."""
    def read(text: str):
        buckets, total, count = defaultdict(float), 0.0, 0.0
        for n, lab, v in _samples(text, "apiserver_admission_webhook_admission_duration_seconds"):
            if lab.get("name") != hook or lab.get("operation") != "CREATE":
                continue
            if n.endswith("_bucket"):
                buckets[float(lab["le"])] += v
            elif n.endswith("_sum"):
                total += v
            elif n.endswith("_count"):
                count += v
        return buckets, total, count

    (b1, s1, c1), (b0, s0, c0) = read(after), read(before)
    return {le: b1[le] - b0.get(le, 0.0) for le in b1}, s1 - s0, c1 - c0


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile: linear within the bucket holding the rank."""
    les = sorted(buckets)
    rank = q * buckets[les[-1]]
    prev_le = prev_count = 0.0
    for le in les:
        if buckets[le] >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(buckets[le] - prev_count, 1e-12)
        prev_le, prev_count = le, buckets[le]
    return prev_le


if __name__ == "__main__":
    main()
