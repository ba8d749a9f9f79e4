"""A namespace's pull secrets as the agent reads them (accelnode/kube/pullsecrets.py), as the
"agent" identity with daemonsets/rbac-agent.yaml applied, against the real API server: only what
a namespace lends, both Secret types kubelet reads, a clear error for anything else."""

from __future__ import annotations

import base64
import json
import uuid

import pytest
from kubernetes import client

from accelnode.kube.client import Client, Config
from accelnode.kube.pullsecrets import PullSecretError, PullSecretReader
from accelnode.oci.credentials import docker_credentials

from .conftest import eventually


@pytest.fixture
def lending(kube_api, kubectl, crds):
    out = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-agent.yaml")
    assert out.returncode == 0, out.stderr
    core = client.CoreV1Api(kube_api("admin"))
    rbac = client.RbacAuthorizationV1Api(kube_api("admin"))
    made = []

    def namespace(secrets: dict[str, tuple[str, dict]], names: list[str], *, lend: bool = True) -> str:
        ns = f"ps-{uuid.uuid4().hex[:8]}"
        core.create_namespace(body={"metadata": {"name": ns}})
        made.append(ns)
        for name, (type_, data) in secrets.items():
            core.create_namespaced_secret(ns, {"metadata": {"name": name}, "type": type_, "data": {
                k: base64.b64encode(v.encode()).decode() for k, v in data.items()}})
        assert eventually(lambda: _patch_sa(core, ns, names))
        if lend:
            rbac.create_namespaced_role_binding(ns, {
                "metadata": {"name": "lend"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": "accelnode-pull-secret-reader"},
                "subjects": [{"kind": "ServiceAccount", "name": "accelnode-agent", "namespace": "accelnode-system"}]})
        return ns

    yield namespace
    for ns in made:
        core.delete_namespace(ns)


def _patch_sa(core, ns: str, names: list[str]) -> bool:
    try:
        core.patch_namespaced_service_account("default", ns, {"imagePullSecrets": [{"name": n} for n in names]})
        return True
    except client.ApiException as e:
        if e.status != 404:  # not made by the ServiceAccount controller yet
            raise
        return False


@pytest.fixture
def reader(control_plane):
    return PullSecretReader(Client(Config.from_kubeconfig(control_plane.kubeconfig("agent"))), who="the agent")


AUTH = base64.b64encode(b"alice:s3cret").decode()


def test_both_secret_types_in_the_service_accounts_order(lending, reader):
    ns = lending({"new": ("kubernetes.io/dockerconfigjson", {".dockerconfigjson": json.dumps(
                      {"auths": {"reg.example.com": {"auth": AUTH}}})}),
                  "old": ("kubernetes.io/dockercfg", {".dockercfg": json.dumps({"legacy.example.com": {"auth": AUTH}})})},
                 ["new", "missing", "old"])
    found = reader.of(ns)
    assert [n for n, _ in found.secrets] == [f"{ns}/new", f"{ns}/old"]  # a missing one is skipped, as kubelet does
    for host in ("reg.example.com", "legacy.example.com"):
        assert docker_credentials(host, None, "img", inline=found.secrets) == ("alice", "s3cret")
    assert docker_credentials("other.example.com", None, "img", inline=found.secrets) is None
    assert found.key.startswith(f"tenant:{ns}:") and "s3cret" not in found.key


def test_a_namespace_that_lends_nothing_has_no_secrets(lending, reader):
    ns = lending({"new": ("kubernetes.io/dockerconfigjson", {".dockerconfigjson": "{}"})}, ["new"], lend=False)
    found = reader.of(ns)
    assert found.secrets == () and found.key == "anonymous"
    assert "may not read ServiceAccount" in found.why and "accelnode-pull-secret-reader" in found.why


def test_a_secret_of_another_type_is_a_clear_error(lending, reader):
    ns = lending({"opaque": ("Opaque", {"password": "s3cret"})}, ["opaque"])
    with pytest.raises(PullSecretError) as e:
        reader.of(ns)
    assert f"pull secret {ns}/opaque is of type 'Opaque'" in str(e.value) and "s3cret" not in str(e.value)
