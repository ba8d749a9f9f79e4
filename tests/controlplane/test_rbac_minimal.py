"""Every ServiceAccount of the kustomize base, asked of the real API server with
SubjectAccessReviews (the authorizer's own answer, groups included): each verb its component
needs is allowed, and a list of dangerous ones is denied to all of them.

The device plugin may read and watch Nodes (its own Node's TPU labels) and nothing else; the
namespace's ``default`` ServiceAccount must be allowed nothing. What each component does with its rights
is tested beside it (tests/agent, tests/controller, tests/csi); this is the whole table."""

from __future__ import annotations

import pytest
from kubernetes import client

NS = "accelnode-system"
RBAC = ["daemonsets/namespace.yaml", "daemonsets/rbac-agent.yaml", "daemonsets/rbac-csi.yaml",
        "daemonsets/rbac-device-plugin.yaml", "daemonsets/rbac-controller-events.yaml",
        "daemonsets/rbac-controller.yaml", "daemonsets/rbac-controller-caches.yaml",
        "daemonsets/rbac-controller-claims.yaml", "daemonsets/rbac-controller-jointokens.yaml",
        "daemonsets/rbac-controller-nodegroups.yaml", "daemonsets/rbac-controller-tpuenv.yaml",
        "daemonsets/rbac-controller-webhooks.yaml"]
ACCOUNTS = ("accelnode-agent", "accelnode-csi", "accelnode-device-plugin", "accelnode-controller", "default")

# (verb, group, resource, namespace, name); "" namespace: cluster-wide
CACHES_READ = [(v, "gkm.io", r, "", "") for r in ("gkmcaches", "clustergkmcaches") for v in ("get", "list", "watch")]
NEEDS = {
    "accelnode-csi": CACHES_READ,
    "accelnode-device-plugin": [("get", "", "nodes", "", "n1"), ("watch", "", "nodes", "", "n1")],
    "accelnode-agent": CACHES_READ + [
        ("create", "gkm.io", "gkmcachenodes", "team-a", ""), ("get", "gkm.io", "gkmcachenodes", "team-a", "n1"),
        ("list", "gkm.io", "gkmcachenodes", "", ""), ("list", "gkm.io", "clustergkmcachenodes", "", ""),
        ("create", "gkm.io", "clustergkmcachenodes", "", ""),
        ("update", "gkm.io", "gkmcachenodes/status", "team-a", "n1"),
        ("update", "gkm.io", "clustergkmcachenodes/status", "", "n1"),
        ("get", "", "nodes", "", "n1"), ("watch", "", "nodes", "", "n1"), ("list", "", "pods", "", ""),
        ("watch", "", "pods", "", "")],
    "accelnode-controller": [
        ("create", "coordination.k8s.io", "leases", NS, ""),
        ("get", "coordination.k8s.io", "leases", NS, "accelnode-controller"),
        ("update", "coordination.k8s.io", "leases", NS, "accelnode-controller"),
        ("list", "gkm.io", "gkmcaches", "", ""), ("patch", "gkm.io", "gkmcaches/status", "team-a", "c"),
        ("patch", "gkm.io", "clustergkmcaches/status", "", "c"), ("list", "gkm.io", "gkmcachenodes", "", ""),
        ("create", "", "persistentvolumeclaims", "team-a", ""), ("delete", "", "persistentvolumeclaims", "team-a", "c"),
        ("create", "", "persistentvolumes", "", ""), ("list", "", "namespaces", "", ""),
        ("update", "apps", "statefulsets", "team-a", "s"),
        ("create", "", "secrets", NS, ""), ("get", "", "secrets", NS, "accelnode-controller-webhook-tls"),
        ("update", "", "secrets", NS, "accelnode-controller-webhook-tls"),
        ("update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "accelnode-gkm-caches"),
        ("update", "admissionregistration.k8s.io", "validatingwebhookconfigurations", "", "accelnode-gkm-caches"),
        ("update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "accelnode-tpu-env"),
        # node groups' join tokens: bootstrap-token Secrets live in kube-system (docs/bootstrap.md)
        ("create", "", "secrets", "kube-system", ""),
        ("delete", "", "secrets", "kube-system", "bootstrap-token-acn007"),
        ("get", "", "secrets", "kube-system", "bootstrap-token-acn007"),
        ("get", "", "configmaps", "kube-public", "cluster-info"),
        ("get", "", "namespaces", "", "kube-system"),  # the cluster id in node groups' ownership markers
        ("delete", "apps", "daemonsets", NS, "accelnode-tpu-device-plugin"),  # the node groups' own
        # Events on users' objects (rbac-controller-events.yaml)
        ("create", "", "events", "team-a", ""), ("patch", "", "events", "team-a", "c.1"),
        ("create", "", "events", "default", "")],
    "default": [],
}
DANGEROUS = [
    ("get", "", "secrets", "kube-system", "any"), ("list", "", "secrets", "", ""),
    ("list", "", "secrets", "kube-system", ""), ("delete", "", "secrets", "kube-system", "bootstrap-token-abcdef"),
    ("list", "", "secrets", NS, ""), ("watch", "", "secrets", "", ""),
    ("get", "", "secrets", NS, "accelnode-registry-credentials"),
    ("create", "", "pods/exec", "team-a", "p"), ("create", "", "pods/attach", "team-a", "p"),
    ("create", "", "pods", "team-a", ""), ("delete", "", "pods", "team-a", "p"),
    ("create", "", "pods/eviction", "team-a", "p"),
    ("update", "", "nodes", "", "n1"), ("patch", "", "nodes", "", "n1"), ("delete", "", "nodes", "", "n1"),
    ("update", "", "nodes/status", "", "n1"), ("patch", "", "nodes/status", "", "n1"),
    ("get", "", "nodes/proxy", "", "n1"),
    ("escalate", "rbac.authorization.k8s.io", "clusterroles", "", "cluster-admin"),
    ("bind", "rbac.authorization.k8s.io", "clusterroles", "", "cluster-admin"),
    ("create", "rbac.authorization.k8s.io", "clusterrolebindings", "", ""),
    ("create", "rbac.authorization.k8s.io", "rolebindings", NS, ""),
    ("impersonate", "", "users", "", "admin"), ("impersonate", "", "serviceaccounts", NS, "accelnode-controller"),
    ("create", "", "serviceaccounts/token", NS, "accelnode-controller"),
    ("update", "certificates.k8s.io", "certificatesigningrequests/approval", "", "x"),
    ("delete", "gkm.io", "gkmcaches", "team-a", "c"), ("create", "gkm.io", "gkmcaches", "team-a", ""),
    ("update", "gkm.io", "gkmcaches", "team-a", "c"),  # a whole cache written back from a trimmed copy
    ("update", "", "secrets", "kube-system", "any"), ("create", "", "secrets", "default", ""),
    ("update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "someone-elses"),
    ("delete", "admissionregistration.k8s.io", "validatingwebhookconfigurations", "", "accelnode-gkm-caches"),
    ("create", "apps", "daemonsets", NS, ""), ("update", "apps", "daemonsets", NS, "accelnode-csi-node"),
    ("delete", "apps", "daemonsets", NS, "accelnode-csi-node"),  # to re-create it as another
    ("delete", "coordination.k8s.io", "leases", NS, "accelnode-controller"),
    ("update", "coordination.k8s.io", "leases", "kube-node-lease", "n1"),
]


@pytest.fixture(scope="module")
def authz(kubectl, crds, kube_api):
    out = kubectl("admin", "apply", *(a for f in RBAC for a in ("-f", f)))
    assert out.returncode == 0, out.stderr
    return client.AuthorizationV1Api(kube_api("admin"))


def allowed(api, account: str, verb: str, group: str, resource: str, namespace: str, name: str) -> bool:
    resource, _, sub = resource.partition("/")
    review = api.create_subject_access_review({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": f"system:serviceaccount:{NS}:{account}",
                 "groups": ["system:serviceaccounts", f"system:serviceaccounts:{NS}", "system:authenticated"],
                 "resourceAttributes": {"verb": verb, "group": group, "resource": resource, "subresource": sub,
                                        "namespace": namespace, "name": name}}})
    return bool(review.status.allowed)


@pytest.mark.parametrize("account", ACCOUNTS)
def test_every_verb_the_component_needs_is_allowed(authz, account):
    denied = [need for need in NEEDS[account] if not allowed(authz, account, *need)]
    assert denied == [], f"{account} lacks {denied}"


@pytest.mark.parametrize("account", ACCOUNTS)
def test_dangerous_verbs_are_denied(authz, account):
    granted = [d for d in DANGEROUS if allowed(authz, account, *d) and d not in NODE_GROUPS.get(account, ())]
    assert granted == [], f"{account} may {granted}"


# What the node-group reconcilers must do (rbac-controller-nodegroups.yaml, docs/tpu-node-groups.md):
# drain a deleted group's nodes through evictions (PodDisruptionBudgets decide), label, taint,
# cordon and delete its Nodes, and deploy the device-plugin DaemonSet. Dangerous, and granted on
# purpose; nothing else on the list is.
NODE_GROUPS = {"accelnode-controller": [("create", "", "pods/eviction", "team-a", "p"),
                                        ("update", "", "nodes", "", "n1"), ("delete", "", "nodes", "", "n1"),
                                        ("create", "apps", "daemonsets", "accelnode-system", "")]}


def test_what_one_component_needs_is_not_granted_to_the_others(authz):
    """Each account's rights are its own: the CSI driver cannot write node status, the agent cannot
    touch PVs or Leases, the device plugin's account nothing but reading Nodes."""
    for account, others in (("accelnode-csi", ("accelnode-agent", "accelnode-controller")),
                            ("accelnode-agent", ("accelnode-controller",)),
                            ("accelnode-device-plugin", ("accelnode-csi", "accelnode-agent", "accelnode-controller")),
                            ("default", ("accelnode-csi", "accelnode-agent", "accelnode-controller"))):
        for other in others:
            extra = [n for n in NEEDS[other] if n not in NEEDS[account] and allowed(authz, account, *n)]
            # the CSI ClusterRole is bound to the agent's account too (both run in one pod)
            assert extra == [], f"{account} may do what only {other} needs: {extra}"


def test_no_shipped_role_grants_secrets_by_kind():
    """Every rule we ship that grants a read of Secrets names them (resourceNames): a namespace
    that binds one of our ClusterRoles, or a Role we ship, gives none of its other Secrets away.
    (main shipped accelnode-pull-secret-reader: get on every Secret of the binding namespace.)"""
    import yaml

    from tests.conftest import ROOT

    loose = []
    for path in sorted((ROOT / "daemonsets").glob("*.yaml")) + sorted((ROOT / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("Role", "ClusterRole"):
                for rule in doc.get("rules") or ():
                    if "secrets" in rule.get("resources", ()) and set(rule["verbs"]) & {"get", "list", "watch", "*"} \
                            and not rule.get("resourceNames"):
                        loose.append(f"{path.name}: {doc['kind']} {doc['metadata']['name']}")
    assert loose == []
