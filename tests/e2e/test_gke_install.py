"""End to end: the base installed as docs/operations.md says, on a control plane configured as GKE
configures its own, with GKE-managed nodes beside self-managed ones; then uninstalled, and a
GKM install moved over.

The control plane is this module's own (tests/rigs/devcluster.py: etcd, kube-apiserver,
kube-controller-manager, all real), so that installing and deleting the whole base touches no
other test. What of GKE it reproduces, with the sources:

- kube-apiserver's ResourceQuota admission with ``limitedResources`` for pods of the
  system-node-critical / system-cluster-critical classes, and kube-system's ``gcp-critical-pods``
  quota (devcluster.GKE_ADMISSION / gke_objects(): Kubernetes' GCE scripts,
  cluster/gce/gci/configure-helper.sh; the error GKE users report in gatekeeper#1120, osm#4408,
  dapr#7783; ../shared/reference/gke.md section 1).
- Nodes as GKE labels and taints them (gke.md section 3): every node of a GKE node pool carries
  ``cloud.google.com/gke-nodepool``; TPU nodes ``cloud.google.com/gke-tpu-accelerator``,
  ``gke-tpu-topology`` and the taint ``google.com/tpu=present:NoSchedule`` (GKE's TPU docs, as
  cited by SkyPilot); GPU nodes ``cloud.google.com/gke-accelerator``, and here the taint
  ``nvidia.com/gpu=present:NoSchedule`` (the taint GKE puts on GPU pools; the key is what our
  toleration matches). A self-managed TPU node (a TPUNodeGroup VM joined to this cluster, or any
  node outside GKE) has the TPU labels and no node pool.

The Nodes are records with no kubelet: kube-controller-manager's DaemonSet controller decides
which of them get which DaemonSet's pod, and creates the pods through admission, which is what
is under test (no scheduler binds them; nothing runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, TOOLS_BIN, require

NS = "accelnode-system"
BASE = ROOT / "daemonsets"
CSI, PLUGIN, CONTROLLER = "accelnode-csi-node", "accelnode-tpu-device-plugin", "accelnode-controller"
TPU_TAINT = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TPU_LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
              "cloud.google.com/gke-tpu-topology": "2x2", "cloud.google.com/gke-accelerator-count": "4"}
NODES = {
    # a GKE TPU node pool: GKE's kube-system/tpu-device-plugin serves google.com/tpu here
    "gke-tpu": ({**TPU_LABELS, "cloud.google.com/gke-nodepool": "tpu-pool"}, [TPU_TAINT]),
    # a GKE GPU node pool: GKE's nvidia-gpu-device-plugin serves nvidia.com/gpu here
    "gke-gpu": ({"cloud.google.com/gke-accelerator": "nvidia-l4", "cloud.google.com/gke-nodepool": "gpu-pool"},
                [GPU_TAINT]),
    "gke-cpu": ({"cloud.google.com/gke-nodepool": "default-pool"}, []),
    # a self-managed TPU VM (TPUNodeGroup): nobody else's plugin
    "self-tpu": ({**TPU_LABELS, "cloud.google.com/tpu-node-group": "ml-v5e"}, [TPU_TAINT]),
    # a GKE TPU pool whose own plugin is off, opted in for ours (overlays/self-managed-device-plugin)
    "gke-tpu-opted-in": ({**TPU_LABELS, "cloud.google.com/gke-nodepool": "own-plugin-pool",
                          "cloud.google.com/gke-tpu-dra-driver": "true", "accelnode.io/tpu-device-plugin": "true"},
                         [TPU_TAINT]),
}
USER_OBJECTS = [
    {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": "kernels", "namespace": "team-a"},
     "spec": {"image": "registry.example.com/team/kernels@sha256:" + "a" * 64}},
    {"apiVersion": "accelnode.io/v1alpha1", "kind": "ClusterCacheTrustPolicy", "metadata": {"name": "team-keys"},
     "spec": {"keys": [{"name": "k", "publicKey": "-----BEGIN PUBLIC KEY-----\nMFkw\n-----END PUBLIC KEY-----\n"}],
              "namespaces": ["team-a"]}},
]

REFUSAL = "insufficient quota to match these scopes: [{PriorityClass In [system-node-critical system-cluster-critical]}]"


class Cluster:
    def __init__(self, cp):
        self.cp = cp

    def kubectl(self, *args: str, stdin: str | None = None, ok: bool = True, identity: str = "admin") -> str:
        out = subprocess.run([str(TOOLS_BIN / "kubectl"), f"--kubeconfig={self.cp.kubeconfig(identity)}", *args],
                             input=stdin, capture_output=True, text=True, timeout=120)
        if ok:
            assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
            return out.stdout
        assert out.returncode != 0, f"kubectl {' '.join(args)} succeeded: {out.stdout}"
        return out.stderr

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def pods_by_node(self, app: str) -> dict[str, str]:
        """node -> pod name of the DaemonSet ``app``'s pods (their nodeName-pinned affinity)."""
        out = {}
        for p in self.get("pods", "-n", NS, "-l", f"app.kubernetes.io/name={app}")["items"]:
            if p["metadata"].get("deletionTimestamp"):
                continue
            terms = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            [node] = terms["nodeSelectorTerms"][0]["matchFields"][0]["values"]
            out[node] = p["metadata"]["name"]
        return out

    def install(self, base: Path = BASE) -> None:
        """docs/operations.md, Install."""
        self.kubectl("apply", "--server-side", "-k", str(BASE / "crds"))
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        self.kubectl("apply", "--server-side", "-k", str(base))


def eventually(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:.0f}s: {what}", pytrace=False)
        time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.rigs.devcluster import ControlPlane

    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl"):
        require((TOOLS_BIN / name).exists(), f"{name} in {TOOLS_BIN} (tools/mk/k8s.mk)")
    cp = ControlPlane(tmp_path_factory.mktemp("gke-cp"), TOOLS_BIN)
    cp.start()
    try:
        c = Cluster(cp)
        for name, (labels, taints) in NODES.items():
            c.kubectl("apply", "-f", "-", stdin=json.dumps({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/os": "linux", "kubernetes.io/hostname": name,
                                                      **labels}},
                "spec": {"taints": taints}}))
            # the API server adds node.kubernetes.io/not-ready to a new Node until its kubelet
            # reports Ready (and the node lifecycle controller lifts it): these are Ready ones
            c.kubectl("patch", "node", name, "--type=merge", "-p", json.dumps({"spec": {"taints": taints or None}}))
        # users' objects from before (a GKM install's caches, a trust policy): made while no
        # webhook of ours is registered, as they would have been under GKM
        c.kubectl("apply", "--server-side", "-k", str(BASE / "crds"))
        c.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        c.kubectl("create", "namespace", "team-a")
        c.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(USER_OBJECTS))
        yield c
    finally:
        cp.stop()


# -- install ---------------------------------------------------------------------------------------


def test_install_places_each_daemon_beside_gkes_own_stack(cluster):
    """The quota admits every pod of ours (each has a critical priority class); the CSI driver and
    agent run on every kind of node, GPU and TPU ones included; our device plugin only where no
    managed one runs; the controller's two replicas are admitted."""
    cluster.install()
    want_csi = set(NODES)
    eventually("a CSI pod per node", lambda: set(cluster.pods_by_node(CSI)) == want_csi)
    eventually("the device plugin on the self-managed TPU node", lambda: set(cluster.pods_by_node(PLUGIN)) == {"self-tpu"})
    eventually("both controller replicas", lambda: len(cluster.get("pods", "-n", NS, "-l",
                                                                   f"app.kubernetes.io/name={CONTROLLER}")["items"]) == 2)
    ds = cluster.get("daemonset", PLUGIN, "-n", NS)
    assert ds["status"]["desiredNumberScheduled"] == 1  # the DaemonSet controller's own count
    events = cluster.get("events", "-n", NS)["items"]
    assert not [e for e in events if e["reason"] == "FailedCreate"], [e["message"] for e in events]


def test_without_the_quota_gke_refuses_our_pods(cluster):
    """What GKE does to an install without daemonsets/quota.yaml: the DaemonSet controller cannot
    create the pod (FailedCreate, GKE's message); the quota back, the pod is made."""
    cluster.kubectl("delete", "resourcequota", "accelnode-critical-pods", "-n", NS)
    victim = cluster.pods_by_node(CSI)["gke-cpu"]
    cluster.kubectl("delete", "pod", victim, "-n", NS, "--grace-period=0", "--force")

    def refused():
        return [e for e in cluster.get("events", "-n", NS)["items"]
                if e["reason"] == "FailedCreate" and e["involvedObject"]["name"] == CSI and REFUSAL in e["message"]]
    eventually("FailedCreate with GKE's refusal", refused)
    assert "gke-cpu" not in cluster.pods_by_node(CSI)
    cluster.kubectl("apply", "--server-side", "-k", str(BASE))  # the base brings its quota back
    eventually("the CSI pod re-made", lambda: "gke-cpu" in cluster.pods_by_node(CSI))


def test_the_switch_turns_our_device_plugin_on_for_opted_in_gke_tpu_nodes(cluster, tmp_path):
    """docs/operations.md's overlay with overlays/self-managed-device-plugin: the opted-in GKE TPU
    node gets ours too; a GKE TPU node where GKE's own plugin runs still does not."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(BASE, tmp_path)],
        "components": [os.path.relpath(ROOT / "overlays/self-managed-device-plugin", tmp_path)]}))
    cluster.kubectl("apply", "--server-side", "-k", str(tmp_path))
    eventually("ours on the opted-in node", lambda: set(cluster.pods_by_node(PLUGIN)) == {"self-tpu", "gke-tpu-opted-in"})
    cluster.kubectl("apply", "--server-side", "-k", str(BASE))  # back to the base
    eventually("ours off the opted-in node again", lambda: set(cluster.pods_by_node(PLUGIN)) == {"self-tpu"})


def test_kubernetes_user_roles_cover_our_kinds(cluster):
    """The aggregated ClusterRoles: a namespace's viewer reads caches and node groups, its editor
    also writes caches, only its admin writes TPU node groups (they create cloud VMs)."""
    ns = "team-a"
    for user, role in (("vera", "view"), ("eddie", "edit"), ("ada", "admin")):
        cluster.kubectl("create", "rolebinding", f"{user}-{role}", f"--clusterrole={role}", f"--user={user}", "-n", ns)

    def can(user: str, verb: str, resource: str) -> bool:
        out = subprocess.run([str(TOOLS_BIN / "kubectl"), f"--kubeconfig={cluster.cp.kubeconfig('admin')}", "auth",
                              "can-i", verb, resource, "-n", ns, f"--as={user}"], capture_output=True, text=True,
                             timeout=60)
        return out.stdout.strip() == "yes"

    def table():
        return {(u, v, r): can(u, v, r) for u in ("vera", "eddie", "ada") for v in ("list", "create")
                for r in ("gkmcaches.gkm.io", "tpunodegroups.tpu.google.com", "gkmcachenodes.gkm.io")}
    want = {(u, v, r): v == "list" or (r == "gkmcaches.gkm.io" and u != "vera")
            or (r == "tpunodegroups.tpu.google.com" and u == "ada")
            for u in ("vera", "eddie", "ada") for v in ("list", "create")
            for r in ("gkmcaches.gkm.io", "tpunodegroups.tpu.google.com", "gkmcachenodes.gkm.io")}
    # the aggregation controller folds our roles into view/edit/admin a moment after they exist
    eventually("view/edit/admin aggregated", lambda: table() == want)


# -- uninstall -------------------------------------------------------------------------------------




def test_uninstall_leaves_the_crds_and_users_objects(cluster):
    """`kubectl delete -k daemonsets/` (docs/operations.md, Uninstall): everything of ours goes,
    no CRD does, so every user's object stays; installing again finds them."""
    crds = {c["metadata"]["name"] for c in cluster.get("crd")["items"]}
    assert len(crds) == 9
    cluster.kubectl("delete", "-k", str(BASE), "--wait=true", "--timeout=120s")
    assert {c["metadata"]["name"] for c in cluster.get("crd")["items"]} == crds
    assert cluster.get("gkmcache", "kernels", "-n", "team-a")["spec"]["image"] == USER_OBJECTS[0]["spec"]["image"]
    assert cluster.get("clustercachetrustpolicy", "team-keys")["spec"]["namespaces"] == ["team-a"]
    assert cluster.kubectl("get", "namespace", NS, "--ignore-not-found", "-o", "name") == ""
    assert cluster.kubectl("get", "csidriver", "--ignore-not-found", "-o", "name") == ""
    assert cluster.kubectl("get", "clusterrole", "accelnode-view", "--ignore-not-found", "-o", "name") == ""


# -- moving from GKM -------------------------------------------------------------------------------

# GKM's CSIDriver (../shared/reference/gkm.md: csi-plugin's manifest): inline ephemeral volumes only.
GKM_CSIDRIVER = {"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": "csi.gkm.io"},
                 "spec": {"attachRequired": False, "podInfoOnMount": True, "volumeLifecycleModes": ["Ephemeral"]}}


def test_moving_from_gkm_replaces_its_csidriver_as_documented(cluster):
    """GKM's CSIDriver differs from ours in spec.volumeLifecycleModes, which the API server keeps
    immutable (k/k ValidateCSIDriverUpdate; gke.md section 6): applying our base over it fails
    with "field is immutable" and changes nothing; docs/operations.md's migration (delete the
    object, apply again) installs ours, and the GKM users' caches are untouched."""
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(GKM_CSIDRIVER))  # as GKM's `kubectl apply` made it
    err = cluster.kubectl("apply", "--server-side", "-k", str(BASE), ok=False)
    assert "conflict" in err, err  # the fields are kubectl's of GKM's install
    err = cluster.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(BASE), ok=False)
    assert "field is immutable" in err and "volumeLifecycleModes" in err, err
    assert cluster.get("csidriver", "csi.gkm.io")["spec"]["volumeLifecycleModes"] == ["Ephemeral"]
    # docs/operations.md, "Moving from GKM", step 3
    cluster.kubectl("delete", "csidriver", "csi.gkm.io")
    cluster.kubectl("apply", "--server-side", "-k", str(BASE))
    assert sorted(cluster.get("csidriver", "csi.gkm.io")["spec"]["volumeLifecycleModes"]) == ["Ephemeral", "Persistent"]
    assert cluster.get("gkmcache", "kernels", "-n", "team-a")["spec"]["image"] == USER_OBJECTS[0]["spec"]["image"]
    eventually("a CSI pod per node again", lambda: set(cluster.pods_by_node(CSI)) == set(NODES))
