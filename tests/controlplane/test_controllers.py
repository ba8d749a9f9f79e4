"""The control plane's kube-controller-manager: the controllers tests rely on act as in a real
cluster (garbage collection, namespace deletion, PV/PVC binding, StatefulSets, Jobs, CSR
signing). No kubelet runs, so pods are created but stay Pending."""

from __future__ import annotations

import base64
import time
import uuid

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes import client
from kubernetes.client.rest import ApiException

GKM = ("gkm.io", "v1alpha1")
HOLD = "accelnode.test/hold"  # a finalizer of our own: keeps an object until the test lets go


def eventually(check, what: str, timeout: float = 90.0, done=bool):
    """The first ``check()`` result that is ``done`` within ``timeout`` seconds (a bound, not a
    measurement); else the test fails with the last result."""
    end = time.monotonic() + timeout
    while True:
        result = check()
        if done(result):
            return result
        if time.monotonic() > end:
            pytest.fail(f"not within {timeout:.0f}s: {what}; last: {result!r}")
        time.sleep(0.25)


def gone(read, *args) -> bool:
    try:
        read(*args)
    except ApiException as e:
        if e.status == 404:
            return True
        raise
    return False


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def core(kube_api):
    return client.CoreV1Api(kube_api("admin"))


def test_garbage_collector_deletes_dependents_of_a_deleted_owner(core, kube_namespace):
    ns = kube_namespace
    owner = core.create_namespaced_config_map(ns, body={"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_config_map(ns, body={"metadata": {"name": "dependent", "ownerReferences": [ref]}})
    core.create_namespaced_config_map(ns, body={"metadata": {"name": "bystander"}})

    core.delete_namespaced_config_map("owner", ns)
    eventually(lambda: gone(core.read_namespaced_config_map, "dependent", ns), "the dependent collected")
    assert core.read_namespaced_config_map("bystander", ns).metadata.name == "bystander"


def test_node_objects_go_with_their_node(core, kube_api, crds):
    """What the agent relies on: its ClusterGKMCacheNode/GKMCacheNode are owned by the Node."""
    node = core.create_node(body={"metadata": {"name": name("gc-node")}})
    objs = client.CustomObjectsApi(kube_api("admin"))
    ref = {"apiVersion": "v1", "kind": "Node", "name": node.metadata.name, "uid": node.metadata.uid}
    objs.create_cluster_custom_object(*GKM, "clustergkmcachenodes", body={
        "apiVersion": "gkm.io/v1alpha1", "kind": "ClusterGKMCacheNode",
        "metadata": {"name": node.metadata.name, "ownerReferences": [ref]}})

    core.delete_node(node.metadata.name)
    eventually(lambda: gone(objs.get_cluster_custom_object, *GKM, "clustergkmcachenodes", node.metadata.name),
               "the ClusterGKMCacheNode collected")


def test_namespace_deletion_removes_everything_in_it(core, kube_api, crds):
    ns = name("doomed")
    core.create_namespace(body={"metadata": {"name": ns}})
    core.create_namespaced_config_map(ns, body={"metadata": {"name": "plain"}})
    core.create_namespaced_secret(ns, body={"metadata": {"name": "secret"}, "stringData": {"k": "v"}})
    objs = client.CustomObjectsApi(kube_api("admin"))
    objs.create_namespaced_custom_object(*GKM, ns, "gkmcaches", body={
        "apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": "kernels"},
        "spec": {"image": "quay.io/gkm/cache-examples:vector-add-cache-rocm-v2"}})
    # held by our finalizer, so the namespace is observably Terminating until we let go
    core.create_namespaced_config_map(ns, body={"metadata": {"name": "held", "finalizers": [HOLD]}})

    core.delete_namespace(ns)
    assert core.read_namespace(ns).status.phase == "Terminating"
    # the namespace controller deletes the contents, custom resources included ...
    def left() -> list[str]:
        there = {"plain": not gone(core.read_namespaced_config_map, "plain", ns),
                 "secret": not gone(core.read_namespaced_secret, "secret", ns),
                 "kernels": not gone(objs.get_namespaced_custom_object, *GKM, ns, "gkmcaches", "kernels"),
                 "held": core.read_namespaced_config_map("held", ns).metadata.deletion_timestamp is None}
        return [k for k, v in there.items() if v]

    eventually(left, "the contents deleted (the held ConfigMap marked deleted)", done=lambda r: r == [])
    assert core.read_namespace(ns).status.phase == "Terminating"
    # ... and removes the namespace once nothing is left in it
    core.patch_namespaced_config_map("held", ns, body={"metadata": {"finalizers": None}})
    eventually(lambda: gone(core.read_namespace, ns), "the namespace gone")


def test_prebound_volume_and_claim_bind_without_a_provisioner(core, kube_namespace):
    ns, pv, pvc = kube_namespace, name("cache-pv"), "cache"
    core.create_persistent_volume(body={
        "metadata": {"name": pv},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "claimRef": {"namespace": ns, "name": pvc},
            "csi": {"driver": "csi.gkm.io", "volumeHandle": pv, "readOnly": True},
        }})
    core.create_namespaced_persistent_volume_claim(ns, body={
        "metadata": {"name": pvc},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}},
                 "storageClassName": "", "volumeName": pv}})

    def phases():
        return (core.read_persistent_volume(pv).status.phase,
                core.read_namespaced_persistent_volume_claim(pvc, ns).status.phase)

    eventually(lambda: phases() == ("Bound", "Bound"), f"PV {pv} and PVC {pvc} Bound")
    claim = core.read_namespaced_persistent_volume_claim(pvc, ns)
    volume = core.read_persistent_volume(pv)
    assert volume.spec.claim_ref.uid == claim.metadata.uid
    assert claim.spec.volume_name == pv
    assert claim.status.access_modes == ["ReadOnlyMany"]


def test_statefulset_creates_its_pods(kube_api, kube_namespace):
    ns = kube_namespace
    apps, core = client.AppsV1Api(kube_api("admin")), client.CoreV1Api(kube_api("admin"))
    labels = {"app": "web"}
    sts = apps.create_namespaced_stateful_set(ns, body={
        "metadata": {"name": "web"},
        "spec": {
            "serviceName": "web",
            "replicas": 2,
            # all at once: OrderedReady would wait for web-0 to be Ready, and no kubelet runs it
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels},
                         "spec": {"containers": [{"name": "c", "image": "registry.example.com/app:1"}]}},
        }})

    def pods():
        return sorted(core.list_namespaced_pod(ns, label_selector="app=web").items, key=lambda p: p.metadata.name)

    eventually(lambda: len(pods()) == 2, "two pods")
    for ordinal, pod in enumerate(pods()):
        assert pod.metadata.name == f"web-{ordinal}"
        assert pod.metadata.labels["statefulset.kubernetes.io/pod-name"] == f"web-{ordinal}"
        assert pod.metadata.labels["apps.kubernetes.io/pod-index"] == str(ordinal)
        assert [(o.kind, o.name, o.uid, o.controller) for o in pod.metadata.owner_references] == [
            ("StatefulSet", "web", sts.metadata.uid, True)]
        assert pod.status.phase == "Pending"  # no kubelet


def test_job_creates_its_pod(kube_api, kube_namespace):
    ns = kube_namespace
    batch, core = client.BatchV1Api(kube_api("admin")), client.CoreV1Api(kube_api("admin"))
    job = batch.create_namespaced_job(ns, body={
        "metadata": {"name": "once"},
        "spec": {"template": {"spec": {"restartPolicy": "Never",
                                       "containers": [{"name": "c", "image": "registry.example.com/app:1"}]}}}})

    def pods():
        return core.list_namespaced_pod(ns, label_selector="batch.kubernetes.io/job-name=once").items

    eventually(lambda: pods(), "the job's pod")
    [pod] = pods()
    assert [(o.kind, o.uid) for o in pod.metadata.owner_references] == [("Job", job.metadata.uid)]
    assert pod.status.phase == "Pending"  # no kubelet


def test_approved_csr_is_signed_by_the_cluster_ca(control_plane, kube_api):
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "someone")]))
           .sign(key, hashes.SHA256()))
    certs = client.CertificatesV1Api(kube_api("admin"))
    csr_name = name("someone")
    made = certs.create_certificate_signing_request(body={
        "metadata": {"name": csr_name},
        "spec": {"request": base64.b64encode(csr.public_bytes(serialization.Encoding.PEM)).decode(),
                 "signerName": "kubernetes.io/kube-apiserver-client", "expirationSeconds": 600,
                 "usages": ["client auth"]}})
    made.status.conditions = [client.V1CertificateSigningRequestCondition(
        type="Approved", status="True", reason="Test", message="approved by the test")]
    certs.replace_certificate_signing_request_approval(csr_name, made)

    issued = eventually(lambda: certs.read_certificate_signing_request(csr_name).status.certificate,
                        "the certificate issued")
    cert = x509.load_pem_x509_certificate(base64.b64decode(issued))
    ca = x509.load_pem_x509_certificate(control_plane.ca_file.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "someone"
