"""TPU node groups end to end: the reconcilers (as the controller identity, with
daemonsets/rbac-controller-nodegroups.yaml) against the real API server and the GCE emulator
(tests/rigs/gce.py) through the official google-cloud-compute client.

Nodes are registered by the test as kubelet would register them (a Node with the VM's
providerID); tests/bootstrap covers the node side of the join."""

from __future__ import annotations

import base64
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from accelnode.kube.bootstraptoken import METADATA_KEYS
from accelnode.kube.client import Client, Config, KubeError, custom_path, is_not_found
from tests.rigs.gce import Server
from controller.nodegroups import reconciler as nodegroups
from controller.nodegroups.compute import GCE
from controller.runtime.manager import Manager
from tests.crds.test_crds import example

NS_CTRL = "accelnode-system"
MULTI = ("tpu/tpunodegroup-multi-host.yaml", "v6e-multi-host")
SINGLE = ("tpu/tpunodegroup-single-host.yaml", "v7x-single-host")
# The groups here use a GCE project of their own: the reconcilers run in this process act on every
# TPUNodeGroup of the shared control plane, so another test's leftover group (project
# my-tpu-project, as the examples say) may be provisioned beside ours; it never lands here.
PROJECT = f"nodegroups-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def nodegroup_rbac(crds, kubectl):
    out = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-controller.yaml",
                  "-f", "daemonsets/rbac-controller-nodegroups.yaml", "-f", "daemonsets/rbac-controller-jointokens.yaml")
    assert out.returncode == 0, out.stderr


@pytest.fixture
def gce():
    srv = Server().start()
    yield srv
    srv.stop()


class Running:
    """The four reconcilers in this process, as the controller identity."""

    def __init__(self, control_plane, endpoint: str, **settings):
        self.client = Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")), max_connections=16)
        settings = nodegroups.Settings(**{"namespace": NS_CTRL, "poll": 0.2, "drain_timeout": 5.0,
                                          "own_project": PROJECT, **settings})
        self.gce = GCE(endpoint)
        self.manager = Manager(self.client, nodegroups.reconcilers(self.client, settings, self.gce),
                               CollectorRegistry(), workers=2, resync=30)

    def __enter__(self):
        self.manager.start()
        return self

    def __exit__(self, *exc):
        self.manager.stop(10)


@pytest.fixture
def admin(control_plane) -> Client:
    return Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")))


def wait(what: str, fn, timeout: float = 60.0):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def tng_path(ns: str, name: str) -> str:
    return custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", ns, name)


def get(admin: Client, path: str) -> dict | None:
    try:
        return admin.request("GET", path)
    except KubeError as e:
        if is_not_found(e):
            return None
        raise


def cond(obj: dict | None, kind: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def make_group(admin: Client, ns: str, where=MULTI, name: str | None = None) -> dict:
    obj = example(*where)
    obj["metadata"]["namespace"] = ns
    obj["spec"]["project"] = PROJECT
    if name:
        obj["metadata"]["name"] = name
    return admin.request("POST", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", ns), body=obj)


def metadata(inst: dict) -> dict:
    return {i["key"]: i.get("value") for i in inst["metadata"].get("items") or []}


def _register(admin: Client, inst: dict, project: str, zone: str, ready: bool = True) -> dict:
    admin.request("POST", "/api/v1/nodes", body={
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": inst["name"], "labels": {"kubernetes.io/hostname": inst["name"]}},
        "spec": {"providerID": f"gce://{project}/{zone}/{inst['name']}"}})
    node = admin.request("GET", f"/api/v1/nodes/{inst['name']}")
    node["status"] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady",
                                      "message": "kubelet is posting ready status",
                                      "lastHeartbeatTime": "2026-11-24T00:00:00Z",
                                      "lastTransitionTime": "2026-11-24T00:00:00Z"}]}
    return admin.request("PUT", f"/api/v1/nodes/{inst['name']}/status", body=node)


def group_secrets(admin: Client, ns: str) -> list[dict]:
    """The join-token Secrets of the node groups in ``ns`` (other tests' groups share kube-system)."""
    out = admin.request("GET", "/api/v1/namespaces/kube-system/secrets",
                        query={"fieldSelector": "type=bootstrap.kubernetes.io/token"})
    return [s for s in out["items"]
            if (s["metadata"].get("annotations") or {}).get("accelnode.io/join-group", "").startswith(f"{ns}/")]


def test_group_lifecycle_join_label_and_teardown(control_plane, nodegroup_rbac, gce, admin, kube_namespace):
    ns = kube_namespace
    project, zone = PROJECT, "us-east5-b"
    with Running(control_plane, gce.endpoint) as ctl:
        g = make_group(admin, ns)
        # GCE: policy, template, BULK MIG with 2 VMs, the join metadata on each RUNNING VM
        insts = wait("two VMs with join metadata", lambda: [
            i for i in gce.compute.instances(project) if i["status"] == "RUNNING" and "kubeadm-join-token" in metadata(i)
        ] if len([i for i in gce.compute.instances(project) if "kubeadm-join-token" in metadata(i)]) == 2 else None)
        policy = gce.compute.resources[f"projects/{project}/regions/us-east5/resourcePolicies/"
                                       f"{next(p for p in gce.compute.resources if p.startswith(f'projects/{project}/') and '/resourcePolicies/' in p).rsplit('/', 1)[1]}"]
        assert policy["workloadPolicy"] == {"type": "HIGH_THROUGHPUT", "acceleratorTopology": "4x4"}
        mig = next(r for p, r in gce.compute.resources.items() if p.startswith(f"projects/{project}/") and "/instanceGroupManagers/" in p)
        assert mig["targetSize"] == 2 and mig["targetSizePolicy"] == {"mode": "BULK"}
        assert mig["resourcePolicies"]["workloadPolicy"] == policy["selfLink"]
        assert mig["instanceLifecyclePolicy"] == {"defaultActionOnFailure": "DO_NOTHING"}
        tmpl = next(r for p, r in gce.compute.resources.items() if p.startswith(f"projects/{project}/") and "/instanceTemplates/" in p)
        assert tmpl["properties"]["machineType"] == "ct6e-standard-8t"
        assert tmpl["properties"]["scheduling"]["provisioningModel"] == "SPOT"
        (secret,) = group_secrets(admin, ns)
        tid = base64.b64decode(secret["data"]["token-id"]).decode()
        for i in insts:
            md = metadata(i)
            assert md["kubeadm-join-token"].startswith(tid + ".")
            assert md["kubeadm-control-plane-ip"] == "10.128.0.2"
            assert md["kubeadm-ca-hash"].startswith("sha256:")
            assert "cloud.google.com/gke-tpu-accelerator=tpu-v6e-slice" in md["kube-labels"]
        # children with owner references, per-child conditions
        g = admin.request("GET", tng_path(ns, "v6e-multi-host"))
        for plural in ("workloadpolicies", "instancetemplates", "managedinstancegroups"):
            (child,) = admin.request("GET", custom_path("tpu.google.com", "v1alpha1", plural, ns))["items"]
            (ref,) = child["metadata"]["ownerReferences"]
            assert ref["uid"] == g["metadata"]["uid"] and ref["controller"] and ref["blockOwnerDeletion"]
            assert cond(child, "Ready")["status"] == "True"
        for kind in ("WorkloadPolicyReady", "InstanceTemplateReady", "ManagedInstanceGroupReady"):
            assert cond(g, kind)["status"] == "True", g["status"]
        assert cond(g, "Ready")["reason"] == "AwaitingNodeJoin"

        # the VMs join (as kubelet registers): labels, taint, token gone from metadata and Secret
        for i in insts:
            _register(admin, i, project, zone, ready=True)
        g = wait("group Ready", lambda: (lambda o: o if cond(o, "Ready").get("status") == "True" else None)(
            admin.request("GET", tng_path(ns, "v6e-multi-host"))))
        assert cond(g, "Ready")["reason"] == "Ready"
        assert g["status"]["nodeSummary"] == {"ready": 2, "reconciling": 0, "failed": 0}
        for i in insts:
            node = admin.request("GET", f"/api/v1/nodes/{i['name']}")
            labels = node["metadata"]["labels"]
            assert labels["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
            assert labels["cloud.google.com/gke-accelerator-count"] == "8"
            assert labels["cloud.google.com/gke-tpu-topology"] == "4x4"
            assert labels["cloud.google.com/tpu-node-group"] == f"{ns}-v6e-multi-host"
            assert {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"} in node["spec"]["taints"]
        wait("join metadata withdrawn", lambda: all(
            not set(METADATA_KEYS) & set(metadata(i)) for i in gce.compute.instances(project)))
        wait("token Secret revoked", lambda: group_secrets(admin, ns) == [])
        ds = wait("device plugin DaemonSet", lambda: get(
            admin, f"/apis/apps/v1/namespaces/{NS_CTRL}/daemonsets/accelnode-tpu-device-plugin"))
        assert ds["spec"]["template"]["spec"]["containers"][0]["command"] == ["accelnode", "device-plugin"]

        # steady state: no write to GCE nor to the API server
        time.sleep(1.0)
        writes = gce.compute.stats["writes"]
        rv = admin.request("GET", tng_path(ns, "v6e-multi-host"))["metadata"]["resourceVersion"]
        for c in ctl.manager.controllers:  # every key looked at again
            for obj in c.reflectors[c.reconciler.watches[0].path].snapshot():
                c.enqueue(f"{obj['metadata'].get('namespace')}/{obj['metadata']['name']}")
        time.sleep(2.0)
        assert gce.compute.stats["writes"] == writes
        assert admin.request("GET", tng_path(ns, "v6e-multi-host"))["metadata"]["resourceVersion"] == rv

        # teardown: cordon, children in reverse order, nodes, DaemonSet, then the group
        admin.request("DELETE", tng_path(ns, "v6e-multi-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v6e-multi-host")) is None, timeout=90)
        assert not [p for p in gce.compute.resources if p.startswith(f"projects/{project}/")]
        for i in insts:
            assert get(admin, f"/api/v1/nodes/{i['name']}") is None
        assert get(admin, f"/apis/apps/v1/namespaces/{NS_CTRL}/daemonsets/accelnode-tpu-device-plugin") is None


def test_drain_respects_pod_disruption_budgets_with_a_bounded_wait(control_plane, nodegroup_rbac, gce, admin,
                                                                    kube_namespace):
    ns = kube_namespace
    project, zone = PROJECT, "us-central1-c"
    with Running(control_plane, gce.endpoint):
        make_group(admin, ns, SINGLE)
        (inst,) = wait("the VM offered a join", lambda: [
            i for i in gce.compute.instances(project) if "kubeadm-join-token" in metadata(i)] or None)
        _register(admin, inst, project, zone)
        wait("group Ready", lambda: cond(get(admin, tng_path(ns, "v7x-single-host")), "Ready").get("status") == "True")
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker", "namespace": ns,
                                                               "labels": {"app": "w"}},
               "spec": {"nodeName": inst["name"], "containers": [{"name": "c", "image": "busybox"}],
                        "tolerations": [{"key": "google.com/tpu", "operator": "Exists"}]}}
        pod = admin.request("POST", f"/api/v1/namespaces/{ns}/pods", body=pod)
        pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}  # as kubelet reports
        admin.request("PUT", f"/api/v1/namespaces/{ns}/pods/worker/status", body=pod)  # (a Pending pod ignores PDBs)
        admin.request("POST", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", body={
            "metadata": {"name": "w"}, "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "w"}}}})
        admin.request("DELETE", tng_path(ns, "v7x-single-host"))
        node = wait("cordoned", lambda: (lambda n: n if n and n["spec"].get("unschedulable") else None)(
            get(admin, f"/api/v1/nodes/{inst['name']}")))
        assert node["spec"]["unschedulable"] is True
        g = wait("draining", lambda: (lambda o: o if cond(o, "Ready").get("reason") == "DrainingNodes" else None)(
            get(admin, tng_path(ns, "v7x-single-host"))))
        assert f"{ns}/worker" in cond(g, "Ready")["message"]
        assert gce.compute.instances(project)  # the VM stays while the budget refuses
        # the budget keeps refusing: after the drain timeout the group goes anyway
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=90)
        assert not gce.compute.instances(project)


FAULTS = [
    ({"bulk_unplaceable": True}, "InstancesCreationFailed", "ZONE_RESOURCE_POOL_EXHAUSTED"),
    ({"quota_exceeded": True}, "InstancesCreationFailed", "QUOTA_EXCEEDED"),
]


@pytest.mark.parametrize("faults, reason, text", FAULTS, ids=["bulk-unplaceable", "quota"])
def test_instance_creation_faults_are_reported_and_recover(control_plane, nodegroup_rbac, gce, admin, kube_namespace,
                                                           faults, reason, text):
    ns = kube_namespace
    gce.compute.set_faults(**faults)
    with Running(control_plane, gce.endpoint):
        make_group(admin, ns)
        g = wait(reason, lambda: (lambda o: o if cond(o, "Ready").get("reason") == reason else None)(
            get(admin, tng_path(ns, "v6e-multi-host"))))
        assert text in cond(g, "Ready")["message"]
        assert gce.compute.instances(PROJECT) == []  # all or nothing: no VM at all
        gce.compute.set_faults(bulk_unplaceable=False, quota_exceeded=False)
        gce.compute.retry_creation()
        wait("VMs offered a join", lambda: len([i for i in gce.compute.instances(PROJECT)
                                               if "kubeadm-join-token" in metadata(i)]) == 2)
        admin.request("DELETE", tng_path(ns, "v6e-multi-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v6e-multi-host")) is None, timeout=90)


def test_terminal_and_transient_gce_errors(control_plane, nodegroup_rbac, gce, admin, kube_namespace):
    ns = kube_namespace
    # a 403 on the template insert is terminal: the message lands in the condition, no retry
    gce.compute.set_faults(errors=[{"method": "POST", "path": f"/{PROJECT}/global/instanceTemplates$", "code": 403,
                                    "reason": "forbidden", "message": "Required 'compute.instanceTemplates.create' "
                                                                      f"permission for 'projects/{PROJECT}'"}],
                           unavailable=3, op_delay_s=0.5)  # and 503s first, retried with backoff
    with Running(control_plane, gce.endpoint):
        make_group(admin, ns, SINGLE)
        g = wait("RequestRejected", lambda: (lambda o: o if cond(o, "InstanceTemplateReady").get("reason") ==
                                             "RequestRejected" else None)(get(admin, tng_path(ns, "v7x-single-host"))))
        assert "compute.instanceTemplates.create" in cond(g, "InstanceTemplateReady")["message"]
        writes = gce.compute.stats["writes"]
        time.sleep(1.5)
        assert gce.compute.stats["writes"] == writes  # terminal: not retried
        admin.request("DELETE", tng_path(ns, "v7x-single-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=60)


def test_restart_and_deletion_mid_provisioning(control_plane, nodegroup_rbac, gce, admin, kube_namespace):
    ns = kube_namespace
    project = PROJECT
    gce.compute.set_faults(op_delay_s=1.0, stuck_provisioning=True)
    with Running(control_plane, gce.endpoint):
        make_group(admin, ns)
        wait("policy operation running", lambda: any(
            (c.get("status") or {}).get("operationName") for c in admin.request(
                "GET", custom_path("tpu.google.com", "v1alpha1", "workloadpolicies", ns))["items"]))
    # the controller restarts while an operation runs: the new one polls it, never inserts twice
    with Running(control_plane, gce.endpoint):
        insts = wait("VMs stuck PROVISIONING", lambda: gce.compute.instances(project) if len(
            gce.compute.instances(project)) == 2 else None)
        assert all(i["status"] == "PROVISIONING" for i in insts)
        g = wait("reported", lambda: (lambda o: o if "PROVISIONING" in cond(o, "Ready").get("message", "") else None)(
            get(admin, tng_path(ns, "v6e-multi-host"))))
        assert cond(g, "Ready")["reason"] == "AwaitingNodeJoin"
        assert not any("kubeadm-join-token" in metadata(i) for i in insts)  # not RUNNING: no token
        assert len([p for p in gce.compute.resources if p.startswith(f"projects/{project}/") and "/resourcePolicies/" in p]) == 1
        # deleted mid-provisioning: everything goes
        admin.request("DELETE", tng_path(ns, "v6e-multi-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v6e-multi-host")) is None, timeout=90)
        assert not [p for p in gce.compute.resources if p.startswith(f"projects/{project}/")]
        assert group_secrets(admin, ns) == []


def test_user_editing_an_immutable_field_is_refused(control_plane, nodegroup_rbac, admin, kube_namespace):
    make_group(admin, kube_namespace, SINGLE, name="immutable")
    g = admin.request("GET", tng_path(kube_namespace, "immutable"))
    g["spec"]["nodeCount"] = 3
    with pytest.raises(KubeError) as err:
        admin.request("PUT", tng_path(kube_namespace, "immutable"), body=g)
    assert err.value.code == 422 and "nodeCount is immutable" in str(err.value)
    admin.request("DELETE", tng_path(kube_namespace, "immutable"))


def test_rbac_is_enough_and_no_more(nodegroup_rbac, kubectl):
    sa = "system:serviceaccount:accelnode-system:accelnode-controller"
    allowed = [("update", "nodes"), ("create", "pods", "--subresource=eviction"),
               ("update", "tpunodegroups.tpu.google.com", "--subresource=finalizers"),
               ("create", "secrets", "-n", "kube-system"), ("create", "daemonsets.apps", "-n", NS_CTRL)]
    denied = [("create", "secrets", "-n", "default"), ("create", "daemonsets.apps", "-n", "default"),
              ("delete", "pods"), ("patch", "nodes"), ("get", "secrets", "-n", "kube-system")]
    for args in allowed + denied:
        out = kubectl("admin", "auth", "can-i", *args, f"--as={sa}")
        assert (out.stdout.strip() == "yes") == (args in allowed), (args, out.stdout, out.stderr)
