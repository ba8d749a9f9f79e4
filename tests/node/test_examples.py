"""The examples that run pods, on the real kubelet (tests/node/conftest.py: our image, the
DaemonSets, a simulated v5e-4 host, the controller in-cluster with its webhooks).

What stands in, and why (everything else is the example's file as shipped):

- Images: the node has no network, only our locally built image. It is tagged in containerd under
  the names the examples use (``python:3.11-slim``, ``python:3.10``,
  ``registry.k8s.io/nginx-slim:0.8``), which the examples pull ``IfNotPresent`` (kubelet's
  default for a tag): kubelet finds it, pulls nothing.
- Network: the rig has no pod network, so each pod gets ``hostNetwork: true`` (and the
  walk-through's ``containerPort`` is dropped: with the host's network it would be a host port,
  and two pods on the one node would collide).
- The cache images: ``quay.io/gkm/cache-examples:vector-add-cache-rocm-v2`` is a small JAX cache
  for tpu/v5e (it must fit the simulated node) pushed to the session's registry under the same
  repository and tag, and the caches' ``spec.image`` names that registry (the rig's controller
  and agent have no registry mirror); signed with the real cosign in the format the examples'
  ``gkm.io/signature-format`` label names, trusted by a ClusterCacheTrustPolicy.
- The v7x walk-through: the one node is labelled as a node of the example's TPUNodeGroup
  (``cloud.google.com/tpu-node-group``, ``gke-tpu-accelerator: tpu7x``, topology 2x2x2) for the
  test and its labels put back after; each of the two workers asks for 2 of the node's 4 chips
  instead of a VM's 4.
- The injector's README StatefulSet: our image is no nginx, so its container is given a command
  that prints its environment and sleeps.
- GKE's Indexed Job: a v5p slice of four 4-chip VMs is not here; its workers take one chip each
  of the node (nodeSelector: the node's labels) and print their environment instead of starting
  JAX.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from accelnode.oci import signatures as sg
from tests.rigs.image import NAME as OUR_IMAGE
from tests.cache.cosign import Cosign
from tests.conftest import ROOT
from tests.node.conftest import NODE_LABELS
from tests.node.test_kubelet import V5E, make_cache, namespace

GKM = ROOT / "examples" / "gkm"
REPO, TAG = "gkm/cache-examples", "vector-add-cache-rocm-v2"
FILES = {"xla/vector_add.bin": b"\x01" * 4096, "xla/index.txt": b"vector-add stand-in\n"}
STAND_INS = ("docker.io/library/python:3.11-slim", "docker.io/library/python:3.10", "registry.k8s.io/nginx-slim:0.8")
ENV_PRINTER = ["python3", "-c", "import json, os, time; print(json.dumps(dict(os.environ)), flush=True); "
               "time.sleep(1e9)"]
POLICY = "node-gkm-examples"


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def on_the_rig(doc: dict) -> dict:
    """A workload from an example as this node can run it (the module docstring says why)."""
    if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
        pod = doc["spec"]["template"]["spec"]
        pod["hostNetwork"] = True
        pod["terminationGracePeriodSeconds"] = 1
        for c in pod["containers"]:
            c.pop("ports", None)
    return doc


def pods_of(world, ns: str, app: str) -> list[dict]:
    return world.pods(ns, f"app={app}")


def running_pods(world, ns: str, app: str, n: int) -> list[dict]:
    def ok():
        pods = pods_of(world, ns, app)
        return len(pods) == n and all(p.get("status", {}).get("phase") == "Running" for p in pods) and pods
    return world.wait(ok, f"{n} pod(s) app={app} Running in {ns}", timeout=180)


def report(world, ns: str, pod: dict, container: str) -> dict:
    """The JSON line the example's container printed."""
    name = pod["metadata"]["name"]
    out = world.wait(lambda: world.node.pod_log(ns, name, container).strip(), f"{ns}/{name} to print", timeout=60)
    return json.loads(out.splitlines()[-1])


@pytest.fixture(scope="module")
def stand_in_images(deployed):
    for name in STAND_INS:
        deployed.node.ctr("images", "tag", "--force", OUR_IMAGE, name)
    yield
    for name in STAND_INS:
        deployed.node.ctr("images", "rm", name, check=False)


def delete_namespaces(world, *names: str) -> None:
    world.kubectl("delete", "namespace", *names, "--ignore-not-found", "--wait=true", "--timeout=120s", check=False)


@pytest.fixture(scope="module")
def gkm_caches(deployed, stand_in_images, tmp_path_factory):
    """examples/gkm/00-namespaces.yaml unchanged; the caches of 10-, 20- and 30-*.yaml with their
    image on the session's registry; the stand-in pushed and signed (v2, as the label says)."""
    w, tmp = deployed, tmp_path_factory.mktemp("gkm")
    w.kubectl("apply", "-f", str(GKM / "00-namespaces.yaml"))
    ref = w.registry.push(make_cache(tmp / "src", FILES), REPO, tag=TAG, kind="jax", targets=V5E)
    cosign = Cosign(tmp)
    key, pub = cosign.keypair("node")
    cosign.sign(ref, key, sg.V2)
    w.apply({"apiVersion": "accelnode.io/v1alpha1", "kind": "ClusterCacheTrustPolicy", "metadata": {"name": POLICY},
             "spec": {"namespaces": ["tpu-inference", "tpu-training"], "clusterCaches": True,
                      "keys": [{"name": "node", "publicKey": pub}]}})
    caches = []
    for f in ("10-gkmcache.yaml", "20-clustergkmcache.yaml", "30-cache-stuck-pending.yaml"):
        for doc in load(GKM / f):
            if "@sha256:" in doc["spec"]["image"]:
                continue  # jax-kernels-v6e: a digest no registry holds (tests/e2e/test_gkm_examples.py)
            doc["spec"]["image"] = doc["spec"]["image"].replace("quay.io", w.registry.host)
            caches.append(doc)
    w.apply(*caches)
    digest = ref.split("@")[1]
    for doc in caches:
        if doc["spec"]["image"].endswith(TAG):
            where = ["-n", doc["metadata"]["namespace"]] if doc["metadata"].get("namespace") else []
            w.wait(lambda: w.get(doc["kind"].lower(), doc["metadata"]["name"], *where).get("status", {}).get(
                "resolvedDigest") == digest, f"{doc['metadata']['name']} pinned")
    yield caches
    delete_namespaces(w, "tpu-inference", "tpu-training")
    w.kubectl("delete", "clustergkmcache", "vector-add-cache-rocm-v2-rwo", "--ignore-not-found", check=False)
    w.kubectl("delete", "clustercachetrustpolicy", POLICY, "--ignore-not-found", check=False)


def cache_files(got: dict) -> set[str]:
    return {f.removeprefix("io.jax.cache/") for f in got["files"] if f.startswith("io.jax.cache/")}


def test_the_gkm_workloads_run_as_deployments_and_as_gkms_daemonset(deployed, gkm_caches):
    """examples/gkm/workloads/: two replicas by claim, one inline from the ClusterGKMCache, and GKM's
    own DaemonSet with its gkm.io/pvc-mutation label: every pod sees the cache's files, read-only."""
    w = deployed
    w.wait(lambda: w.claim_phase("vector-add-cache-rocm", "tpu-inference") == "Bound",
           "the cache's claim Bound")
    for f in ("deployment-by-claim.yaml", "deployment-inline.yaml", "gkm-daemonset.yaml"):
        w.apply(*(on_the_rig(d) for d in load(GKM / "workloads" / f)))
    for ns, app, n, container in (("tpu-inference", "vector-add-by-claim", 2, "worker"),
                                  ("tpu-training", "vector-add-inline", 1, "worker"),
                                  ("tpu-inference", "vector-add-reader", 1, "reader")):
        for pod in running_pods(w, ns, app, n):
            if container == "reader":  # GKM's workload prints the directory listing
                name = pod["metadata"]["name"]
                out = w.wait(lambda: w.node.pod_log(ns, name, container).strip(), f"{name} to print", timeout=60)
                assert "io.jax.cache" in out, out
                continue
            got = report(w, ns, pod, container)
            assert got["read_only"] is True and cache_files(got) == set(FILES), got
    assert w.allocatable() == 4  # 3 chips in use, but allocatable is capacity: the pods got theirs
    for ns, kind, name in (("tpu-inference", "deployment", "vector-add-by-claim"),
                           ("tpu-training", "deployment", "vector-add-inline"),
                           ("tpu-inference", "daemonset", "vector-add-reader")):
        w.kubectl("delete", kind, name, "-n", ns, "--wait=true", "--timeout=90s")


def test_the_top_level_pod_examples_mount_the_cache_inline_and_by_claim(deployed, gkm_caches):
    """examples/pod-inline-cache.yaml and examples/pod-claim-cache.yaml, one after the other (each
    takes the node's 4 chips): GKMCache tpu-inference/jax-kernels-v5e names the stand-in; the pods
    run to completion (restartPolicy Never; ``python3``, which the stand-in image has) and list
    the mounted cache."""
    w = deployed
    w.apply({"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache",
             "metadata": {"name": "jax-kernels-v5e", "namespace": "tpu-inference"},
             "spec": {"image": f"{w.registry.host}/{REPO}:{TAG}"}})
    w.wait(lambda: w.claim_phase("jax-kernels-v5e", "tpu-inference") == "Bound",
           "the claim of jax-kernels-v5e Bound")
    for f in ("pod-inline-cache.yaml", "pod-claim-cache.yaml"):
        (pod,) = [on_the_rig(d) for d in load(ROOT / "examples" / f)]
        pod["spec"].update(hostNetwork=True, restartPolicy="Never", terminationGracePeriodSeconds=1)
        c = pod["spec"]["containers"][0]
        c["command"] = ["python3", *c["command"][1:]]
        w.apply(pod)
        name = pod["metadata"]["name"]
        w.wait(lambda: w.get("pod", name, "-n", "tpu-inference")["status"].get("phase") in ("Succeeded", "Failed"),
               f"{name} to finish", timeout=180)
        out = w.node.pod_log("tpu-inference", name, "worker")
        assert w.get("pod", name, "-n", "tpu-inference")["status"]["phase"] == "Succeeded", out
        assert "'io.jax.cache'" in out, out
        w.kubectl("delete", "pod", name, "-n", "tpu-inference", "--wait=true", "--timeout=90s")


def test_a_cache_stuck_pending_says_why_on_the_cache_and_on_the_pod(deployed, gkm_caches):
    """examples/gkm/30-cache-stuck-pending.yaml: the ReadOnlyMany cache on a class without it is
    pinned and its claim Bound; the never-pushed tag is Unresolved/ImageNotFound, and a Deployment
    mounting it waits with a FailedMount event naming the cache and the reason."""
    w = deployed
    rox = w.wait(lambda: (o := w.get("gkmcache", "vector-add-cache-rocm-rox", "-n", "tpu-inference"))
                 .get("status", {}).get("pvcStatus", {}).get("tpu-inference", {}).get("conditions")
                 and o, "the ReadOnlyMany cache's claim reported")
    assert rox["status"]["pvcStatus"]["tpu-inference"]["conditions"][0]["reason"] in ("Bound", "Pending"), rox
    w.wait(lambda: w.claim_phase("vector-add-cache-rocm-rox", "tpu-inference") == "Bound",
           "the ReadOnlyMany cache's claim Bound (storageClassName ignored)")

    def unresolved():
        st = w.get("gkmcache", "vector-add-cache-rocm-next", "-n", "tpu-inference").get("status", {})
        conds = {c["type"]: c for c in st.get("conditions") or []}
        return conds.get("Resolved", {}).get("reason") == "ImageNotFound" and conds
    conds = w.wait(unresolved, "Resolved=False ImageNotFound on the never-pushed tag")
    assert conds["Ready"]["reason"] == "Unresolved" and conds["Resolved"]["status"] == "False"
    assert "vector-add-cache-rocm-v4" in conds["Resolved"]["message"], conds
    printed = w.kubectl("get", "gkmcache", "vector-add-cache-rocm-next", "-n", "tpu-inference").stdout
    assert "Unresolved" in printed, printed  # kubectl's STATUS column

    (dep,) = load(GKM / "workloads" / "deployment-by-claim.yaml")
    dep = on_the_rig(dep)
    dep["metadata"]["name"] = "waits-for-next"
    dep["spec"]["replicas"] = 1
    dep["spec"]["selector"]["matchLabels"]["app"] = dep["spec"]["template"]["metadata"]["labels"]["app"] = "next"
    dep["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = "vector-add-cache-rocm-next"
    w.apply(dep)
    (pod,) = w.wait(lambda: pods_of(w, "tpu-inference", "next"), "the pod made")
    name = pod["metadata"]["name"]
    why = w.wait(lambda: [e for e in w.events("tpu-inference", name) if e.startswith("FailedMount")
                          and "vector-add-cache-rocm-next" in e and "ImageNotFound" in e],
                 "a FailedMount event naming the cache and ImageNotFound")
    assert "not pinned yet" in why[0], why
    assert w.get("pod", name, "-n", "tpu-inference")["status"]["phase"] == "Pending"
    w.kubectl("delete", "deployment", "waits-for-next", "-n", "tpu-inference", "--wait=true", "--timeout=90s")


def test_the_injector_readme_statefulset_gets_its_env_in_the_running_containers(deployed, stand_in_images):
    w, ns = deployed, namespace(deployed)
    docs = [on_the_rig(d) for d in load(ROOT / "examples/tpu-env/injector-readme-statefulset.yaml")]
    for d in docs:
        d["metadata"]["namespace"] = ns
        if d["kind"] == "StatefulSet":
            d["spec"]["template"]["spec"]["containers"][0]["command"] = ENV_PRINTER
    w.apply(*docs)
    pods = running_pods(w, ns, "nginx", 3)
    for pod in pods:
        env = report(w, ns, pod, "nginx")
        ordinal = pod["metadata"]["name"].rsplit("-", 1)[1]
        assert env["FOO"] == "bar"
        assert env["TPU_WORKER_HOSTNAMES"] == "web-0.nginx,web-1.nginx,web-2.nginx", env
        assert env["TPU_WORKER_ID"] == ordinal, (pod["metadata"]["name"], env)
    w.kubectl("delete", "namespace", ns, "--wait=false")


def test_gkes_indexed_job_gets_its_env_in_the_running_containers(deployed, stand_in_images):
    """examples/tpu-env/gke-indexed-job.yaml: the Job GKE's docs give, its four workers one chip
    each on this node (a v5p 2x2x4 slice of 4-chip VMs is not here: the nodeSelector names the
    node's labels instead) and printing their environment instead of starting JAX."""
    w, ns = deployed, namespace(deployed)
    docs = [on_the_rig(d) for d in load(ROOT / "examples/tpu-env/gke-indexed-job.yaml")]
    for d in docs:
        d["metadata"]["namespace"] = ns
        if d["kind"] == "Job":
            pod = d["spec"]["template"]["spec"]
            pod["nodeSelector"] = {k: NODE_LABELS[k] for k in pod["nodeSelector"]}
            (c,) = pod["containers"]
            c["resources"] = {"requests": {"google.com/tpu": 1}, "limits": {"google.com/tpu": 1}}
            c["command"] = ["python3", "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
    w.apply(*docs)
    w.wait(lambda: w.get("job", "tpu-job-podslice", "-n", ns).get("status", {}).get("succeeded") == 4,
           "the Indexed Job's 4 pods Succeeded", timeout=180)
    hosts = ",".join(f"tpu-job-podslice-{i}.headless-svc" for i in range(4))
    for pod in w.pods(ns, "job-name=tpu-job-podslice"):
        env = report(w, ns, pod, "tpu-job")
        index = pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]
        assert env["TPU_WORKER_HOSTNAMES"] == hosts and env["TPU_WORKER_ID"] == index, env
        assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "tpu-job-podslice-0.headless-svc", env
        assert env["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,1,1", env  # the device plugin's, beside ours
    w.kubectl("delete", "namespace", ns, "--wait=false")


@pytest.fixture
def tpu7x_node(deployed):
    """The node labelled as one of the walk-through's TPUNodeGroup (labels put back after)."""
    w = deployed
    walk = {"cloud.google.com/tpu-node-group": "default-tpu7x-slice", "cloud.google.com/gke-tpu-accelerator": "tpu7x",
            "cloud.google.com/gke-tpu-topology": "2x2x2"}
    w.kubectl("label", "node", w.node.name, "--overwrite", *(f"{k}={v}" for k, v in walk.items()))
    try:
        yield
    finally:
        w.kubectl("label", "node", w.node.name, "--overwrite", "cloud.google.com/tpu-node-group-",
                  *(f"{k}={NODE_LABELS[k]}" for k in walk if k in NODE_LABELS))


def test_the_v7x_walkthrough_statefulset_gets_what_it_set_by_hand(deployed, stand_in_images, tpu7x_node):
    """examples/tpu/walkthrough/20-workload.yaml: no hand-set TPU variables; the webhooks inject
    them and the running containers see them."""
    w = deployed
    docs = [on_the_rig(d) for d in load(ROOT / "examples/tpu/walkthrough/20-workload.yaml")]
    for d in docs:
        if d["kind"] == "StatefulSet":
            d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] = 2
    w.apply(*docs)
    try:
        for pod in running_pods(w, "default", "tpu7x-workers", 2):
            env = report(w, "default", pod, "jax")
            ordinal = pod["metadata"]["name"].rsplit("-", 1)[1]
            hosts = "tpu7x-workers-0.tpu7x-workers,tpu7x-workers-1.tpu7x-workers"
            assert env["TPU_WORKER_HOSTNAMES"] == hosts, env
            assert env["TPU_PROCESS_ADDRESSES"] == ",".join(f"{h}:8476" for h in hosts.split(",")), env
            assert env["TPU_WORKER_ID"] == ordinal and env["TPU_PROCESS_PORT"] == "8476", env
            assert (env["MEGASCALE_NUM_SLICES"], env["MEGASCALE_SLICE_ID"], env["MEGASCALE_PORT"]) == ("1", "0", "8080")
            assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "tpu7x-workers-0.tpu7x-workers", env
    finally:
        w.kubectl("delete", "-f", "-", "--wait=true", "--timeout=90s", stdin=yaml.safe_dump_all(docs), check=False)
        w.wait(lambda: not pods_of(w, "default", "tpu7x-workers"), "the walk-through's pods gone", timeout=90)

