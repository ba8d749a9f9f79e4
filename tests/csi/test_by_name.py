"""The driver resolves a volume's cache by name through the real API server, as the "csi"
identity with daemonsets/rbac-csi.yaml applied: the image and the namespace come from the cache
object only. Cache objects and their status (the controller's pin) are written by the admin."""

from __future__ import annotations

import datetime as dt
import subprocess
import uuid

import grpc
import pytest

from tests.conftest import accelnode_cmd, http_get

from .conftest import code_of, error_of, eventually

Code = grpc.StatusCode
GROUP, VERSION = "gkm.io", "v1alpha1"


@pytest.fixture(scope="session")
def csi_rbac(kubectl, crds):
    out = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-csi.yaml")
    assert out.returncode == 0, out.stderr


@pytest.fixture
def objects(kube_api, csi_rbac):
    from kubernetes import client

    return client.CustomObjectsApi(kube_api("admin"))


@pytest.fixture
def namespaces(kube_api):
    """Two fresh namespaces, A and B."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api("admin"))
    names = [f"t-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    for name in names:
        core.create_namespace(body={"metadata": {"name": name}})
    return names


def readyz(node) -> tuple[int, str]:
    return http_get(node.csi_metrics_port, "/readyz")


def start_by_name(node, control_plane, identity: str = "csi", *flags: str):
    # no kubelet here to confirm a registration: /readyz then speaks of the cache view alone
    node.set_csi_flags("--kubeconfig", str(control_plane.kubeconfig(identity)), "--plugins-registry", "", *flags)
    node.agent.start()
    node.csi.start()
    return node


@pytest.fixture
def by_name(node, control_plane, csi_rbac):
    """Agent and driver running; the driver looks caches up as "csi" and has read them."""
    start_by_name(node, control_plane)
    assert eventually(lambda: readyz(node)[0] == 200), readyz(node)
    return node


def repo_of(image: str) -> str:
    return image.split("@", 1)[0]


def digest_of(image: str) -> str:
    return image.split("@", 1)[1]


def make_cache(objects, name: str, image: str, namespace: str | None = None, **spec) -> dict:
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GKMCache" if namespace else "ClusterGKMCache",
            "metadata": {"name": name}, "spec": {"image": image, **spec}}
    if namespace:
        return objects.create_namespaced_custom_object(GROUP, VERSION, namespace, "gkmcaches", body)
    return objects.create_cluster_custom_object(GROUP, VERSION, "clustergkmcaches", body)


def write_status(objects, name: str, status: dict, namespace: str | None = None) -> None:
    """What the controller would write, through the status subresource."""
    if namespace:
        objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "gkmcaches", name,
                                                      {"status": status})
    else:
        objects.patch_cluster_custom_object_status(GROUP, VERSION, "clustergkmcaches", name, {"status": status})


def condition(type_: str, status: str, reason: str, message: str) -> dict:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": now}


def verdict(digest: str, policies: list[str], verified: bool = True, reason: str = "Verified") -> dict:
    """The status fields the controller writes for a verdict (``status.verification``, the data
    nodes act on, and the ``Verified`` condition that tells people)."""
    from accelnode.oci.refusal import Verdict

    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"verification": Verdict(digest, tuple(policies), verified, reason, now).to_status(),
            "conditions": [condition("Verified", "True" if verified else "False", reason, f"by the test: {reason}")]}


def pinned_cache(objects, name: str, image: str, namespace: str | None = None, **spec) -> None:
    """A cache whose spec.image is a tag and whose status pins the digest (a resolved cache)."""
    make_cache(objects, name, repo_of(image) + ":latest", namespace, **spec)
    write_status(objects, name, {"resolvedDigest": digest_of(image),
                                 "conditions": [condition("Resolved", "True", "Resolved", "pinned")]}, namespace)


def publish_until(node, vol, want=Code.OK) -> grpc.StatusCode:
    """Publish until the answer is ``want`` (the driver's view follows the API by watch); the last
    answer's code."""
    stub, last = node.node_stub(), None

    def check() -> bool:
        nonlocal last
        last = code_of(stub.NodePublishVolume, vol.publish_request())
        return last == want

    eventually(check)
    return last


def test_publish_by_name_mounts_the_pinned_digest(by_name, objects, namespaces, images):
    a, _ = namespaces
    pinned_cache(objects, "kernels", images.tpu, a)
    vol = by_name.volume("", pod_namespace=a, cache="kernels", cache_namespace=a)
    assert publish_until(by_name, vol) == Code.OK
    assert by_name.references()[vol.volume_id] == digest_of(images.tpu)
    assert (vol.target / "io.jax.cache" / "xla" / "index.txt").read_bytes() == b"m1\n"
    by_name.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert not vol.target.exists()


def test_another_namespace_cannot_mount_the_cache(by_name, objects, namespaces, images):
    a, b = namespaces
    pinned_cache(objects, "kernels", images.tpu, a)
    stub = by_name.node_stub()
    mine = by_name.volume("", pod_namespace=a, cache="kernels", cache_namespace=a)
    assert publish_until(by_name, mine) == Code.OK
    # naming it with its namespace (the attribute says A, the pod is in B)
    err = error_of(stub.NodePublishVolume, by_name.volume("", pod_namespace=b, cache="kernels",
                                                         cache_namespace=a).publish_request())
    assert err.code() == Code.PERMISSION_DENIED and f"pods in namespace {a}" in err.details()
    # claiming it is B's: there is no B/kernels
    err = error_of(stub.NodePublishVolume, by_name.volume("", pod_namespace=b, cache="kernels",
                                                         cache_namespace=b).publish_request())
    assert err.code() == Code.NOT_FOUND and f"GKMCache {b}/kernels does not exist" in err.details()
    # no namespace: a ClusterGKMCache of that name, and there is none
    err = error_of(stub.NodePublishVolume, by_name.volume("", pod_namespace=b, cache="kernels",
                                                         cache_namespace=None).publish_request())
    assert err.code() == Code.NOT_FOUND and "ClusterGKMCache kernels does not exist" in err.details()
    # bringing the image along: refused, whoever asks (the image comes from the cache object)
    for ns, cache_ns in ((b, b), (b, None), (a, a)):
        vol = by_name.volume(images.tpu, pod_namespace=ns, cache="kernels", cache_namespace=cache_ns)
        err = error_of(stub.NodePublishVolume, vol.publish_request())
        assert err.code() == Code.INVALID_ARGUMENT, err.details()
        assert "csi.gkm.io/image is refused" in err.details() and "--trust-pod-image-attribute" in err.details()
        assert not vol.target.exists()
    assert list(by_name.references()) == [mine.volume_id]


def test_cluster_cache_only_for_its_workload_namespaces(by_name, objects, namespaces, images):
    a, b = namespaces
    listed, open_to_all = f"shared-{uuid.uuid4().hex[:8]}", f"open-{uuid.uuid4().hex[:8]}"
    pinned_cache(objects, listed, images.cluster_tpu, workloadNamespaces=[a])
    pinned_cache(objects, open_to_all, images.cluster_tpu)
    ok = by_name.volume("", pod_namespace=a, cache=listed, cache_namespace=None)
    assert publish_until(by_name, ok) == Code.OK
    assert by_name.references()[ok.volume_id] == digest_of(images.cluster_tpu)
    err = error_of(by_name.node_stub().NodePublishVolume,
                   by_name.volume("", pod_namespace=b, cache=listed, cache_namespace=None).publish_request())
    assert err.code() == Code.PERMISSION_DENIED
    assert f"pods in namespaces {a} (spec.workloadNamespaces)" in err.details() and f"pod {b}/" in err.details()
    anyone = by_name.volume("", pod_namespace=b, cache=open_to_all, cache_namespace=None)
    assert publish_until(by_name, anyone) == Code.OK


def test_unresolved_cache_is_unavailable_until_the_status_pins_it(by_name, objects, namespaces, images):
    a, _ = namespaces
    make_cache(objects, "later", repo_of(images.tpu) + ":latest", a)
    vol = by_name.volume("", pod_namespace=a, cache="later", cache_namespace=a)
    stub = by_name.node_stub()
    assert publish_until(by_name, vol, Code.UNAVAILABLE) == Code.UNAVAILABLE
    err = error_of(stub.NodePublishVolume, vol.publish_request())
    assert "not pinned yet" in err.details()
    write_status(objects, "later", {"conditions": [condition("Resolved", "False", "RegistryUnavailable",
                                                             "registry timed out")]}, a)
    assert eventually(lambda: "RegistryUnavailable" in error_of(stub.NodePublishVolume,
                                                                vol.publish_request()).details())
    assert not vol.target.exists() and vol.volume_id not in by_name.references()
    write_status(objects, "later", {"resolvedDigest": digest_of(images.tpu),
                                    "conditions": [condition("Resolved", "True", "Resolved", "pinned")]}, a)
    assert publish_until(by_name, vol) == Code.OK  # the view learns the pin from its watch
    assert by_name.references()[vol.volume_id] == digest_of(images.tpu)


def test_digest_pinned_spec_needs_no_status_but_a_stale_pin_waits(by_name, objects, namespaces, images):
    a, _ = namespaces
    make_cache(objects, "pinned", images.tpu, a)
    vol = by_name.volume("", pod_namespace=a, cache="pinned", cache_namespace=a)
    assert publish_until(by_name, vol) == Code.OK
    # spec pinned to one digest, the status to another (the controller has not caught up): wait
    make_cache(objects, "stale", images.missing, a)
    write_status(objects, "stale", {"resolvedDigest": digest_of(images.tpu)}, a)
    stale = by_name.volume("", pod_namespace=a, cache="stale", cache_namespace=a)
    stub = by_name.node_stub()
    assert eventually(lambda: "is not the digest of spec.image" in error_of(stub.NodePublishVolume,
                                                                            stale.publish_request()).details())
    assert error_of(stub.NodePublishVolume, stale.publish_request()).code() == Code.UNAVAILABLE
    assert not stale.target.exists()


def test_unknown_cache_is_not_found_and_a_deleted_one_too(by_name, objects, namespaces, images):
    a, _ = namespaces
    err = error_of(by_name.node_stub().NodePublishVolume,
                   by_name.volume("", pod_namespace=a, cache="nope", cache_namespace=a).publish_request())
    assert err.code() == Code.NOT_FOUND and f"GKMCache {a}/nope does not exist" in err.details()
    pinned_cache(objects, "brief", images.tpu, a)
    vol = by_name.volume("", pod_namespace=a, cache="brief", cache_namespace=a)
    assert publish_until(by_name, vol) == Code.OK
    objects.delete_namespaced_custom_object(GROUP, VERSION, a, "gkmcaches", "brief")
    other = by_name.volume("", pod_namespace=a, cache="brief", cache_namespace=a, pod_name="worker-1")
    assert publish_until(by_name, other, Code.NOT_FOUND) == Code.NOT_FOUND


def test_failed_verification_is_a_failed_precondition(by_name, objects, namespaces, images):
    a, _ = namespaces
    make_cache(objects, "unsigned", repo_of(images.tpu) + ":latest", a)
    refused = verdict(digest_of(images.tpu), [], False, "SignatureMissing")
    write_status(objects, "unsigned", {"resolvedDigest": digest_of(images.tpu), **refused, "conditions": [
        *refused["conditions"], condition("Resolved", "True", "Resolved", "pinned")]}, a)
    vol = by_name.volume("", pod_namespace=a, cache="unsigned", cache_namespace=a)
    assert publish_until(by_name, vol, Code.FAILED_PRECONDITION) == Code.FAILED_PRECONDITION
    err = error_of(by_name.node_stub().NodePublishVolume, vol.publish_request())
    assert "failed verification: SignatureMissing" in err.details()
    assert not vol.target.exists() and vol.volume_id not in by_name.references()


def test_not_ready_and_unavailable_until_the_caches_are_read(node, control_plane, csi_rbac, namespaces):
    """An identity that may not read caches never syncs: /readyz says so, publishes are retried."""
    a, _ = namespaces
    start_by_name(node, control_plane, "device-plugin")
    code, body = readyz(node)
    assert code == 503 and "GKMCaches, ClusterGKMCaches and ClusterCacheTrustPolicies not read from the API server yet" in body
    err = error_of(node.node_stub().NodePublishVolume,
                   node.volume("", pod_namespace=a, cache="kernels", cache_namespace=a).publish_request())
    assert err.code() == Code.UNAVAILABLE and "has not read the GKMCaches" in err.details()


def test_without_an_api_server_the_driver_needs_the_trust_flag(tmp_path):
    base = ["csi", "--endpoint", f"unix://{tmp_path}/csi.sock", "--node-id", "n", "--agent-socket",
            str(tmp_path / "agent.sock"), "--plugins-registry", ""]
    proc = subprocess.run(accelnode_cmd() + base, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("accelnode csi: no API server to look caches up in: give --kubeconfig")
    assert "--trust-pod-image-attribute" in lines[-1]
    assert not (tmp_path / "csi.sock").exists()
    proc = subprocess.run(accelnode_cmd() + base + ["--kubeconfig", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "API server configuration" in proc.stderr.strip().splitlines()[-1]
    help_text = subprocess.run(accelnode_cmd() + ["csi", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--trust-pod-image-attribute" in help_text and "trusts pod authors" in " ".join(help_text.split())
