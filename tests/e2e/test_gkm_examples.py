"""End to end: GKM's own manifests (examples/gkm/) applied unchanged to a real cluster.

All real peers on 127.0.0.1: the session's kube-apiserver + etcd + kube-controller-manager, the
local registry (standing in for quay.io and registry.example.com:5000 through
``--registry-mirror``), the real ``accelnode controller`` as a subprocess with the controller
identity, serving daemonsets/webhooks-gkm.yaml as shipped (each ``clientConfig`` pointed at its
loopback address with a test CA's ``caBundle``, as bench/bench_controller.py does), and a
simulated TPU v5e node running the real ``accelnode agent`` (reporting as ``--node-name``) and
``accelnode csi`` (resolving caches by name through the API as the "csi" identity; no
``--trust-pod-image-attribute``).

The journey, in order (the tests share one module-scoped world and run top to bottom):

1. ``kubectl apply -f examples/gkm/`` from the repository (its README's scenarios): the caches naming
   ``quay.io/gkm/cache-examples:vector-add-cache-rocm-v2`` are pinned to the digest pushed there,
   the digest-pinned ``jax-kernels-v6e`` names a digest no registry holds, and a digest is asked
   about like a tag (docs/security.md): ImageNotFound, never pinned, never pulled; a PV/PVC pair
   per workload namespace is Bound.
2. kubelet-shaped publishes: inline by name (the GKMCache) and by claim (the ClusterGKMCache's
   PV in tpu-training); read-only mounts of the pushed files; the node objects and the caches'
   counts follow the pods; unpublish moves them back.
3. leader failover (SIGKILL; a second controller takes the Lease) and a roll of the GKMCache's
   tag pinned by the new leader.
4. kube-apiserver stopped and started: the controller and the driver's cache view recover, a
   publish after it mounts the rolled digest.

The image content is a stand-in: a small JAX cache built for tpu/v5e (so it fits the simulated
node), pushed under the repository and tags the examples name; the real ROCm kernels are not
needed to exercise the journey. The examples carry GKM's ``gkm.io/signature-format`` label, so,
as on a cluster that means it, the stand-in images are signed by the real cosign (v2 ``.sig``, as
the label says) and a ClusterCacheTrustPolicy trusts that key for the example namespaces and
cluster caches: a signature is checked before anything is pulled (docs/signatures.md).
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from kubernetes import client

from tests.rigs import devcluster
from controller.caches.pinning import DIGEST_ANNOTATION
from csi_driver import mounts
from csi_driver.api import agent as agent_api
from csi_driver.api import csi
from accelnode.oci import signatures as sg
from tests.agent.conftest import eventually, make_cache
from tests.cache.cosign import Cosign
from tests.conftest import ROOT, require_root
from tests.controller.conftest import ControllerProc, lease_spec, remove_webhooks, serve_webhooks
from tests.controller.test_webhook_server import CA
from tests.controller.test_caches import GKM, cond, status
from tests.controller.test_claims import Cluster, pv_name, reason_in
from tests.csi.conftest import Node, Volume, free_ports
from tests.csi.test_by_name import publish_until, readyz
from tests.fixtures.cluster import load_manifests

Code = grpc.StatusCode
EXAMPLES = ROOT / "examples" / "gkm"
REPO = "gkm/cache-examples"  # what the examples name on quay.io, served by our registry
TAG, ROLLED_TAG = "vector-add-cache-rocm-v2", "vector-add-cache-rocm-v3"
NS_INFERENCE, NS_TRAINING = "tpu-inference", "tpu-training"
POLICY = "e2e-gkm-examples"  # the ClusterCacheTrustPolicy trusting the stand-in images' signing key
VECTOR_ADD = "vector-add-cache-rocm"  # GKMCache in tpu-inference
JAX = "jax-kernels-v6e"  # GKMCache in tpu-inference, pinned by a digest no registry holds
JAX_DIGEST = "sha256:4c4e6bb3f7ee5f1bc0c4bd1b8b6b3c37e7d0c1a5d0e8c3e5b0f0a0b1c2d3e4f5"
CLUSTER = "vector-add-cache-rocm-v2-rwo"  # ClusterGKMCache for tpu-inference and tpu-training
ROX = "vector-add-cache-rocm-rox"  # 30-cache-stuck-pending.yaml: ReadOnlyMany on a class without it
NEXT = "vector-add-cache-rocm-next"  # 30-cache-stuck-pending.yaml: a tag never pushed
NODE = f"e2e-{uuid.uuid4().hex[:8]}"
WAIT = 90  # seconds: a bound on resolution, binding, pulls and recovery, never a measurement
FAST = ("--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "1")
# the second leader outlives an API server restart without losing its Lease
PATIENT = ("--lease-duration", "90", "--renew-deadline", "60", "--retry-period", "1")
WEBHOOKS = ROOT / "daemonsets" / "webhooks-gkm.yaml"
CONTROLLER_USER = next(i.user for i in devcluster.IDENTITIES if i.name == "controller")


@dataclass
class Pushed:
    digest: str
    files: dict[str, bytes]  # path below io.jax.cache/ -> content


class World:
    """Everything the journey set up; ``cluster`` is the admin's view (tests/controller)."""

    def __init__(self, kube_api, control_plane, registry, tmp: Path):
        api = kube_api("admin")
        self.core, self.objs = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.admission = client.AdmissionregistrationV1Api(api)
        self.cluster = Cluster(kube_api, control_plane, [])
        self.cp, self.registry, self.tmp = control_plane, registry, tmp
        self.images: dict[str, Pushed] = {}
        self.ca = CA()
        (tmp / "tls").mkdir()
        self.cert, self.key, _ = self.ca.serving(tmp / "tls", "accelnode-controller")
        self.webhook_port = free_ports(1)[0]
        self.controllers: list[ControllerProc] = []
        self.node: Node | None = None
        self.applied: subprocess.CompletedProcess | None = None  # the apply of examples/gkm/

    # -- the controller ----------------------------------------------------------------------------

    def start_controller(self, identity: str, *timing: str) -> ControllerProc:
        host = self.registry.host
        c = ControllerProc(self.cp, self.tmp, identity, *timing,
                           "--webhook-address", f"127.0.0.1:{self.webhook_port}",
                           "--tls-cert-file", self.cert, "--tls-key-file", self.key, "--plain-http",
                           "--registry-mirror", f"quay.io={host}",
                           "--registry-mirror", f"registry.example.com:5000={host}").start()
        self.controllers.append(c)
        assert eventually(lambda: c.proc.poll() is not None or lease_spec(self.cluster_client()).get(
            "holderIdentity") == identity, timeout=WAIT), f"{identity} did not lead:\n{c.log()}"
        assert c.proc.poll() is None, f"{identity} exited:\n{c.log()}"
        return c

    def cluster_client(self):
        from accelnode.kube.client import Client, Config

        if not hasattr(self, "_admin"):
            self._admin = Client(Config.from_kubeconfig(self.cp.kubeconfig("admin")))
        return self._admin

    def register_webhooks(self) -> None:
        serve_webhooks(self.admission, [WEBHOOKS], self.webhook_port, self.ca.pem)

    def delete_webhooks(self) -> None:
        remove_webhooks(self.admission, [WEBHOOKS])

    def webhooks_called(self) -> bool:
        """A dry-run create of each kind comes back pinned (the API server picks webhook
        configurations up asynchronously)."""
        image = f"quay.io/{REPO}@{self.images[TAG].digest}"
        body = {"apiVersion": "gkm.io/v1alpha1", "metadata": {"name": "probe"}, "spec": {"image": image}}
        try:
            a = self.objs.create_namespaced_custom_object(*GKM, "default", "gkmcaches", dry_run="All",
                                                          body={**body, "kind": "GKMCache"})
            b = self.objs.create_cluster_custom_object(*GKM, "clustergkmcaches", dry_run="All",
                                                       body={**body, "kind": "ClusterGKMCache"})
        except client.ApiException:
            return False
        return all(DIGEST_ANNOTATION in (o["metadata"].get("annotations") or {}) for o in (a, b))

    # -- reading -----------------------------------------------------------------------------------

    def cache(self, name: str, namespace: str | None = None) -> dict | None:
        return self.cluster.get(name, namespace)

    def node_object(self, namespace: str | None) -> dict | None:
        try:
            if namespace:
                return self.objs.get_namespaced_custom_object(*GKM, namespace, "gkmcachenodes", NODE)
            return self.objs.get_cluster_custom_object(*GKM, "clustergkmcachenodes", NODE)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def node_entry(self, namespace: str | None, name: str, digest: str) -> dict:
        obj = self.node_object(namespace) or {}
        return ((status(obj).get("caches") or {}).get(name) or {}).get(digest) or {}

    def store_digests(self) -> set[str]:
        listing = self.node.agent_stub().ListCaches(agent_api.ListCachesRequest(), timeout=10)
        return {c.digest for c in listing.caches}


def counts(obj: dict | None) -> tuple:
    c = status(obj or {}).get("counts") or {}
    return c.get("nodeCnt"), c.get("nodeInUseCnt"), c.get("podRunningCnt")


def pinned(obj: dict | None, digest: str) -> bool:
    if not obj:
        return False
    return (status(obj).get("resolvedDigest") == digest
            and (obj["metadata"].get("annotations") or {}).get(DIGEST_ANNOTATION) == digest
            and cond(obj, "Resolved").get("status") == "True")


@dataclass
class ClaimVolume(Volume):
    """A pod's ``persistentVolumeClaim`` volume as kubelet publishes it: the PV's volumeHandle
    as the volume id, its attributes plus the pod's, read-only as the PV says."""

    handle: str = ""
    attributes: dict | None = None

    @property
    def volume_id(self) -> str:
        return self.handle

    def context(self) -> dict[str, str]:
        return {**(self.attributes or {}), "csi.storage.k8s.io/pod.name": self.pod_name,
                "csi.storage.k8s.io/pod.namespace": self.pod_namespace, "csi.storage.k8s.io/pod.uid": self.pod_uid,
                "csi.storage.k8s.io/serviceAccount.name": "default", "csi.storage.k8s.io/ephemeral": "false"}

    def publish_request(self, **overrides) -> csi.NodePublishVolumeRequest:
        mode = csi.VolumeCapability.AccessMode(mode=csi.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY)
        return super().publish_request(readonly=True, volume_capability=csi.VolumeCapability(
            mount=csi.VolumeCapability.MountVolume(), access_mode=mode), **overrides)


def assert_mounted(vol: Volume, image: Pushed) -> None:
    top = mounts.top_mount(vol.target)
    assert top is not None and "ro" in top.options, top
    got = {str(p.relative_to(vol.target / "io.jax.cache")): p.read_bytes()
           for p in (vol.target / "io.jax.cache").rglob("*") if p.is_file()}
    assert got == image.files


# -- the world ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(control_plane, kube_api, kubectl, crds, registry, tmp_path_factory):
    require_root()
    rbac = [a for f in sorted((ROOT / "daemonsets").glob("rbac-controller*.yaml")) for a in ("-f", str(f))]
    out = kubectl("admin", "apply", "-f", str(ROOT / "daemonsets/namespace.yaml"), *rbac,
                  "-f", str(ROOT / "daemonsets/rbac-csi.yaml"), "-f", str(ROOT / "daemonsets/rbac-agent.yaml"))
    assert out.returncode == 0, out.stderr
    tmp = tmp_path_factory.mktemp("e2e")
    w = World(kube_api, control_plane, registry, tmp)
    for tag, seed in ((TAG, b"\x01"), (ROLLED_TAG, b"\x02")):  # stand-in content, see the docstring
        files = {"xla/vector_add.bin": seed * 4096, "xla/index.txt": f"vector-add {tag}\n".encode()}
        ref = registry.push(make_cache(tmp / "src" / tag, files), REPO, tag=tag, kind="jax",
                            targets=[{"backend": "tpu", "arch": "v5e"}])
        w.images[tag] = Pushed(ref.rsplit("@", 1)[1], files)
    cosign = Cosign(tmp)
    key, pub = cosign.keypair("e2e")
    for pushed in w.images.values():
        cosign.sign(f"{registry.host}/{REPO}@{pushed.digest}", key, sg.V2)
    policies = client.CustomObjectsApi(kube_api("admin"))
    policies.create_cluster_custom_object("accelnode.io", "v1alpha1", "clustercachetrustpolicies", body={
        "apiVersion": "accelnode.io/v1alpha1", "kind": "ClusterCacheTrustPolicy", "metadata": {"name": POLICY},
        "spec": {"namespaces": [NS_INFERENCE, NS_TRAINING], "clusterCaches": True,
                 "keys": [{"name": "e2e", "publicKey": pub}]}})
    applied = False
    try:
        w.start_controller("e2e-1", *FAST)
        w.register_webhooks()
        assert eventually(w.webhooks_called, timeout=WAIT), w.controllers[-1].log()
        w.core.create_node(body={"metadata": {"name": NODE}})  # the agent's objects get it as owner
        # example objects another test left behind would make the apply below an update, not
        # the create whose admission pins the digest
        leftovers = [o for o in load_manifests(*sorted(EXAMPLES.glob("*.yaml"))) if o["kind"] != "Namespace"]
        out = kubectl("admin", "delete", "--ignore-not-found", "--wait=true", "--timeout=45s", "-f", "-",
                      stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": leftovers}))
        assert out.returncode == 0, out.stderr
        # the manifests as users have them: the repository's files, not copies
        assert not subprocess.run(["git", "status", "--porcelain", "--", str(EXAMPLES)], cwd=ROOT,
                                  capture_output=True, text=True, check=True).stdout, "examples/gkm/ is modified"
        out = kubectl("admin", "apply", "-f", str(EXAMPLES))
        assert out.returncode == 0, out.stderr
        applied = True
        w.applied = out
        assert f"gkmcache.gkm.io/{VECTOR_ADD} created" in out.stdout, out.stdout
        yield w
    finally:
        try:
            teardown(w, kubectl, applied)
        finally:
            policies.delete_cluster_custom_object("accelnode.io", "v1alpha1", "clustercachetrustpolicies", POLICY)


def teardown(w: World, kubectl, applied: bool) -> None:
    """Unmount, stop the node, delete the examples while the controller still runs (its finalizer
    lets go), then the webhooks and the controller; leave the session's cluster as found."""
    errors = []
    if w.node is not None:
        w.node.close()  # stops the driver and the agent, unmounts what is left
        if [m for m in mounts.mount_points() if m.startswith(str(w.node.root) + "/")]:
            errors.append("mounts left behind")
    try:
        if applied:
            if w.controllers and all(c.proc.poll() is not None for c in w.controllers):
                # as a Deployment would: a controller must run for the claims finalizer to go
                errors.append(f"no controller running at teardown:\n{w.controllers[-1].log()[-3000:]}")
                w.start_controller("e2e-cleanup", *FAST)
            out = kubectl("admin", "delete", "-f", str(EXAMPLES), "--wait=false", "--ignore-not-found")
            if out.returncode != 0:
                errors.append(out.stderr)
            gone = eventually(lambda: all(w.cache(n, ns) is None for ns, n in (
                (NS_INFERENCE, VECTOR_ADD), (NS_INFERENCE, JAX), (None, CLUSTER))), timeout=WAIT)
            if not gone:
                left = [w.cache(VECTOR_ADD, NS_INFERENCE), w.cache(JAX, NS_INFERENCE), w.cache(CLUSTER)]
                errors.append(f"caches still there after {WAIT}s: {left}")
            if not eventually(lambda: all(w.cluster.namespace_gone(ns) for ns in (NS_INFERENCE, NS_TRAINING)),
                              timeout=WAIT):
                errors.append("the example namespaces are still there")
    finally:
        w.delete_webhooks()
        for c in w.controllers:
            c.terminate()  # releases the Lease for the next test
        w.cluster.scrub()  # claims or finalizers the controller gave other tests' leftovers
        for delete in (lambda: w.objs.delete_cluster_custom_object(*GKM, "clustergkmcachenodes", NODE),
                       lambda: w.core.delete_node(NODE)):
            try:
                delete()
            except client.ApiException as e:
                if e.status != 404:
                    raise
    assert not errors, errors


@pytest.fixture(scope="module")
def node(world, control_plane, tmp_path_factory):
    """The simulated v5e node: agent (reporting as NODE, pulling through the mirrors) and the CSI
    driver looking caches up by name as "csi"."""
    n = Node(tmp_path_factory.mktemp("node"))
    world.node = n
    host = world.registry.host
    n.set_agent_flags("--node-name", NODE, "--kubeconfig", str(control_plane.kubeconfig("agent")),
                      "--registry-mirror", f"quay.io={host}", "--registry-mirror", f"registry.example.com:5000={host}",
                      # the endpoint is the registry these images live in, with its own access rules
                      "--mirror-enforces-access", host, "--status-resync", "5")
    n.set_csi_flags("--kubeconfig", str(control_plane.kubeconfig("csi")), "--plugins-registry", "")
    n.csi.argv = [NODE if a == "node-a" else a for a in n.csi.argv]
    assert "--trust-pod-image-attribute" not in n.csi.argv
    n.agent.start()
    n.csi.start()
    assert eventually(lambda: readyz(n)[0] == 200, timeout=WAIT), readyz(n)
    return n


# -- the journey -------------------------------------------------------------------------------------


def test_examples_are_resolved_and_their_claims_bound(world):
    v2 = world.images[TAG].digest
    got = eventually(lambda: pinned(o := world.cache(VECTOR_ADD, NS_INFERENCE), v2) and o, timeout=WAIT)
    assert got, world.cache(VECTOR_ADD, NS_INFERENCE)
    assert got["spec"]["image"] == f"quay.io/{REPO}:{TAG}"  # the user's spec is left as written
    got = eventually(lambda: pinned(o := world.cache(CLUSTER), v2) and o, timeout=WAIT)
    assert got, world.cache(CLUSTER)

    # a digest the registry does not hold: naming it pins nothing, and nothing ever pulls it
    jax = eventually(lambda: cond(o := world.cache(JAX, NS_INFERENCE), "Resolved").get("reason") == "ImageNotFound"
                     and o, timeout=WAIT)
    assert jax, world.cache(JAX, NS_INFERENCE)
    assert cond(jax, "Resolved")["status"] == "False" and not status(jax).get("resolvedDigest")

    for cache_ns, name, workload in ((NS_INFERENCE, VECTOR_ADD, NS_INFERENCE), (NS_INFERENCE, JAX, NS_INFERENCE),
                                     (None, CLUSTER, NS_INFERENCE), (None, CLUSTER, NS_TRAINING)):
        assert eventually(lambda: reason_in(world.cache(name, cache_ns), workload) == "Bound", timeout=WAIT), \
            world.cache(name, cache_ns)
        pvc, pv = world.cluster.pvc(workload, name), world.cluster.pv(pv_name(cache_ns, name, workload))
        assert (pvc.status.phase, pv.status.phase) == ("Bound", "Bound")
        assert pvc.spec.volume_name == pv.metadata.name and pv.spec.claim_ref.uid == pvc.metadata.uid
        # GKM's storageClassName "standard" / ReadWriteOnce are ignored: read-only CSI claims
        assert pvc.spec.access_modes == ["ReadOnlyMany"] and pv.spec.csi.driver == "csi.gkm.io"


def test_a_cache_stuck_pending_on_gkm_is_bound_here_or_says_why(world):
    """examples/gkm/30-cache-stuck-pending.yaml (examples/gkm/README.md): ReadOnlyMany on a
    StorageClass without it is pinned and its claim Bound; the never-pushed tag was admitted with
    a warning and says ImageNotFound, by name, in its conditions."""
    v2 = world.images[TAG].digest
    assert eventually(lambda: pinned(world.cache(ROX, NS_INFERENCE), v2), timeout=WAIT), world.cache(ROX, NS_INFERENCE)
    assert eventually(lambda: reason_in(world.cache(ROX, NS_INFERENCE), NS_INFERENCE) == "Bound", timeout=WAIT), \
        world.cache(ROX, NS_INFERENCE)
    assert world.cluster.pvc(NS_INFERENCE, ROX).spec.access_modes == ["ReadOnlyMany"]

    got = eventually(lambda: cond(o := world.cache(NEXT, NS_INFERENCE), "Resolved").get("reason") == "ImageNotFound"
                     and o, timeout=WAIT)
    assert got, world.cache(NEXT, NS_INFERENCE)
    assert cond(got, "Resolved")["status"] == "False" and f"{REPO}:vector-add-cache-rocm-v4" in cond(
        got, "Resolved")["message"], got
    assert cond(got, "Ready")["reason"] == "Unresolved" and not status(got).get("resolvedDigest")
    assert "gkm.io/resolvedDigest not set" in world.applied.stderr, world.applied.stderr  # the apply's warning


def test_the_stuck_cache_heals_once_its_tag_is_pushed(world, registry, kubectl):
    """examples/gkm/README.md's promise for the never-pushed tag: push it, and the cache is
    pinned. ImageNotFound is retried with the controller's backoff (up to 5 minutes apart); any
    edit of the cache retries at once (its admission pins it), which is what the test does, as a
    user in a hurry would."""
    tag = "vector-add-cache-rocm-v4"
    files = {"xla/vector_add.bin": b"\x04" * 4096, "xla/index.txt": f"vector-add {tag}\n".encode()}
    ref = registry.push(make_cache(world.tmp / "src" / tag, files), REPO, tag=tag, kind="jax",
                        targets=[{"backend": "tpu", "arch": "v5e"}])
    digest = ref.rsplit("@", 1)[1]
    try:
        out = kubectl("admin", "annotate", "gkmcache", NEXT, "-n", NS_INFERENCE, "example.com/nudge=1")
        assert out.returncode == 0, out.stderr
        assert eventually(lambda: pinned(world.cache(NEXT, NS_INFERENCE), digest), timeout=WAIT), \
            world.cache(NEXT, NS_INFERENCE)
        assert cond(world.cache(NEXT, NS_INFERENCE), "Ready").get("reason") != "Unresolved"
    finally:
        # the registry is the session's: other tests (tests/node/test_examples.py) need this tag missing
        req = urllib.request.Request(f"http://{registry.host}/v2/{REPO}/manifests/{digest}", method="DELETE")
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 202, resp.status


def test_a_kubelet_shaped_publish_mounts_the_pinned_digest(world, node):
    v2 = world.images[TAG]
    # (a) an inline volume naming the GKMCache
    inline = node.volume("", pod_namespace=NS_INFERENCE, cache=VECTOR_ADD, cache_namespace=NS_INFERENCE,
                         pod_name="inference-0")
    assert publish_until(node, inline) == Code.OK, node.csi.log()[-3000:]
    assert_mounted(inline, v2)
    assert node.references()[inline.volume_id] == v2.digest

    # (b) the ClusterGKMCache's claim in tpu-training, as kubelet publishes the bound PV
    pv = world.cluster.pv(pv_name(None, CLUSTER, NS_TRAINING))
    claim = ClaimVolume(node.kubelet_dir, NS_TRAINING, CLUSTER, "", None, pod_name="training-0",
                        name=pv.metadata.name, handle=pv.spec.csi.volume_handle,
                        attributes=dict(pv.spec.csi.volume_attributes))
    assert claim.handle == f"gkmcache:{CLUSTER}:{NS_TRAINING}"
    assert publish_until(node, claim) == Code.OK, node.csi.log()[-3000:]
    assert_mounted(claim, v2)
    assert node.references()[claim.volume_id] == v2.digest
    assert world.store_digests() == {v2.digest}  # one copy, the pushed digest, nothing else

    for ns, name in ((NS_INFERENCE, VECTOR_ADD), (None, CLUSTER)):
        assert eventually(lambda: world.node_entry(ns, name, v2.digest).get("state") == "Running",
                          timeout=WAIT), world.node_object(ns)
        assert eventually(lambda: counts(world.cache(name, ns)) == (1, 1, 1), timeout=WAIT), world.cache(name, ns)
    assert JAX not in (status(world.node_object(NS_INFERENCE)).get("caches") or {})
    assert JAX_DIGEST not in world.store_digests()
    log = (world.registry.workdir / "registry.log").read_text(errors="replace")
    # only its manifest was asked for (the pin: 404), never a blob: never pulled
    asked = [ln for ln in log.splitlines() if "caches/jax-kernels" in ln and '"GET ' in ln]
    # (through the --registry-mirror endpoint, so with ?ns=registry.example.com:5000)
    assert asked and all(f"/manifests/{JAX_DIGEST} " in ln or f"/manifests/{JAX_DIGEST}?ns=" in ln
                         for ln in asked), asked
    assert cond(world.cache(JAX, NS_INFERENCE), "Resolved")["reason"] == "ImageNotFound"

    for vol in (inline, claim):
        node.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
        assert not vol.target.exists()
    for ns, name in ((NS_INFERENCE, VECTOR_ADD), (None, CLUSTER)):
        assert eventually(lambda: world.node_entry(ns, name, v2.digest).get("state") == "Extracted",
                          timeout=WAIT), world.node_object(ns)
        assert eventually(lambda: counts(world.cache(name, ns)) == (1, 0, 0), timeout=WAIT), world.cache(name, ns)


def test_a_new_leader_pins_a_roll(world, node):
    first = world.controllers[0]
    first.stop()  # SIGKILL: no release, the Lease runs out
    second = world.start_controller("e2e-2", *PATIENT)
    assert lease_spec(world.cluster_client())["holderIdentity"] == "e2e-2"
    assert eventually(world.webhooks_called, timeout=WAIT), second.log()

    v3 = world.images[ROLLED_TAG].digest
    world.objs.patch_namespaced_custom_object(*GKM, NS_INFERENCE, "gkmcaches", VECTOR_ADD,
                                              body={"spec": {"image": f"quay.io/{REPO}:{ROLLED_TAG}"}})
    assert eventually(lambda: pinned(world.cache(VECTOR_ADD, NS_INFERENCE), v3), timeout=WAIT), \
        world.cache(VECTOR_ADD, NS_INFERENCE)
    assert status(world.cache(CLUSTER))["resolvedDigest"] == world.images[TAG].digest  # the other stays


def test_after_an_apiserver_restart_the_controller_and_the_driver_recover(world, node, control_plane):
    second = world.controllers[-1]
    control_plane.stop_apiserver()
    control_plane.start_apiserver()
    assert second.proc.poll() is None, second.log()[-3000:]
    assert eventually(lambda: readyz(node)[0] == 200, timeout=WAIT), readyz(node)

    v3 = world.images[ROLLED_TAG]
    vol = node.volume("", pod_namespace=NS_INFERENCE, cache=VECTOR_ADD, cache_namespace=NS_INFERENCE,
                      pod_name="inference-1")
    assert publish_until(node, vol) == Code.OK, node.csi.log()[-3000:]
    assert_mounted(vol, v3)
    assert node.references()[vol.volume_id] == v3.digest
    # the old digest stays on the node: the ClusterGKMCache still names it
    assert world.store_digests() == {v3.digest, world.images[TAG].digest}
    # the controller, after the restart, sums the node's new state into the cache
    assert eventually(lambda: counts(world.cache(VECTOR_ADD, NS_INFERENCE)) == (1, 1, 1), timeout=WAIT), \
        world.cache(VECTOR_ADD, NS_INFERENCE)
    assert lease_spec(world.cluster_client())["holderIdentity"] == "e2e-2"
    node.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    assert not vol.target.exists()
