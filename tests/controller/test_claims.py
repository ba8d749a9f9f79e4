"""The claims reconciler (controller/caches/claims.py) in-process, as the controller's identity with
daemonsets/rbac-controller-claims.yaml applied, beside the cache reconciler, against the real
kube-apiserver and kube-controller-manager (PV/PVC binding, pvc-protection, garbage collection
are theirs): a PV/PVC pair per workload namespace, bound with no provisioner; namespaces added
and removed; deletion that waits for the last pod using a claim; a user's claim of the same name
left alone; no writes in steady state."""

from __future__ import annotations

import datetime
import hashlib
import json
import time

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry

from accelnode.kube.client import Client, Config, KubeError
from accelnode.oci.registry import RegistryOptions
from controller.caches import volumes as co
from controller.caches.reconciler import clustergkmcache_reconciler, gkmcache_reconciler
from controller.caches.claims import ClaimsReconciler
from controller.runtime.runner import Controller, Metrics
from controller.caches.pinning import DIGEST_ANNOTATION, SIZE_ANNOTATION, Resolver
from controller.runtime.queue import Backoff
from csi_driver import resolve
from tests.agent.conftest import eventually
from tests.conftest import ROOT
from tests.controller.test_caches import CONTROLLER_USER, GKM, UNREACHABLE_HOST, caches_rbac, status, uid  # noqa: F401

DIGEST = "sha256:" + "ab" * 32
# pinned by the webhook's annotation (see Cluster.cache): no registry needed
IMAGE = f"{UNREACHABLE_HOST}/nowhere/kernels:v1@{DIGEST}"
HOLD = "accelnode.test/hold"  # a finalizer of the test's own: keeps an object until the test lets go
WAIT = 60  # seconds: a bound on binding, deletion and the garbage collector, never a measurement


@pytest.fixture(scope="session")
def claims_rbac(kubectl, crds):
    out = kubectl("admin", "apply", "-f", str(ROOT / "daemonsets/namespace.yaml"),
                  "-f", str(ROOT / "daemonsets/rbac-controller.yaml"),
                  "-f", str(ROOT / "daemonsets/rbac-controller-claims.yaml"))
    assert out.returncode == 0, out.stderr


def pv_name(cache_ns: str | None, name: str, workload_ns: str) -> str:
    """The contract's PV name, computed here on its own."""
    return "gkmcache-" + hashlib.sha256(f"{cache_ns or ''}/{name}/{workload_ns}".encode()).hexdigest()[:16]


def entry(obj: dict | None, ns: str) -> dict:
    return (status(obj or {}).get("pvcStatus") or {}).get(ns) or {}


def reason_in(obj: dict | None, ns: str) -> str | None:
    conds = entry(obj, ns).get("conditions") or []
    return conds[0]["reason"] if conds else None


class Cluster:
    """The admin's side: caches as users write them, and reading what the controller made."""

    def __init__(self, kube_api, control_plane, controllers: list[Controller]):
        api = kube_api("admin")
        self.core, self.objs = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.cp, self.controllers = control_plane, controllers
        self.made: list[tuple[str | None, str]] = []  # caches made by the test, deleted after it
        self.nodes: list[str] = []

    def cache(self, name: str, namespace: str | None = None, *, workload_namespaces=None, size=None) -> dict:
        # the pin's mirror (with the size), as the webhook writes it once the registry has
        # answered: a digest in spec.image alone is asked about like a tag
        md = {"name": name, "annotations": {DIGEST_ANNOTATION: DIGEST}}
        if size is not None:
            md["annotations"][SIZE_ANNOTATION] = str(size)
        body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache" if namespace else "ClusterGKMCache",
                "metadata": md, "spec": {"image": IMAGE}}
        if workload_namespaces is not None:
            body["spec"]["workloadNamespaces"] = workload_namespaces
        self.made.append((namespace, name))
        if namespace:
            return self.objs.create_namespaced_custom_object(*GKM, namespace, "gkmcaches", body=body)
        return self.objs.create_cluster_custom_object(*GKM, "clustergkmcaches", body=body)

    def get(self, name: str, namespace: str | None = None) -> dict | None:
        try:
            if namespace:
                return self.objs.get_namespaced_custom_object(*GKM, namespace, "gkmcaches", name)
            return self.objs.get_cluster_custom_object(*GKM, "clustergkmcaches", name)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def delete(self, name: str, namespace: str | None = None) -> None:
        try:
            if namespace:
                self.objs.delete_namespaced_custom_object(*GKM, namespace, "gkmcaches", name)
            else:
                self.objs.delete_cluster_custom_object(*GKM, "clustergkmcaches", name)
        except client.ApiException as e:
            if e.status != 404:
                raise

    def set_namespaces(self, name: str, namespaces: list[str]) -> None:
        self.objs.patch_cluster_custom_object(*GKM, "clustergkmcaches", name,
                                              body={"spec": {"workloadNamespaces": namespaces}})

    def pvc(self, ns: str, name: str):
        try:
            return self.core.read_namespaced_persistent_volume_claim(name, ns)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def pv(self, name: str):
        try:
            return self.core.read_persistent_volume(name)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def namespace_gone(self, ns: str) -> bool:
        try:
            self.core.read_namespace(ns)
        except client.ApiException as e:
            if e.status == 404:
                return True
            raise
        return False

    def namespace(self) -> str:
        ns = f"t-{uid()}"
        self.core.create_namespace(body={"metadata": {"name": ns}})
        return ns

    def pod_using(self, ns: str, claim: str) -> str:
        """A pod bound to a (bare) Node that names the claim: what pvc-protection counts as a
        user (it ignores pods no node has been chosen for). No kubelet runs it: it stays Pending."""
        node = f"node-{uid()}"
        self.core.create_node(body={"metadata": {"name": node}})
        self.nodes.append(node)
        pod = f"user-{uid()}"
        self.core.create_namespaced_pod(ns, body={
            "metadata": {"name": pod},
            "spec": {"nodeName": node,
                     "containers": [{"name": "c", "image": "busybox",
                                     "volumeMounts": [{"name": "k", "mountPath": "/k", "readOnly": True}]}],
                     "volumes": [{"name": "k", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}]}})
        return pod

    def writes(self, *objects: tuple[str | None, str]) -> int:
        """Successful writes by the controller identity to these objects, (namespace or None,
        name) each (audit log). Objects of the same name in other namespaces, which the
        cluster-wide reconcilers may write meanwhile (other tests' leftovers), do not count."""
        return sum(1 for w in self.writers("", *objects) if w[0] == CONTROLLER_USER)

    def writers(self, since: str, *objects: tuple[str | None, str]) -> list[tuple]:
        """Every successful write to these objects received at or after ``since`` (RFC 3339, the
        audit log's clock; "" for all), by any user: (user, verb, resource, subresource,
        namespace, name), to name who moved a resourceVersion when steady state is asserted."""
        out = []
        for line in self.cp.audit_log.read_text().splitlines():
            ev = json.loads(line)
            ref = ev.get("objectRef") or {}
            if (ev.get("stage") == "ResponseComplete" and ev.get("verb") not in ("get", "list", "watch")
                    and (ref.get("namespace"), ref.get("name")) in objects
                    and ev.get("requestReceivedTimestamp", "") >= since
                    and (ev.get("responseStatus") or {}).get("code", 0) < 400):
                out.append((ev["user"]["username"], ev["verb"], ref.get("resource"), ref.get("subresource"),
                            ref.get("namespace"), ref.get("name")))
        return out

    def reconciles(self, name: str) -> float:
        """How many times the reconciler ``name`` finished a key without error."""
        m = self.controllers[0].metrics.reconciles
        return sum(m.labels(name, outcome)._value.get() for outcome in ("success", "requeue_after"))

    def settle(self, name: str, rounds: int = 6) -> None:
        """Let the reconciler ``name`` run a few more times (resync is 0.5 s)."""
        before = self.reconciles(name)
        assert eventually(lambda: self.reconciles(name) >= before + rounds, timeout=WAIT)

    # -- after the test ----------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Delete what the test made while the reconcilers still run (so the finalizer lets go)."""
        for ns, name in self.made:
            self.delete(name, ns)
        eventually(lambda: all(self.get(name, ns) is None for ns, name in self.made), timeout=WAIT)
        for node in self.nodes:
            try:
                self.core.delete_node(node)
            except client.ApiException as e:
                if e.status != 404:
                    raise

    def scrub(self) -> None:
        """With the reconcilers stopped: leave the session as others expect it. Caches other tests
        left behind got claims and the finalizer while ours ran; take both away."""
        def gone(delete, *args) -> None:  # what the garbage collector took meanwhile is gone already
            try:
                delete(*args)
            except client.ApiException as e:
                if e.status != 404:
                    raise

        for pvc in self.core.list_persistent_volume_claim_for_all_namespaces(label_selector=co.KIND_LABEL).items:
            gone(self.core.delete_namespaced_persistent_volume_claim, pvc.metadata.name, pvc.metadata.namespace)
        for pv in self.core.list_persistent_volume(label_selector=co.KIND_LABEL).items:
            gone(self.core.delete_persistent_volume, pv.metadata.name)
        for plural in ("gkmcaches", "clustergkmcaches"):
            for obj in self.objs.list_cluster_custom_object(*GKM, plural)["items"]:
                md = obj["metadata"]
                if co.FINALIZER not in (md.get("finalizers") or []):
                    continue
                fins = [f for f in md["finalizers"] if f != co.FINALIZER]
                body = {"metadata": {"finalizers": fins or None}}
                if md.get("namespace"):
                    self.objs.patch_namespaced_custom_object(*GKM, md["namespace"], plural, md["name"], body)
                else:
                    self.objs.patch_cluster_custom_object(*GKM, plural, md["name"], body)


@pytest.fixture
def cluster(kube_api, control_plane, caches_rbac, claims_rbac):
    """Both claims reconcilers and both cache reconcilers in-process as the controller identity;
    short resync, backoff and conflict re-check so steady state is exercised often."""
    me = Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")), user_agent="accelnode-controller")
    metrics = Metrics(CollectorRegistry())
    resolver = Resolver(RegistryOptions(plain_http=True, timeout=5))
    reconcilers = [ClaimsReconciler(me, cluster=False, conflict_recheck=1.0),
                   ClaimsReconciler(me, cluster=True, conflict_recheck=1.0),
                   gkmcache_reconciler(me, resolver), clustergkmcache_reconciler(me, resolver)]
    ctls = [Controller(me, r, metrics, workers=2, resync=0.5, backoff=Backoff(0.2, 2.0)).start() for r in reconcilers]
    c = Cluster(kube_api, control_plane, ctls)
    try:
        yield c
        c.cleanup()
    finally:
        for ctl in ctls:
            ctl.stop(10)
        c.scrub()


# ---------------------------------------------------------------------------------------------


def test_a_gkmcache_gets_a_bound_claim_in_its_namespace(cluster, kube_namespace):
    ns = kube_namespace
    made = cluster.cache("kernels", ns, size=3000)
    pv_ = pv_name(ns, "kernels", ns)
    got = eventually(lambda: (o := cluster.get("kernels", ns)) and reason_in(o, ns) == "Bound"
                     and status(o).get("resolvedDigest") and o, timeout=WAIT)
    assert got, cluster.get("kernels", ns)

    pvc, pv = cluster.pvc(ns, "kernels"), cluster.pv(pv_)
    assert (pvc.status.phase, pv.status.phase) == ("Bound", "Bound")
    assert pvc.spec.volume_name == pv_ and pv.spec.claim_ref.uid == pvc.metadata.uid
    assert pvc.spec.storage_class_name == "" and not pv.spec.storage_class_name  # the server drops "" on a PV
    assert pvc.spec.access_modes == ["ReadOnlyMany"] == pv.spec.access_modes
    assert pv.spec.persistent_volume_reclaim_policy == "Retain"
    # no csi.readOnly: the driver picks the view by the cache's kind (docs/cache-claims.md)
    assert pv.spec.csi.driver == "csi.gkm.io" and not pv.spec.csi.read_only
    assert pv.spec.csi.volume_handle == f"gkmcache:{ns}/kernels:{ns}"
    assert pv.spec.csi.volume_attributes == {resolve.CACHE_KEY: "kernels", resolve.NAMESPACE_KEY: ns}
    assert co.quantity_bytes(pv.spec.capacity["storage"]) == 3000  # from gkm.io/cache-size-bytes
    # the admission plugin StorageObjectInUseProtection is on: deletion waits for the claim's pods
    assert "kubernetes.io/pvc-protection" in pvc.metadata.finalizers
    assert [(o.kind, o.name, o.uid) for o in pvc.metadata.owner_references] == \
        [("GKMCache", "kernels", made["metadata"]["uid"])]
    assert not pv.metadata.owner_references  # a namespaced cache cannot own a cluster-scoped volume
    assert pvc.metadata.labels[co.NAME_LABEL] == "kernels" and pv.metadata.labels[co.NAMESPACE_LABEL] == ns

    assert co.FINALIZER in got["metadata"]["finalizers"]
    e = entry(got, ns)
    assert (e["pvName"], e["pvcName"], e["pvcOwner"]) == (pv_, "kernels", "Operator")
    assert e["conditions"][0]["status"] == "True"
    assert status(got)["pvcOwner"] == "Operator"
    # the cache reconciler's part of the status stands beside ours
    assert status(got)["resolvedDigest"] == DIGEST
    assert status(got)["conditions"][0]["type"] == "Ready"


def test_a_cluster_cache_gets_a_claim_per_workload_namespace(cluster, kube_namespace):
    a, b, later = kube_namespace, cluster.namespace(), f"t-{uid()}"
    name = f"shared-{uid()}"
    made = cluster.cache(name, workload_namespaces=[a, b, later])
    got = eventually(lambda: (o := cluster.get(name)) and reason_in(o, a) == reason_in(o, b) == "Bound" and o,
                     timeout=WAIT)
    assert got, cluster.get(name)
    assert reason_in(got, later) == "NamespaceNotFound"
    for ns in (a, b):
        pvc, pv = cluster.pvc(ns, name), cluster.pv(pv_name(None, name, ns))
        assert pv.spec.claim_ref.uid == pvc.metadata.uid and pvc.spec.volume_name == pv.metadata.name
        assert pv.spec.csi.volume_handle == f"gkmcache:{name}:{ns}"
        assert pv.spec.csi.volume_attributes == {resolve.CACHE_KEY: name}  # no namespace: a ClusterGKMCache
        assert co.quantity_bytes(pv.spec.capacity["storage"]) == co.PLACEHOLDER_BYTES  # size unknown
        for obj in (pv, pvc):
            assert [(o.kind, o.uid) for o in obj.metadata.owner_references] == \
                [("ClusterGKMCache", made["metadata"]["uid"])]

    # the missing namespace appears: its claim follows
    cluster.core.create_namespace(body={"metadata": {"name": later}})
    assert eventually(lambda: reason_in(cluster.get(name), later) == "Bound", timeout=WAIT)

    # a namespace leaves the list: its pair goes, the others stay as they are
    kept = {ns: cluster.pvc(ns, name).metadata.uid for ns in (b, later)}
    cluster.set_namespaces(name, [b, later])
    assert eventually(lambda: cluster.pvc(a, name) is None and cluster.pv(pv_name(None, name, a)) is None,
                      timeout=WAIT)
    assert eventually(lambda: set(status(cluster.get(name)).get("pvcStatus") or {}) == {b, later})
    assert {ns: cluster.pvc(ns, name).metadata.uid for ns in (b, later)} == kept

    # no namespaces at all: no claims, no finalizer
    cluster.set_namespaces(name, [])
    gone = eventually(lambda: (o := cluster.get(name)) and co.FINALIZER not in (o["metadata"].get("finalizers") or [])
                      and not status(o).get("pvcStatus") and o, timeout=WAIT)
    assert gone, cluster.get(name)
    assert "pvcOwner" not in status(gone)
    assert all(cluster.pvc(ns, name) is None and cluster.pv(pv_name(None, name, ns)) is None for ns in (a, b, later))


def test_deleting_a_cache_waits_for_the_last_pod_using_its_claim(cluster, kube_namespace):
    ns = kube_namespace
    cluster.cache("kernels", ns)
    assert eventually(lambda: reason_in(cluster.get("kernels", ns), ns) == "Bound", timeout=WAIT)
    pod = cluster.pod_using(ns, "kernels")
    pv_ = pv_name(ns, "kernels", ns)

    cluster.delete("kernels", ns)
    held = eventually(lambda: (p := cluster.pvc(ns, "kernels")) and p.metadata.deletion_timestamp and p, timeout=WAIT)
    assert held, "the claim was not marked for deletion"
    assert eventually(lambda: reason_in(cluster.get("kernels", ns), ns) == "Deleting")
    cluster.settle("gkmcache-claims")
    # a pod still names the claim: the claim, its volume and the cache all stay
    assert cluster.pvc(ns, "kernels").metadata.deletion_timestamp is not None
    assert cluster.pv(pv_).status.phase == "Bound" and cluster.pv(pv_).metadata.deletion_timestamp is None
    cache = cluster.get("kernels", ns)
    assert cache["metadata"]["deletionTimestamp"] and co.FINALIZER in cache["metadata"]["finalizers"]

    cluster.core.delete_namespaced_pod(pod, ns, grace_period_seconds=0)
    assert eventually(lambda: cluster.get("kernels", ns) is None, timeout=WAIT), cluster.get("kernels", ns)
    assert cluster.pvc(ns, "kernels") is None
    assert cluster.pv(pv_) is None


def test_a_users_claim_of_that_name_is_left_alone_and_reported(cluster, kube_namespace):
    ns = kube_namespace
    users = cluster.core.create_namespaced_persistent_volume_claim(ns, body={
        "metadata": {"name": "kernels"},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "manual",
                 "resources": {"requests": {"storage": "1Gi"}}}})
    cluster.cache("kernels", ns)
    got = eventually(lambda: (o := cluster.get("kernels", ns)) and reason_in(o, ns) == "Conflict" and o, timeout=WAIT)
    assert got, cluster.get("kernels", ns)
    assert "not made by the controller" in entry(got, ns)["conditions"][0]["message"]
    cluster.settle("gkmcache-claims")  # looked at again several times (re-check every second)
    now = cluster.pvc(ns, "kernels")
    assert now.metadata.resource_version == users.metadata.resource_version
    assert now.metadata.labels is None and now.spec.volume_name is None
    assert cluster.pv(pv_name(ns, "kernels", ns)) is None  # no volume pre-bound to someone else's claim

    # the user's claim goes: ours is made
    cluster.core.delete_namespaced_persistent_volume_claim("kernels", ns)
    assert eventually(lambda: reason_in(cluster.get("kernels", ns), ns) == "Bound", timeout=WAIT)
    assert cluster.pvc(ns, "kernels").metadata.labels[co.KIND_LABEL] == "GKMCache"


def test_a_deleted_claim_is_made_again_and_bound_to_its_volume(cluster, kube_namespace):
    ns = kube_namespace
    cluster.cache("kernels", ns)
    assert eventually(lambda: reason_in(cluster.get("kernels", ns), ns) == "Bound", timeout=WAIT)
    old = cluster.pvc(ns, "kernels").metadata.uid
    cluster.core.delete_namespaced_persistent_volume_claim("kernels", ns)
    # the Retain volume is Released to the old claim until the controller points it at the new one
    fresh = eventually(lambda: (p := cluster.pvc(ns, "kernels")) and p.metadata.uid != old
                       and p.status.phase == "Bound" and p, timeout=WAIT)
    assert fresh, cluster.pvc(ns, "kernels")
    pv = cluster.pv(pv_name(ns, "kernels", ns))
    assert pv.spec.claim_ref.uid == fresh.metadata.uid and pv.status.phase == "Bound"
    assert eventually(lambda: reason_in(cluster.get("kernels", ns), ns) == "Bound")


def test_a_terminating_workload_namespace_gets_no_claim(cluster, kube_namespace):
    ns = cluster.namespace()
    name = f"shared-{uid()}"
    cluster.cache(name, workload_namespaces=[ns, kube_namespace])
    assert eventually(lambda: reason_in(cluster.get(name), ns) == "Bound"
                      and reason_in(cluster.get(name), kube_namespace) == "Bound", timeout=WAIT)
    # held by a finalizer of the test's, so the namespace is observably Terminating
    cluster.core.create_namespaced_config_map(ns, body={"metadata": {"name": "held", "finalizers": [HOLD]}})
    cluster.core.delete_namespace(ns)
    got = eventually(lambda: (o := cluster.get(name)) and reason_in(o, ns) == "NamespaceTerminating" and o,
                     timeout=WAIT)
    assert got, cluster.get(name)
    # the namespace controller takes the claim; the controller then lets its volume go too
    assert eventually(lambda: cluster.pv(pv_name(None, name, ns)) is None, timeout=WAIT)
    assert cluster.pvc(ns, name) is None
    assert reason_in(cluster.get(name), kube_namespace) == "Bound"  # the other namespace is untouched

    cluster.core.patch_namespaced_config_map("held", ns, body={"metadata": {"finalizers": None}})
    assert eventually(lambda: reason_in(cluster.get(name), ns) == "NamespaceNotFound", timeout=WAIT)


def test_a_gkmcache_in_a_deleted_namespace_goes_with_it(cluster):
    ns = cluster.namespace()
    cluster.cache("kernels", ns)
    assert eventually(lambda: reason_in(cluster.get("kernels", ns), ns) == "Bound", timeout=WAIT)
    cluster.core.delete_namespace(ns)
    # the namespace controller deletes the cache and the claim; the finalizer lets go once the
    # volume is gone too, and then the namespace goes
    assert eventually(lambda: cluster.pv(pv_name(ns, "kernels", ns)) is None, timeout=WAIT)
    assert eventually(lambda: cluster.namespace_gone(ns), timeout=WAIT)


def test_steady_state_makes_no_writes(cluster, kube_namespace):
    ns = kube_namespace
    name = f"steady-{uid()}"
    cluster.cache(name, workload_namespaces=[ns])
    cluster.cache("kernels", ns, size=5000)
    assert eventually(lambda: reason_in(cluster.get(name), ns) == "Bound"
                      and reason_in(cluster.get("kernels", ns), ns) == "Bound", timeout=WAIT)
    pvs = (pv_name(None, name, ns), pv_name(ns, "kernels", ns))
    # the ClusterGKMCache, the GKMCache, the two PVCs named after them, the two PVs
    objects = ((None, name), (ns, "kernels"), (ns, name), *((None, p) for p in pvs))

    def versions():
        return (cluster.get(name)["metadata"]["resourceVersion"], cluster.get("kernels", ns)["metadata"]["resourceVersion"],
                *(cluster.pv(p).metadata.resource_version for p in pvs),
                *(cluster.pvc(ns, n).metadata.resource_version for n in (name, "kernels")))

    # let the peers' own writes after binding finish first: the cache reconciler's (pin,
    # annotations), and Kubernetes 1.37's pvc-protection controller, which writes an `Unused`
    # condition once on every Bound claim (feature PersistentVolumeClaimUnusedSinceTime); under
    # load it came seconds after Bound and moved both claims' resourceVersions (a CI run)
    assert eventually(lambda: all(any(c.type == "Unused" for c in cluster.pvc(ns, n).status.conditions or ())
                                  for n in (name, "kernels")), timeout=WAIT)
    time.sleep(1.5)
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    before, writes = versions(), cluster.writes(*objects)
    for rec in ("gkmcache-claims", "clustergkmcache-claims"):
        cluster.settle(rec)
    time.sleep(1.0)
    assert versions() == before, cluster.writers(since, *objects)
    assert cluster.writes(*objects) == writes


def test_the_claims_identity_may_do_nothing_more(control_plane, claims_rbac, kube_namespace):
    me = Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")))
    me.request("GET", "/api/v1/persistentvolumes")
    me.request("GET", "/api/v1/namespaces")
    for method, path, body in (
            ("PUT", f"/api/v1/namespaces/{kube_namespace}/persistentvolumeclaims/x",
             {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "x"}}),
            ("PATCH", "/api/v1/persistentvolumes/x", {}),
            ("GET", f"/api/v1/namespaces/{kube_namespace}/pods", None),
            ("DELETE", f"/api/v1/namespaces/{kube_namespace}", None),
            ("GET", f"/api/v1/namespaces/{kube_namespace}/secrets", None)):
        with pytest.raises(KubeError) as err:
            me.request(method, path, body=body)
        assert err.value.code == 403, (method, path, err.value)
