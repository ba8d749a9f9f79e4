"""A namespace's pull secrets as the agent reads them (accelnode/kube/pullsecrets.py), as the
"agent" identity with daemonsets/rbac-agent.yaml applied, against the real API server: only what
a namespace lends (by a Role naming each pull secret: examples/lend-pull-secrets.yaml), both Secret
types kubelet reads, a clear error for anything else."""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from accelnode.kube.client import Client, Config, KubeError
from accelnode.kube.pullsecrets import AGENT, PullSecretError, PullSecretReader
from accelnode.kube.pullsecrets import lending as lending_objects
from accelnode.oci.credentials import docker_credentials

from .conftest import eventually


@pytest.fixture
def lending(kube_api, kubectl, crds):
    out = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-agent.yaml")
    assert out.returncode == 0, out.stderr
    core = client.CoreV1Api(kube_api("admin"))
    rbac = client.RbacAuthorizationV1Api(kube_api("admin"))
    made = []

    def namespace(secrets: dict[str, tuple[str, dict]], names: list[str], *, lend: bool | list[str] = True) -> str:
        ns = f"ps-{uuid.uuid4().hex[:8]}"
        core.create_namespace(body={"metadata": {"name": ns}})
        made.append(ns)
        for name, (type_, data) in secrets.items():
            core.create_namespaced_secret(ns, {"metadata": {"name": name}, "type": type_, "data": {
                k: base64.b64encode(v.encode()).decode() for k, v in data.items()}})
        assert eventually(lambda: _patch_sa(core, ns, names))
        if lend:
            role, binding = lending_objects(ns, lend if isinstance(lend, list) else names, (AGENT,))
            rbac.create_namespaced_role(ns, role)
            rbac.create_namespaced_role_binding(ns, binding)
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
    assert "may not read ServiceAccount" in found.why and "Role accelnode-pull-secrets" in found.why


def test_a_secret_of_another_type_is_a_clear_error(lending, reader):
    ns = lending({"opaque": ("Opaque", {"password": "s3cret"})}, ["opaque"])
    with pytest.raises(PullSecretError) as e:
        reader.of(ns)
    assert f"pull secret {ns}/opaque is of type 'Opaque'" in str(e.value) and "s3cret" not in str(e.value)


def test_lending_grants_only_the_named_secrets(lending, reader, control_plane):
    """The lending Role names the pull secrets: the agent's identity reads those and no other
    Secret of the namespace (with main's ClusterRole accelnode-pull-secret-reader bound, the
    lending namespace handed over every Secret it held)."""
    ns = lending({"regcred": ("kubernetes.io/dockerconfigjson", {".dockerconfigjson": json.dumps(
                      {"auths": {"reg.example.com": {"auth": AUTH}}})}),
                  "db-password": ("Opaque", {"password": "s3cret"})}, ["regcred"])
    assert [n for n, _ in reader.of(ns).secrets] == [f"{ns}/regcred"]
    agent = Client(Config.from_kubeconfig(control_plane.kubeconfig("agent")))
    for method, path in (("GET", f"/api/v1/namespaces/{ns}/secrets/db-password"),
                         ("GET", f"/api/v1/namespaces/{ns}/secrets"),
                         ("GET", f"/api/v1/namespaces/{ns}/serviceaccounts/other")):
        with pytest.raises(KubeError) as err:
            agent.request(method, path)
        assert err.value.code == 403, (path, err.value)


def test_a_pull_secret_left_out_of_the_role_is_refused_by_name(lending, reader):
    ns = lending({"regcred": ("kubernetes.io/dockerconfigjson", {".dockerconfigjson": "{}"}),
                  "second": ("kubernetes.io/dockerconfigjson", {".dockerconfigjson": "{}"})},
                 ["regcred", "second"], lend=["regcred"])
    with pytest.raises(PullSecretError) as e:
        reader.of(ns)
    assert f"may not read pull secret {ns}/second" in str(e.value) and "Role accelnode-pull-secrets" in str(e.value)


def test_the_example_is_the_lending_the_docs_show():
    """examples/lend-pull-secrets.yaml is what ``pullsecrets.lending`` writes (the tests above apply that)."""
    docs = [d for d in yaml.safe_load_all((Path(__file__).parents[2] / "examples/lend-pull-secrets.yaml").read_text())
            if d]
    assert docs == lending_objects("team-a", ["regcred"])


def test_the_status_pass_reads_nothing_once_read_and_a_pull_reads_again(lending, control_plane):
    """What the status reporter asks on every pass of every node (``fresh=False``) is the last
    answer, whatever its age: an idle fleet sends no reads (docs/scale.md); a pull asks within
    the TTL and reads again past it, and then the status pass sees what it read."""
    cfg = {"auths": {"reg.example": {"auth": AUTH}}}
    ns = lending({"regcred": ("kubernetes.io/dockerconfigjson", {".dockerconfigjson": json.dumps(cfg)})},
                 ["regcred"])
    c = Client(Config.from_kubeconfig(control_plane.kubeconfig("agent")))
    reader = PullSecretReader(c, ttl=0.0, who="the agent")
    first = reader.of(ns, fresh=False)
    sent = c.sent
    assert first.secrets and [reader.of(ns, fresh=False) for _ in range(5)] == [first] * 5
    assert c.sent == sent  # nothing read: the answer is kept
    assert reader.of(ns) == first and c.sent == sent + 2  # a pull reads (ServiceAccount, secret)
