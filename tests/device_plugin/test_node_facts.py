"""The slice facts reach the real device plugin (issue 25.3): from a real API server's Node
labels, as the node-group DaemonSet runs it (its env, ``spec.nodeName`` resolved as kubelet does,
the plugin's own ServiceAccount rights from daemonsets/rbac-device-plugin.yaml), and from the
metadata server's ``kube-labels``."""

import json

import pytest

from controller.nodegroups.reconciler import device_plugin_daemonset
from tests.conftest import ROOT
from tests.device_plugin.test_plugin import eventually, registered
from tests.rigs.metadata import MetadataServer

NODE = "tpu-node-facts"
ACCEL, TOPO = "cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"


def daemonset_env(node: str) -> dict[str, str]:
    """The node-group DaemonSet's container env as kubelet gives it on ``node``."""
    container = device_plugin_daemonset("accelnode-system", "img")["spec"]["template"]["spec"]["containers"][0]
    env = {}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}, e
            env[e["name"]] = node
    return env


@pytest.fixture
def labelled_node(kubectl):
    out = kubectl("admin", "apply", "-f", str(ROOT / "daemonsets/namespace.yaml"),
                  "-f", str(ROOT / "daemonsets/rbac-device-plugin.yaml"))
    assert out.returncode == 0, out.stderr
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "labels": {ACCEL: "tpu-v5-lite-podslice", TOPO: "2x2"}}}
    kubectl("admin", "delete", "node", NODE, "--ignore-not-found")
    out = kubectl("admin", "create", "-f", "-", stdin=json.dumps(node))
    assert out.returncode == 0, out.stderr
    yield NODE
    kubectl("admin", "delete", "node", NODE, "--ignore-not-found")


def test_both_daemonsets_run_as_the_account_that_may_read_nodes():
    import yaml

    (sa,) = [d for d in yaml.safe_load_all((ROOT / "daemonsets/rbac-device-plugin.yaml").read_text())
             if d["kind"] == "ServiceAccount"]
    base = yaml.safe_load((ROOT / "daemonsets/device-plugin.yaml").read_text())
    for ds in (base, device_plugin_daemonset("accelnode-system", "img")):
        spec = ds["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == sa["metadata"]["name"] and "automountServiceAccountToken" not in spec
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["ACCELNODE_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_the_node_group_daemonset_env_reads_the_nodes_labels(control_plane, kubectl, labelled_node, tpu_host,
                                                             kubelet, run_plugin):
    host = tpu_host("v5e-4")
    env = daemonset_env(labelled_node)
    assert env["ACCELNODE_NODE_NAME"] == NODE
    # as in its pod: the API server found as kubectl finds it (here KUBECONFIG), the plugin's own identity
    p = run_plugin(host, env={**env, "KUBECONFIG": str(control_plane.kubeconfig("device-plugin"))})
    ids = sorted(registered(kubelet))

    def allocated(key, want):
        return eventually(lambda: (e := dict(kubelet.allocate(ids[:2]).envs)).get(key) == want and e,
                          f"{key}={want} in the env", timeout=20)

    env2 = allocated("TPU_TOPOLOGY", "2x2")
    assert env2 == {"TPU_SKIP_MDS_QUERY": "true", "TPU_TOPOLOGY": "2x2", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
                    "TPU_HOST_BOUNDS": "2,1,1", "HOST_BOUNDS": "2,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": "1,2,1",
                    "CHIPS_PER_HOST_BOUNDS": "1,2,1", "TPU_TOPOLOGY_WRAP": "false,false,false",
                    "WRAP": "false,false,false", "TPU_TOPOLOGY_ALT": "false", "ALT": "false",
                    "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost"}
    # the labels change (a node group relabels its Nodes): the next allocation follows, no restart
    out = kubectl("admin", "label", "node", NODE, "--overwrite", f"{TOPO}=4x4")
    assert out.returncode == 0, out.stderr
    env4 = allocated("TPU_TOPOLOGY", "4x4")
    assert (env4["TPU_ACCELERATOR_TYPE"], env4["TPU_HOST_BOUNDS"]) == ("v5litepod-16", "4,2,1")
    assert "TPU_WORKER_ID" not in env4  # four hosts: the worker env is the webhooks' (docs/tpu-env.md)
    # a label that is not a topology gives no slice env rather than a wrong one
    kubectl("admin", "label", "node", NODE, "--overwrite", f"{TOPO}=big")
    eventually(lambda: "TPU_TOPOLOGY" not in kubelet.allocate(ids[:2]).envs, "slice env dropped", timeout=20)
    assert "node label ignored" in p.log() and p.proc.poll() is None


def test_without_rights_on_nodes_the_plugin_still_serves(control_plane, labelled_node, tpu_host, kubelet,
                                                         run_plugin):
    """The agent's identity may not read Nodes this way: the plugin logs it, retries, serves chips."""
    host = tpu_host("v5e-4")
    p = run_plugin(host, "--node-name", labelled_node, "--kubeconfig", str(control_plane.kubeconfig("csi")))
    ids = sorted(registered(kubelet))
    assert dict(kubelet.allocate(ids).envs) == {}
    eventually(lambda: "watch failed, retrying" in p.log(), "the refusal logged")
    assert "Forbidden" in p.log() or "forbidden" in p.log()


def test_metadata_kube_labels(tpu_host, kubelet, run_plugin):
    md = MetadataServer(attributes={"kube-labels": f"{ACCEL}=tpu7x,{TOPO}=2x2x2,other=x"}).start()
    try:
        host = tpu_host("v7x-4")
        run_plugin(host, "--metadata-labels", env={"GCE_METADATA_HOST": md.host})
        ids = sorted(registered(kubelet))
        env = kubelet.allocate(ids).envs
    finally:
        md.stop()
    assert (env["TPU_ACCELERATOR_TYPE"], env["TPU_TOPOLOGY"], env["TPU_HOST_BOUNDS"]) == ("tpu7x-16", "2x2x2", "1,1,2")
    assert "TPU_WORKER_ID" not in env  # 8 chips in the slice, 4 on this host
