"""The test control plane carries what `kubeadm init` leaves for joining nodes, with kubeadm's
rights: anonymous clients read cluster-info and nothing else; a bootstrap-token holder reads
kubeadm-config and kubelet-config and may file a CSR."""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request

import yaml

from accelnode.kube.client import Client, Config


def anonymous(control_plane, path: str) -> int:
    ctx = ssl.create_default_context(cafile=str(control_plane.ca_file))
    try:
        with urllib.request.urlopen(control_plane.url + path, context=ctx, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_anonymous_reads_cluster_info_only(control_plane):
    assert anonymous(control_plane, "/api/v1/namespaces/kube-public/configmaps/cluster-info") == 200
    assert anonymous(control_plane, "/version") == 200
    for path in ("/api/v1/namespaces/kube-public/configmaps", "/api/v1/namespaces/kube-system/configmaps/kubeadm-config",
                 "/api/v1/namespaces/kube-system/secrets", "/api/v1/nodes"):
        assert anonymous(control_plane, path) == 403, path


def test_cluster_info_names_this_api_server_and_its_ca(control_plane, kube_api):
    from kubernetes import client

    cm = client.CoreV1Api(kube_api("admin")).read_namespaced_config_map("cluster-info", "kube-public")
    cluster = yaml.safe_load(cm.data["kubeconfig"])["clusters"][0]["cluster"]
    assert cluster["server"] == control_plane.url
    assert base64.b64decode(cluster["certificate-authority-data"]) == control_plane.ca_file.read_bytes()


def test_a_bootstrap_token_holder_has_kubeadms_rights(control_plane, join_tokens):
    info = join_tokens.ensure("kubeadm-rights", f"127.0.0.1:{control_plane.port}")
    c = Client(Config(control_plane.url, str(control_plane.ca_file), token=info.token))
    cfg = c.request("GET", "/api/v1/namespaces/kube-system/configmaps/kubeadm-config")
    assert yaml.safe_load(cfg["data"]["ClusterConfiguration"])["kind"] == "ClusterConfiguration"
    c.request("GET", "/api/v1/namespaces/kube-system/configmaps/kubelet-config")
    review = c.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body={
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {"group": "certificates.k8s.io", "resource": "certificatesigningrequests",
                                        "verb": "create"}}})
    assert review["status"]["allowed"] is True, json.dumps(review["status"])
    join_tokens.revoke("kubeadm-rights")


def test_the_token_gets_a_kubelet_client_certificate_as_kubelets_tls_bootstrap_does(control_plane, join_tokens):
    """What kubelet does with bootstrap-kubelet.conf after kubeadm join: a CSR for
    system:node:<name> to kubernetes.io/kube-apiserver-client-kubelet, approved by
    kube-controller-manager (kubeadm's auto-approve binding) and signed by the cluster CA."""
    import time

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    info = join_tokens.ensure("tls-bootstrap", f"127.0.0.1:{control_plane.port}")
    node = "tpu-tls-bootstrap-0"
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}")])).sign(key, hashes.SHA256()))
    c = Client(Config(control_plane.url, str(control_plane.ca_file), token=info.token))
    name = f"node-csr-{node}-{int(time.time())}"
    c.request("POST", "/apis/certificates.k8s.io/v1/certificatesigningrequests", body={
        "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest", "metadata": {"name": name},
        "spec": {"request": base64.b64encode(csr.public_bytes(serialization.Encoding.PEM)).decode(),
                 "signerName": "kubernetes.io/kube-apiserver-client-kubelet",
                 "usages": ["digital signature", "client auth"]}})
    deadline = time.monotonic() + 60
    got = {}
    while time.monotonic() < deadline:
        got = c.request("GET", f"/apis/certificates.k8s.io/v1/certificatesigningrequests/{name}")
        if (got.get("status") or {}).get("certificate"):
            break
        time.sleep(0.2)
    status = got.get("status") or {}
    assert any(cond["type"] == "Approved" for cond in status.get("conditions", [])), status
    cert = x509.load_pem_x509_certificate(base64.b64decode(status["certificate"]))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"system:node:{node}"
    ca = x509.load_pem_x509_certificate(control_plane.ca_file.read_bytes())
    cert.verify_directly_issued_by(ca)
    join_tokens.revoke("tls-bootstrap")
