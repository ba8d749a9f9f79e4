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
