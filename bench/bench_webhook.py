"""TPU environment webhook benchmark: admission latency at a fixed rate over TLS, alone and while
hostile clients hold connections open.

The server is a process of its own serving exactly what ``accelnode controller`` serves for
these webhooks (controller/webhooks/server.py's AdmissionServer with controller/tpuenv/webhooks.py's
routes and its default limits, logging JSON at info as the daemon does;
tests/controller/admission_proc.py) on 127.0.0.1 with a test CA's ECDSA P-256 certificate, as
the controller's own. The client sends AdmissionReviews open-loop at ``RATE`` requests per second
for ``ACCELNODE_BENCH_WEBHOOK_S`` seconds (default 60) per mode, round-robin over three requests
as the API server sends them for a TPU workload: a StatefulSet CREATE (16 replicas, opted in), an
Indexed Job CREATE (a JobSet's slice of 16 hosts) and a Pod CREATE (a worker of that
StatefulSet). Latency is from the moment a request was due (not when a client thread got to it:
no coordinated omission) to the last byte of the answer.

Modes: ``newconn`` (a TCP connection and a full TLS handshake per request, as the API server
makes when it has no idle connection: client-go sets no TLS session cache, so it never resumes),
``resumed`` (a new connection per request resuming the TLS session, as a client with a session
cache does), ``keepalive`` (requests over a few persistent connections, as the API server's
pooled client) and ``attacked`` (``newconn`` while 500 idle connections, 450 without and 50 with
a TLS handshake, and 50 slow-loris connections, each sending a byte of a request head every
second, are held open; the attacker reopens whatever the server closes). Metrics:
``<mode>_p50_ms``, ``<mode>_p99_ms``, ``<mode>_max_ms``, ``<mode>_rps`` (achieved),
``<mode>_errors``, the server's CPU seconds over each mode (``<mode>_server_cpu_s``);
``attacked_server_threads`` and ``attacked_server_rss_mb`` (the most seen during that mode),
``attacked_held_connections`` (hostile connections open at the end) and ``server_rss_mb`` at the
end. Targets: p99 <= 10 ms at 200 rps for ``newconn`` and ``keepalive``.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import ssl
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


class Resuming(http.client.HTTPSConnection):
    """A connection that offers the TLS session of the last one made through the same ``sessions``."""

    def __init__(self, *args, sessions: dict, **kw):
        super().__init__(*args, **kw)
        self.sessions = sessions

    def connect(self):
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host,
                                              session=self.sessions.get("last"))


class Client:
    def __init__(self, port: int, ctx: ssl.SSLContext, keepalive: bool, resume: bool = False):
        self.port, self.ctx, self.keepalive, self.resume = port, ctx, keepalive, resume
        self.local = threading.local()
        self.sessions: dict = {}

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self.local, "conn", None) if self.keepalive else None
        if conn is None:
            if self.resume:
                conn = Resuming("127.0.0.1", self.port, context=self.ctx, timeout=10, sessions=self.sessions)
            else:
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
            if self.resume:
                self.sessions["last"] = conn.sock.session  # TLS 1.3 tickets arrive after the handshake
            return resp.status == 200 and json.loads(data)["response"]["allowed"] is True
        except (OSError, http.client.HTTPException, ValueError):
            self.local.conn = None
            conn.close()
            return False
        finally:
            if not self.keepalive:
                conn.close()


class Attacker:
    """Holds ``idle`` connections (``tls_idle`` of them after a TLS handshake) and ``slow``
    slow-loris connections open, reopening what the server closes, until stopped."""

    def __init__(self, port: int, ctx: ssl.SSLContext, idle: int = 500, tls_idle: int = 50, slow: int = 50):
        self.port, self.ctx = port, ctx
        self.kinds = ["tcp"] * (idle - tls_idle) + ["tls"] * tls_idle + ["slow"] * slow
        self.socks: list = [None] * len(self.kinds)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, kind: str):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        if kind != "tcp":
            s = self.ctx.wrap_socket(s, server_hostname="127.0.0.1")
            s.settimeout(0)
        if kind == "slow":
            s.send(b"POST /mutate-tpu-env-pod HTTP/1.1\r\nHost: webhook\r\n")
        s.setblocking(False)
        return s

    def _alive(self, s) -> bool:
        try:
            return s.recv(1) != b""
        except (BlockingIOError, ssl.SSLWantReadError):
            return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self.stop.is_set():
            for i, kind in enumerate(self.kinds):
                s = self.socks[i]
                if s is not None and not self._alive(s):
                    s.close()
                    s = self.socks[i] = None
                if s is None:
                    try:
                        self.socks[i] = self._open(kind)
                    except OSError:
                        continue
                elif kind == "slow":
                    try:
                        s.send(b"X")
                    except (OSError, ssl.SSLWantWriteError):
                        pass
            self.stop.wait(1.0)

    def held(self) -> int:
        return sum(s is not None for s in self.socks)

    def __enter__(self) -> "Attacker":
        for i, kind in enumerate(self.kinds):
            self.socks[i] = self._open(kind)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            if s is not None:
                s.close()


def run_mode(port: int, ctx: ssl.SSLContext, keepalive: bool, bodies, resume: bool = False
             ) -> tuple[list[float], int, float]:
    """(latencies in ms, errors, achieved rps) of ``DURATION_S`` seconds at ``RATE``."""
    client = Client(port, ctx, keepalive, resume)
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

    from tests.controller.admission_proc import AdmissionProc
    from tests.controller.test_webhook_server import CA

    bodies = reviews()
    with tempfile.TemporaryDirectory(prefix="bench-webhook-") as tmp:
        ca = CA()
        cert, key, _ = ca.serving(Path(tmp), "accelnode-controller")
        proc = AdmissionProc(cert, key, "tpuenv")
        try:
            port = proc.port
            server = psutil.Process(proc.pid)
            ctx = ssl.create_default_context(cadata=ca.pem.decode())
            # warm every path (imports, first handshakes) before measuring
            for keepalive, resume in ((False, False), (False, True), (True, False)):
                c = Client(port, ctx, keepalive, resume)
                for path, body in bodies * 5:
                    assert c.post(path, body), "the server does not admit the benchmark's requests"
            emit("rate_rps", RATE, ".0f")
            emit("duration_s", DURATION_S, ".0f")
            for mode, keepalive, resume in (("newconn", False, False), ("resumed", False, True),
                                            ("keepalive", True, False), ("attacked", False, False)):
                cpu0 = sum(server.cpu_times()[:2])
                if mode == "attacked":
                    peak = {"threads": 0, "rss": 0}
                    done = threading.Event()

                    def watch():
                        while not done.wait(0.2):
                            peak["threads"] = max(peak["threads"], server.num_threads())
                            peak["rss"] = max(peak["rss"], server.memory_info().rss)
                    with Attacker(port, ctx) as attacker:
                        watcher = threading.Thread(target=watch, daemon=True)
                        watcher.start()
                        lat, errors, rps = run_mode(port, ctx, keepalive, bodies, resume)
                        held = attacker.held()
                        done.set()
                        watcher.join()
                else:
                    lat, errors, rps = run_mode(port, ctx, keepalive, bodies, resume)
                cpu = sum(server.cpu_times()[:2]) - cpu0
                emit(f"{mode}_p50_ms", pct(lat, 0.50))
                emit(f"{mode}_p99_ms", pct(lat, 0.99))
                emit(f"{mode}_max_ms", max(lat))
                emit(f"{mode}_rps", rps, ".1f")
                emit(f"{mode}_errors", errors, "d")
                emit(f"{mode}_server_cpu_s", cpu)
            emit("attacked_server_threads", peak["threads"], "d")
            emit("attacked_server_rss_mb", peak["rss"] / 2**20, ".1f")
            emit("attacked_held_connections", held, "d")
            emit("server_rss_mb", server.memory_info().rss / 2**20, ".1f")
        finally:
            proc.stop()


if __name__ == "__main__":
    main()
