"""TPU environment webhook benchmark: admission latency at a fixed rate over TLS.

The server is a process of its own serving exactly what ``accelnode controller`` serves for
these webhooks (controller/webhooks/server.py's AdmissionServer with controller/tpuenv/webhooks.py's routes,
logging JSON at info as the daemon does) on 127.0.0.1 with a test CA's certificate. The client
sends AdmissionReviews open-loop at ``RATE`` requests per second for ``ACCELNODE_BENCH_WEBHOOK_S``
seconds (default 60) per mode, round-robin over three requests as the API server sends them
for a TPU workload: a StatefulSet CREATE (16 replicas, opted in), an Indexed Job CREATE (a
JobSet's slice of 16 hosts) and a Pod CREATE (a worker of that StatefulSet). Latency is from the
moment a request was due (not when a client thread got to it: no coordinated omission) to the
last byte of the answer.

Modes: ``newconn`` (a TCP connection and TLS handshake per request, as the API server makes
when it has no idle connection) and ``keepalive`` (requests over a few persistent connections,
as the API server's pooled client). Metrics: ``<mode>_p50_ms``, ``<mode>_p99_ms``,
``<mode>_rps`` (achieved), ``<mode>_errors``, the server's CPU seconds over each mode
(``<mode>_server_cpu_s``) and its RSS at the end (``server_rss_mb``). Target: p99 <= 10 ms at
200 rps.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

G = "webhook"
RATE = 200.0
DURATION_S = float(os.environ.get("ACCELNODE_BENCH_WEBHOOK_S", "60"))
CLIENT_THREADS = 16
KEEPALIVE_CONNECTIONS = 8
TARGETS = {"newconn_p99_ms": "<=10", "keepalive_p99_ms": "<=10"}  # bench/run.py's format


def emit(metric: str, value, fmt: str = ".2f") -> None:
    print(f"BENCH {G} {metric}={value:{fmt}}", flush=True)
    if metric in TARGETS:
        print(f"BENCH {G} target_{metric}{TARGETS[metric]}", flush=True)


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(samples)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def reviews() -> list[tuple[str, bytes]]:
    from controller.tpuenv import patches as t
    from controller.tpuenv.webhooks import MUTATE_JOB, MUTATE_POD, MUTATE_STATEFULSET

    tpu = {"limits": {t.TPU_RESOURCE: "4"}, "requests": {t.TPU_RESOURCE: "4"}}
    container = {"name": "worker", "image": "us-docker.pkg.dev/project/repo/trainer:v1",
                 "env": [{"name": "FOO", "value": "bar"}], "resources": tpu}
    opt_in = {t.INJECT_LABEL: t.INJECT_VALUE}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web", "namespace": "ml",
                                                                        "labels": dict(opt_in)},
           "spec": {"serviceName": "nginx", "replicas": 16, "selector": {"matchLabels": {"app": "web"}},
                    "template": {"metadata": {"labels": {"app": "web", **opt_in}},
                                 "spec": {"containers": [container]}}}}
    labels = {t.JOBSET_NAME: "js", t.JOBSET_RJOB: "slice", t.JOBSET_JOB_INDEX: "1", t.JOBSET_REPLICAS: "2"}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "js-slice-1", "namespace": "ml",
                                                                 "labels": labels},
           "spec": {"completionMode": "Indexed", "parallelism": 16, "completions": 16,
                    "template": {"metadata": {"labels": labels},
                                 "spec": {"subdomain": "js", "restartPolicy": "Never", "containers": [container]}}}}
    patched = json.loads(json.dumps(sts))
    t.apply_ops(patched, t.statefulset_patch(sts)[0])
    tpl = patched["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "web-7", "namespace": "ml", "annotations": tpl["metadata"]["annotations"],
                        "labels": {**tpl["metadata"]["labels"], t.POD_INDEX_LABEL: "7"},
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web",
                                             "uid": "0" * 8, "controller": True}]},
           "spec": tpl["spec"]}
    out = []
    for path, (group, kind), obj in ((MUTATE_STATEFULSET, ("apps", "StatefulSet"), sts),
                                     (MUTATE_JOB, ("batch", "Job"), job), (MUTATE_POD, ("", "Pod"), pod)):
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {"uid": "00000000-0000-0000-0000-000000000000",
                            "kind": {"group": group, "version": "v1", "kind": kind},
                            "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
                            "operation": "CREATE", "namespace": "ml", "name": obj["metadata"]["name"],
                            "userInfo": {"username": "system:serviceaccount:kube-system:statefulset-controller"},
                            "object": obj, "dryRun": False}}
        out.append((path + "?timeout=5s", json.dumps(body).encode()))
    return out


def serve(cert: str, key: str) -> None:
    """The server process: prints its port, serves until stdin closes."""
    from accelnode import log as alog
    from controller.webhooks.server import AdmissionServer
    from controller.tpuenv.webhooks import routes

    alog.setup("info", "json", stream=open(os.devnull, "w"))
    server = AdmissionServer("127.0.0.1:0", cert, key, routes()).start()
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()


class Client:
    def __init__(self, port: int, ctx: ssl.SSLContext, keepalive: bool):
        self.port, self.ctx, self.keepalive = port, ctx, keepalive
        self.local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self.local, "conn", None) if self.keepalive else None
        if conn is None:
            conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx, timeout=10)
            if self.keepalive:
                self.local.conn = conn
        return conn

    def post(self, path: str, body: bytes) -> bool:
        conn = self._conn()
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status == 200 and json.loads(data)["response"]["allowed"] is True
        except (OSError, http.client.HTTPException, ValueError):
            self.local.conn = None
            conn.close()
            return False
        finally:
            if not self.keepalive:
                conn.close()


def run_mode(port: int, ctx: ssl.SSLContext, keepalive: bool, bodies) -> tuple[list[float], int, float]:
    """(latencies in ms, errors, achieved rps) of ``DURATION_S`` seconds at ``RATE``."""
    client = Client(port, ctx, keepalive)
    threads = KEEPALIVE_CONNECTIONS if keepalive else CLIENT_THREADS
    lat: list[float] = []
    errors = 0
    lock = threading.Lock()

    def one(due: float, path: str, body: bytes) -> None:
        nonlocal errors
        ok = client.post(path, body)
        ms = (time.perf_counter() - due) * 1000
        with lock:
            if ok:
                lat.append(ms)
            else:
                errors += 1

    n = int(RATE * DURATION_S)
    start = time.perf_counter() + 0.1
    with ThreadPoolExecutor(threads) as pool:
        for i in range(n):
            due = start + i / RATE
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            path, body = bodies[i % len(bodies)]
            pool.submit(one, due, path, body)
    elapsed = time.perf_counter() - start
    return lat, errors, n / elapsed


def main() -> None:
    import psutil

    from tests.controller.test_webhook_server import CA

    bodies = reviews()
    with tempfile.TemporaryDirectory(prefix="bench-webhook-") as tmp:
        ca = CA()
        cert, key, _ = ca.serving(Path(tmp), "accelnode-controller")
        proc = subprocess.Popen([sys.executable, __file__, "--serve", cert, key], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            server = psutil.Process(proc.pid)
            ctx = ssl.create_default_context(cadata=ca.pem.decode())
            # warm both paths (imports, first handshakes) before measuring
            for keepalive in (False, True):
                c = Client(port, ctx, keepalive)
                for path, body in bodies * 5:
                    assert c.post(path, body), "the server does not admit the benchmark's requests"
            emit("rate_rps", RATE, ".0f")
            emit("duration_s", DURATION_S, ".0f")
            for mode, keepalive in (("newconn", False), ("keepalive", True)):
                cpu0 = sum(server.cpu_times()[:2])
                lat, errors, rps = run_mode(port, ctx, keepalive, bodies)
                cpu = sum(server.cpu_times()[:2]) - cpu0
                emit(f"{mode}_p50_ms", pct(lat, 0.50))
                emit(f"{mode}_p99_ms", pct(lat, 0.99))
                emit(f"{mode}_max_ms", max(lat))
                emit(f"{mode}_rps", rps, ".1f")
                emit(f"{mode}_errors", errors, "d")
                emit(f"{mode}_server_cpu_s", cpu)
            emit("server_rss_mb", server.memory_info().rss / 2**20, ".1f")
        finally:
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], sys.argv[3])
    else:
        main()
