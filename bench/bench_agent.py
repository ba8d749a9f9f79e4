"""Agent status-reporter benchmarks: the real ``accelnode agent --node-name`` on a simulated
v5e-4 host, a real registry, and a control plane of its own (etcd + kube-apiserver from
``.tools/bin``) whose audit log counts every API write the agent makes (needs root).

Metrics:
* ``writes_per_change``: API writes per cache state change, over 20 changes (a pod taking or
  dropping a cache, seen as Extracted <-> Running);
* ``idle_writes``: API writes during an idle window (``BENCH_AGENT_IDLE_S``, default 300 s);
* ``rss_mb``: the agent's RSS with 100 caches known and reported (and ``pss_mb``, ``uss_mb``:
  bench/memory.py);
* ``present_install_ms``: median EnsureCache of an installed cache over the agent's unix
  socket, as the CSI driver asks before every publish;
* memory under pulls: RSS after one pull of ``BIG_MIB`` MiB (``rss_after_1_pull_mb``), after
  ``BIG_PULLS`` more asked at once (queued behind ``--max-pulls``; ``rss_after_n_pulls_mb``),
  the growth between them (``rss_growth_mb``, target: flat) and the peak sampled meanwhile
  (``pull_peak_rss_mb``, what the manifest's memory limit must cover).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
from kubernetes import client, config

from accelnode import grpcutil
from bench import memory
from tests.rigs.devcluster import ControlPlane, crd_args
from agent.api import agent as agent_api
from agent.api import agent_grpc
from tests.rigs.simhost import SimHost
from tests.agent.conftest import AGENT_USER, TPU_LABELS, make_cache
from tests.conftest import ROOT, TOOLS_BIN, accelnode_cmd, tool
from tests.csi.conftest import free_ports
from tests.fixtures.registry import RunningRegistry

G = "agent"
CACHES = 100
CHANGES = 20
IDLE_S = float(os.environ.get("BENCH_AGENT_IDLE_S", "300"))
BIG_PULLS, BIG_MIB = 6, 32
TARGETS = {"writes_per_change": "<=1", "idle_writes": "==0", "rss_mb": "<=50", "present_install_ms": "<=20",
           "rss_growth_mb": "<=10"}  # bench/run.py's format
GKM = ("gkm.io", "v1alpha1")


def emit(metric: str, value, fmt: str = ".2f") -> None:
    print(f"BENCH {G} {metric}={value:{fmt}}", flush=True)
    if metric in TARGETS:
        print(f"BENCH {G} target_{metric}{TARGETS[metric]}", flush=True)


def wait(check, what: str, timeout: float = 300.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        result = check()
        if result:
            return result
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def agent_writes(cp: ControlPlane) -> int:
    n = 0
    for line in cp.audit_log.read_text().splitlines():
        ev = json.loads(line)
        n += ev.get("stage") == "ResponseComplete" and ev["user"]["username"] == AGENT_USER
    return n


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        run(Path(tmp))


def run(tmp: Path) -> None:
    cp = ControlPlane(tmp / "cp", TOOLS_BIN)
    cp.start()
    (tmp / "registry").mkdir()
    reg = RunningRegistry(tmp / "registry")
    proc = None
    try:
        kubectl = tool("kubectl")
        subprocess.run([kubectl, f"--kubeconfig={cp.kubeconfig('admin')}", "apply", *crd_args(),
                        "-f", str(ROOT / "daemonsets/namespace.yaml"), "-f", str(ROOT / "daemonsets/rbac-agent.yaml")],
                       check=True, capture_output=True)
        api = config.new_client_from_config(config_file=str(cp.kubeconfig("admin")))
        objs, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        wait(lambda: _established(api), "CRDs Established")
        node = f"bench-{uuid.uuid4().hex[:6]}"
        core.create_node(body={"metadata": {"name": node, "labels": TPU_LABELS}})
        core.create_namespace(body={"metadata": {"name": "bench"}})

        images = [reg.push(make_cache(tmp / "c" / str(i), {"xla/m.bin": os.urandom(2048)}), f"bench/c{i}",
                           kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}]) for i in range(CACHES)]
        for i, image in enumerate(images):
            objs.create_namespaced_custom_object(*GKM, "bench", "gkmcaches", body={
                "apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": f"c{i}"},
                "spec": {"image": image, "podTemplate": {"spec": {"nodeSelector": TPU_LABELS}}}})

        host = SimHost.preset(tmp / "host", "v5e-4")
        sock = tmp / "agent.sock"
        with open(tmp / "agent.log", "ab") as log:
            proc = subprocess.Popen(accelnode_cmd() + [
                "agent", "--store", str(tmp / "store"), "--socket", str(sock), "--plain-http",
                "--sysfs-root", str(host.sysfs_root), "--dev-root", str(host.dev_root),
                "--metrics-address", f"127.0.0.1:{free_ports(1)[0]}", "--node-name", node,
                "--kubeconfig", str(cp.kubeconfig("agent"))], stdout=log, stderr=log)
        grpcutil.wait_listening(sock, timeout=60)

        def entries():
            try:
                st = objs.get_namespaced_custom_object(*GKM, "bench", "gkmcachenodes", node).get("status") or {}
            except client.ApiException:
                return {}
            return {name: e for name, by in (st.get("caches") or {}).items() for e in by.values()}

        wait(lambda: sum(e["state"] == "Extracted" for e in entries().values()) == CACHES, "100 caches prefetched")
        time.sleep(2)  # let the last cues drain
        p = psutil.Process(proc.pid)
        memory.emit_all(emit, "", memory.of(proc.pid))

        stub = agent_grpc.AgentStub(grpcutil.unix_channel(sock))
        digest = images[0].rsplit("@", 1)[1]
        target = "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/c0/mount"
        before = agent_writes(cp)
        for i in range(CHANGES):
            if i % 2 == 0:
                stub.AcquireReference(agent_api.AcquireReferenceRequest(
                    volume_id="v0", digest=digest, target_path=target, exclusive=True,
                    pod=agent_api.PodRef(namespace="bench", name="p", uid="u")), timeout=30)
                wait(lambda: entries()["c0"]["state"] == "Running", "Running")
            else:
                stub.ReleaseReference(agent_api.ReleaseReferenceRequest(volume_id="v0", target_path=target), timeout=30)
                wait(lambda: entries()["c0"]["state"] == "Extracted", "Extracted")
        time.sleep(2)
        emit("writes_per_change", (agent_writes(cp) - before) / CHANGES)

        present_install(stub, images[0])
        big = [reg.push(make_cache(tmp / "big" / str(i), {f"xla/m{j}.bin": os.urandom(BIG_MIB << 18) for j in range(4)}),
                        f"bench/big{i}", kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}], layers=4)
               for i in range(BIG_PULLS + 1)]
        memory_under_pulls(stub, p, big)

        before = agent_writes(cp)
        time.sleep(IDLE_S)
        emit("idle_writes", agent_writes(cp) - before, "d")
        emit("idle_window_s", IDLE_S, ".0f")
        mem = memory.of(proc.pid)
        emit("rss_mb_after_idle", mem.rss_mb, ".1f")
        emit("pss_mb_after_idle", mem.pss_mb, ".1f")
        emit("uss_mb_after_idle", mem.uss_mb, ".1f")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        reg.stop()
        cp.stop()


def present_install(stub, image: str, n: int = 200) -> None:
    """EnsureCache of an installed image over the unix socket, as the CSI driver asks it."""
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        answer = stub.EnsureCache(agent_api.EnsureCacheRequest(image=image, wait_seconds=10), timeout=30)
        samples.append(time.perf_counter() - start)
        assert answer.state == agent_api.EnsureCacheResponse.READY, answer
    emit("present_install_ms", statistics.median(samples) * 1000)


def memory_under_pulls(stub, p: psutil.Process, images: list[str]) -> None:
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.wait(0.05):
            peak[0] = max(peak[0], p.memory_info().rss)

    def pull(image: str) -> None:
        answer = stub.EnsureCache(agent_api.EnsureCacheRequest(image=image, wait_seconds=600), timeout=660)
        assert answer.state == agent_api.EnsureCacheResponse.READY, answer

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        pull(images[0])
        time.sleep(1)
        one = p.memory_info().rss
        threads = [threading.Thread(target=pull, args=(image,)) for image in images[1:]]  # all at once: queued
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(1)
        after = p.memory_info().rss
    finally:
        stop.set()
        sampler.join()
    emit("rss_after_1_pull_mb", one / 2**20, ".1f")
    emit(f"rss_after_{len(images)}_pulls_mb", after / 2**20, ".1f")
    mem = memory.of(p.pid)
    emit(f"pss_after_{len(images)}_pulls_mb", mem.pss_mb, ".1f")
    emit(f"uss_after_{len(images)}_pulls_mb", mem.uss_mb, ".1f")
    emit("rss_growth_mb", (after - one) / 2**20, ".1f")
    emit("pull_peak_rss_mb", max(peak[0], after) / 2**20, ".1f")
    emit("pull_mib_each", BIG_MIB, "d")


def _established(api) -> bool:
    ext = client.ApiextensionsV1Api(api)
    return all(any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or []))
               for crd in ext.list_custom_resource_definition().items if crd.spec.group == "gkm.io")
