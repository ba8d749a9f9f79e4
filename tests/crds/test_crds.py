"""The CRDs in daemonsets/crds/ on a real kube-apiserver: the examples apply unchanged, bad
objects are rejected with a message naming the field, immutable fields stay immutable, and
kubectl shows GKM's printer columns."""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.conftest import ROOT
from tests.fixtures.cluster import load_manifests, status_message

EXAMPLES = sorted((ROOT / "examples" / "gkm").glob("*.yaml")) + sorted((ROOT / "examples" / "tpu").glob("*.yaml")) + [
    ROOT / "examples" / "tpu" / "walkthrough" / "10-tpunodegroup.yaml"]
PLURALS = {"GKMCache": "gkmcaches", "ClusterGKMCache": "clustergkmcaches", "GKMCacheNode": "gkmcachenodes",
           "ClusterGKMCacheNode": "clustergkmcachenodes", "TPUNodeGroup": "tpunodegroups",
           "WorkloadPolicy": "workloadpolicies", "InstanceTemplate": "instancetemplates",
           "ManagedInstanceGroup": "managedinstancegroups"}


def example(path: str, name: str) -> dict:
    """A deep copy of one object of an example file."""
    (obj,) = [o for o in load_manifests(ROOT / "examples" / path) if o["metadata"]["name"] == name]
    return copy.deepcopy(obj)


class Objects:
    """Create/read/patch custom objects of any of our kinds through the Python client."""

    def __init__(self, api):
        self.api = client.CustomObjectsApi(api)
        self.created: list[dict] = []

    def _where(self, obj: dict) -> tuple:
        group, version = obj["apiVersion"].split("/")
        ns = obj["metadata"].get("namespace")
        return (group, version, *((ns,) if ns else ()), PLURALS[obj["kind"]])

    def create(self, obj: dict) -> dict:
        where = self._where(obj)
        call = self.api.create_namespaced_custom_object if len(where) == 4 else self.api.create_cluster_custom_object
        made = call(*where, body=obj)
        self.created.append(made)
        return made

    def delete_created(self) -> None:
        """Leave the shared control plane as found: a TPUNodeGroup left behind would be provisioned
        by any node-group reconciler another test runs."""
        for obj in reversed(self.created):
            where = self._where(obj)
            call = self.api.delete_namespaced_custom_object if len(where) == 4 else self.api.delete_cluster_custom_object
            try:
                call(*where, obj["metadata"]["name"])
            except ApiException as e:
                if e.status != 404:
                    raise
        self.created.clear()

    def get(self, obj: dict) -> dict:
        where = self._where(obj)
        call = self.api.get_namespaced_custom_object if len(where) == 4 else self.api.get_cluster_custom_object
        return call(*where, obj["metadata"]["name"])

    def patch(self, obj: dict, body: dict, status: bool = False) -> dict:
        where = self._where(obj)
        ns = len(where) == 4
        call = {(True, False): self.api.patch_namespaced_custom_object,
                (True, True): self.api.patch_namespaced_custom_object_status,
                (False, False): self.api.patch_cluster_custom_object,
                (False, True): self.api.patch_cluster_custom_object_status}[(ns, status)]
        return call(*where, obj["metadata"]["name"], body=body)

    def rejected(self, call, *args, **kwargs) -> str:
        with pytest.raises(ApiException) as err:
            call(*args, **kwargs)
        assert err.value.status == 422, err.value.body
        return status_message(err.value)


@pytest.fixture(scope="module")
def applied(crds, kubectl):
    """Every example, applied unchanged with strict field validation (unknown fields fail)."""
    args = [a for path in EXAMPLES for a in ("-f", str(path.relative_to(ROOT)))]
    out = kubectl("admin", "apply", "--validate=strict", *args)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr  # not even a warning
    objs = load_manifests(*EXAMPLES)
    yield objs
    # tests leave the shared control plane as they found it (the namespaces stay: other tests
    # name them, and a Terminating namespace refuses new objects for a while)
    rest = [o for o in objs if o["kind"] != "Namespace"]
    out = kubectl("admin", "delete", "--ignore-not-found", "--wait=true", "--timeout=45s", "-f", "-",
                  stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": rest}))
    assert out.returncode == 0, out.stderr


@pytest.fixture(scope="module")
def objects(kube_api) -> Objects:
    objs = Objects(kube_api("admin"))
    yield objs
    objs.delete_created()


def test_crds_have_names_short_names_and_status_subresources(crds, kube_api):
    ext = client.ApiextensionsV1Api(kube_api("admin"))
    short = {c.metadata.name: c.status.accepted_names.short_names or [] for c in ext.list_custom_resource_definition().items}
    assert {k: v for k, v in short.items() if k.endswith(("gkm.io", "tpu.google.com"))} == {
        "gkmcaches.gkm.io": ["gkmc"], "clustergkmcaches.gkm.io": ["cgkmc"],
        "gkmcachenodes.gkm.io": ["gkmcn"], "clustergkmcachenodes.gkm.io": ["cgkmcn"],
        "tpunodegroups.tpu.google.com": ["tng"], "workloadpolicies.tpu.google.com": [],
        "instancetemplates.tpu.google.com": [], "managedinstancegroups.tpu.google.com": [],
    }
    for crd in crds:
        if crd["spec"]["group"] == "accelnode.io":  # trust policies are the admin's spec only: verdicts live on caches
            assert "status" not in (crd["spec"]["versions"][0].get("subresources") or {}), crd["metadata"]["name"]
            continue
        assert crd["spec"]["versions"][0]["subresources"] == {"status": {}}, crd["metadata"]["name"]


def _written_in(written, stored) -> bool:
    if isinstance(written, dict):
        return isinstance(stored, dict) and all(k in stored and _written_in(v, stored[k]) for k, v in written.items())
    return written == stored


def test_examples_are_stored_as_written(applied, objects):
    assert {o["kind"] for o in applied} >= {"GKMCache", "ClusterGKMCache", "TPUNodeGroup", "WorkloadPolicy",
                                            "InstanceTemplate", "ManagedInstanceGroup"}
    for obj in applied:
        if obj["kind"] not in PLURALS:
            continue
        # What the example says is kept verbatim; the schema only adds defaults.
        assert _written_in(obj["spec"], objects.get(obj)["spec"]), obj["metadata"]["name"]
    defaults = objects.get(example("gkm/10-gkmcache.yaml", "vector-add-cache-rocm"))["spec"]
    assert defaults["accessModes"] == ["ReadWriteOnce"]


def test_kubectl_shows_gkm_printer_columns(applied, objects, kubectl):
    cache = example("gkm/10-gkmcache.yaml", "vector-add-cache-rocm")
    objects.patch(cache, status=True, body={"status": {
        "conditions": [{"type": "Running", "status": "True", "reason": "Running", "message": "in use on 2 nodes",
                        "lastTransitionTime": "2026-11-21T05:00:00Z"}],
        "counts": {"nodeCnt": 3, "nodeInUseCnt": 2, "nodeNotInUseCnt": 1, "nodeErrorCnt": 0,
                   "podRunningCnt": 4, "podOutdatedCnt": 0, "podDeletingCnt": 0}}})
    out = kubectl("admin", "get", "gkmc", "-n", "tpu-inference", "vector-add-cache-rocm")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.split("\n")[:2]
    assert header.split() == ["NAME", "STATUS", "NODES", "NODE-IN-USE", "NODE-NOT-IN-USE", "NODE-ERROR",
                              "POD-RUNNING", "POD-OUTDATED", "POD-DELETING", "AGE"]
    assert row.split()[:9] == ["vector-add-cache-rocm", "Running", "3", "2", "1", "0", "4", "0", "0"]
    for kind in ("cgkmc", "gkmcn", "cgkmcn"):
        out = kubectl("admin", "get", kind, "-A")
        assert out.returncode == 0, out.stderr
    out = kubectl("admin", "get", "cgkmc")
    assert out.stdout.split("\n")[0].split()[1:8] == ["STATUS", "NODES", "NODE-IN-USE", "NODE-NOT-IN-USE",
                                                        "NODE-ERROR", "POD-RUNNING", "POD-OUTDATED"]
    out = kubectl("admin", "get", "tng", "-n", "default")
    assert out.stdout.split("\n")[0].split() == ["NAME", "READY", "REASON", "NODES", "READY-NODES", "TOPOLOGY",
                                                 "LOCATION", "AGE"]


GKMCACHE = ("gkm/10-gkmcache.yaml", "vector-add-cache-rocm")
CLUSTERCACHE = ("gkm/20-clustergkmcache.yaml", "vector-add-cache-rocm-v2-rwo")
SINGLE = ("tpu/tpunodegroup-single-host.yaml", "v7x-single-host")
FROM_TEMPLATE = ("tpu/tpunodegroup-from-template.yaml", "v7x-from-template")
MIG = ("tpu/children.yaml", "v6e-multi-host-mig-1a2b3c4d")


def _set(obj: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        obj = obj.setdefault(p, {})
    if value is _DELETE:
        del obj[leaf]
    else:
        obj[leaf] = value


_DELETE = object()
BAD_IMAGE = 'spec.image: Invalid value: "{value}": must be an OCI image reference'  # a CEL rule's message

INVALID = [
    (GKMCACHE, "spec.image", _DELETE, "spec.image: Required value"),
    (GKMCACHE, "spec.image", "not an image!", BAD_IMAGE),
    (GKMCACHE, "spec.image", "", BAD_IMAGE),
    (GKMCACHE, "spec.image", "https://quay.io/gkm/cache:v1", BAD_IMAGE),
    (GKMCACHE, "spec.image", "quay.io/GKM/Cache:v1", BAD_IMAGE),
    (GKMCACHE, "spec.image", "quay.io/gkm/cache:v1 --privileged", BAD_IMAGE),
    (GKMCACHE, "spec.image", "quay.io/gkm/cache@sha256:1234", BAD_IMAGE),
    (GKMCACHE, "spec.image", "quay.io/gkm/" + "x" * 520, "spec.image: Too long"),
    (GKMCACHE, "spec.accessModes", ["ReadWriteSometimes"], 'spec.accessModes[0]: Unsupported value: "ReadWriteSometimes"'),
    (GKMCACHE, "spec.podTemplate.spec.tolerations", [{"key": "k", "operator": "Maybe"}],
     "spec.podTemplate.spec.tolerations[0].operator: Unsupported value"),
    (CLUSTERCACHE, "spec.workloadNamespaces", ["Not_A_Namespace"], "spec.workloadNamespaces[0] in body should match"),
    (CLUSTERCACHE, "spec.workloadNamespaces", ["a", "a"], "spec.workloadNamespaces[1]: Duplicate value"),
    (SINGLE, "spec.project", _DELETE, "spec.project: Required value"),
    (SINGLE, "spec.project", "My Project", "spec.project in body should match"),
    (SINGLE, "spec.nodeLocation", "the-moon", "spec.nodeLocation in body should match"),
    (SINGLE, "spec.nodeCount", 0, "spec.nodeCount in body should be greater than or equal to 1"),
    (SINGLE, "spec.acceleratorConnectionMode", "DYNAMIC", 'spec.acceleratorConnectionMode: Unsupported value: "DYNAMIC"'),
    (SINGLE, "spec.topology", "big", "spec.topology in body should match"),
    (SINGLE, "spec.targetSizePolicyMode", "BULK", "targetSizePolicyMode BULK needs nodeCount > 1"),
    (SINGLE, "spec.instanceConfig.machineType", "n2-standard-8", "machineType must be a TPU machine type"),
    (SINGLE, "spec.topology", "2x2", "spec.topology: v5e and v6e slices (ct5lp-, ct5l-, ct6e-) are 2-dimensional"),
    (SINGLE, "spec.topology", "3x3x3", "spec.topology: not a slice shape GCE offers"),
    (SINGLE, "spec.topology", "2x2x2", "spec.nodeCount: the topology's chip count must equal nodeCount times"),
    (SINGLE, "spec.instanceConfig.provisioningModel", "FREE", "spec.instanceConfig.provisioningModel: Unsupported value"),
    (SINGLE, "spec.instanceConfig.reservation", _DELETE, "reservation is required when provisioningModel is RESERVATION_BOUND"),
    (SINGLE, "spec.instanceConfig.serviceAccounts", [{"email": "a", "scopes": []}, {"email": "b", "scopes": []}],
     "spec.instanceConfig.serviceAccounts: Too many"),
    (SINGLE, "spec.instanceConfig", _DELETE, "exactly one of instanceConfig and instanceTemplateURI must be set"),
    (SINGLE, "spec.instanceTemplateURI", "projects/my-tpu-project/global/instanceTemplates/t",
     "exactly one of instanceConfig and instanceTemplateURI must be set"),
    (SINGLE, "spec.bootstrapKubernetes.controlPlaneIP", "control-plane.local", "controlPlaneIP must be an IP address"),
    (SINGLE, "spec.bootstrapKubernetes.version", "latest", "spec.bootstrapKubernetes.version in body should match"),
    (FROM_TEMPLATE, "spec.instanceTemplateURI", "projects/other-project/global/instanceTemplates/t",
     "instanceTemplateURI must name an instance template in spec.project"),
    (FROM_TEMPLATE, "spec.instanceTemplateURI", "instanceTemplates/t", "spec.instanceTemplateURI in body should match"),
    (FROM_TEMPLATE, "spec.bootstrapKubernetes", {"version": "1.35", "controlPlaneIP": "10.0.0.1"},
     "bootstrapKubernetes needs instanceConfig"),
    (MIG, "spec.instanceTemplate", "my-template", "spec.instanceTemplate in body should match"),
    (MIG, "spec.defaultActionOnFailure", "PANIC", "spec.defaultActionOnFailure: Unsupported value"),
]


@pytest.mark.parametrize("where, path, value, message", INVALID,
                         ids=[f"{w[1]}:{p}={'<del>' if v is _DELETE else v}"[:80] for w, p, v, _ in INVALID])
def test_invalid_objects_are_rejected_with_the_field_named(crds, applied, objects, where, path, value, message):
    obj = example(*where)
    obj["metadata"]["name"] = "invalid-" + obj["metadata"]["name"]
    _set(obj, path, value)
    assert message.format(value=value) in objects.rejected(objects.create, obj)
    with pytest.raises(ApiException) as err:  # and nothing was stored
        objects.get(obj)
    assert err.value.status == 404


def test_kubectl_prints_a_useful_message_for_a_bad_image(crds, applied, kubectl):
    obj = example(*GKMCACHE)
    obj["metadata"]["name"] = "garbage-image"
    obj["spec"]["image"] = "!!garbage!!"
    out = kubectl("admin", "apply", "-f", "-", stdin=json.dumps(obj))
    assert out.returncode != 0
    assert out.stderr.startswith('The GKMCache "garbage-image" is invalid: spec.image: Invalid value: "!!garbage!!": '
                                  "must be an OCI image reference, [registry[:port]/]repository[:tag]"), out.stderr


IMMUTABLE = [
    ({"spec": {"nodeCount": 2}}, "nodeCount is immutable"),
    ({"spec": {"project": "another-project"}}, "project is immutable"),
    ({"spec": {"nodeLocation": "us-east5-b"}}, "nodeLocation is immutable"),
    ({"spec": {"topology": "2x2x2"}}, "topology is immutable"),
    ({"spec": {"targetSizePolicyMode": "BULK", "nodeCount": 1}}, "targetSizePolicyMode is immutable"),
    ({"spec": {"instanceConfig": {"machineType": "tpu7x-standard-1t"}}}, "instanceConfig is immutable"),
    ({"spec": {"bootstrapKubernetes": {"controlPlaneIP": "10.0.0.9"}}}, "bootstrapKubernetes is immutable"),
    ({"spec": {"minNodeCount": 1}}, "optional fields cannot be added or removed after creation"),
    ({"spec": {"bootstrapKubernetes": None}}, "optional fields cannot be added or removed after creation"),
]


@pytest.fixture(scope="module")
def group(crds, objects):
    obj = example(*SINGLE)
    obj["metadata"]["name"] = "immutable-group"
    return objects.create(obj)


@pytest.mark.parametrize("patch, message", IMMUTABLE, ids=[m for _, m in IMMUTABLE])
def test_tpunodegroup_spec_is_immutable(objects, group, patch, message):
    assert message in objects.rejected(objects.patch, group, patch)
    assert objects.get(group)["spec"] == group["spec"]


def test_tpunodegroup_metadata_and_status_stay_writable(objects, group):
    objects.patch(group, {"metadata": {"labels": {"team": "inference"}}})
    status = {"nodeSummary": {"ready": 1, "reconciling": 0, "failed": 0},
              "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "All nodes are ready",
                              "lastTransitionTime": "2026-11-21T05:00:00Z"}]}
    assert objects.patch(group, {"status": status}, status=True)["status"] == status
    bad = {"status": {"nodeSummary": {"ready": -1, "reconciling": 0, "failed": 0}}}
    assert "status.nodeSummary.ready: Invalid value: -1" in objects.rejected(
        objects.patch, group, bad, status=True)


def test_cache_node_status_is_validated(crds, objects, kube_namespace):
    node = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCacheNode",
            "metadata": {"name": "tpu-node-1", "namespace": kube_namespace},
            "status": {"nodeName": "ignored on create"}}
    created = objects.create(node)
    assert "status" not in created  # status is a subresource: create does not set it
    digest = "sha256:" + "ab" * 32
    good = {"status": {"nodeName": "tpu-node-1", "gpus": [{"gpuType": "tpu7x", "ids": [0, 1, 2, 3]}],
                       "caches": {"vector-add-cache-rocm": {digest: {
                           "state": "Running", "volumeSize": 73728, "compatibleGPUs": [0, 1, 2, 3],
                           "pods": [{"podNamespace": kube_namespace, "podName": "infer-0"}]}}}}}
    assert objects.patch(node, good, status=True)["status"] == good["status"]
    bad = {"status": {"caches": {"vector-add-cache-rocm": {digest: {"state": "Melting"}}}}}
    msg = objects.rejected(objects.patch, node, bad, status=True)
    assert f"status.caches.vector-add-cache-rocm.{digest}.state: Unsupported value: \"Melting\"" in msg
