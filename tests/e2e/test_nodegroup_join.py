"""The whole join of a TPU node group, real from the token to a TPU pod: the group is created ->
the emulated VM runs (GCE emulator) -> the controller's token lands in its metadata -> the VM's
metadata server (the emulator, fed from the VM's GCE metadata as Compute feeds a VM's) wakes
``accelnode bootstrap`` -> token discovery and a real ``kubeadm join`` against a control plane
configured as kubeadm expects -> kubeadm starts the real kubelet from the shipped unit files
(tests/rigs/joinnode.py: no systemd in this container) -> TLS bootstrap, the Node registers with
the group's providerID, turns Ready, the controller labels it -> our device plugin advertises the
simulated host's chips -> a pod requesting ``google.com/tpu`` runs with them -> the token is gone
from the metadata and from the API server.

Needs the real-kubelet rig: run under ``flock /tmp/kubelet.lock``.
"""

from __future__ import annotations

import json
import subprocess
import threading
import uuid

import pytest

from accelnode.kube.bootstraptoken import METADATA_KEYS
from accelnode.kube.client import Client, Config
from tests.conftest import ROOT, TOOLS_BIN, accelnode_cmd, require, tool
from tests.controller.test_nodegroups import Running, cond, get, group_secrets, metadata, tng_path, wait
from tests.crds.test_crds import example
from tests.rigs.gce import Server
from tests.rigs.metadata import MetadataServer

PROJECT, ZONE = "my-tpu-project", "us-central1-c"
TPU = "google.com/tpu"


class Mirror(threading.Thread):
    """Feeds each emulated VM's GCE metadata to its own metadata server (one per VM)."""

    def __init__(self, gce: Server):
        super().__init__(daemon=True, name="metadata-mirror")
        self.gce, self.stop = gce, threading.Event()
        self.servers: dict[str, MetadataServer] = {}
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            for inst in self.gce.compute.instances(PROJECT):
                with self.lock:
                    srv = self.servers.get(inst["name"])
                    if srv is None:
                        srv = self.servers[inst["name"]] = MetadataServer(
                            name=inst["name"], zone=ZONE, project=PROJECT).start()
                items = metadata(inst)
                if srv.attributes() != items:
                    srv.replace_attributes(items)

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        for srv in self.servers.values():
            srv.stop()


@pytest.fixture(scope="module")
def kubelet_cluster(tmp_path_factory):
    """A control plane for real kubelets (scheduler, Node authorizer, NodeRestriction), with the
    CRDs and the controller's RBAC applied."""
    from tests.rigs.devcluster import ControlPlane, crd_args
    from tests.rigs.node import prerequisites

    for what in prerequisites(TOOLS_BIN):
        require(False, what)
    cp = ControlPlane(tmp_path_factory.mktemp("join-cp"), TOOLS_BIN, kubelets=True)
    cp.start()
    try:
        out = subprocess.run([tool("kubectl"), f"--kubeconfig={cp.kubeconfig('admin')}", "apply",
                              *crd_args(), "-f", "daemonsets/namespace.yaml",
                              "-f", "daemonsets/rbac-controller.yaml", "-f", "daemonsets/rbac-controller-nodegroups.yaml",
                              "-f", "daemonsets/rbac-controller-jointokens.yaml"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        yield cp
    finally:
        cp.stop()


def _ready(obj: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in obj.get("status", {}).get("conditions") or [])


def _container_spec(node, pod: dict) -> dict:
    """The OCI runtime spec containerd gave runc for the pod's (only) container."""
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    return json.loads(node.ctr("containers", "info", cid).stdout)["Spec"]


def test_token_to_ready_node_running_a_tpu_pod(kubelet_cluster, tmp_path):
    from tests.rigs.joinnode import JoinNode
    from tests.rigs.simhost import SimHost

    cp = kubelet_cluster
    admin = Client(Config.from_kubeconfig(cp.kubeconfig("admin")))
    ns = f"t-{uuid.uuid4().hex[:10]}"
    admin.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                      "metadata": {"name": ns}})
    gce = Server().start()
    gce.compute.set_faults(boot_s=0.5)
    mirror = Mirror(gce)
    mirror.start()
    host = SimHost.preset(tmp_path / "host", "v7x-4")  # tpu7x-standard-4t: 4 chips
    vm = plugin = boot = None
    try:
        with Running(cp, gce.endpoint, api_server_port=cp.port):
            g = example("tpu/tpunodegroup-single-host.yaml", "v7x-single-host")
            g["metadata"]["namespace"] = ns
            g["spec"]["bootstrapKubernetes"]["controlPlaneIP"] = "127.0.0.1"
            admin.request("POST", f"/apis/tpu.google.com/v1alpha1/namespaces/{ns}/tpunodegroups", body=g)
            (inst,) = wait("the VM", lambda: gce.compute.instances(PROJECT) or None)
            srv = wait("its metadata server", lambda: mirror.servers.get(inst["name"]))
            # the VM boots: its software is there (node-startup.sh), accelnode-bootstrap.service
            # starts and parks in the metadata long poll
            vm = JoinNode(tmp_path / "vm", TOOLS_BIN, cp, name=inst["name"])
            vm.start()
            log = tmp_path / "bootstrap.log"
            boot = vm.bootstrap(srv.host, log, "--backoff", "0.2")
            try:
                rc = boot.wait(240)
            except subprocess.TimeoutExpired:
                boot.kill()
                raise AssertionError(f"accelnode bootstrap did not end:\n{log.read_text()[-4000:]}\n{vm.logs()}")
            out = log.read_text(errors="replace")
            assert rc == 0, f"{out[-4000:]}\n{vm.logs()}"
            assert "This node has joined the cluster" in out
            token = srv.attributes().get("kubeadm-join-token") or ""
            assert not token or token.split(".")[1] not in out  # the secret never in its output
            # the kubelet kubeadm started, from our units: TLS bootstrap done, its own client certificate
            assert (vm.etc_kubernetes / "kubelet.conf").exists()
            argv = (vm.unit_state / "kubelet.service.argv").read_text().split("\n")
            pid = f"gce://{PROJECT}/{ZONE}/{inst['name']}"
            assert f"--provider-id={pid}" in argv and "--config=/var/lib/kubelet/config.yaml" in argv
            node = wait("the Node Ready", lambda: (n := get(admin, f"/api/v1/nodes/{inst['name']}")) and _ready(n) and n,
                        timeout=120)
            assert node["spec"]["providerID"] == pid
            certs = admin.request("GET", "/apis/certificates.k8s.io/v1/certificatesigningrequests")["items"]
            assert any(c["spec"]["username"].startswith("system:bootstrap:") and c["status"].get("certificate")
                       for c in certs), "the kubelet's client certificate came through the bootstrap CSR"
            wait("group Ready", lambda: cond(get(admin, tng_path(ns, "v7x-single-host")), "Ready").get("status") == "True",
                 timeout=90)
            labels = get(admin, f"/api/v1/nodes/{inst['name']}")["metadata"]["labels"]
            assert labels["cloud.google.com/gke-tpu-accelerator"] == "tpu7x"
            assert labels["cloud.google.com/gke-tpu-topology"] == "2x2x1"
            assert labels["cloud.google.com/gke-accelerator-count"] == "4"
            wait("token gone from the VM's metadata server", lambda: not set(METADATA_KEYS) & set(srv.attributes()))
            wait("token Secret gone", lambda: group_secrets(admin, ns) == [])

            # our device plugin on the VM, the simulated host's chips -> the Node's capacity
            plugin = subprocess.Popen(
                vm.vm_argv([*accelnode_cmd(), "device-plugin", "--sysfs-root", str(host.sysfs_root),
                            "--dev-root", str(host.dev_root), "--kubelet-dir", "/var/lib/kubelet/device-plugins",
                            "--accelerator-type", "tpu7x-8", "--topology", "2x2x1",
                            "--metrics-address", "127.0.0.1:0", "--log-format", "text"]),
                env=vm.vm_env(), stdout=open(tmp_path / "device-plugin.log", "wb"), stderr=subprocess.STDOUT)
            wait("4 chips allocatable", lambda: get(admin, f"/api/v1/nodes/{inst['name']}")["status"].get(
                "allocatable", {}).get(TPU) == "4", timeout=60)
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tpu", "namespace": ns},
                   "spec": {"hostNetwork": True, "dnsPolicy": "Default", "terminationGracePeriodSeconds": 1,
                            "tolerations": [{"operator": "Exists"}],
                            "containers": [{"name": "worker", "image": "localhost/accelnode/pause:catatonit",
                                            "imagePullPolicy": "Never", "resources": {"limits": {TPU: "4"}}}]}}
            admin.request("POST", f"/api/v1/namespaces/{ns}/pods", body=pod)
            running = wait("the TPU pod Running", lambda: (p := get(admin, f"/api/v1/namespaces/{ns}/pods/tpu"))
                           and p["status"].get("phase") == "Running" and p, timeout=120)
            assert running["spec"]["nodeName"] == inst["name"]
            spec = _container_spec(vm, running)
            devices = sorted(d["path"] for d in spec["linux"].get("devices") or [])
            host_nodes = sorted("/dev/" + str(p.relative_to(host.dev_root)) for p in host.dev_root.rglob("*")
                                if p.is_char_device())
            assert devices == host_nodes and len(host.chips()) == 4, (devices, host_nodes)
            env = dict(e.split("=", 1) for e in spec["process"]["env"])
            # the whole host: this host's share of the 2x2x1 slice
            assert env.get("TPU_TOPOLOGY") == "2x2x1" and env.get("TPU_CHIPS_PER_HOST_BOUNDS") == "2,2,1", env
            admin.request("DELETE", f"/api/v1/namespaces/{ns}/pods/tpu")
            wait("the pod gone", lambda: get(admin, f"/api/v1/namespaces/{ns}/pods/tpu") is None, timeout=60)
            # the VM goes away with the group
            plugin.terminate()
            plugin.wait(10)
            vm.stop()
            admin.request("DELETE", tng_path(ns, "v7x-single-host"))
            wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=90)
    finally:
        if plugin is not None and plugin.poll() is None:
            plugin.kill()
            plugin.wait()
        if boot is not None and boot.poll() is None:
            boot.kill()
            boot.wait()
        if vm is not None:
            vm.stop()
        mirror.close()
        gce.stop()
