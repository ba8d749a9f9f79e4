"""The controller's identity (daemonsets/rbac-controller.yaml) may read, create and renew its
Lease in its namespace, and nothing else."""

from __future__ import annotations

import pytest

from accelnode.kube.client import Client, Config, KubeError
from controller.leader import micro_time
from tests.controller.conftest import LEASE, LEASE_PATH, NAMESPACE

LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"


@pytest.fixture
def me(control_plane, fresh_lease) -> Client:
    return Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")))


def forbidden(client: Client, method: str, path: str, body=None) -> str:
    with pytest.raises(KubeError) as err:
        client.request(method, path, body=body)
    assert err.value.code == 403, err.value
    return err.value.message


def lease(name: str) -> dict:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
            "spec": {"holderIdentity": "me", "leaseDurationSeconds": 15, "renewTime": micro_time()}}


def test_the_controller_gets_creates_and_renews_its_lease(me):
    created = me.request("POST", LEASES, body=lease(LEASE))
    got = me.request("GET", LEASE_PATH)
    assert got["metadata"]["uid"] == created["metadata"]["uid"]
    got["spec"]["renewTime"] = micro_time()
    me.request("PUT", LEASE_PATH, body=got)


def test_the_controller_is_forbidden_everything_else(me, kube_namespace):
    me.request("POST", LEASES, body=lease(LEASE))
    msg = forbidden(me, "DELETE", LEASE_PATH)
    assert "system:serviceaccount:accelnode-system:accelnode-controller" in msg
    forbidden(me, "PATCH", LEASE_PATH, body={"spec": {"holderIdentity": "x"}})
    forbidden(me, "GET", LEASES)
    forbidden(me, "GET", f"{LEASES}/kube-controller-manager")
    forbidden(me, "POST", f"/apis/coordination.k8s.io/v1/namespaces/{kube_namespace}/leases", body=lease(LEASE))
    forbidden(me, "GET", f"/api/v1/namespaces/{NAMESPACE}/secrets")
    forbidden(me, "GET", "/api/v1/configmaps")
    forbidden(me, "GET", "/api/v1/nodes")
