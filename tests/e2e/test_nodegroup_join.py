"""The whole join loop of a TPU node group: the group is created -> the emulated VMs run (GCE
emulator) -> the controller's token lands in their metadata -> each VM's metadata server
(the metadata emulator, fed from the VM's GCE metadata as Compute feeds a VM's) wakes
``accelnode bootstrap`` -> token discovery against the real API server and the real
``kubeadm join`` (``--dry-run``: this host is not changed) -> the Node registers (by the test,
as the kubelet kubeadm configured would, with the providerID kubeadm was given) -> labels ->
the token is gone from the metadata and from the API server."""

from __future__ import annotations

import threading

from accelnode.kube.bootstraptoken import METADATA_KEYS
from tests.rigs.gce import Server
from tests.rigs.metadata import MetadataServer
from tests.bootstrap.conftest import Bootstrap
from tests.conftest import tool
from tests.controller.test_nodegroups import (Running, _register, admin, cond, get, group_secrets,  # noqa: F401
                                              metadata, nodegroup_rbac, tng_path, wait)
from tests.crds.test_crds import example

PROJECT, ZONE = "my-tpu-project", "us-central1-c"


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


def test_group_to_joined_labelled_node_and_token_gone(control_plane, nodegroup_rbac, admin, kube_namespace, tmp_path):
    tool("kubeadm")  # fails loudly when it is not built (tools/mk/k8s.mk)
    ns = kube_namespace
    gce = Server().start()
    gce.compute.set_faults(boot_s=0.5)
    mirror = Mirror(gce)
    mirror.start()
    boots: list[Bootstrap] = []
    try:
        with Running(control_plane, gce.endpoint, api_server_port=control_plane.port):
            g = example("tpu/tpunodegroup-single-host.yaml", "v7x-single-host")
            g["metadata"]["namespace"] = ns
            g["spec"]["bootstrapKubernetes"]["controlPlaneIP"] = "127.0.0.1"
            admin.request("POST", f"/apis/tpu.google.com/v1alpha1/namespaces/{ns}/tpunodegroups", body=g)
            def own_vm():  # other namespaces' leftover groups get VMs of their own in this emulator
                migs = admin.request("GET", f"/apis/tpu.google.com/v1alpha1/namespaces/{ns}/managedinstancegroups")
                prefixes = [m["metadata"]["name"] + "-" for m in migs["items"]]
                return [i for i in gce.compute.instances(PROJECT) if any(i["name"].startswith(p) for p in prefixes)] or None
            (inst,) = wait("the VM", own_vm)
            srv = wait("its metadata server", lambda: mirror.servers.get(inst["name"]))
            # the VM boots: its startup script runs accelnode bootstrap, which parks in a long poll
            b = Bootstrap(srv, tool("kubeadm"), tmp_path, "--ignore-preflight-errors", "all", "--backoff", "0.2")
            boots.append(b)
            assert b.wait(180) == 0, b.output()
            out = b.output()
            assert "This node has joined the cluster" in out
            token = metadata(next(i for i in gce.compute.instances(PROJECT) if i["name"] == inst["name"])).get(
                "kubeadm-join-token")
            assert token is None or token.split(".")[1] not in out
            flags = (b.dryrun_dir / "kubeadm-flags.env").read_text()
            pid = f"gce://{PROJECT}/{ZONE}/{inst['name']}"
            assert f"--provider-id={pid}" in flags
            # kubelet registers the Node with that providerID (a dry run does not start kubelet)
            _register(admin, inst, PROJECT, ZONE)
            wait("group Ready", lambda: cond(get(admin, tng_path(ns, "v7x-single-host")), "Ready").get("status") == "True")
            node = admin.request("GET", f"/api/v1/nodes/{inst['name']}")
            assert node["metadata"]["labels"]["cloud.google.com/gke-tpu-accelerator"] == "tpu7x"
            assert node["metadata"]["labels"]["cloud.google.com/gke-tpu-topology"] == "2x2x1"
            wait("token gone from the VM's metadata server",
                 lambda: not set(METADATA_KEYS) & set(mirror.servers[inst["name"]].attributes()))
            wait("token Secret gone", lambda: group_secrets(admin, ns) == [])
            admin.request("DELETE", tng_path(ns, "v7x-single-host"))
            wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=90)
    finally:
        for b in boots:
            b.stop()
        mirror.close()
        gce.stop()

