"""Critical-priority pods on a control plane configured as GKE configures its own.

The test API server runs with the ResourceQuota admission configuration of Kubernetes' GCE
scripts, which GKE inherits (tests/rigs/devcluster.py, GKE_ADMISSION; sources there and in
../shared/reference/gke.md section 1): a pod of priority class system-node-critical or
system-cluster-critical is admitted only in a namespace holding a ResourceQuota whose
scopeSelector matches its class. Every pod of ours has one of those classes, so the base ships
daemonsets/quota.yaml. Without it the API server refuses the pods with the message GKE users see;
with it (unchanged but for the namespace) they are admitted."""

from __future__ import annotations

import time
import uuid

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from accelnode import IMAGE
from tests.conftest import ROOT
from tests.fixtures.cluster import status_message

REFUSAL = ("insufficient quota to match these scopes: "
           "[{PriorityClass In [system-node-critical system-cluster-critical]}]")


def pod(name: str, priority_class: str | None) -> dict:
    spec = {"containers": [{"name": "c", "image": IMAGE}]}
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def shipped_quota(namespace: str) -> dict:
    quota = yaml.safe_load((ROOT / "daemonsets/quota.yaml").read_text())
    quota["metadata"]["namespace"] = namespace
    return quota


def test_critical_pods_are_refused_without_the_shipped_quota_and_admitted_with_it(kube_api, kube_namespace):
    core = client.CoreV1Api(kube_api("admin"))
    ns = kube_namespace
    for cls in ("system-node-critical", "system-cluster-critical"):
        with pytest.raises(ApiException) as err:
            core.create_namespaced_pod(ns, pod(f"refused-{cls}", cls))
        assert REFUSAL in status_message(err.value), err.value.body
    core.create_namespaced_pod(ns, pod("plain", None))  # no priority class: not limited

    core.create_namespaced_resource_quota(ns, shipped_quota(ns))
    for cls in ("system-node-critical", "system-cluster-critical"):
        core.create_namespaced_pod(ns, pod(f"admitted-{cls}", cls))
    names = {p.metadata.name for p in core.list_namespaced_pod(ns).items}
    assert names == {"plain", "admitted-system-node-critical", "admitted-system-cluster-critical"}


def test_kube_system_admits_critical_pods_by_gkes_own_quota(kube_api):
    """kube-system is where GKE's own critical pods run, by its quota gcp-critical-pods (which
    has a hard pod count: admitted once kube-controller-manager has filled in its status)."""
    core = client.CoreV1Api(kube_api("admin"))
    name = f"critical-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + 60
    while True:
        try:
            core.create_namespaced_pod("kube-system", pod(name, "system-node-critical"))
            break
        except ApiException as e:
            if "status unknown for quota" not in e.body or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    core.delete_namespaced_pod(name, "kube-system", grace_period_seconds=0)


def test_the_shipped_quota_names_exactly_the_classes_our_pods_use():
    quota = yaml.safe_load((ROOT / "daemonsets/quota.yaml").read_text())
    assert quota["metadata"]["namespace"] == "accelnode-system" and "hard" not in quota["spec"]
    [expr] = quota["spec"]["scopeSelector"]["matchExpressions"]
    used = set()
    for path in ("csi-driver.yaml", "device-plugin.yaml", "controller.yaml"):
        for doc in yaml.safe_load_all((ROOT / "daemonsets" / path).read_text()):
            if doc and doc["kind"] in ("DaemonSet", "Deployment"):
                used.add(doc["spec"]["template"]["spec"]["priorityClassName"])
    assert (expr["scopeName"], expr["operator"]) == ("PriorityClass", "In") and used <= set(expr["values"])
