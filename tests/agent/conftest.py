"""Fixtures for the agent's status reporter: a simulated v5e-4 node running the real agent
service (cache store, gRPC API on a unix socket) and the reporter, against the real
kube-apiserver of ``tests/fixtures/cluster.py`` and the local registry."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from tests.conftest import ROOT, require_root

GKM = ("gkm.io", "v1alpha1")
AGENT_USER = "system:serviceaccount:accelnode-system:accelnode-agent"
TPU_LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
              "cloud.google.com/gke-tpu-topology": "2x2"}


def eventually(check, timeout: float = 30.0, interval: float = 0.2):
    """The first truthy ``check()`` within ``timeout`` seconds (a bound, not a measurement);
    else the last result."""
    end = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > end:
            return result
        time.sleep(interval)


def make_cache(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@dataclass(frozen=True)
class Images:
    tpu: str  # jax cache for tpu/v5e (fits the node)
    tpu_v2: str  # a newer build of the same cache (another digest, same repository)
    shared: str  # another v5e cache (cluster-scoped, prefetched)
    gpu: str  # triton cache for cuda/sm_90 (does not fit)


@pytest.fixture(scope="session")
def images(registry, tmp_path_factory):
    d = tmp_path_factory.mktemp("agent-caches")
    v5e = [{"backend": "tpu", "arch": "v5e"}]
    return Images(
        registry.push(make_cache(d / "a", {"xla/m1.bin": b"\x7fXLA" * 2048}), "status/jax-v5e", tag="v1",
                      kind="jax", targets=v5e),
        registry.push(make_cache(d / "b", {"xla/m1.bin": b"\x7fXLA" * 4096}), "status/jax-v5e", tag="v2",
                      kind="jax", targets=v5e),
        registry.push(make_cache(d / "c", {"xla/shared.bin": b"\x01" * 1000}), "status/jax-shared",
                      kind="jax", targets=v5e),
        registry.push(make_cache(d / "g", {"ab/k.cubin": b"\x02" * 1000}), "status/triton-h100",
                      kind="triton", targets=[{"backend": "cuda", "arch": "sm_90", "warp_size": 32}]),
    )


@pytest.fixture(scope="session")
def agent_rbac(kubectl, crds):
    applied = kubectl("admin", "apply", "-f", str(ROOT / "daemonsets/namespace.yaml"),
                      "-f", str(ROOT / "daemonsets/rbac-agent.yaml"))
    assert applied.returncode == 0, applied.stderr


class Cluster:
    """Admin-side helpers: what a user or the controller does, and what the agent wrote."""

    def __init__(self, control_plane, kube_api):
        self.cp = control_plane
        self.objs = client.CustomObjectsApi(kube_api("admin"))
        self.core = client.CoreV1Api(kube_api("admin"))
        self.cluster_caches: list[str] = []  # deleted after the test: they would reach every later node

    def make_node(self, labels: dict) -> str:
        name = f"tpu-{uuid.uuid4().hex[:8]}"
        self.core.create_node(body={"metadata": {"name": name, "labels": labels}})
        return name

    def cache(self, name: str, image: str, *, namespace: str | None = None, annotations=None, node_selector=None,
              workload_namespaces=None, pin: bool = True) -> dict:
        """Create a cache; ``pin``: and pin a digest-pinned image as the controller would
        (``status.resolvedDigest``: only what the controller pinned is prefetched)."""
        spec = {"image": image}
        if node_selector:
            spec["podTemplate"] = {"spec": {"nodeSelector": node_selector}}
        if workload_namespaces:
            spec["workloadNamespaces"] = workload_namespaces
        body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache" if namespace else "ClusterGKMCache",
                "metadata": {"name": name, "annotations": annotations or {}}, "spec": spec}
        if namespace:
            obj = self.objs.create_namespaced_custom_object(*GKM, namespace, "gkmcaches", body=body)
        else:
            self.cluster_caches.append(name)
            obj = self.objs.create_cluster_custom_object(*GKM, "clustergkmcaches", body=body)
        if pin and "@" in image:
            self.pin(namespace, name, image.rsplit("@", 1)[1])
        return obj

    def pin(self, namespace: str | None, name: str, digest: str) -> None:
        """What the controller writes once it has resolved (and checked) a cache's image."""
        body = {"status": {"resolvedDigest": digest}}
        if namespace:
            self.objs.patch_namespaced_custom_object_status(*GKM, namespace, "gkmcaches", name, body=body)
        else:
            self.objs.patch_cluster_custom_object_status(*GKM, "clustergkmcaches", name, body=body)

    def set_image(self, namespace: str, name: str, image: str) -> None:
        self.objs.patch_namespaced_custom_object(*GKM, namespace, "gkmcaches", name, body={"spec": {"image": image}})
        if "@" in image:
            self.pin(namespace, name, image.rsplit("@", 1)[1])

    def node_status(self, node: str, namespace: str | None = None) -> dict | None:
        """status of the node's GKMCacheNode in ``namespace`` (ClusterGKMCacheNode when None)."""
        try:
            if namespace:
                obj = self.objs.get_namespaced_custom_object(*GKM, namespace, "gkmcachenodes", node)
            else:
                obj = self.objs.get_cluster_custom_object(*GKM, "clustergkmcachenodes", node)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return obj.get("status")

    def agent_writes(self) -> list[dict]:
        """Audit events of every write the agent identity made so far."""
        out = []
        for line in self.cp.audit_log.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("stage") == "ResponseComplete" and ev["user"]["username"] == AGENT_USER:
                out.append(ev)
        return out


@pytest.fixture
def cluster(control_plane, kube_api, agent_rbac):
    c = Cluster(control_plane, kube_api)
    yield c
    for name in c.cluster_caches:
        c.objs.delete_cluster_custom_object(*GKM, "clustergkmcaches", name)


class Node:
    """One node: simulated v5e-4 host, the agent service on a unix socket, and the reporter
    talking to the API server as the agent's identity."""

    def __init__(self, root: Path, name: str, control_plane, registry, *, pull_secrets: bool = False):
        """``pull_secrets``: the agent reads the namespaces' pull secrets through the API server
        as its own identity (else every GKMCache is pulled anonymously)."""
        from accelnode import grpcutil
        from accelnode.hw import accelerators
        from accelnode.kube.client import Client, Config
        from accelnode.kube.pullsecrets import PullSecretReader
        from tests.rigs.simhost import SimHost
        from agent import core
        from agent import reporter
        from agent import service
        from agent.credentials import Chooser
        from agent.store import CacheStore
        from prometheus_client import CollectorRegistry

        self.name = name
        self.host = SimHost.preset(root / "host", "v5e-4")
        self.store = CacheStore(root / "store", registry=registry.options())
        accs = accelerators.detect(self.host.sysfs_root, self.host.dev_root)
        reader = PullSecretReader(Client(Config.from_kubeconfig(control_plane.kubeconfig("agent"))),
                                  who="the agent") if pull_secrets else None
        self.agent = core.Agent(self.store, accs, core.Metrics(CollectorRegistry()),
                                credentials=Chooser(self.store.options, reader))
        self.socket = root / "agent.sock"
        self.server = grpcutil.serve_unix(self.socket, lambda s: service.add_to_server(service.AgentService(self.agent), s))
        # resync far beyond any test: every update must come from a watch event or the
        # agent's change cue
        self.reporter = reporter.for_agent(self.agent, name, str(control_plane.kubeconfig("agent")), resync=3600)
        self.agent.on_change = self.reporter.poke
        self._channel = grpcutil.unix_channel(self.socket)

    def start(self) -> "Node":
        self.reporter.start()
        return self

    def stub(self):
        from agent.api import agent_grpc

        return agent_grpc.AgentStub(self._channel)

    def ensure(self, image: str, cache: tuple[str, str] | None = None):
        """What the CSI driver does before a publish: EnsureCache for ``cache`` ((namespace,
        name), namespace "" for a ClusterGKMCache: the cache the volume names, whose credentials
        and proof the request gets), waiting for the pull. None: the operator's own request."""
        from agent.api import agent

        ref = agent.CacheRef(namespace=cache[0], name=cache[1]) if cache else None
        return self.stub().EnsureCache(agent.EnsureCacheRequest(image=image, wait_seconds=60, cache=ref), timeout=90)

    def acquire(self, volume_id: str, digest: str, pod_namespace: str, pod_name: str,
                cache: tuple[str, str] | None = None) -> None:
        """A reference as the CSI driver takes it; ``cache`` (namespace, name - namespace "" for
        a ClusterGKMCache) is the cache the volume names, None for a driver that does not say."""
        from agent.api import agent

        self.stub().AcquireReference(agent.AcquireReferenceRequest(
            volume_id=volume_id, digest=digest, target_path=self.target(volume_id),
            pod=agent.PodRef(namespace=pod_namespace, name=pod_name, uid=str(uuid.uuid4())),
            cache=agent.CacheRef(namespace=cache[0], name=cache[1]) if cache else None), timeout=30)

    def release(self, volume_id: str) -> None:
        from agent.api import agent

        self.stub().ReleaseReference(agent.ReleaseReferenceRequest(volume_id=volume_id, target_path=self.target(volume_id)),
                                     timeout=30)

    @staticmethod
    def target(volume_id: str) -> str:
        return f"/var/lib/kubelet/pods/{volume_id}/volumes/kubernetes.io~csi/cache/mount"

    def close(self) -> None:
        self.reporter.stop()
        self._channel.close()
        self.server.stop(grace=1).wait()


@pytest.fixture
def node_factory(tmp_path, control_plane, registry, cluster):
    require_root()
    nodes = []

    def make(labels: dict | None = None, **kw) -> Node:
        name = cluster.make_node(TPU_LABELS if labels is None else labels)
        n = Node(tmp_path / name, name, control_plane, registry, **kw)
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        n.close()
