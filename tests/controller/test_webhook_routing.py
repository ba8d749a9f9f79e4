"""The API server reaches the webhooks the way the shipped manifests route them, as GKE routes
them: each webhook configuration names Service accelnode-controller on port 443, the Service
sends 443 to the Deployment's named container port, and the controller listens on that port.

GKE runs kube-apiserver with --enable-aggregator-routing (the control plane dials the pod's
address and container port, not the Service's cluster IP; docs/security.md), so this test's own
control plane does too, and the Service's endpoint is what the endpoints controller would publish
for a controller pod on this machine: its address and the Deployment's containerPort of the
Service's targetPort name. A private GKE cluster's firewall lets the control plane reach pods on
443 and 10250 only (../shared/reference/gke.md, section 2): the manifests use 10250.

The port is taken from the manifests, not from this test: the server binds the port of the
Deployment's ACCELNODE_WEBHOOK_ADDRESS on this machine's own address (the kubelet rigs give
their kubelets free ports, never 10250)."""

from __future__ import annotations

import base64
import socket
import time
import uuid

import pytest
from cryptography.hazmat.primitives import serialization

from accelnode.kube.client import Client, Config, KubeError
from controller.tpuenv.patches import INJECT_LABEL
from controller.tpuenv.webhooks import routes
from controller.webhooks.certs import _key_pem, new_ca, new_serving, service_names
from controller.webhooks.server import AdmissionServer
from tests.conftest import TOOLS_BIN, require
from tests.controlplane.test_controllers import eventually
from tests.test_manifests import BASE, build

def own_address() -> str:
    """This machine's address on its default route (never loopback: Endpoints refuse it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # no packet is sent: the kernel picks the source address
        return s.getsockname()[0]


@pytest.fixture(scope="module")
def routed_plane(tmp_path_factory):
    from tests.rigs.devcluster import ControlPlane

    for name in ("etcd", "kube-apiserver", "kube-controller-manager"):
        require((TOOLS_BIN / name).exists(), f"{name} in {TOOLS_BIN} (tools/mk/k8s.mk)")
    cp = ControlPlane(tmp_path_factory.mktemp("routed"), TOOLS_BIN, apiserver_args=("--enable-aggregator-routing=true",))
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def serve_on(address: str, cert: str, key: str) -> AdmissionServer:
    """The TPU env webhooks on ``address``; a port another process holds is waited for a while."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return AdmissionServer(address, cert, key, routes()).start()
        except OSError as e:
            if time.monotonic() > deadline:
                pytest.fail(f"cannot listen on {address} (the manifests' webhook port): {e}")
            time.sleep(1)


def test_the_apiserver_calls_the_webhooks_through_the_service_on_443_to_the_container_port(
        routed_plane, tmp_path):
    docs = build(BASE)
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (svc_port,) = svc["spec"]["ports"]
    container_port = {p["name"]: p["containerPort"] for p in container["ports"]}[svc_port["targetPort"]]
    listen = int(env["ACCELNODE_WEBHOOK_ADDRESS"].rpartition(":")[2])
    assert (svc_port["port"], listen, container_port) == (443, 10250, 10250)

    ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
    now = time.time()
    ca, ca_key = new_ca(now, 3600)
    cert, key = new_serving(ca, ca_key, service_names(name, ns), now, 3600)
    (tmp_path / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "tls.key").write_bytes(_key_pem(key))
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)

    addr = own_address()
    server = serve_on(f"{addr}:{listen}", str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    admin = Client(Config.from_kubeconfig(routed_plane.kubeconfig("admin")))
    run = uuid.uuid4().hex[:8]
    try:
        admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
        # no pod runs here: the Service without its selector, and the EndpointSlice the endpoint
        # slice controller would publish for a ready controller pod at ``addr``
        admin.request("POST", f"/api/v1/namespaces/{ns}/services",
                      body={**svc, "spec": {k: v for k, v in svc["spec"].items() if k != "selector"}})
        admin.request("POST", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", body={
            "metadata": {"name": f"{name}-test", "namespace": ns,
                         "labels": {"kubernetes.io/service-name": name,
                                    "endpointslice.kubernetes.io/managed-by": "accelnode-test"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [addr], "conditions": {"ready": True}}],
            "ports": [{"name": svc_port["name"], "port": container_port, "protocol": "TCP"}]})
        [config] = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"
                    and d["metadata"]["name"] == "accelnode-tpu-env"]
        for hook in config["webhooks"]:
            assert {k: v for k, v in hook["clientConfig"]["service"].items() if k != "path"} == {
                "namespace": ns, "name": name, "port": 443}
            hook["clientConfig"]["caBundle"] = base64.b64encode(ca_pem).decode()  # the shipped Service reference stays
        admin.request("POST", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", body=config)

        work = f"routed-{run}"
        admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": work}})
        opt_in = {INJECT_LABEL: "enabled"}
        sts = {"apiVersion": "apps/v1", "kind": "StatefulSet",
               "metadata": {"name": "web", "labels": dict(opt_in)},
               "spec": {"serviceName": "web", "replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                        "template": {"metadata": {"labels": {"app": "web", **opt_in}},
                                     "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}}

        def created():  # the webhook configuration takes effect once the API server has read it
            try:
                return admin.request("POST", f"/apis/apps/v1/namespaces/{work}/statefulsets", body=sts)
            except KubeError as e:
                return str(e)
        out = eventually(created, "a StatefulSet admitted through the webhook Service",
                         timeout=60, done=lambda r: isinstance(r, dict))
        names = {e["name"]: e.get("value") for e in out["spec"]["template"]["spec"]["containers"][0].get("env", [])}
        assert names["TPU_WORKER_HOSTNAMES"] == "web-0.web,web-1.web", names
    finally:
        server.stop()
