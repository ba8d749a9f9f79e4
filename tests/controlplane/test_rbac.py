"""RBAC is enforced for the component identities: the agent's ClusterRole
(daemonsets/rbac-agent.yaml) grants exactly what its status reporter needs, and nothing more."""

from __future__ import annotations

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.fixtures.cluster import status_message

GKM = ("gkm.io", "v1alpha1")
NODE = "tpu-node-rbac"


@pytest.fixture(scope="module")
def agent(kubectl, crds, kube_api):
    applied = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-agent.yaml")
    assert applied.returncode == 0, applied.stderr
    client.CoreV1Api(kube_api("admin")).create_node(body={"metadata": {"name": NODE}})
    return kube_api("agent")


def forbidden(call, *args, **kwargs) -> str:
    with pytest.raises(ApiException) as err:
        call(*args, **kwargs)
    assert err.value.status == 403, err.value.body
    return status_message(err.value)


def test_agent_reads_caches_and_writes_its_node_objects(agent, kube_namespace):
    objs = client.CustomObjectsApi(agent)
    assert objs.list_cluster_custom_object(*GKM, "gkmcaches")["kind"] == "GKMCacheList"
    assert objs.list_cluster_custom_object(*GKM, "clustergkmcaches")["kind"] == "ClusterGKMCacheList"

    node_obj = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCacheNode",
                "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}}
    created = objs.create_namespaced_custom_object(*GKM, kube_namespace, "gkmcachenodes", body=node_obj)
    updated = objs.replace_namespaced_custom_object_status(
        *GKM, kube_namespace, "gkmcachenodes", NODE, body={**created, "status": {"nodeName": NODE}})
    assert updated["status"]["nodeName"] == NODE
    assert objs.list_namespaced_custom_object(*GKM, kube_namespace, "gkmcachenodes")["items"]
    created = objs.create_cluster_custom_object(*GKM, "clustergkmcachenodes",
                                                body={**node_obj, "kind": "ClusterGKMCacheNode"})
    objs.replace_cluster_custom_object_status(*GKM, "clustergkmcachenodes", NODE,
                                              body={**created, "status": {"nodeName": NODE}})
    # what it does not need: patching or relabelling its objects, patching their status
    forbidden(objs.patch_namespaced_custom_object, *GKM, kube_namespace, "gkmcachenodes", NODE,
              body={"metadata": {"finalizers": ["gkm.io.demo/finalizer"]}})
    forbidden(objs.patch_cluster_custom_object_status, *GKM, "clustergkmcachenodes", NODE,
              body={"status": {"nodeName": "someone-else"}})


def test_agent_watches_its_node_and_the_pods_on_it(agent, kube_api, kube_namespace):
    admin = client.CoreV1Api(kube_api("admin"))
    for pod, node in (("on-this-node", NODE), ("elsewhere", "another-node")):
        admin.create_namespaced_pod(kube_namespace, body={
            "metadata": {"name": pod},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "registry.example.com/app:1"}]}})
    core = client.CoreV1Api(agent)
    assert core.read_node(NODE).metadata.name == NODE
    events = watch.Watch().stream(core.list_node, field_selector=f"metadata.name={NODE}", timeout_seconds=5)
    first = next(events)
    events.close()
    assert (first["type"], first["object"].metadata.name) == ("ADDED", NODE)
    pods = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}")
    assert [(p.metadata.namespace, p.metadata.name) for p in pods.items] == [(kube_namespace, "on-this-node")]


def test_agent_is_forbidden_outside_its_role(agent, kube_api, kube_namespace):
    objs, core = client.CustomObjectsApi(agent), client.CoreV1Api(agent)
    cache = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": "c"},
             "spec": {"image": "quay.io/gkm/cache-examples:vector-add-cache-rocm-v2"}}
    msg = forbidden(objs.create_namespaced_custom_object, *GKM, kube_namespace, "gkmcaches", body=cache)
    assert 'cannot create resource "gkmcaches"' in msg
    assert "system:serviceaccount:accelnode-system:accelnode-agent" in msg
    forbidden(objs.delete_cluster_custom_object, *GKM, "clustergkmcachenodes", NODE)
    forbidden(core.patch_node, NODE, body={"metadata": {"labels": {"hacked": "yes"}}})
    forbidden(core.list_node)
    forbidden(core.list_namespaced_secret, kube_namespace)
    forbidden(core.create_namespaced_pod, kube_namespace,
              body={"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    assert "hacked" not in (client.CoreV1Api(kube_api("admin")).read_node(NODE).metadata.labels or {})
