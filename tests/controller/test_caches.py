"""The GKMCache / ClusterGKMCache reconciler (controller/caches/reconciler.py) in-process, as the
controller's identity with daemonsets/rbac-controller-caches.yaml applied, against the real
kube-apiserver and the local registry: pinning, registry outages, the agents' node objects summed
into the cache's status, no writes in steady state, coalesced writes under churn, rolls."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import uuid

import pytest
from kubernetes import client, watch
from prometheus_client import CollectorRegistry

from accelnode.kube.client import Client, Config, KubeError, custom_path
from controller.caches.reconciler import clustergkmcache_reconciler, gkmcache_reconciler
from controller.runtime.runner import Controller, Metrics
from controller.caches.pinning import DIGEST_ANNOTATION, SIZE_ANNOTATION, Resolver
from controller.runtime.queue import Backoff
from tests.agent.conftest import agent_rbac, cluster, eventually, make_cache, node_factory  # noqa: F401 (fixtures)
from tests.conftest import ROOT, require
from tests.fixtures.registry import RunningRegistry

GKM = ("gkm.io", "v1alpha1")
CONTROLLER_USER = "system:serviceaccount:accelnode-system:accelnode-controller"
UNREACHABLE_HOST = "127.0.0.1:9"  # discard port: nothing serves a registry there


@pytest.fixture(scope="session")
def caches_rbac(kubectl, crds):
    out = kubectl("admin", "apply", "-f", str(ROOT / "daemonsets/namespace.yaml"),
                  "-f", str(ROOT / "daemonsets/rbac-controller.yaml"),
                  "-f", str(ROOT / "daemonsets/rbac-controller-caches.yaml"))
    assert out.returncode == 0, out.stderr


@pytest.fixture(scope="module")
def cache_images(registry, tmp_path_factory):
    d = tmp_path_factory.mktemp("pin-caches")
    v5e = [{"backend": "tpu", "arch": "v5e"}]
    v1 = registry.push(make_cache(d / "a", {"xla/a.bin": b"\x01" * 3000}), "pin/jax", tag="v1", kind="jax",
                       targets=v5e)
    v2 = registry.push(make_cache(d / "b", {"xla/b.bin": b"\x02" * 5000}), "pin/jax", tag="v2", kind="jax",
                       targets=v5e)
    return {"v1": (f"{registry.host}/pin/jax:v1", v1.rsplit("@", 1)[1]),
            "v2": (f"{registry.host}/pin/jax:v2", v2.rsplit("@", 1)[1])}


class World:
    """The admin's side: caches as users write them, node objects as agents write them."""

    def __init__(self, kube_api, control_plane):
        self.objs = client.CustomObjectsApi(kube_api("admin"))
        self.cp = control_plane
        self.cluster_objects: list[tuple[str, str]] = []  # (plural, name), deleted after the test

    def cache(self, name: str, image: str, namespace: str | None = None) -> None:
        body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache" if namespace else "ClusterGKMCache",
                "metadata": {"name": name}, "spec": {"image": image}}
        if namespace:
            self.objs.create_namespaced_custom_object(*GKM, namespace, "gkmcaches", body=body)
        else:
            self.cluster_objects.append(("clustergkmcaches", name))
            self.objs.create_cluster_custom_object(*GKM, "clustergkmcaches", body=body)

    def get(self, name: str, namespace: str | None = None) -> dict:
        if namespace:
            return self.objs.get_namespaced_custom_object(*GKM, namespace, "gkmcaches", name)
        return self.objs.get_cluster_custom_object(*GKM, "clustergkmcaches", name)

    def set_image(self, name: str, namespace: str, image: str) -> None:
        self.objs.patch_namespaced_custom_object(*GKM, namespace, "gkmcaches", name, body={"spec": {"image": image}})

    def node(self, node: str, caches: dict, namespace: str | None = None) -> None:
        """Create or replace a node object's status, as an agent does (POST, then PUT status)."""
        plural = "gkmcachenodes" if namespace else "clustergkmcachenodes"
        try:
            obj = (self.objs.get_namespaced_custom_object(*GKM, namespace, plural, node) if namespace
                   else self.objs.get_cluster_custom_object(*GKM, plural, node))
        except client.ApiException as e:
            assert e.status == 404, e
            body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCacheNode" if namespace else "ClusterGKMCacheNode",
                    "metadata": {"name": node}}
            if namespace:
                obj = self.objs.create_namespaced_custom_object(*GKM, namespace, plural, body=body)
            else:
                self.cluster_objects.append((plural, node))
                obj = self.objs.create_cluster_custom_object(*GKM, plural, body=body)
        obj["status"] = {"nodeName": node, "caches": caches}
        if namespace:
            self.objs.replace_namespaced_custom_object_status(*GKM, namespace, plural, node, obj)
        else:
            self.objs.replace_cluster_custom_object_status(*GKM, plural, node, obj)

    def status_writes(self, name: str, namespace: str | None = None) -> int:
        """Successful status writes (merge patches) of one cache by the controller identity (audit log)."""
        n = 0
        for line in self.cp.audit_log.read_text().splitlines():
            ev = json.loads(line)
            ref = ev.get("objectRef") or {}
            if (ev.get("stage") == "ResponseComplete" and ev["user"]["username"] == CONTROLLER_USER
                    and ev.get("verb") == "patch" and ref.get("subresource") == "status"
                    and ref.get("name") == name and ref.get("namespace") == namespace
                    and (ev.get("responseStatus") or {}).get("code") == 200):
                n += 1
        return n

    def cleanup(self) -> None:
        for plural, name in self.cluster_objects:
            try:
                self.objs.delete_cluster_custom_object(*GKM, plural, name)
            except client.ApiException as e:
                if e.status != 404:
                    raise


@pytest.fixture
def world(kube_api, control_plane, caches_rbac):
    w = World(kube_api, control_plane)
    yield w
    w.cleanup()


def controller_client(control_plane) -> Client:
    return Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")), user_agent="accelnode-controller")


def run_reconcilers(me: Client, resolver: Resolver, **options):
    """Both cache reconcilers running in-process as ``me`` until the generator is closed; short
    resync and backoff so steady state is exercised often and a healed registry is noticed soon.
    ``options`` go to both reconcilers (``fanout_per_second``)."""
    metrics = Metrics(CollectorRegistry())
    ctls = [Controller(me, make(me, resolver, **options), metrics, workers=2, resync=0.5,
                       backoff=Backoff(0.2, 2.0)).start()
            for make in (gkmcache_reconciler, clustergkmcache_reconciler)]
    try:
        yield ctls
    finally:  # also when closed (gen.close()): reconcilers left running would judge other tests' caches
        for c in ctls:
            c.stop(10)


@pytest.fixture
def reconcilers(control_plane, caches_rbac, registry):
    """Both cache reconcilers as the controller identity, with the registry's options."""
    yield from run_reconcilers(controller_client(control_plane), Resolver(registry.options(timeout=10)))


def status(obj: dict) -> dict:
    return obj.get("status") or {}


def cond(obj: dict, kind: str) -> dict:
    return next((c for c in status(obj).get("conditions") or () if c["type"] == kind), {})


def reason(obj: dict) -> str | None:
    """What the STATUS column shows."""
    conds = status(obj).get("conditions") or []
    return conds[0]["reason"] if conds else None


def uid() -> str:
    return uuid.uuid4().hex[:8]


# ---------------------------------------------------------------------------------------------


def test_a_cache_by_tag_is_pinned_and_mirrored(world, reconcilers, cache_images, kube_namespace):
    image, digest = cache_images["v1"]
    world.cache("kernels", image, kube_namespace)
    got = eventually(lambda: (o := world.get("kernels", kube_namespace))
                     and (o["metadata"].get("annotations") or {}).get(DIGEST_ANNOTATION) and o)
    assert got, world.get("kernels", kube_namespace)
    assert status(got)["resolvedDigest"] == digest
    ann = got["metadata"]["annotations"]
    assert ann[DIGEST_ANNOTATION] == digest
    assert int(ann[SIZE_ANNOTATION]) == 3000
    res = cond(got, "Resolved")
    assert (res["status"], res["reason"], res["observedGeneration"]) == ("True", "Resolved", 1)
    assert image in res["message"] and digest in res["message"]
    assert reason(got) == "Resolved"  # pinned, no node holds it yet
    assert status(got)["counts"] == dict.fromkeys(("nodeCnt", "nodeInUseCnt", "nodeNotInUseCnt", "nodeErrorCnt",
                                                   "podRunningCnt", "podOutdatedCnt", "podDeletingCnt"), 0)
    assert status(got)["lastUpdated"]


def test_a_digest_pinned_image_is_pinned_only_where_its_repository_holds_it(world, reconcilers, registry,
                                                                          cache_images, tmp_path):
    """Naming a digest proves nothing: the pin asks the repository named, as it does for a tag."""
    _, digest = cache_images["v1"]
    name = f"pinned-{uid()}"
    world.cache(name, f"{registry.host}/pin/jax:v1@{digest}")  # a ClusterGKMCache
    got = eventually(lambda: (o := world.get(name)) and status(o).get("resolvedDigest") and o)
    assert status(got)["resolvedDigest"] == digest
    assert cond(got, "Resolved")["status"] == "True"
    assert eventually(lambda: (world.get(name)["metadata"].get("annotations") or {}).get(SIZE_ANNOTATION) == "3000")
    # the same digest under a repository that does not hold it, and under a registry that is down
    registry.push(make_cache(tmp_path / "other", {"xla/o.bin": b"\x04" * 10}), "pin/other", tag="v1", kind="jax",
                  targets=[{"backend": "tpu", "arch": "v5e"}])
    for image, why in ((f"{registry.host}/pin/other@{digest}", "ImageNotFound"),
                       (f"{UNREACHABLE_HOST}/nowhere/kernels:v1@{digest}", "RegistryUnavailable")):
        name = f"stolen-{uid()}"
        world.cache(name, image)
        got = eventually(lambda: (o := world.get(name)) and cond(o, "Resolved") and o)
        assert (cond(got, "Resolved")["status"], cond(got, "Resolved")["reason"]) == ("False", why), got
        assert "resolvedDigest" not in status(got)
        assert DIGEST_ANNOTATION not in (got["metadata"].get("annotations") or {})


def test_registry_down_then_back(world, reconcilers, kube_namespace, tmp_path):
    require(shutil.which("docker-registry") is not None, "docker-registry (Debian package docker-registry)")
    (tmp_path / "late").mkdir()
    late = RunningRegistry(tmp_path / "late")
    try:
        (tmp_path / "src").mkdir()
        pushed = late.push(make_cache(tmp_path / "src", {"xla/x.bin": b"\x03" * 100}), "pin/late", tag="v1",
                           kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}])
        digest = pushed.rsplit("@", 1)[1]
        late.stop()
        world.cache("late", f"{late.host}/pin/late:v1", kube_namespace)

        down = eventually(lambda: (o := world.get("late", kube_namespace)) and cond(o, "Resolved") and o)
        res = cond(down, "Resolved")
        assert (res["status"], res["reason"]) == ("False", "RegistryUnavailable"), res
        assert late.host in res["message"]
        assert reason(down) == "Unresolved"
        assert "resolvedDigest" not in status(down)
        assert DIGEST_ANNOTATION not in (down["metadata"].get("annotations") or {})

        # the same registry comes back on the same address: pinned on a later retry
        late.log = open(late.workdir / "registry.log", "ab")
        late.proc = subprocess.Popen(["docker-registry", "serve", str(late.workdir / "config.yml")],
                                     stdout=late.log, stderr=subprocess.STDOUT)
        assert late._wait_ready(), (late.workdir / "registry.log").read_text()
        up = eventually(lambda: (o := world.get("late", kube_namespace))
                        and status(o).get("resolvedDigest") == digest and o, timeout=60)
        assert up, world.get("late", kube_namespace)
        assert cond(up, "Resolved")["status"] == "True"
        assert reason(up) == "Resolved"
        assert eventually(lambda: (world.get("late", kube_namespace)["metadata"].get("annotations") or {})
                          .get(DIGEST_ANNOTATION) == digest)
    finally:
        late.stop()


def pods(ns: str, *names: str) -> list[dict]:
    return [{"podNamespace": ns, "podName": n, "volumeId": f"vol-{n}"} for n in names]


def test_node_objects_are_summed_into_counts_and_status(world, reconcilers, cache_images, kube_namespace,
                                                        kube_api):
    ns = kube_namespace
    image, d1 = cache_images["v1"]
    world.cache("kernels", image, ns)
    world.cache("other", image, ns)
    assert eventually(lambda: status(world.get("kernels", ns)).get("resolvedDigest") == d1)
    n1, n2, n3 = (f"node-{uid()}" for _ in range(3))
    world.node(n1, {"kernels": {d1: {"state": "Running", "pods": pods(ns, "a", "b")}},
                    "other": {d1: {"state": "Extracted"}}}, ns)
    world.node(n2, {"kernels": {d1: {"state": "Extracted"}}}, ns)
    world.node(n3, {"kernels": {d1: {"state": "Error", "message": "pull failed: 500 from registry"}}}, ns)
    # the same cache name in another namespace is another cache
    elsewhere = f"t-{uid()}"
    client.CoreV1Api(kube_api("admin")).create_namespace(body={"metadata": {"name": elsewhere}})
    world.node(n1, {"kernels": {d1: {"state": "Running", "pods": pods(elsewhere, "z")}}}, elsewhere)

    want = {"nodeCnt": 3, "nodeInUseCnt": 1, "nodeNotInUseCnt": 1, "nodeErrorCnt": 1, "podRunningCnt": 2,
            "podOutdatedCnt": 0, "podDeletingCnt": 0}
    got = eventually(lambda: (o := world.get("kernels", ns)) and status(o).get("counts") == want and o)
    assert got, status(world.get("kernels", ns))
    assert reason(got) == "Error"
    ready = status(got)["conditions"][0]
    assert ready["type"] == "Ready" and ready["status"] == "False"
    assert ready["message"] == (f"2 of 3 nodes hold {d1}; 2 pods running; "
                                f"1 node failed ({n3}: 'pull failed: 500 from registry')")
    other = eventually(lambda: (o := world.get("other", ns)) and reason(o) == "Extracted" and o)
    assert other and status(other)["counts"]["nodeCnt"] == 1

    # the failed node recovers; a node stops reporting the cache: both are counted again
    world.node(n3, {"kernels": {d1: {"state": "Running", "pods": pods(ns, "c")}}}, ns)
    world.node(n2, {}, ns)
    want = dict(want, nodeCnt=2, nodeInUseCnt=2, nodeNotInUseCnt=0, nodeErrorCnt=0, podRunningCnt=3)
    got = eventually(lambda: (o := world.get("kernels", ns)) and status(o).get("counts") == want and o)
    assert got, status(world.get("kernels", ns))
    assert (reason(got), status(got)["conditions"][0]["status"]) == ("Running", "True")


def test_cluster_caches_sum_cluster_node_objects(world, reconcilers, cache_images):
    image, d1 = cache_images["v1"]
    name = f"shared-{uid()}"
    world.cache(name, image)
    assert eventually(lambda: status(world.get(name)).get("resolvedDigest") == d1)
    n1, n2 = f"node-{uid()}", f"node-{uid()}"
    world.node(n1, {name: {d1: {"state": "Downloading"}}})
    world.node(n2, {name: {d1: {"state": "Pending"}}})
    got = eventually(lambda: (o := world.get(name)) and status(o)["counts"]["nodeCnt"] == 2 and o)
    assert got and reason(got) == "Downloading"
    world.node(n1, {name: {d1: {"state": "Running", "pods": pods("team-a", "p")},
                           "sha256:" + "0" * 64: {"state": "Outdated", "pods": pods("team-b", "q")}}})
    got = eventually(lambda: (o := world.get(name)) and reason(o) == "Outdated" and o)
    assert got, status(world.get(name))
    counts = status(got)["counts"]
    assert (counts["nodeInUseCnt"], counts["podRunningCnt"], counts["podOutdatedCnt"]) == (1, 1, 1)


def test_steady_state_makes_no_writes(world, reconcilers, cache_images, kube_namespace):
    ns = kube_namespace
    image, d1 = cache_images["v1"]
    world.cache("kernels", image, ns)
    world.node(f"node-{uid()}", {"kernels": {d1: {"state": "Extracted"}}}, ns)
    settled = eventually(lambda: (o := world.get("kernels", ns)) and reason(o) == "Extracted"
                         and DIGEST_ANNOTATION in (o["metadata"].get("annotations") or {}) and o)
    assert settled
    rv, writes = settled["metadata"]["resourceVersion"], world.status_writes("kernels", ns)
    # resync is 0.5 s: every key is reconciled several times meanwhile
    metric = reconcilers[0].metrics.reconciles.labels("gkmcache", "success")
    before = metric._value.get()
    assert eventually(lambda: metric._value.get() >= before + 6)
    time.sleep(1.0)  # and a little longer, past the coalescing interval
    assert world.get("kernels", ns)["metadata"]["resourceVersion"] == rv
    assert world.status_writes("kernels", ns) == writes


def test_many_node_changes_make_few_writes(world, reconcilers, cache_images, kube_namespace):
    ns = kube_namespace
    image, d1 = cache_images["v1"]
    world.cache("kernels", image, ns)
    assert eventually(lambda: (o := world.get("kernels", ns)) and status(o).get("resolvedDigest") == d1
                      and DIGEST_ANNOTATION in (o["metadata"].get("annotations") or {}))
    nodes = [f"node-{i:02d}-{uid()}" for i in range(50)]
    started, writes = time.monotonic(), world.status_writes("kernels", ns)
    for state in ("Downloading", "Extracted"):
        for n in nodes:
            world.node(n, {"kernels": {d1: {"state": state}}}, ns)
    for i, n in enumerate(nodes):
        world.node(n, {"kernels": {d1: {"state": "Running", "pods": pods(ns, f"pod-{i}")}}}, ns)
    want = {"nodeCnt": 50, "nodeInUseCnt": 50, "nodeNotInUseCnt": 0, "nodeErrorCnt": 0, "podRunningCnt": 50,
            "podOutdatedCnt": 0, "podDeletingCnt": 0}
    final = eventually(lambda: (o := world.get("kernels", ns)) and status(o).get("counts") == want and o)
    elapsed = time.monotonic() - started
    assert final, status(world.get("kernels", ns))
    assert reason(final) == "Running"
    assert status(final)["conditions"][0]["message"] == f"50 of 50 nodes hold {d1}; 50 pods running"
    made = world.status_writes("kernels", ns) - writes
    # at most one write per second of the churn, plus one (150 node changes)
    assert 1 <= made <= math.floor(elapsed) + 1, (made, elapsed)


def test_a_cache_on_more_nodes_is_written_less_often(world, control_plane, caches_rbac, registry, cache_images,
                                                     kube_namespace):
    """The write interval is max(1 s, nodes / fan-out): with a fan-out of 10 watch events a
    second, a cache counted on 40 nodes is written at most every 4 s (each write reaches every
    agent), and the last write still carries the final counts."""
    ns = kube_namespace
    image, d1 = cache_images["v1"]
    gen = run_reconcilers(controller_client(control_plane), Resolver(registry.options(timeout=10)),
                          fanout_per_second=10.0)
    next(gen)
    try:
        world.cache("kernels", image, ns)
        assert eventually(lambda: status(world.get("kernels", ns) or {}).get("resolvedDigest") == d1)
        nodes = [f"node-{i:02d}-{uid()}" for i in range(40)]
        for n in nodes:
            world.node(n, {"kernels": {d1: {"state": "Downloading"}}}, ns)
        assert eventually(lambda: status(world.get("kernels", ns))["counts"]["nodeCnt"] == 40, timeout=30)
        started, writes = time.monotonic(), world.status_writes("kernels", ns)
        for n in nodes:
            world.node(n, {"kernels": {d1: {"state": "Extracted"}}}, ns)
        assert eventually(lambda: status(world.get("kernels", ns))["counts"]["nodeNotInUseCnt"] == 40, timeout=30)
        elapsed = time.monotonic() - started
        made = world.status_writes("kernels", ns) - writes
        # 40 node changes over `elapsed` seconds: one write per 4 s of it, plus the one that
        # may come due at once (the last was written before the churn began)
        assert 1 <= made <= math.floor(elapsed / 4.0) + 1, (made, elapsed)
    finally:
        gen.close()


def test_a_roll_moves_the_pin(world, reconcilers, cache_images, kube_namespace):
    ns = kube_namespace
    (v1, d1), (v2, d2) = cache_images["v1"], cache_images["v2"]
    world.cache("kernels", v1, ns)
    assert eventually(lambda: (world.get("kernels", ns)["metadata"].get("annotations") or {})
                      .get(DIGEST_ANNOTATION) == d1)
    world.set_image("kernels", ns, v2)
    got = eventually(lambda: (o := world.get("kernels", ns))
                     and (o["metadata"].get("annotations") or {}).get(DIGEST_ANNOTATION) == d2 and o)
    assert got, world.get("kernels", ns)
    assert status(got)["resolvedDigest"] == d2
    assert int(got["metadata"]["annotations"][SIZE_ANNOTATION]) == 5000
    res = cond(got, "Resolved")
    assert v2 in res["message"] and res["observedGeneration"] == 2


def test_a_roll_is_not_counted_held_before_the_node_holds_it(reconcilers, cluster, node_factory, registry, tmp_path,
                                                            kube_namespace):
    """The scale bench's premature "N of N nodes hold <new digest>": a real agent holds the old
    digest, the cache rolls, and until the agent sees the new pin its object still says the old
    digest is Extracted. No version of the cache's status (every one, from a watch) counts that
    node as holding the new digest; once the node pulls it, it does."""
    ns = kube_namespace
    v5e = [{"backend": "tpu", "arch": "v5e"}]
    old, new = (registry.push(make_cache(tmp_path / v, {"xla/m.bin": v.encode() * 3000}), f"recount/{ns}", tag=v,
                              kind="jax", targets=v5e) for v in ("v1", "v2"))
    d1, d2 = old.rsplit("@", 1)[1], new.rsplit("@", 1)[1]
    node = node_factory(labels={}).start()
    cluster.cache("rolling", old, namespace=ns, pin=False)  # the controller pins it
    assert eventually(lambda: status(rolling(cluster, ns)).get("resolvedDigest") == d1)
    node.ensure(old, (ns, "rolling"))

    def message(st: dict) -> str:
        return ((st.get("conditions") or [{}])[0]).get("message", "")

    held = eventually(lambda: (o := rolling(cluster, ns)) and message(status(o)) == f"1 of 1 node hold {d1}" and o)
    assert held, status(rolling(cluster, ns))
    assert cluster.node_status(node.name, ns)["caches"]["rolling"][d1]["cacheDigest"] == d1  # kept by the CRD

    versions = []
    stream = watch.Watch().stream(cluster.objs.list_namespaced_custom_object, *GKM, ns, "gkmcaches",
                                  field_selector="metadata.name=rolling",
                                  resource_version=held["metadata"]["resourceVersion"], timeout_seconds=60)
    cluster.objs.patch_namespaced_custom_object(*GKM, ns, "gkmcaches", "rolling", body={"spec": {"image": new}})
    for ev in stream:  # until the agent has seen the pin and dropped the old digest (nothing to hold)
        versions.append(st := status(ev["object"]))
        if st.get("resolvedDigest") == d2 and not st["counts"]["nodeCnt"]:
            break
    stream.close()
    rolled = [st for st in versions if st.get("resolvedDigest") == d2]
    assert rolled and message(rolled[-1]) == f"pinned to {d2}; no node holds it yet", versions
    for st in rolled:  # the node has never held d2 so far
        assert not message(st).startswith("1 of") and st["counts"]["nodeNotInUseCnt"] == 0, st

    node.ensure(new, (ns, "rolling"))
    assert eventually(lambda: message(status(rolling(cluster, ns))) == f"1 of 1 node hold {d2}"), \
        status(rolling(cluster, ns))


def rolling(cluster, ns: str) -> dict:
    """The cache the roll test rolls, as stored."""
    return cluster.objs.get_namespaced_custom_object(*GKM, ns, "gkmcaches", "rolling")


def test_the_controller_may_not_write_node_objects_or_delete_caches(control_plane, caches_rbac, kube_namespace):
    me = Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")))
    me.request("GET", custom_path(*GKM, "gkmcaches"))
    me.request("GET", custom_path(*GKM, "clustergkmcachenodes"))
    for method, path, body in (
            ("POST", custom_path(*GKM, "gkmcachenodes", kube_namespace),
             {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCacheNode", "metadata": {"name": "n"}}),
            ("DELETE", custom_path(*GKM, "gkmcaches", kube_namespace, "x"), None),
            ("GET", custom_path(*GKM, "gkmcaches", kube_namespace, "x"), None),
            ("PUT", custom_path(*GKM, "clustergkmcaches", None, "x"), {}),  # its writes are patches
            ("PUT", custom_path(*GKM, "gkmcaches", kube_namespace, "x") + "/status", {})):
        with pytest.raises(KubeError) as err:
            me.request(method, path, body=body)
        assert err.value.code == 403, (method, path, err.value)
