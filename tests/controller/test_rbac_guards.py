"""The controller's power is what docs/controller.md says, and RBAC alone cannot say it: real
requests as the controller's identity (its client certificate: user
system:serviceaccount:accelnode-system:accelnode-controller) against the real API server, with
every daemonsets/rbac-controller*.yaml applied (the guards, daemonsets/rbac-controller-guards.yaml,
among them).

The attack of issue 33 item 6: `create` on Secrets in kube-system and `get` on the join-token pool's
names let the controller mint a kubernetes.io/service-account-token Secret for any kube-system
ServiceAccount under a pool name, have the token controller fill it, and read the token back.
Each other verb it holds is held to what the controller does with it."""

from __future__ import annotations

import base64
import copy
import glob
import uuid

import pytest
import yaml

from accelnode.kube.client import Client, Config, KubeError, is_not_found
from controller.nodegroups.jointokens import GROUP_ANNOTATION, NODE_GROUP, POOL, JoinTokens
from controller.nodegroups.reconciler import DEVICE_PLUGIN, device_plugin_daemonset
from tests.conftest import ROOT, eventually, refused
from tests.controller.test_jointokens import Ledger, whoami

KS = "/api/v1/namespaces/kube-system/secrets"
OURS = "/api/v1/namespaces/accelnode-system/secrets"
DAEMONSETS = "/apis/apps/v1/namespaces/accelnode-system/daemonsets"
ME = "system:serviceaccount:accelnode-system:accelnode-controller"
GUARDS = ROOT / "daemonsets/rbac-controller-guards.yaml"
DRY = {"dryRun": "All"}


@pytest.fixture(scope="module")
def guarded(kubectl, crds, kube_api):
    """Every controller RBAC file we ship applied; the guards removed again afterwards (other
    modules' controllers run with test images the guards would refuse)."""
    files = sorted(glob.glob(str(ROOT / "daemonsets/rbac-controller*.yaml")))
    out = kubectl("admin", "apply", "-f", str(ROOT / "daemonsets/namespace.yaml"), *(a for f in files for a in ("-f", f)))
    assert out.returncode == 0, out.stderr
    yield
    if GUARDS.exists():
        kubectl("admin", "delete", "--ignore-not-found", "-f", str(GUARDS))


@pytest.fixture
def me(control_plane, guarded) -> Client:
    return Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")), user_agent="accelnode-controller")


def in_force(call, what: str) -> str:
    """The API server loads a new policy asynchronously: retry ``call`` (a dry run) until refused."""
    why = eventually(lambda: refused(call), what, timeout=30)
    assert why, f"{what}: not refused within 30 s"
    return why


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def sa_token_secret(name: str, account: str = "namespace-controller") -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
            "metadata": {"name": name, "annotations": {"kubernetes.io/service-account.name": account}}}


def bootstrap_secret(tid: str, **data: str) -> dict:
    fields = {"token-id": tid, "token-secret": "0123456789abcdef", "expiration": "2099-01-01T00:00:00Z",
              "usage-bootstrap-authentication": "true", "usage-bootstrap-signing": "true",
              "auth-extra-groups": NODE_GROUP, "description": "accelnode test", **data}
    return {"apiVersion": "v1", "kind": "Secret", "type": "bootstrap.kubernetes.io/token",
            "metadata": {"name": f"bootstrap-token-{tid}", "annotations": {GROUP_ANNOTATION: "g"}},
            "data": {k: b64(v) for k, v in fields.items() if v is not None}}


def delete(admin: Client, path: str) -> None:
    try:
        admin.request("DELETE", path)
    except KubeError as e:
        assert is_not_found(e), e


# -- Secrets (item 6's attack) -------------------------------------------------------------------


def test_the_controller_cannot_mint_a_service_account_token_under_a_pool_name(me, admin):
    """The attack, for real: without the guard the token controller fills the Secret with a token
    of kube-system/namespace-controller (which may delete any namespace) and the pool name lets
    the controller read it back."""
    name = f"bootstrap-token-{POOL[-1]}"
    delete(admin, f"{KS}/{name}")
    try:
        why = in_force(lambda: me.request("POST", KS, query=DRY, body=sa_token_secret(name)), "the secrets guard")
        assert why.startswith("403") and "only bootstrap.kubernetes.io/token Secrets" in why, why
        assert refused(lambda: me.request("POST", KS, body=sa_token_secret(name))).startswith("403")
        # had it been created, this is what the controller would hold
        assert refused(lambda: me.request("GET", f"{KS}/{name}")).startswith("404")
        # nor under a name outside the pool, nor of another type, nor in another namespace
        assert refused(lambda: me.request("POST", KS, query=DRY, body=sa_token_secret("kube-proxy-token"))
                       ).startswith("403")
        opaque = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": name}}
        assert refused(lambda: me.request("POST", KS, query=DRY, body=opaque)).startswith("403")
        assert "kubernetes.io/tls Secrets" in refused(lambda: me.request(
            "POST", OURS, query=DRY, body=sa_token_secret("accelnode-controller-webhook-tls", "accelnode-agent")))
    finally:
        delete(admin, f"{KS}/{name}")


@pytest.mark.parametrize("change", [
    {"auth-extra-groups": "system:bootstrappers:kubeadm:default-node-token,system:bootstrappers:other"},
    {"auth-extra-groups": "system:bootstrappers:other"},
    {"usage-bootstrap-signing": "false"},
    {"extra": "x"},
    {"expiration": None},
    {"token-id": "acn001"},  # not its name's
], ids=["two-groups", "other-group", "no-signing", "extra-key", "no-expiration", "foreign-id"])
def test_a_join_token_has_exactly_kubeadms_keys(me, change):
    body = bootstrap_secret(POOL[-2], **change)
    in_force(lambda: me.request("POST", KS, query=DRY, body=bootstrap_secret(POOL[-2], extra="probe")),
             "the secrets guard")
    why = refused(lambda: me.request("POST", KS, query=DRY, body=body))
    assert why.startswith("422") and "exactly kubeadm's keys" in why, why


def test_every_pool_name_takes_a_kubeadm_token(me):
    """The guard compares token-id with its name in base64 (the API server's CEL has no decoder):
    every name of the pool passes, as its API server dry run shows."""
    in_force(lambda: me.request("POST", KS, query=DRY, body=sa_token_secret(f"bootstrap-token-{POOL[-1]}")),
             "the secrets guard")
    assert [tid for tid in POOL if refused(lambda: me.request("POST", KS, query=DRY, body=bootstrap_secret(tid)))
            .startswith(("403", "422"))] == []


def test_a_kubeadm_join_token_still_works(control_plane, me, admin):
    """What the node groups do (controller/nodegroups/jointokens.py) under the guard: a token
    created as the controller authenticates as kubeadm's node bootstrapper; it is read, reused
    and revoked by its pool name."""
    in_force(lambda: me.request("POST", KS, query=DRY, body=sa_token_secret(f"bootstrap-token-{POOL[-1]}")),
             "the secrets guard")
    jt = JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes())
    ledger = Ledger(jt, f"guards-{uuid.uuid4().hex[:8]}")
    try:
        info = ledger.ensure()
        assert ledger.ensure().token == info.token  # read back and reused
        def authenticated():
            try:
                return whoami(control_plane, info.token)
            except KubeError:  # the authenticator reads token Secrets through an informer: a moment
                return None
        user = eventually(authenticated, "the token authenticates", timeout=30)
        assert user["username"] == f"system:bootstrap:{info.token_id}" and NODE_GROUP in user["groups"]
    finally:
        ledger.revoke()
    assert refused(lambda: admin.request("GET", f"{KS}/bootstrap-token-{info.token_id}")).startswith("404")


# -- the device-plugin DaemonSet -----------------------------------------------------------------


def pinned_image() -> str:
    (cm,) = [d for d in yaml.safe_load_all(GUARDS.read_text()) if d and d["kind"] == "ConfigMap"]
    return cm["data"]["image"]


def test_the_controller_creates_only_the_device_plugin_daemonset_as_the_operator_pinned_it(me):
    good = device_plugin_daemonset("accelnode-system", pinned_image())
    evil = device_plugin_daemonset("accelnode-system", "attacker.example.com/root:latest")
    why = in_force(lambda: me.request("POST", DAEMONSETS, query=DRY, body=evil), "the daemonsets guard")
    assert why.startswith("403") and "accelnode-device-plugin-image" in why, why
    assert not refused(lambda: me.request("POST", DAEMONSETS, query=DRY, body=good)).startswith("403")
    for mutate in (lambda c, p: c.update(securityContext={"privileged": True}),
                   lambda c, p: c.update(command=["sh", "-c", "cat /host/etc/shadow"]),
                   lambda c, p: p["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
                   lambda c, p: p.update(hostPID=True),
                   lambda c, p: p.update(serviceAccountName="accelnode-agent")):
        ds = copy.deepcopy(good)
        pod = ds["spec"]["template"]["spec"]
        mutate(pod["containers"][0], pod)
        assert refused(lambda: me.request("POST", DAEMONSETS, query=DRY, body=ds)).startswith("403")
    other = copy.deepcopy(good)
    other["metadata"]["name"] = "accelnode-csi-node"
    assert "only the DaemonSet accelnode-tpu-device-plugin" in refused(
        lambda: me.request("POST", DAEMONSETS, query=DRY, body=other))
    # RBAC: delete by name only, so the CSI DaemonSet cannot be deleted to be re-created as another
    assert refused(lambda: me.request("DELETE", f"{DAEMONSETS}/accelnode-csi-node")).startswith("403")
    assert not refused(lambda: me.request("DELETE", f"{DAEMONSETS}/{DEVICE_PLUGIN}", query=DRY)).startswith("403")


# -- webhook configurations, StatefulSets, volumes, Nodes, caches --------------------------------


WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


def test_the_controller_changes_only_the_ca_bundle_of_its_webhooks(me, admin):
    delete(admin, f"{WEBHOOKS}/accelnode-tpu-env")
    (doc,) = [d for d in yaml.safe_load_all((ROOT / "daemonsets/webhooks-tpu-env.yaml").read_text()) if d]
    admin.request("POST", WEBHOOKS, body=doc)
    try:
        cur = admin.request("GET", f"{WEBHOOKS}/accelnode-tpu-env")  # the controller lists and watches them
        wider = copy.deepcopy(cur)
        for h in wider["webhooks"]:
            h.pop("namespaceSelector", None)
            h.pop("objectSelector", None)
            h["rules"][0]["resources"] = ["*"]
        why = in_force(lambda: me.request("PUT", f"{WEBHOOKS}/accelnode-tpu-env", query=DRY, body=wider),
                       "the webhook configurations guard")
        assert why.startswith("403") and "only the caBundle" in why, why
        moved = copy.deepcopy(cur)
        moved["webhooks"][0]["clientConfig"] = {"url": "https://attacker.example.com/hook"}
        assert refused(lambda: me.request("PUT", f"{WEBHOOKS}/accelnode-tpu-env", query=DRY, body=moved))
        renewed = copy.deepcopy(cur)
        for h in renewed["webhooks"]:
            h["clientConfig"]["caBundle"] = b64("-----BEGIN CERTIFICATE-----\n")
        me.request("PUT", f"{WEBHOOKS}/accelnode-tpu-env", body=renewed)
    finally:
        delete(admin, f"{WEBHOOKS}/accelnode-tpu-env")


def test_the_controller_changes_only_the_tpu_environment_of_a_statefulset(me, admin, kube_namespace):
    path = f"/apis/apps/v1/namespaces/{kube_namespace}/statefulsets"
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet",
           "metadata": {"name": "w", "labels": {"gke-tpu-env-injector.aaronbatilo.dev/inject": "enabled"}},
           "spec": {"serviceName": "w", "replicas": 2, "selector": {"matchLabels": {"app": "w"}},
                    "template": {"metadata": {"labels": {"app": "w"}}, "spec": {"containers": [
                        {"name": "w", "image": "python:3.12", "env": [{"name": "A", "value": "1"}]}]}}}}
    admin.request("POST", path, body=sts)

    def put(name: str, mutate, query=None) -> str:
        """``refused`` of the controller's update of the StatefulSet as read now, changed by
        ``mutate``; read again when its controller wrote the status meanwhile (409)."""
        def once():
            s = admin.request("GET", f"{path}/{name}")  # the controller reads from its watch: RBAC gives it no get
            mutate(s)
            why = refused(lambda: me.request("PUT", f"{path}/{name}", query=query, body=s))
            return None if why.startswith("409") else (why or "written")
        return eventually(once, "an update between the StatefulSet controller's status writes")

    why = eventually(lambda: put("w", lambda s: s["spec"]["template"]["spec"]["containers"][0].update(
        image="attacker.example.com/x:1"), DRY).replace("written", ""), "the statefulsets guard", timeout=30)
    assert why.startswith("403") and "TPU_* and MEGASCALE_*" in why, why
    for mutate in (lambda s: s["spec"]["template"]["spec"]["containers"][0].update(command=["sh"]),
                   lambda s: s["spec"]["template"]["spec"].update(serviceAccountName="builder"),
                   lambda s: s["spec"]["template"]["spec"]["containers"][0]["env"].append(
                       {"name": "LD_PRELOAD", "value": "/x.so"}),
                   lambda s: s["spec"]["template"]["spec"]["containers"][0]["env"].append(
                       {"name": "TPU_X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}})):
        assert put("w", mutate, DRY).startswith("403")

    def ours(s: dict) -> None:
        s["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "TPU_WORKER_HOSTNAMES", "value": "w-0.w"})
        s["spec"]["template"].setdefault("metadata", {}).setdefault("annotations", {})[
            "tpu-env.accelnode.io/injected"] = "{}"
    assert put("w", ours) == "written"
    unlabelled = copy.deepcopy(sts)
    unlabelled["metadata"] = {"name": "plain"}
    admin.request("POST", path, body=unlabelled)
    why = put("plain", lambda s: s["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "TPU_WORKER_ID", "value": "0"}))
    assert "gke-tpu-env-injector.aaronbatilo.dev/inject=enabled" in why, why


def test_the_controller_writes_only_csi_gkm_io_volumes(me):
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"guard-{uuid.uuid4().hex[:6]}"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                   "hostPath": {"path": "/"}}}
    why = in_force(lambda: me.request("POST", "/api/v1/persistentvolumes", query=DRY, body=pv), "the volumes guard")
    assert why.startswith("403") and "csi.gkm.io" in why, why
    pv["spec"].pop("hostPath")
    pv["spec"]["csi"] = {"driver": "csi.gkm.io", "volumeHandle": "h", "nodePublishSecretRef": {
        "name": "db", "namespace": "kube-system"}}
    assert refused(lambda: me.request("POST", "/api/v1/persistentvolumes", query=DRY, body=pv)).startswith("403")
    pv["spec"]["csi"].pop("nodePublishSecretRef")
    me.request("POST", "/api/v1/persistentvolumes", query=DRY, body=pv)


def test_the_controller_changes_only_its_labels_and_taint_on_a_node(me, admin):
    name = f"guard-{uuid.uuid4().hex[:6]}"
    admin.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name, "labels": {"kubernetes.io/hostname": name}}, "spec": {
        "providerID": f"gce://p/z/{name}", "taints": [{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]}})
    try:
        cur = admin.request("GET", f"/api/v1/nodes/{name}")
        evil = copy.deepcopy(cur)
        evil["metadata"]["labels"]["node-restriction.kubernetes.io/pci-dss"] = "true"
        why = in_force(lambda: me.request("PUT", f"/api/v1/nodes/{name}", query=DRY, body=evil), "the nodes guard")
        assert why.startswith("403") and "kubernetes.io or k8s.io" in why, why
        for mutate in (lambda n: n["spec"].update(taints=[]),
                       lambda n: n["metadata"].setdefault("annotations", {}).update(x="y"),
                       lambda n: n["metadata"]["labels"].update({"node-role.kubernetes.io/control-plane": ""})):
            n = copy.deepcopy(cur)
            mutate(n)
            assert refused(lambda: me.request("PUT", f"/api/v1/nodes/{name}", query=DRY, body=n)).startswith("403")
        ok = copy.deepcopy(cur)
        ok["metadata"]["labels"]["cloud.google.com/tpu-node-group"] = "g"
        ok["spec"]["taints"].append({"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"})
        ok["spec"]["unschedulable"] = True
        me.request("PUT", f"/api/v1/nodes/{name}", body=ok)
        me.request("DELETE", f"/api/v1/nodes/{name}", query=DRY)
    finally:
        delete(admin, f"/api/v1/nodes/{name}")
    cp = f"{name}-cp"
    admin.request("POST", "/api/v1/nodes", body={"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": cp, "labels": {"node-role.kubernetes.io/control-plane": ""}}})
    try:
        assert "deletes only GCE VMs' Nodes" in refused(lambda: me.request("DELETE", f"/api/v1/nodes/{cp}"))
    finally:
        delete(admin, f"/api/v1/nodes/{cp}")


def test_the_controller_never_changes_a_caches_spec(me, admin, kube_namespace):
    path = f"/apis/gkm.io/v1alpha1/namespaces/{kube_namespace}/gkmcaches"
    admin.request("POST", path, body={"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": "c"},
                                      "spec": {"image": "registry.example.com/team/c@sha256:" + "a" * 64}})
    # its writes are merge patches (RBAC grants patch, not update: tests/controlplane/test_rbac_minimal.py)
    evil = {"spec": {"image": "attacker.example.com/c@sha256:" + "b" * 64}}
    why = in_force(lambda: me.request("PATCH", f"{path}/c", query=DRY, body=evil), "the caches guard")
    assert why.startswith("403") and "never changes a cache's spec" in why, why
    ok = {"metadata": {"annotations": {"gkm.io/resolvedDigest": "sha256:" + "a" * 64}}}
    assert not refused(lambda: me.request("PATCH", f"{path}/c", query=DRY, body=ok)).startswith("403")


def test_the_controller_moves_spec_image_only_for_an_auto_capture_and_only_to_its_repository(me, admin, kube_namespace):
    """docs/capture.md: the one spec change the caches guard lets through. Each attack is a write a
    compromised controller could try on a cache whose namespace opted into automatic promotion
    (or did not)."""
    path = f"/apis/gkm.io/v1alpha1/namespaces/{kube_namespace}/gkmcaches"
    repo = "registry.example.com/team/captured"

    def cache(name: str, promotion: str) -> str:
        admin.request("POST", path, body={
            "apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache",
            "metadata": {"name": name, "annotations": {
                "accelnode.io/capture": "on", "accelnode.io/capture-repository": repo,
                "accelnode.io/capture-promotion": promotion}},
            "spec": {"image": "registry.example.com/team/base@sha256:" + "a" * 64}})
        return f"{path}/{name}"

    def patch(at: str, body: dict) -> str:
        return refused(lambda: me.request("PATCH", at, query=DRY, body=body))

    auto, manual = cache("auto", "auto"), cache("manual", "manual")
    new = {"spec": {"image": f"{repo}@sha256:" + "c" * 64}}
    in_force(lambda: me.request("PATCH", manual, query=DRY, body=new), "the caches guard")
    assert not patch(auto, new).startswith("403"), "an auto capture's promotion"
    for body, what in (
            (new, "a cache that chose manual promotion"),
            ({"spec": {"image": "attacker.example.com/x@sha256:" + "c" * 64}}, "another repository"),
            ({"spec": {"image": f"{repo}-evil@sha256:" + "c" * 64}}, "a repository that only starts like it"),
            ({"spec": {"image": f"{repo}:latest"}}, "a tag"),
            ({"spec": {"image": f"{repo}@sha256:" + "c" * 64, "storageClassName": "fast"}}, "another spec field"),
            ({"metadata": {"annotations": {"accelnode.io/capture-repository": "attacker.example.com/x"}},
              "spec": {"image": "attacker.example.com/x@sha256:" + "c" * 64}}, "the repository moved in the same write"),
    ):
        at = manual if what.startswith("a cache that chose") else auto
        why = patch(at, body)
        assert why.startswith("403") and "never changes a cache's spec" in why, (what, why)
    # turning auto on in the very write that promotes is no opt-in
    flip = {"metadata": {"annotations": {"accelnode.io/capture-promotion": "auto"}}, **new}
    why = patch(manual, flip)
    assert why.startswith("403"), why


def test_the_caches_guard_names_every_spec_field_of_a_cache():
    """A spec field added to the CRD must be held unchanged by the promotion exception too."""
    crds = yaml.safe_load((ROOT / "daemonsets/crds/gkm.io.yaml").read_text())["items"]
    (crd,) = [d for d in crds if d["spec"]["names"]["plural"] == "gkmcaches"]
    fields = set()
    for v in crd["spec"]["versions"]:
        fields |= set(v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])
    guards = list(yaml.safe_load_all((ROOT / "daemonsets/rbac-controller-guards.yaml").read_text()))
    (policy,) = [d for d in guards if d and d["kind"] == "ValidatingAdmissionPolicy"
                 and d["metadata"]["name"] == "accelnode-controller-caches"]
    (promoting,) = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == "promoting"]
    assert {f for f in fields if f"object.spec.?{f} == oldObject.spec.?{f}" not in promoting} == {"image"}
