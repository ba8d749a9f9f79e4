"""Hollow node agents: the node agent's real API-facing code, many agents per process, the way
kubemark runs kubelets (docs/scale.md).

Each :class:`HollowAgent` is the real :class:`agent.core.Agent` (pull queue, proofs, collection)
with the real status reporter, prefetcher, watches and pull-secret reader built exactly as
``accelnode agent --node-name NODE --kubeconfig FILE`` builds them (:func:`agent.reporter.for_agent`,
``agent.cli._credentials``); what is injected is the node's identity (its name) and the store:
:class:`SimStore` keeps no files, and a pull of an image it does not hold takes ``pull_seconds``
(jittered by +-50 %, a 512 MiB cache through a mirror at ~250 MiB/s). Nothing talks to a
registry: a cache is prefetched only where its ``podTemplate.spec.nodeSelector`` matches the
node (no manifest inspection).

:class:`HollowFleet` runs many in one process (threads: six per agent, its four watches, the
status writer and the prefetcher, plus a pull thread per running pull). ``python -m
tests.rigs.hollow --kubeconfig FILE --node NAME ...`` runs a fleet as its own process until
SIGTERM and prints ``HOLLOW ready <n>`` once every agent has listed its watches.

:func:`register_nodes` creates Node objects as kubemark's hollow kubelets register (name,
hostname label, the TPU labels, capacity), with an admin client; no kubelet, no Lease.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from accelnode.hw import accelerators as hw
from accelnode.kube.client import Client, KubeError, is_conflict
from accelnode.log import setup
from accelnode.oci.limits import Limits
from accelnode.oci.registry import RegistryOptions
from accelnode.oci.reference import Reference
from agent import core, reporter as status_reporter
from agent.cli import _credentials
from agent.store import Installed
from tests.conftest import ROOT, TOOLS_BIN, accelnode_cmd, tool
from tests.csi.conftest import free_ports
from tests.fixtures.registry import RunningRegistry
from tests.rigs import devcluster

ACCELERATORS = ("tpu/v5e:4",)
TARGETS = [{"backend": "tpu", "arch": "v5e"}]
NODE_LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
               "cloud.google.com/gke-tpu-topology": "2x2"}
SIZE = 512 << 20


class SimStore:
    """The cache store as :class:`agent.core.Agent` uses it, holding no content: ``installed``
    digests are there from the start; :meth:`ensure` of another one takes ``pull_seconds``
    (x0.5 to x1.5) and then holds it; :meth:`gc` forgets."""

    def __init__(self, pull_seconds: float = 2.0, installed: tuple[str, ...] = (), seed: int | None = None):
        self.options, self.limits = RegistryOptions(), Limits()
        self.pull_seconds = pull_seconds
        self.on_served = self.on_collect = lambda *_: None
        self._rand = random.Random(seed)
        self._lock = threading.Lock()
        self._held: dict[str, Installed] = {}
        for image in installed:
            self._put(image)
        self.pulls = 0  # simulated downloads (an installed digest costs none)

    def _put(self, image: str) -> Installed:
        digest = Reference.parse(image).digest
        inst = Installed(digest, Path("/hollow") / digest.split(":", 1)[1], image, "jax", list(TARGETS), SIZE, {})
        with self._lock:
            self._held[digest] = inst
        return inst

    def ensure(self, image: str, *, accelerators=None, progress=None, options=None) -> Installed:
        inst = self.installed(Reference.parse(image).digest)
        if inst is not None:
            return inst
        time.sleep(self.pull_seconds * (0.5 + self._rand.random()))
        self.pulls += 1
        return self._put(image)

    def installed(self, digest: str) -> Installed | None:
        with self._lock:
            return self._held.get(digest)

    def list(self) -> list[Installed]:
        with self._lock:
            return list(self._held.values())

    def references(self) -> dict[str, dict]:
        return {}

    def mark_used(self, digest: str) -> bool:
        return self.installed(digest) is not None

    def check_server(self, image: str, options) -> None:
        return None

    def no_space(self, e: Exception, what: str) -> Exception:
        return e

    def collect_to_watermark(self, need: int = 0, *, at_least: int = 0) -> list[Installed]:
        return []

    def gc(self, max_bytes: int | None = None, *, only: set[str] | None = None) -> list[str]:
        with self._lock:
            gone = [d for d in self._held if only is None or d in only]
            for d in gone:
                del self._held[d]
        return gone


class HollowAgent:
    """One node's agent: the real core and reporter over a :class:`SimStore`, as node ``node``."""

    def __init__(self, node: str, kubeconfig: Path, *, store: SimStore, resync: float = 30.0,
                 accelerators: tuple[str, ...] = ACCELERATORS):
        self.node, self.store = node, store
        args = argparse.Namespace(pull_secrets="api", kubeconfig=str(kubeconfig), node_name=node,
                                  node_credentials_for_cluster_caches=False)
        self.agent = core.Agent(store, hw.declared(list(accelerators)), core.Metrics(CollectorRegistry()),
                                credentials=_credentials(args, store.options))
        self.reporter = status_reporter.for_agent(self.agent, node, str(kubeconfig), resync=resync)
        self.agent.on_change = self.reporter.poke

    def start(self) -> "HollowAgent":
        self.reporter.start()
        return self

    def ready(self) -> bool:
        return self.reporter.ready()[0]


class HollowFleet:
    """Many :class:`HollowAgent` in this process; ``stop()`` ends every watch and thread."""

    def __init__(self, kubeconfig: Path, nodes: list[str], *, pull_seconds: float = 2.0, resync: float = 30.0,
                 installed: tuple[str, ...] = ()):
        self.agents = [HollowAgent(n, kubeconfig, resync=resync,
                                   store=SimStore(pull_seconds, installed, seed=i))
                       for i, n in enumerate(nodes)]

    def start(self, rate: float = 0.0) -> "HollowFleet":
        """Start every agent; ``rate`` > 0: that many a second, as a DaemonSet rollout does."""
        for i, a in enumerate(self.agents):
            if rate > 0 and i:
                time.sleep(1.0 / rate)
            a.start()
        return self

    def ready(self) -> bool:
        return all(a.ready() for a in self.agents)

    def writes(self) -> int:
        return sum(a.reporter.writes.creates + a.reporter.writes.updates for a in self.agents)

    def stop(self, timeout: float = 20.0) -> None:
        """Close every watch, then join the reporters' threads, ``timeout`` seconds in all (the
        threads are daemons: what is left ends with the process)."""
        for a in self.agents:
            a.reporter._stop.set()
            for r in a.reporter._reflectors:
                r.interrupt()
        end = time.monotonic() + timeout
        for a in self.agents:
            a.reporter.stop(timeout=max(0.0, end - time.monotonic()))


# ---------------------------------------------------------------------------------------------
# the cluster they run against


GV = "/apis/gkm.io/v1alpha1"
AGENT_USER = next(i.user for i in devcluster.IDENTITIES if i.name == "agent")
CONTROLLER_USER = next(i.user for i in devcluster.IDENTITIES if i.name == "controller")
WEBHOOK_FILES = ("webhooks-gkm.yaml", "webhooks-tpu-env.yaml")
SHIPPED = ROOT / "daemonsets"


class ScaleCluster:
    """A real control plane (:class:`tests.rigs.devcluster.ControlPlane`; the agent's and the
    controller's reads audited too), the CRDs, both components' RBAC and the FlowSchemas
    (daemonsets/flowcontrol.yaml) as shipped, a registry,
    and ``accelnode controller`` as the controller identity with its webhooks
    (daemonsets/webhooks-*.yaml pointed at it on 127.0.0.1): as tests/controller and tests/e2e run
    it. ``start()``/``stop()``; ``admin`` is an admin :class:`Client` once started."""

    def __init__(self, workdir: Path, *, resync: float = 300.0, workers: int | None = None):
        self.workdir, self.resync, self.workers = Path(workdir), resync, workers
        # the audit log is read by byte offset (Audit): never rotated (kube-apiserver's default
        # rotates at 100 MB, which the agents' audited reads pass at 1,000 nodes)
        self.cp = devcluster.ControlPlane(self.workdir / "cp", TOOLS_BIN, audit_reads_of=(AGENT_USER, CONTROLLER_USER),
                                          apiserver_args=("--audit-log-maxsize=1000000",))
        self.registry: RunningRegistry | None = None
        self.controller: subprocess.Popen | None = None
        self.admin: Client | None = None
        self.metrics_port = 0
        self.restarts = 0  # controller exits the supervisor restarted
        self._stopping = threading.Event()

    def start(self) -> "ScaleCluster":
        try:
            self.cp.start()
            subprocess.run([tool("kubectl"), f"--kubeconfig={self.cp.kubeconfig('admin')}", "apply",
                            *devcluster.crd_args(), "-f", str(SHIPPED / "namespace.yaml"),
                            "-f", str(SHIPPED / "flowcontrol.yaml"),
                            *[a for f in sorted(SHIPPED.glob("rbac-controller*.yaml")) for a in ("-f", str(f))],
                            "-f", str(SHIPPED / "rbac-agent.yaml")], check=True, capture_output=True, timeout=120)
            self.admin = Client(devcluster_config(self.cp, "admin"), user_agent="scale-bench")
            until(self._established, "the CRDs to be Established")
            (self.workdir / "registry").mkdir(parents=True, exist_ok=True)
            self.registry = RunningRegistry(self.workdir / "registry")
            self._start_controller()
        except BaseException:
            self.stop()
            raise
        return self

    def _established(self) -> bool:
        crds = self.admin.request("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")["items"]
        return all(any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"].get("conditions", ()))
                   for crd in crds if crd["spec"]["group"] in ("gkm.io", "accelnode.io"))

    def _start_controller(self) -> None:
        from tests.controller.test_webhook_server import CA

        ca = CA()
        (self.workdir / "tls").mkdir(exist_ok=True)
        cert, key, _ = ca.serving(self.workdir / "tls", "accelnode-controller")
        webhook_port, self.metrics_port = free_ports(2)
        self._argv = accelnode_cmd() + [
            "controller", "--kubeconfig", str(self.cp.kubeconfig("controller")), "--identity", "scale",
            "--namespace", devcluster.NAMESPACE, "--metrics-address", f"127.0.0.1:{self.metrics_port}",
            "--webhook-address", f"127.0.0.1:{webhook_port}", "--tls-cert-file", cert, "--tls-key-file", key,
            "--plain-http", "--resync", str(self.resync), *(["--workers", str(self.workers)] if self.workers else [])]
        self._spawn()
        until(lambda: self.controller_metric("accelnode_controller_leader") == 1, "the controller to lead",
              self.controller)
        threading.Thread(target=self._supervise, daemon=True).start()
        for name in WEBHOOK_FILES:
            for doc in yaml.safe_load_all((SHIPPED / name).read_text()):
                for hook in doc["webhooks"]:
                    path = hook["clientConfig"]["service"]["path"]
                    hook["clientConfig"] = {"url": f"https://127.0.0.1:{webhook_port}{path}",
                                            "caBundle": base64.b64encode(ca.pem).decode()}
                self.admin.request("POST", f"/apis/admissionregistration.k8s.io/v1/{doc['kind'].lower()}s", body=doc)

    def _spawn(self) -> None:
        with open(self.workdir / "controller.log", "ab") as log:
            self.controller = subprocess.Popen(self._argv, cwd=ROOT, stdout=log, stderr=log)

    def _supervise(self) -> None:
        """Start the controller again when it exits, as its Deployment would (a leader that
        cannot renew its Lease exits on purpose); ``restarts`` counts them."""
        while not self._stopping.wait(1.0):
            if self.controller.poll() is not None and not self._stopping.is_set():
                self.restarts += 1
                time.sleep(2.0)
                self._spawn()

    def controller_metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))

    def wait_webhooks(self, namespace: str) -> None:
        """Until the API server calls the pod webhook (it loads configurations asynchronously): a
        dry-run create of :func:`churn_pod` comes back with ``TPU_WORKER_ID``."""
        def injected() -> bool:
            pod = self.admin.request("POST", f"/api/v1/namespaces/{namespace}/pods", query={"dryRun": "All"},
                                     body=churn_pod("probe", "hollow-probe", 0))
            return any(e.get("name") == "TPU_WORKER_ID" for e in pod["spec"]["containers"][0].get("env") or ())
        until(injected, "the pod webhook to be called", self.controller)

    def push(self, repo: str, tag: str) -> str:
        """A small jax cache for tpu/v5e pushed as ``repo:tag``; its digest-pinned reference."""
        src = self.workdir / "src" / f"{repo.replace('/', '_')}-{tag}"
        (src / "xla").mkdir(parents=True, exist_ok=True)
        (src / "xla" / "m.bin").write_bytes(f"{repo}:{tag}".encode() * 64)
        return self.registry.push(src, repo, tag=tag, kind="jax", targets=TARGETS)

    def audit(self) -> "Audit":
        return Audit(self.cp.audit_log)

    def stop(self) -> None:
        self._stopping.set()
        if self.controller is not None and self.controller.poll() is None:
            self.controller.terminate()
            try:
                self.controller.wait(30)
            except subprocess.TimeoutExpired:
                self.controller.kill()
                self.controller.wait()
        if self.registry is not None:
            self.registry.stop()
        self.cp.stop()


def devcluster_config(cp: devcluster.ControlPlane, identity: str):
    from accelnode.kube.client import Config

    return Config.from_kubeconfig(cp.kubeconfig(identity))


def cache_body(ns: str | None, name: str, image: str) -> dict:
    """A cache meant for every hollow node (its pod template's nodeSelector matches them)."""
    return {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache" if ns else "ClusterGKMCache",
            "metadata": {"name": name, **({"namespace": ns} if ns else {})},
            "spec": {"image": image, "podTemplate": {"spec": {"nodeSelector": dict(NODE_LABELS)}}}}


def cache_path(ns: str | None, name: str | None = None) -> str:
    base = f"{GV}/namespaces/{ns}/gkmcaches" if ns else f"{GV}/clustergkmcaches"
    return f"{base}/{name}" if name else base


def claim_bound(cache: dict, namespace: str) -> bool:
    """The cache's claim in ``namespace`` is reported Bound (status.pvcStatus, docs/cache-claims.md)."""
    entry = (((cache or {}).get("status") or {}).get("pvcStatus") or {}).get(namespace) or {}
    return any(c.get("type") == "Bound" and c.get("status") == "True" for c in entry.get("conditions") or ())


def churn_pod(name: str, node: str, index: int) -> dict:
    """A worker pod of an Indexed TPU Job as the Job controller makes it (completion index,
    the template's tpu-env state annotation), bound to ``node``: what the pod webhook mutates."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"batch.kubernetes.io/job-completion-index": str(index % 4)},
                         "annotations": {"tpu-env.accelnode.io/injected": '{"kind":"Job","workers":4,"vars":{}}'}},
            "spec": {"nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "w", "image": "registry.invalid/worker:1",
                                     "resources": {"limits": {"google.com/tpu": "4"}}}]}}


class Audit:
    """The API server's audit log, read by byte offset: ``mark()`` now, ``events(since)`` later."""

    def __init__(self, path: Path):
        self.path = path

    def mark(self) -> int:
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            return f.tell()

    def events(self, start: int = 0, end: int | None = None) -> list[dict]:
        if self.path.stat().st_size < start:  # a mark from before a rotation would read nothing, silently
            raise RuntimeError(f"{self.path} was rotated: its marks no longer hold")
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(end - start)
        return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


WRITES = {"create", "update", "patch", "delete", "deletecollection"}


def by(events: list[dict], user: str, verbs: set[str]) -> list[dict]:
    return [e for e in events if e.get("stage") == "ResponseComplete" and e["user"]["username"] == user
            and e.get("verb") in verbs]


def accelnode_writes(events: list[dict]) -> list[str]:
    """"verb resource/subresource name" of each write by the agent or the controller (the
    controller's Lease renewals apart)."""
    return [f"{e['verb']} {e['objectRef'].get('resource')}/{e['objectRef'].get('subresource', '')} "
            f"{e['objectRef'].get('name', '')}" for u in (AGENT_USER, CONTROLLER_USER) for e in by(events, u, WRITES)
            if e["objectRef"].get("resource") != "leases"]


def quiet(audit: Audit, still: float = 3.0, timeout: float = 120.0) -> None:
    """Until neither the agents nor the controller wrote for ``still`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        start = audit.mark()
        time.sleep(still)
        if not accelnode_writes(audit.events(start)):
            return
    raise RuntimeError(f"accelnode kept writing for {timeout:.0f}s")


def unpaged_lists(events: list[dict]) -> list[str]:
    """The requestURI of every list by the agent or the controller that asked no ``limit``."""
    return [e["requestURI"] for u in (AGENT_USER, CONTROLLER_USER) for e in by(events, u, {"list"})
            if "limit=" not in e["requestURI"]]


def until(check, what: str, proc: subprocess.Popen | None = None, timeout: float = 120.0, interval: float = 0.2):
    """The first truthy ``check()`` (API and connection errors count as not yet); raises after
    ``timeout`` seconds, or at once when ``proc`` exited."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"a process exited with {proc.returncode} while waiting for {what}")
        try:
            if result := check():
                return result
        except (OSError, KubeError):
            pass
        time.sleep(interval)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def node_object(name: str) -> dict:
    """A Node as a hollow kubelet registers it (TPU v5e host, 4 chips)."""
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                  **NODE_LABELS}},
            "status": {"capacity": {"cpu": "8", "memory": "32Gi", "pods": "110", "google.com/tpu": "4"},
                       "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "google.com/tpu": "4"}}}


def register_nodes(admin: Client, names: list[str], workers: int = 8) -> None:
    """POST a Node for each name (an existing one is kept)."""
    def create(name: str) -> None:
        try:
            admin.request("POST", "/api/v1/nodes", body=node_object(name))
        except KubeError as e:
            if not is_conflict(e):
                raise
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(create, names))


def node_names(prefix: str, first: int, count: int) -> list[str]:
    return [f"{prefix}{i:05d}" for i in range(first, first + count)]


# A real agent runs its ~7 threads alone on its node; here hundreds of agents' threads share one
# interpreter lock. Every thread waiting for it wakes each switch interval (CPython: 5 ms) to ask
# for it: with hundreds waiting at once (a roll wakes every agent) the process spends its time in
# those wake-ups (half the CPU in the kernel, load in the hundreds, docs/scale.md). A longer
# interval is the rig's cost lowered, not the agent's: an agent's threads mostly wait on sockets.
SWITCH_INTERVAL = 0.05


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.rigs.hollow", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kubeconfig", required=True, type=Path, help="the agents' identity (one for all)")
    ap.add_argument("--prefix", default="hollow-", help="node names: PREFIX00000 ...")
    ap.add_argument("--first", type=int, default=0, help="index of the first node")
    ap.add_argument("--count", type=int, required=True, help="agents in this process")
    ap.add_argument("--pull-seconds", type=float, default=2.0, help="mean time of one simulated pull")
    ap.add_argument("--resync", type=float, default=30.0, help="the agents' --status-resync")
    ap.add_argument("--start-rate", type=float, default=0.0, help="agents started a second (0: all at once)")
    ap.add_argument("--installed", action="append", default=[], metavar="IMAGE",
                    help="digest-pinned image every node holds at start (repeatable)")
    ap.add_argument("--switch-interval", type=float, default=SWITCH_INTERVAL, metavar="SECONDS",
                    help="the interpreter's thread switch interval (sys.setswitchinterval; default %(default)s)")
    args = ap.parse_args(argv)
    setup("warning", "json", sys.stderr)
    threading.stack_size(256 << 10)  # thousands of threads: 256 KiB stacks (the default is 8 MiB)
    sys.setswitchinterval(args.switch_interval)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    fleet = HollowFleet(args.kubeconfig, node_names(args.prefix, args.first, args.count),
                        pull_seconds=args.pull_seconds, resync=args.resync,
                        installed=tuple(args.installed)).start(args.start_rate)
    while not fleet.ready():
        if stop.wait(0.5):
            break
    else:
        print(f"HOLLOW ready {len(fleet.agents)} pid={os.getpid()}", flush=True)
    stop.wait()
    fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
