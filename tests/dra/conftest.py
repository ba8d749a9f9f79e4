"""Fixtures for the DRA plugin: the real ``accelnode dra`` against a simulated host and a real API server."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from accelnode import grpcutil
from device_plugin.dra import api
from tests.conftest import accelnode_cmd, eventually
from tests.fixtures.device_plugin import PluginProcess

DRIVER = "tpu.google.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def claim_path(ns: str, name: str = "") -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims" + (f"/{name}" if name else "")


class DRA:
    """One running ``accelnode dra`` and the paths it uses."""

    def __init__(self, tmp: Path, host, node: str, kubeconfig: Path, driver: str = DRIVER):
        self.tmp, self.host, self.node, self.kubeconfig, self.driver = tmp, host, node, kubeconfig, driver
        self.root = tmp / "kubelet"
        self.cdi = tmp / "cdi"
        self.reg_socket = self.root / "plugins_registry" / f"{driver}-reg.sock"
        self.endpoint = self.root / "plugins" / driver / "dra.sock"
        self.procs: list[PluginProcess] = []

    def start(self, *flags: str, wait: bool = True) -> PluginProcess:
        argv = accelnode_cmd() + ["dra", "--node-name", self.node, "--kubeconfig", str(self.kubeconfig),
                                  "--kubelet-root", str(self.root), "--cdi-dir", str(self.cdi),
                                  "--sysfs-root", str(self.host.sysfs_root), "--dev-root", str(self.host.dev_root),
                                  "--driver-name", self.driver, "--health-interval", "0.2", "--metrics-address", "",
                                  "--log-format", "text", *flags]
        p = PluginProcess(argv, self.tmp / f"dra{len(self.procs)}.log")
        self.procs.append(p)
        if wait:
            eventually(lambda: p.proc.poll() is not None or not any(map(grpcutil.serving_problem, (
                self.endpoint, self.reg_socket))), "the plugin serving on its sockets", timeout=30)
            assert p.proc.poll() is None, p.log()
        return p

    def stub(self, version: str = "v1.DRAPlugin"):
        _, pb_grpc = api.SERVICES[version]
        return pb_grpc.DRAPluginStub(grpcutil.unix_channel(self.endpoint))

    def prepare(self, ns: str, name: str, uid: str, version: str = "v1.DRAPlugin"):
        pb, _ = api.SERVICES[version]
        req = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace=ns, name=name, uid=uid)])
        return self.stub(version).NodePrepareResources(req, timeout=45).claims[uid]

    def unprepare(self, ns: str, name: str, uid: str, version: str = "v1.DRAPlugin"):
        pb, _ = api.SERVICES[version]
        req = pb.NodeUnprepareResourcesRequest(claims=[pb.Claim(namespace=ns, name=name, uid=uid)])
        return self.stub(version).NodeUnprepareResources(req, timeout=45).claims[uid]

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


@pytest.fixture
def dra(tmp_path):
    made = []

    def start(host, node: str, kubeconfig: Path, **kw) -> DRA:
        # short: unix socket paths end at 107 bytes (pytest's tmp_path is long)
        made.append(DRA(Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp")), host, node, kubeconfig, **kw))
        return made[-1]

    yield start
    for d in made:
        d.stop()
        shutil.rmtree(d.tmp, ignore_errors=True)


@pytest.fixture
def admin(control_plane):
    from accelnode.kube.client import Client, Config

    return Client(Config.load(control_plane.kubeconfig("admin")), user_agent="accelnode-tests")


@pytest.fixture
def node(admin):
    """A Node object (no kubelet) for the plugin's slice to belong to."""
    from accelnode.kube.client import KubeError

    created = []

    def make(name: str, labels: dict | None = None) -> str:
        try:
            admin.request("DELETE", f"/api/v1/nodes/{name}")
        except KubeError:
            pass
        admin.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node",
                                                     "metadata": {"name": name, "labels": labels or {}}})
        created.append(name)
        return name

    yield make
    for name in created:
        for s in admin.list(SLICES, query={"fieldSelector": f"spec.nodeName={name}"})["items"]:
            admin.request("DELETE", f"{SLICES}/{s['metadata']['name']}")
        admin.request("DELETE", f"/api/v1/nodes/{name}")


def node_slices(admin, node: str) -> list[dict]:
    return admin.list(SLICES, query={"fieldSelector": f"spec.nodeName={node}"})["items"]


def allocated_claim(admin, ns: str, name: str, node: str, devices: list[str], driver: str = DRIVER) -> str:
    """A ResourceClaim allocated (as the scheduler does, through /status) to ``devices`` of ``node``; its UID."""
    claim = admin.request("POST", claim_path(ns), body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "tpu", "exactly": {"deviceClassName": driver,
                                                                       "count": len(devices)}}]}}})
    claim["status"] = {"allocation": {"devices": {"results": [
        {"request": "tpu", "driver": driver, "pool": node, "device": d} for d in devices]}}}
    admin.request("PUT", claim_path(ns, name) + "/status", body=claim)
    return claim["metadata"]["uid"]


def dump(obj) -> str:
    return json.dumps(obj, indent=1)
