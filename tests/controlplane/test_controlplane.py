"""The test control plane itself: a real etcd + kube-apiserver (and kube-controller-manager:
test_controllers.py) that kubectl and the Python
client can use, with the identities, token signing and audit log other tests rely on."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.rigs.devcluster import IDENTITIES, ControlPlane, ControlPlaneError
from tests.conftest import ROOT, TOOLS_BIN
from tests.fixtures.cluster import status_message


def test_kubectl_talks_to_the_apiserver(kubectl):
    ready = kubectl("admin", "get", "--raw", "/readyz")
    assert (ready.returncode, ready.stdout) == (0, "ok"), ready.stderr
    version = kubectl("admin", "version", "-o", "json")
    assert version.returncode == 0, version.stderr
    info = json.loads(version.stdout)
    # kubectl is built from the same release as the apiserver: no version skew; and that release
    # is the one tools/k8s/go.mod pins (tools/mk/k8s.mk stamps it)
    assert info["serverVersion"]["gitVersion"] == info["clientVersion"]["gitVersion"]
    pinned = re.search(r"^\s*k8s\.io/kubernetes (v[0-9.]+)", (ROOT / "tools/k8s/go.mod").read_text(), re.M)[1]
    assert info["serverVersion"]["gitVersion"] == pinned
    assert info["serverVersion"]["minor"] == pinned.split(".")[1]


def test_kubectl_writes_and_reads_back(kubectl, kube_namespace):
    made = kubectl("admin", "-n", kube_namespace, "create", "configmap", "greeting", "--from-literal=hello=world")
    assert made.returncode == 0, made.stderr
    got = kubectl("admin", "-n", kube_namespace, "get", "configmap", "greeting", "-o", "jsonpath={.data.hello}")
    assert (got.returncode, got.stdout) == (0, "world"), got.stderr


@pytest.mark.parametrize("ident", IDENTITIES, ids=lambda i: i.name)
def test_each_identity_authenticates_as_itself(kube_api, ident):
    review = client.AuthenticationV1Api(kube_api(ident.name)).create_self_subject_review(
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    )
    assert review.status.user_info.username == ident.user
    assert set(ident.groups) | {"system:authenticated"} == set(review.status.user_info.groups)


def test_component_identities_have_no_rights_without_rbac(kube_api):
    with pytest.raises(ApiException) as err:
        client.CoreV1Api(kube_api("device-plugin")).list_node()
    assert err.value.status == 403
    assert 'cannot list resource "nodes"' in status_message(err.value)


def test_service_account_tokens_are_signed_and_accepted(control_plane, kube_api, kube_namespace):
    core = client.CoreV1Api(kube_api("admin"))
    core.create_namespaced_service_account(kube_namespace, body={"metadata": {"name": "robot"}})
    token = core.create_namespaced_service_account_token(
        "robot", kube_namespace, body={"spec": {"audiences": [], "expirationSeconds": 600}}
    ).status.token
    cfg = client.Configuration(host=control_plane.url, api_key={"BearerToken": token},
                               api_key_prefix={"BearerToken": "Bearer"})
    cfg.ssl_ca_cert = str(control_plane.ca_file)
    with client.ApiClient(cfg) as api:
        review = client.AuthenticationV1Api(api).create_self_subject_review(
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        )
    assert review.status.user_info.username == f"system:serviceaccount:{kube_namespace}:robot"


def test_audit_log_records_writes(control_plane, kube_api, kube_namespace):
    client.CoreV1Api(kube_api("admin")).create_namespaced_config_map(
        kube_namespace, body={"metadata": {"name": "audited"}}
    )

    def entries():
        lines = control_plane.audit_log.read_text().splitlines()
        return [json.loads(line) for line in lines]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        hits = [e for e in entries() if e.get("objectRef", {}).get("name") == "audited"]
        if hits:
            break
        time.sleep(0.1)
    assert [(e["verb"], e["user"]["username"], e["objectRef"]["namespace"]) for e in hits] == [
        ("create", "accelnode-admin", kube_namespace)
    ]
    assert not [e for e in entries() if e["verb"] in ("get", "list", "watch")], "reads must not be audited"


def test_apiserver_restart_keeps_data(control_plane, kube_api, kube_namespace):
    core = client.CoreV1Api(kube_api("admin"))
    core.create_namespaced_config_map(kube_namespace, body={"metadata": {"name": "survivor"}})
    control_plane.stop_apiserver()
    try:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", control_plane.port)) != 0, "apiserver still listening"
    finally:
        control_plane.start_apiserver()
    assert core.read_namespaced_config_map("survivor", kube_namespace).metadata.name == "survivor"
    control_plane.check_running()  # the controller-manager rode out the outage


def test_startup_failure_reports_the_log_tail(control_plane, tmp_path):
    cp = ControlPlane(tmp_path, TOOLS_BIN, start_timeout=60)
    with socket.socket() as squatter:  # the apiserver's port is taken: it must fail, and say why
        squatter.bind(("127.0.0.1", cp.port))
        squatter.listen()
        with pytest.raises(ControlPlaneError) as err:
            cp.start()
    assert "kube-apiserver exited during startup" in str(err.value)
    assert "address already in use" in str(err.value)
    assert not (tmp_path / "etcd").exists(), "etcd data must be removed after a failed start"


def test_controller_manager_startup_failure_reports_its_log_tail(control_plane, tmp_path):
    cp = ControlPlane(tmp_path, TOOLS_BIN, start_timeout=60)
    with socket.socket() as squatter:  # its port is taken: it must fail, say why, and stop the rest
        squatter.bind(("127.0.0.1", cp.controller_manager_port))
        squatter.listen()
        with pytest.raises(ControlPlaneError) as err:
            cp.start()
    assert "kube-controller-manager exited during startup" in str(err.value)
    assert "address already in use" in str(err.value)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", cp.port)) != 0, "kube-apiserver still listening"
    assert not (tmp_path / "etcd").exists(), "etcd data must be removed after a failed start"


def test_missing_binary_is_a_clear_error(tmp_path):
    with pytest.raises(ControlPlaneError, match=r"etcd is missing: build it with `make tools`"):
        ControlPlane(tmp_path / "work", tmp_path / "no-bin").start()
