"""End to end: the GemmaOnTPUServer ResourceGraphDefinition (examples/kro/) accepted and expanded
by kro itself, with our controller acting on what kro makes.

All real peers on 127.0.0.1: the session's kube-apiserver + etcd + kube-controller-manager; the
kro controller v0.9.4 built from its Go module (tools/mk/kro.mk) as a subprocess, as a
ServiceAccount with only the RBAC its Helm chart's aggregation mode gives it plus
examples/kro/rbac-kro.yaml (docs/kro.md); the real
``accelnode controller`` as a subprocess with the controller identity and all its RBAC, node
groups on (against the GCE emulator, tests/rigs/gce.py), serving
daemonsets/webhooks-gkm.yaml and daemonsets/webhooks-tpu-env.yaml as shipped (pointed at its
loopback address with a test CA); the local registry standing in for registry.example.com:5000
(``--registry-mirror``), holding a small stand-in JAX cache under the name the instance uses.

The files are the repository's, unchanged: rgd.yaml, platform.yaml (the platform team's
per-namespace ConfigMap) and instance.yaml, applied into a fresh namespace; a second instance
from the same file with two hosts shows every user field wired through. No kubelet runs: the test
registers the VMs' Nodes, binds the StatefulSet's pods and reports them Ready, as kube-scheduler
and kubelet would, to see the instance's status follow.
"""

from __future__ import annotations

import copy
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from accelnode.kube.client import Client, Config, KubeError, custom_path, is_conflict, is_not_found
from tests.rigs.gce import Server
from tests.agent.conftest import make_cache
from tests.conftest import ROOT, TOOLS_BIN, eventually, http_get, require, tool
from tests.controller.conftest import ControllerProc, lease_spec, remove_webhooks, serve_webhooks
from tests.controller.test_webhook_server import CA
from tests.controller.test_nodegroups import _register, cond, get
from tests.csi.conftest import free_ports
from tests.fixtures.cluster import wait_established

EXAMPLES = ROOT / "examples" / "kro"
KRO_CRDS = TOOLS_BIN.parent / "kro" / "crds"  # copied from kro's Go module by tools/mk/kro.mk
WEBHOOKS = [ROOT / "daemonsets" / "webhooks-gkm.yaml", ROOT / "daemonsets" / "webhooks-tpu-env.yaml"]
KRO_GROUP, KRO_VERSION, PLURAL = "kro.run", "v1alpha1", "gemmaontpuservers"
INJECT = "gke-tpu-env-injector.aaronbatilo.dev/inject"
WAIT = 90  # seconds: a bound on provisioning, expansion and teardown, never a measurement

RGD = yaml.safe_load((EXAMPLES / "rgd.yaml").read_text())
PLATFORM = yaml.safe_load((EXAMPLES / "platform.yaml").read_text())
INSTANCE = yaml.safe_load((EXAMPLES / "instance.yaml").read_text())
PROJECT, ZONE = PLATFORM["data"]["project"], PLATFORM["data"]["zone"]


class Kro:
    """The kro controller as a process; its log is kept for failure messages."""

    def __init__(self, kubeconfig: Path, workdir: Path):
        self.metrics_port, self.health_port = free_ports(2)
        self.log_path = workdir / "kro.log"
        self.argv = [tool("kro-controller"), "--kubeconfig", str(kubeconfig),
                     f"--metrics-bind-address=127.0.0.1:{self.metrics_port}",
                     f"--health-probe-bind-address=127.0.0.1:{self.health_port}",
                     "--zap-devel=false", "--instance-requeue-interval=1s", "--rgd-progress-requeue-delay=1s"]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Kro":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=log)
        eventually(lambda: self.proc.poll() is not None or http_get(self.health_port, "/readyz")[0] == 200,
                   "kro's /readyz", timeout=WAIT)
        assert self.proc.poll() is None, self.log()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self, tail: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:] if self.log_path.exists() else ""


LOGS: dict[str, object] = {}  # name -> callable giving a log tail, shown when a wait fails


def until(predicate, what: str, timeout: float = 20.0):
    """tests.conftest.eventually, with the logs of kro and our controller in the failure."""
    try:
        return eventually(predicate, what, timeout)
    except AssertionError as e:
        raise AssertionError("\n".join([str(e), *(f"--- {n} log:\n{log()}" for n, log in LOGS.items())])) from None


def instance_path(ns: str, name: str | None = None) -> str:
    return custom_path(KRO_GROUP, KRO_VERSION, PLURAL, ns, name)


def instance(name: str | None = None, **spec) -> dict:
    """instance.yaml as users have it; a second instance gets another name and spec fields."""
    obj = copy.deepcopy(INSTANCE)
    if name:
        obj["metadata"]["name"] = name
    obj["spec"].update(spec)
    return obj


# kro's own permissions as its Helm chart grants them with rbac.mode=aggregation (the ClusterRole
# kro:controller:static of helm/templates/cluster-role.yaml, v0.9.4); what our graph needs on top
# comes from examples/kro/rbac-kro.yaml through the aggregation label.
KRO_STATIC_RULES = [
    {"apiGroups": ["kro.run"], "resources": ["resourcegraphdefinitions"],
     "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]},
    {"apiGroups": ["kro.run"], "resources": ["resourcegraphdefinitions/finalizers"], "verbs": ["update"]},
    {"apiGroups": ["kro.run"], "resources": ["resourcegraphdefinitions/status"], "verbs": ["get", "patch", "update"]},
    {"apiGroups": ["internal.kro.run"], "resources": ["graphrevisions"],
     "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]},
    {"apiGroups": ["internal.kro.run"], "resources": ["graphrevisions/finalizers"], "verbs": ["update"]},
    {"apiGroups": ["internal.kro.run"], "resources": ["graphrevisions/status"], "verbs": ["get", "patch", "update"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
     "verbs": ["create", "get", "list", "watch", "patch", "update", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
     "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
]
KRO_NS, KRO_SA = "kro-system", "kro"


def kro_kubeconfig(control_plane, admin: Client, kubectl, workdir: Path) -> Path:
    """A kubeconfig for ServiceAccount kro-system/kro holding only the chart's aggregated role:
    its static rules and examples/kro/rbac-kro.yaml."""
    label = {"rbac.kro.run/aggregate-to-controller": "true"}
    objs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KRO_NS}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": KRO_SA, "namespace": KRO_NS}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "kro:controller"}, "aggregationRule": {"clusterRoleSelectors": [{"matchLabels": label}]}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "kro:controller:static", "labels": label}, "rules": KRO_STATIC_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "kro:controller"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kro:controller"},
         "subjects": [{"kind": "ServiceAccount", "name": KRO_SA, "namespace": KRO_NS}]},
    ]
    out = kubectl("admin", "apply", "-f", "-", "-f", str(EXAMPLES / "rbac-kro.yaml"),
                  stdin=yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objs}))
    assert out.returncode == 0, out.stderr
    token = admin.request("POST", f"/api/v1/namespaces/{KRO_NS}/serviceaccounts/{KRO_SA}/token", body={
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}})
    cfg = yaml.safe_load(control_plane.kubeconfig("admin").read_text())
    cfg["users"] = [{"name": "kro", "user": {"token": token["status"]["token"]}}]
    cfg["contexts"] = [{"name": "kro", "context": {"cluster": cfg["clusters"][0]["name"], "user": "kro"}}]
    cfg["current-context"] = "kro"
    path = workdir / "kubeconfig-kro"
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def kro(control_plane, crds, kubectl, kube_api, tmp_path_factory):
    """kro's CRDs installed, kro running as its own ServiceAccount with the chart's aggregated
    RBAC (examples/kro/rbac-kro.yaml for our kinds), the RGD from the repository Active."""
    require(KRO_CRDS.is_dir(), f"kro's CRDs in {KRO_CRDS} (tools/mk/kro.mk)")
    out = kubectl("admin", "apply", "--server-side", "-f", str(KRO_CRDS))
    assert out.returncode == 0, out.stderr
    wait_established(kube_api, ["resourcegraphdefinitions.kro.run", "graphrevisions.internal.kro.run"])
    workdir = tmp_path_factory.mktemp("kro")
    admin = Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")))
    k = Kro(kro_kubeconfig(control_plane, admin, kubectl, workdir), workdir).start()
    LOGS["kro"] = k.log
    rgd_path = custom_path("kro.run", "v1alpha1", "resourcegraphdefinitions", None, RGD["metadata"]["name"])
    try:
        # the manifest as the platform team has it: the repository's file, applied as is
        out = kubectl("admin", "apply", "-f", str(EXAMPLES / "rgd.yaml"))
        assert out.returncode == 0, out.stderr
        rgd = until(lambda: (o := get(admin, rgd_path)) and (o.get("status") or {}).get("state") == "Active" and o,
                    "the RGD Active", timeout=WAIT)
        for kind in ("GraphAccepted", "KindReady", "ControllerReady", "Ready"):
            assert cond(rgd, kind).get("status") == "True", (kind, rgd["status"], k.log())
        # kro read our CRDs' schemas to type-check the graph, and ordered it by its references
        assert rgd["status"]["topologicalOrder"] == ["platform", "nodeGroup", "jaxCache", "service", "server"]
        wait_established(kube_api, [f"{PLURAL}.{KRO_GROUP}"])  # the CRD kro generated from the schema
        yield k
    finally:
        try:  # kro keeps an RGD while instances of its kind are left: those go first, with kro running
            kubectl("admin", "delete", PLURAL, "--all", "--all-namespaces", "--ignore-not-found", "--timeout=45s")
            kubectl("admin", "delete", "--ignore-not-found", "--timeout=45s", "-f", str(EXAMPLES / "rgd.yaml"))
        finally:
            LOGS.pop("kro", None)
            k.stop()
            # kro leaves the CRD it generated (no --allow-crd-deletion): the test removes it
            kubectl("admin", "delete", "--ignore-not-found", f"crd/{PLURAL}.{KRO_GROUP}",
                    "clusterrolebinding/kro:controller", "clusterrole/kro:controller", "clusterrole/kro:controller:static")
            kubectl("admin", "delete", "--ignore-not-found", "-f", str(EXAMPLES / "rbac-kro.yaml"))


# -- bad input ------------------------------------------------------------------------------------


def put_spec(admin: Client, path: str, **spec) -> KubeError:
    """PUT a spec change of the live object; the API server's refusal. kro writes the instance's
    status meanwhile, so a 409 (the object moved) means: read it again and retry."""
    for _ in range(50):
        obj = admin.request("GET", path)
        obj["spec"].update(spec)
        try:
            admin.request("PUT", path, body=obj)
        except KubeError as e:
            if not is_conflict(e):
                return e
            continue
        raise AssertionError(f"{path}: {spec} was accepted")
    raise AssertionError(f"{path}: still conflicting after 50 tries")


def test_the_generated_api_refuses_bad_instances(kro, control_plane, kube_namespace):
    """The CRD kro generated from the schema does the refusing, before anything is made."""
    admin = Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")))
    ns = kube_namespace
    no_cache = instance()
    del no_cache["spec"]["cacheImage"]
    for bad, says in ((no_cache, "spec.cacheImage: Required value"),
                      (instance(hosts=0), "spec.hosts: Invalid value: 0: spec.hosts in body should be greater than "
                                          "or equal to 1")):
        with pytest.raises(KubeError) as e:
            admin.request("POST", instance_path(ns), body=bad)
        assert e.value.code == 422 and says in str(e.value), e.value
    # accepted, then the slice shape cannot change (the node group's spec is immutable too);
    # no platform ConfigMap in this namespace: kro waits for it before the node group
    name = INSTANCE["metadata"]["name"]
    admin.request("POST", instance_path(ns), body=instance())
    try:
        got = until(lambda: (o := get(admin, instance_path(ns, name))) and cond(o, "ResourcesReady") and o,
                    "kro's status on the instance", timeout=WAIT)
        # waiting on the platform ConfigMap, and saying so
        assert got["status"]["state"] != "ACTIVE" and "platform" in cond(got, "ResourcesReady")["message"], got
        refused = put_spec(admin, instance_path(ns, name), topology="4x4")
        assert refused.code == 422 and "spec.topology: Invalid value" in str(refused) \
            and "field is immutable" in str(refused), refused
        # no TPU VMs for a namespace the platform team has not prepared
        assert admin.request("GET", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", ns))["items"] == []
        # a slice shape GCE does not offer for that machine: the node group's CRD refuses it and
        # kro says so on the instance
        admin.request("POST", f"/api/v1/namespaces/{ns}/configmaps", body=PLATFORM)
        admin.request("POST", instance_path(ns), body=instance("misfit", topology="4x4"))
        got = until(lambda: (o := get(admin, instance_path(ns, "misfit"))) and
                    "spec.nodeCount" in cond(o, "ResourcesReady").get("message", "") and o,
                    f"the node group's refusal on the instance", timeout=WAIT)
        assert cond(got, "Ready")["status"] == "False", got["status"]
        assert get(admin, custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", ns, "misfit-tpus")) is None
    finally:
        for n in (name, "misfit"):
            try:
                admin.request("DELETE", instance_path(ns, n))
            except KubeError as e:
                if not is_not_found(e):
                    raise
        until(lambda: admin.request("GET", instance_path(ns))["items"] == [], "the instances gone",
              timeout=WAIT)


# -- the journey ----------------------------------------------------------------------------------


def test_an_instance_expands_into_our_kinds_and_our_controller_acts_on_them(
        kro, control_plane, kube_api, kubectl, registry, kube_namespace, tmp_path):
    ns = kube_namespace
    admin = Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")))
    admission = client.AdmissionregistrationV1Api(kube_api("admin"))
    rbac = [a for f in sorted((ROOT / "daemonsets").glob("rbac-controller*.yaml")) for a in ("-f", str(f))]
    out = kubectl("admin", "apply", "-f", str(ROOT / "daemonsets/namespace.yaml"), *rbac)
    assert out.returncode == 0, out.stderr

    # the stand-in cache images, under the names the instances use (registry.example.com:5000)
    one = INSTANCE["spec"]["cacheImage"]
    two = one.rsplit(":", 1)[0] + ":v5e-2x4-2hosts-maxengine-v0.2.2"
    mirrored, _, _ = one.partition("/")
    digests = {}
    for ref, seed in ((one, b"\x01"), (two, b"\x02")):
        repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
        files = {f"jit_gemma-7b-{seed.hex()}": seed * 4096}
        pushed = registry.push(make_cache(tmp_path / "src" / tag, files), repo, tag=tag, kind="jax",
                               targets=[{"backend": "tpu", "arch": "v5e"}])
        digests[ref] = pushed.rsplit("@", 1)[1]

    gce = Server().start()
    ca = CA()
    (tmp_path / "tls").mkdir()
    cert, key, _ = ca.serving(tmp_path / "tls", "accelnode-controller")
    port = free_ports(1)[0]
    ctl = ControllerProc(control_plane, tmp_path, "e2e-kro", "--lease-duration", "4", "--renew-deadline", "3",
                         "--retry-period", "1", "--webhook-address", f"127.0.0.1:{port}", "--tls-cert-file", cert,
                         "--tls-key-file", key, "--plain-http", "--registry-mirror", f"{mirrored}={registry.host}",
                         "--tpu-node-groups", "--gce-endpoint", gce.endpoint, "--gce-project", "my-tpu-project",
                         "--node-group-poll", "0.2",
                         "--drain-timeout", "5")
    names = [INSTANCE["metadata"]["name"], "gemma-7b-it-two-hosts"]
    started = False
    try:
        ctl.start()
        LOGS["controller"] = lambda: ctl.log()[-4000:]
        until(lambda: ctl.proc.poll() is not None or lease_spec(admin).get("holderIdentity") == "e2e-kro",
              "our controller leading", timeout=WAIT)
        assert ctl.proc.poll() is None, ctl.log()
        serve_webhooks(admission, WEBHOOKS, port, ca.pem)
        until(lambda: webhooks_called(admin, ns), "the API server calling our webhooks", timeout=WAIT)

        out = kubectl("admin", "apply", "-n", ns, "-f", str(EXAMPLES / "platform.yaml"),
                      "-f", str(EXAMPLES / "instance.yaml"))
        assert out.returncode == 0, out.stderr
        started = True
        admin.request("POST", instance_path(ns), body=instance(
            names[1], hosts=2, machineType="ct5lp-hightpu-4t", cacheImage=two))
        journey(admin, kubectl, ns, names, gce, {names[0]: (1, 8, digests[one]), names[1]: (2, 4, digests[two])})
    finally:
        try:
            if started:
                for name in names:
                    try:
                        admin.request("DELETE", instance_path(ns, name))
                    except KubeError as e:
                        if not is_not_found(e):
                            raise
                until(lambda: kubelet_confirms_deletions(admin, ns) or all(
                    get(admin, instance_path(ns, n)) is None for n in names), "the instances gone", timeout=WAIT)
        finally:
            LOGS.pop("controller", None)
            remove_webhooks(admission, WEBHOOKS)
            ctl.terminate()  # releases the Lease for the next test
            gce.stop()


def webhooks_called(admin: Client, ns: str) -> bool:
    """A dry-run create of an opted-in StatefulSet comes back with the worker variables (the API
    server picks webhook configurations up asynchronously)."""
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet",
           "metadata": {"name": "probe", "labels": {INJECT: "enabled"}},
           "spec": {"serviceName": "probe", "replicas": 1, "selector": {"matchLabels": {"app": "probe"}},
                    "template": {"metadata": {"labels": {"app": "probe", INJECT: "enabled"}},
                                 "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}}
    try:
        got = admin.request("POST", f"/apis/apps/v1/namespaces/{ns}/statefulsets", body=sts, query={"dryRun": "All"})
    except KubeError:
        return False
    return any(e["name"] == "TPU_WORKER_HOSTNAMES" for e in got["spec"]["template"]["spec"]["containers"][0].get("env") or [])


def kubelet_confirms_deletions(admin: Client, ns: str) -> bool:
    """What a kubelet does for a terminating pod on its node, its containers stopped: the final
    delete (grace period 0). Always False, so it can run inside a wait."""
    for pod in admin.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]:
        if pod["metadata"].get("deletionTimestamp") and pod["spec"].get("nodeName"):
            try:
                admin.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}",
                              body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                                    "preconditions": {"uid": pod["metadata"]["uid"]}})
            except KubeError as e:
                if not (is_not_found(e) or is_conflict(e)):
                    raise
    return False


def journey(admin: Client, kubectl, ns: str, names: list[str], gce: Server, want: dict) -> None:
    tng = lambda name: custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", ns, f"{name}-tpus")  # noqa: E731
    cache = lambda name: custom_path("gkm.io", "v1alpha1", "gkmcaches", ns, f"{name}-jax-cache")  # noqa: E731
    sts = lambda name: f"/apis/apps/v1/namespaces/{ns}/statefulsets/{name}"  # noqa: E731

    # 1. kro expands each instance into our objects, labelled as its own
    for name in names:
        inst = until(lambda: get(admin, instance_path(ns, name)), f"instance {name}")
        for path in (tng(name), cache(name), f"/api/v1/namespaces/{ns}/services/{name}"):
            obj = until(lambda: get(admin, path), f"{path} made by kro", timeout=WAIT)
            labels = obj["metadata"]["labels"]
            assert labels["kro.run/owned"] == "true" and labels["kro.run/instance-name"] == name, labels
            assert labels["kro.run/instance-id"] == inst["metadata"]["uid"], labels
        hosts, chips, _ = want[name]
        group = get(admin, tng(name))
        assert group["spec"]["project"] == PROJECT and group["spec"]["nodeLocation"] == ZONE  # from the platform
        assert group["spec"]["nodeCount"] == hosts and group["spec"]["topology"] == "2x4"
        assert group["spec"]["targetSizePolicyMode"] == ("BULK" if hosts > 1 else "INDIVIDUAL")
        assert group["spec"]["instanceConfig"]["machineType"] == f"ct5lp-hightpu-{chips}t"
        svc = get(admin, f"/api/v1/namespaces/{ns}/services/{name}")
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert [p["port"] for p in svc["spec"]["ports"]] == [8000, 9000]

    # 2. our controller resolves each cache (digest pinned) and makes its claim
    for name in names:
        digest = want[name][2]
        c = until(lambda: (o := get(admin, cache(name))) and cond(o, "Resolved").get("status") == "True" and o,
                  f"cache of {name} Resolved", timeout=WAIT)
        assert c["status"]["resolvedDigest"] == digest
        assert c["metadata"]["annotations"]["gkm.io/resolvedDigest"] == digest  # the admission pin survives kro's applies
        pvc = until(lambda: (o := get(admin, f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}-jax-cache"))
                    and o["status"].get("phase") == "Bound" and o, f"claim of {name} Bound", timeout=WAIT)
        assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]

    # 3. the node groups provision against the GCE emulator: children, then VMs
    vms: dict[str, list[dict]] = {}
    for name in names:
        hosts = want[name][0]
        kinds = ["managedinstancegroups", "instancetemplates"] + (["workloadpolicies"] if hosts > 1 else [])
        for plural in kinds:
            children = custom_path("tpu.google.com", "v1alpha1", plural, ns)
            until(lambda: [c for c in admin.request("GET", children)["items"] if c["metadata"]["name"].startswith(
                f"{name}-tpus-") and cond(c, "Ready").get("status") == "True"], f"{plural} of {name} Ready", timeout=WAIT)
        vms[name] = until(lambda: (v := [i for i in gce.compute.instances(PROJECT) if i["status"] == "RUNNING"
                                         and i["name"].startswith(f"{name}-tpus-mig-")]) and len(v) == hosts and v,
                          f"{hosts} VMs of {name} RUNNING", timeout=WAIT)
        # capacity not joined yet: kro holds the server back (readyWhen of the node group)
        assert cond(get(admin, tng(name)), "Ready").get("status") != "True"
        assert get(admin, sts(name)) is None
        got = get(admin, instance_path(ns, name))
        assert got["status"].get("capacity", {}).get("ready") is not True, got["status"]

    # 4. the VMs join (as their kubelets would register); the group is Ready; kro makes the server
    for name in names:
        for inst in vms[name]:
            _register(admin, inst, PROJECT, ZONE)
    for name in names:
        hosts, chips, digest = want[name]
        until(lambda: cond(get(admin, tng(name)), "Ready").get("status") == "True", f"group of {name} Ready",
              timeout=WAIT)
        s = until(lambda: get(admin, sts(name)), f"StatefulSet {name} made by kro", timeout=WAIT)
        assert s["metadata"]["labels"]["kro.run/instance-name"] == name and s["metadata"]["labels"][INJECT] == "enabled"
        assert s["spec"]["replicas"] == hosts and s["spec"]["serviceName"] == name
        pod_spec = s["spec"]["template"]["spec"]
        (volume,) = pod_spec["volumes"]
        assert volume["persistentVolumeClaim"] == {"claimName": f"{name}-jax-cache", "readOnly": True}
        server = pod_spec["containers"][0]
        assert server["resources"]["limits"]["google.com/tpu"] == str(chips)
        assert "load_parameters_path=" + INSTANCE["spec"]["checkpoint"] in server["args"]
        # the pods land on the group's nodes: its labels (written by our controller) match the
        # selector kro wrote, and they tolerate the group's taint
        for inst in vms[name]:
            node = admin.request("GET", f"/api/v1/nodes/{inst['name']}")
            assert pod_spec["nodeSelector"].items() <= node["metadata"]["labels"].items(), (pod_spec, node["metadata"])
            tpu = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}
            assert tpu in node["spec"]["taints"], node["spec"]
            assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec["tolerations"]

    # 5. kube-controller-manager makes the pods; our webhooks gave each its worker identity
    for name in names:
        hosts = want[name][0]
        workers = ",".join(f"{name}-{i}.{name}" for i in range(hosts))
        for i in range(hosts):
            pod = until(lambda: get(admin, f"/api/v1/namespaces/{ns}/pods/{name}-{i}"), f"pod {name}-{i}",
                        timeout=WAIT)
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
            assert env["TPU_WORKER_ID"] == str(i) and env["TPU_WORKER_HOSTNAMES"] == workers, env
            assert env["JAX_COMPILATION_CACHE_DIR"] == "/jax-cache/io.jax.cache"
            assert "TPU_WORKER_ID" not in {e["name"] for e in pod["spec"]["containers"][1].get("env") or []}
        # the instance's status surfaces our objects: capacity, cache, workers
        got = until(lambda: (o := get(admin, instance_path(ns, name))) and
                    o["status"].get("server", {}).get("workerHostnames") == workers and o,
                    f"status of {name} naming its workers", timeout=WAIT)["status"]
        assert got["capacity"] == {"ready": True, "reason": "Ready", "readyNodes": hosts}, got
        assert got["cache"] == {"resolved": True, "digest": want[name][2], "claim": f"{name}-jax-cache"}, got
        assert got["endpoint"] == f"http://{name}.{ns}.svc:8000"
        # no worker is Ready yet: neither is the instance (readyWhen of the server)
        assert cond({"status": got}, "Ready").get("status") == "False", got
        assert "server" in cond({"status": got}, "ResourcesReady").get("message", ""), got

    # 6. the pods are scheduled and come up (as kube-scheduler and kubelet would report)
    for name in names:
        for i, inst in enumerate(vms[name]):
            pod_path = f"/api/v1/namespaces/{ns}/pods/{name}-{i}"
            admin.request("POST", pod_path + "/binding", body={
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": f"{name}-{i}"},
                "target": {"apiVersion": "v1", "kind": "Node", "name": inst["name"]}})
            pod = admin.request("GET", pod_path)
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            pod["status"] = {"phase": "Running", "startTime": now, "conditions": [
                {"type": t, "status": "True", "lastTransitionTime": now}
                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}
            admin.request("PUT", pod_path + "/status", body=pod)
    for name in names:
        got = until(lambda: (o := get(admin, instance_path(ns, name))) and o["status"].get("state") == "ACTIVE"
                    and cond(o, "Ready").get("status") == "True" and o, f"instance {name} Ready",
                    timeout=WAIT)["status"]
        assert got["server"]["readyReplicas"] == want[name][0], got
    # the printer columns kro generated from the schema, as users see them
    out = kubectl("admin", "get", PLURAL, "-n", ns, names[0])
    header, row = (line.split() for line in out.stdout.strip().splitlines())
    assert header == ["NAME", "HOSTS", "TOPOLOGY", "CAPACITY", "CACHE", "READY-WORKERS", "STATE", "AGE"], out
    assert row[:-1] == [names[0], "1", "2x4", "Ready", "true", "1", "ACTIVE"], out

    # 7. deleting an instance tears everything down: node-group finalizers run against GCE; the
    # test, as the pods' kubelet, confirms their deletion once their containers would have stopped
    for name in names:
        admin.request("DELETE", instance_path(ns, name))
    for name in names:
        until(lambda: kubelet_confirms_deletions(admin, ns) or get(admin, instance_path(ns, name)) is None,
              f"instance {name} gone", timeout=WAIT)
        for path in (tng(name), cache(name), sts(name), f"/api/v1/namespaces/{ns}/services/{name}",
                     f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}-jax-cache"):
            until(lambda: get(admin, path) is None, f"{path} gone", timeout=WAIT)
        for inst in vms[name]:
            until(lambda: get(admin, f"/api/v1/nodes/{inst['name']}") is None, f"node {inst['name']} gone",
                  timeout=WAIT)
    until(lambda: admin.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"] == [], "pods gone", timeout=WAIT)
    for plural in ("managedinstancegroups", "instancetemplates", "workloadpolicies"):
        assert admin.request("GET", custom_path("tpu.google.com", "v1alpha1", plural, ns))["items"] == []
    ours = [p for p in gce.compute.resources if any(f"/{n}-tpus-" in p for n in names)]
    assert ours == [], ours  # MIGs, VMs, templates and policies deleted in GCE
    # the platform team's ConfigMap is read by kro, never owned: it stays
    assert get(admin, f"/api/v1/namespaces/{ns}/configmaps/tpu-platform") is not None
