"""The controller's identity (daemonsets/rbac-controller.yaml) may read, create and renew its
Lease in its namespace, and nothing else; with daemonsets/rbac-controller-webhooks.yaml, also
keep its one webhook Secret there and update the webhook configurations named there."""

from __future__ import annotations

import pytest

from accelnode.kube.client import Client, Config, KubeError, is_not_found
from controller.runtime.leader import micro_time
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
    forbidden(me, "GET", "/api/v1/namespaces/default/secrets")  # nodes: the node groups may (rbac-controller-nodegroups.yaml)


# -- the webhook certificates (daemonsets/rbac-controller-webhooks.yaml) -----------------------------

SECRET = "accelnode-controller-webhook-tls"
SECRETS = f"/api/v1/namespaces/{NAMESPACE}/secrets"
WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


@pytest.fixture
def webhook_rbac(kubectl, controller_rbac, admin):
    out = kubectl("admin", "apply", "-f", "daemonsets/rbac-controller-webhooks.yaml")
    assert out.returncode == 0, out.stderr

    def clean():  # the names are shared with tests/controller/test_webhook_certs.py
        for path in (f"{SECRETS}/{SECRET}", f"{WEBHOOKS}/accelnode-gkm-caches", f"{WEBHOOKS}/rbac-test-other"):
            try:
                admin.request("DELETE", path)
            except KubeError as e:
                assert is_not_found(e), e

    clean()
    yield
    clean()


def _secret(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls", "metadata": {"name": name},
            "data": {"tls.crt": "", "tls.key": ""}}


def _webhooks(name: str) -> dict:
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "accelnode"}}, "webhooks": []}


def test_the_controller_keeps_its_webhook_secret_and_no_other(me, webhook_rbac, admin, kube_namespace):
    me.request("POST", SECRETS, body=_secret(SECRET))
    got = me.request("GET", f"{SECRETS}/{SECRET}")
    me.request("PUT", f"{SECRETS}/{SECRET}", body=got)
    listed = me.request("GET", SECRETS, query={"fieldSelector": f"metadata.name={SECRET}"})
    assert [s["metadata"]["name"] for s in listed["items"]] == [SECRET]
    forbidden(me, "GET", SECRETS)  # every Secret of the namespace
    forbidden(me, "DELETE", f"{SECRETS}/{SECRET}")
    forbidden(me, "PATCH", f"{SECRETS}/{SECRET}", body={"metadata": {"labels": {"x": "y"}}})
    admin.request("POST", SECRETS, body=_secret("someone-elses"))
    try:
        forbidden(me, "GET", f"{SECRETS}/someone-elses")
        forbidden(me, "PUT", f"{SECRETS}/someone-elses", body=_secret("someone-elses"))
    finally:
        admin.request("DELETE", f"{SECRETS}/someone-elses")
    other = f"/api/v1/namespaces/{kube_namespace}/secrets"
    forbidden(me, "POST", other, body=_secret(SECRET))
    forbidden(me, "GET", f"{other}/{SECRET}")
    forbidden(me, "GET", "/api/v1/secrets")


def test_the_controller_updates_only_our_webhook_configurations(me, webhook_rbac, admin):
    admin.request("POST", WEBHOOKS, body=_webhooks("accelnode-gkm-caches"))
    admin.request("POST", WEBHOOKS, body=_webhooks("rbac-test-other"))
    listed = me.request("GET", WEBHOOKS, query={"labelSelector": "app.kubernetes.io/part-of=accelnode"})
    ours = next(c for c in listed["items"] if c["metadata"]["name"] == "accelnode-gkm-caches")
    me.request("PUT", f"{WEBHOOKS}/accelnode-gkm-caches", body=ours)
    me.request("GET", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations")
    other = next(c for c in listed["items"] if c["metadata"]["name"] == "rbac-test-other")
    forbidden(me, "PUT", f"{WEBHOOKS}/rbac-test-other", body=other)
    forbidden(me, "POST", WEBHOOKS, body=_webhooks("rbac-test-new"))
    forbidden(me, "DELETE", f"{WEBHOOKS}/accelnode-gkm-caches")
    forbidden(me, "PATCH", f"{WEBHOOKS}/accelnode-gkm-caches", body={"webhooks": []})
