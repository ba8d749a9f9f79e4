"""The DRA plugin's account (overlays/dra/rbac-dra.yaml) on a real API server: what it needs is
granted, and the ValidatingAdmissionPolicy (resourceslices-policy.yaml) keeps it to the
ResourceSlices of the node its pod runs on. Its token is a real bound ServiceAccount token of a
pod on that node, as kubelet mounts it."""

from __future__ import annotations

import pytest
import yaml

from accelnode import IMAGE
from accelnode.kube.client import Client, Config, KubeError
from tests.conftest import ROOT, eventually, refused
from tests.dra.conftest import DRIVER, SLICES, node_slices

SYSTEM = "accelnode-system"
COMPONENT = ROOT / "overlays/dra"


def slice_of(node: str, name: str | None = None) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name or f"{node}-x"},
            "spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "tpu-0"}]}}


@pytest.fixture
def plugin_token(control_plane, admin, node, kubectl):
    """``token(node)``: the accelnode-dra account's token bound to a pod on ``node``."""
    for f in (ROOT / "daemonsets/namespace.yaml", COMPONENT / "rbac-dra.yaml", COMPONENT / "resourceslices-policy.yaml"):
        out = kubectl("admin", "apply", "-f", str(f))
        assert out.returncode == 0, out.stderr
    pods = []

    def token(node_name: str | None) -> str:
        """None: a token bound to nothing (no node)."""
        if node_name is None:
            return admin.request("POST", f"/api/v1/namespaces/{SYSTEM}/serviceaccounts/accelnode-dra/token", body={
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": 3600}})["status"]["token"]
        name = f"dra-{node_name}"
        try:
            admin.request("DELETE", f"/api/v1/namespaces/{SYSTEM}/pods/{name}", query={"gracePeriodSeconds": "0"})
        except KubeError:
            pass
        pod = admin.request("POST", f"/api/v1/namespaces/{SYSTEM}/pods", body={
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node_name, "serviceAccountName": "accelnode-dra",
                     "containers": [{"name": "dra-plugin", "image": IMAGE}]}})
        pods.append(name)
        tr = admin.request("POST", f"/api/v1/namespaces/{SYSTEM}/serviceaccounts/accelnode-dra/token", body={
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600,
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod["metadata"]["uid"]}}})
        return tr["status"]["token"]

    yield token
    for name in pods:
        admin.request("DELETE", f"/api/v1/namespaces/{SYSTEM}/pods/{name}", query={"gracePeriodSeconds": "0"})


def as_plugin(control_plane, token: str) -> Client:
    return Client(Config(server=f"https://127.0.0.1:{control_plane.port}", ca_file=str(control_plane.ca_file),
                         token=token), user_agent="accelnode-dra-test")


def test_the_plugin_account_writes_only_its_own_nodes_slices(control_plane, admin, node, plugin_token):
    a, b = node("dra-own-a"), node("dra-own-b")
    plugin = as_plugin(control_plane, plugin_token(a))
    # the policy takes a moment to load after it was created: wait for it with dry runs
    eventually(lambda: refused(lambda: plugin.request("POST", SLICES, query={"dryRun": "All"}, body=slice_of(b))),
               "the policy in force", timeout=30)
    # the attack: the plugin on node a writes a slice claiming devices on node b (or on no node),
    # or deletes b's slice; RBAC alone allows all of it, the policy refuses
    why = refused(lambda: plugin.request("POST", SLICES, body=slice_of(b)))
    assert why.startswith("403") and "may not write ResourceSlices of node dra-own-b" in why, why
    no_node = slice_of(a, "dra-own-all")
    del no_node["spec"]["nodeName"]
    no_node["spec"]["allNodes"] = True
    assert "may not write ResourceSlices of no node" in refused(lambda: plugin.request("POST", SLICES, body=no_node))
    admin.request("POST", SLICES, body=slice_of(b))
    assert "may not write" in refused(lambda: plugin.request("DELETE", f"{SLICES}/{b}-x"))
    assert [s["metadata"]["name"] for s in node_slices(admin, b)] == [f"{b}-x"]
    # its own node, but another node's pool or another driver: devices the scheduler would
    # allocate as b's pool, or as another driver's
    other_pool = slice_of(a, "dra-own-pool")
    other_pool["spec"]["pool"]["name"] = b
    why = refused(lambda: plugin.request("POST", SLICES, body=other_pool))
    assert why.startswith("403") and f"writes only pool {a}, not pool {b}" in why, why
    other_driver = slice_of(a, "dra-own-driver")
    other_driver["spec"]["driver"] = "gpu.example.com"
    why = refused(lambda: plugin.request("POST", SLICES, body=other_driver))
    assert why.startswith("403") and "driver tpu.google.com only, not gpu.example.com" in why, why
    # its own node's slice: create, update, delete
    mine = plugin.request("POST", SLICES, body=slice_of(a))
    mine["spec"]["devices"].append({"name": "tpu-1"})
    plugin.request("PUT", f"{SLICES}/{a}-x", body=mine)
    plugin.request("DELETE", f"{SLICES}/{a}-x")
    # the same account with a token bound to no pod (so to no node) writes nothing
    unbound = as_plugin(control_plane, plugin_token(None))
    why = refused(lambda: unbound.request("POST", SLICES, body=slice_of(a)))
    assert why.startswith("403") and "only from a pod bound to a node" in why, why


def test_other_users_are_not_held_by_the_policy(control_plane, admin, node, plugin_token):
    b = node("dra-admin-b")
    plugin_token(b)  # the policy is installed
    admin.request("POST", SLICES, body=slice_of(b, "dra-admin-b-z"))  # the admin may still write any slice
    admin.request("DELETE", f"{SLICES}/dra-admin-b-z")


def test_the_real_plugin_runs_with_exactly_these_rights(control_plane, admin, node, plugin_token, tpu_host, dra,
                                                         tmp_path):
    n = node("dra-rights")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{control_plane.port}",
                                               "certificate-authority": str(control_plane.ca_file)}}],
        "users": [{"name": "u", "user": {"token": plugin_token(n)}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    d = dra(tpu_host("v5e-4"), n, kubeconfig)
    p = d.start()
    eventually(lambda: len(node_slices(admin, n)) == 2, "its slices published under its own account", timeout=30)
    assert "Forbidden" not in p.log() and "forbidden" not in p.log(), p.log()
