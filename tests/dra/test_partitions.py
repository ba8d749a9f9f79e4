"""Chips as partitionable devices, allocated by the real kube-scheduler 1.37 (no kubelet needed:
Node objects, the slices ``accelnode dra`` publishes for a simulated host, ResourceClaims and
pods; the scheduler writes each allocation into the claim's status).

Each host shape gets a fresh Node: ``chips/size`` claims for one ICI block of ``size`` chips
pack it exactly, with valid aligned blocks that never overlap; one more claim stays
unschedulable. Claims written for Google's driver (class ``tpu.google.com``, chips counted)
share the chips' counters with block claims; a pod asking ``google.com/tpu`` is served by the
driver through the DeviceClass's extendedResourceName.
"""

from __future__ import annotations

import json

import pytest

from accelnode import IMAGE
from accelnode.kube.client import Client, Config, KubeError
from tests.conftest import ROOT, TOOLS_BIN, eventually, tool
from tests.dra.conftest import DRIVER, SLICES, claim_path

BLOCK_CLASS = "ici-block.tpu.google.com"
CLASSES = ROOT / "overlays/dra/deviceclass.yaml"
CHIPS = {"v5e-4": 4, "v6e-8": 8, "v7x-4": 4}
LABELS = {"v5e-4": ("tpu-v5-lite-podslice", "2x2"), "v6e-8": ("tpu-v6e-slice", "2x4"), "v7x-4": ("tpu7x", "2x2x1")}


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    """A control plane with kube-scheduler (and the resource-claim controller), the DeviceClasses applied."""
    import subprocess

    from tests.rigs.devcluster import ControlPlane

    cp = ControlPlane(tmp_path_factory.mktemp("dra-sched"), TOOLS_BIN, kubelets=True)
    cp.start()
    try:
        out = subprocess.run([tool("kubectl"), f"--kubeconfig={cp.kubeconfig('admin')}", "apply", "-f", str(CLASSES)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="module")
def api(sched):
    return Client(Config.load(sched.kubeconfig("admin")), user_agent="accelnode-tests")


@pytest.fixture
def ns(api):
    import uuid

    name = f"t-{uuid.uuid4().hex[:10]}"
    api.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    # ServiceAccount admission wants the namespace's default account, made a moment later
    eventually(lambda: _get(api, f"/api/v1/namespaces/{name}/serviceaccounts/default"), "the default ServiceAccount")
    return name


def _get(api, path: str):
    try:
        return api.request("GET", path)
    except KubeError:
        return None


@pytest.fixture
def tpu_node(sched, api, tpu_host, dra):
    """``tpu_node(name, preset)``: a Ready Node (no kubelet) whose chips ``accelnode dra`` publishes."""
    made = []

    def make(name: str, preset: str):
        accel, topo = LABELS[preset]
        api.request("POST", "/api/v1/nodes", body={
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                  "cloud.google.com/gke-tpu-accelerator": accel,
                                                  "cloud.google.com/gke-tpu-topology": topo}}})
        made.append(name)
        api.request("PATCH", f"/api/v1/nodes/{name}/status", body={"status": {
            "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "a Node object of the test"}]}})
        host = tpu_host(preset)
        d = dra(host, name, sched.kubeconfig("admin"))
        d.start()
        n = CHIPS[preset]
        eventually(lambda: len(pool_devices(api, name)) == sum(n // s for s in (1, 2, 4, 8) if s <= n),
                   f"the pool of {name}", timeout=30)
        return d

    yield make
    for name in made:
        api.request("DELETE", f"/api/v1/nodes/{name}")


def pool_devices(api, node: str) -> dict[str, dict]:
    slices = api.list(SLICES, query={"fieldSelector": f"spec.nodeName={node}"})["items"]
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def block_claim(api, ns: str, name: str, chips: int) -> None:
    """A claim for one ICI block of ``chips`` chips."""
    cel = f'device.attributes["{DRIVER}"].chips == {chips}'
    claim(api, ns, name, {"deviceClassName": BLOCK_CLASS, "count": 1, "selectors": [{"cel": {"expression": cel}}]})


def claim(api, ns: str, name: str, exactly: dict) -> None:
    api.request("POST", claim_path(ns), body={
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "tpu", "exactly": exactly}]}}})


def pod(api, ns: str, name: str, node: str, *, claim_name: str | None = None, tpus: int | None = None) -> None:
    """A pod for ``node`` (never started: there is no kubelet) holding a claim, or asking ``google.com/tpu``."""
    c = {"name": "worker", "image": IMAGE}
    spec = {"nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [{"operator": "Exists"}],
            "containers": [c], "terminationGracePeriodSeconds": 0}
    if claim_name:
        spec["resourceClaims"] = [{"name": "tpu", "resourceClaimName": claim_name}]
        c["resources"] = {"claims": [{"name": "tpu"}]}
    if tpus:
        c["resources"] = {"limits": {"google.com/tpu": str(tpus)}}
    api.request("POST", f"/api/v1/namespaces/{ns}/pods",
                body={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})


def allocated(api, ns: str, name: str, timeout: float = 30.0) -> list[str]:
    """The devices the scheduler allocated to claim ``name`` (waits for it)."""
    def get():
        alloc = (api.request("GET", claim_path(ns, name)).get("status") or {}).get("allocation")
        return alloc and [r["device"] for r in alloc["devices"]["results"]]
    return eventually(get, f"claim {ns}/{name} allocated", timeout=timeout)


def unschedulable(api, ns: str, pod_name: str) -> str:
    """The scheduler's reason a pod stays Pending."""
    def get():
        p = api.request("GET", f"/api/v1/namespaces/{ns}/pods/{pod_name}")
        cond = [c for c in (p.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"]
        return cond and cond[0]["status"] == "False" and cond[0].get("reason") == "Unschedulable" and cond[0]["message"]
    return eventually(get, f"pod {pod_name} unschedulable", timeout=30)


def chips_of(pool: dict, device: str) -> set[str]:
    (use,) = pool[device]["consumesCounters"]
    return set(use["counters"])


@pytest.mark.parametrize("preset,size", [(p, s) for p in CHIPS for s in (1, 2, 4, 8) if s <= CHIPS[p]])
def test_block_claims_pack_a_host_exactly_and_one_more_is_refused(api, ns, tpu_node, preset, size):
    node = f"pack-{preset}-{size}"
    d = tpu_node(node, preset)
    n = CHIPS[preset]
    pool = pool_devices(api, node)
    got = []
    for k in range(n // size):
        block_claim(api, ns, f"c{k}", size)
        pod(api, ns, f"p{k}", node, claim_name=f"c{k}")
        (dev,) = allocated(api, ns, f"c{k}")
        got.append(dev)
    # each a valid aligned block of `size` chips (the driver's own rule), together every chip once
    used = [chips_of(pool, dev) for dev in got]
    assert all(len(u) == size for u in used), got
    assert sorted(c for u in used for c in u) == sorted(f"chip-{i}" for i in range(n)), got
    assert sorted(got) == sorted(f"tpu-{i}" if size == 1 else f"tpu-{i}-{i + size - 1}" for i in range(0, n, size))
    # the host is full: a further claim of any size stays unschedulable, unallocated
    block_claim(api, ns, "more", 1)
    pod(api, ns, "more", node, claim_name="more")
    assert "cannot allocate all claims" in unschedulable(api, ns, "more")
    assert not (api.request("GET", claim_path(ns, "more")).get("status") or {}).get("allocation")
    if size == 2:  # what a container of a 2-chip block gets: its chips' nodes and a 2-chip host's env
        uid = api.request("GET", claim_path(ns, "c1"))["metadata"]["uid"]
        assert d.prepare(ns, "c1", uid).error == ""
        spec = json.loads((d.cdi / f"k8s.{DRIVER}-tpu_{uid}.json").read_text())
        env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
        assert (env["TPU_TOPOLOGY"], env["TPU_CHIPS_PER_HOST_BOUNDS"]) == (LABELS[preset][1], "1,2,1")
        (cdi_dev,) = spec["devices"]
        assert cdi_dev["containerEdits"]["env"] == [f"TPU_DEVICE_{i}_RESOURCE_CLAIM={uid}" for i in (2, 3)]
        chips = d.host.chips()
        assert cdi_dev["name"] == f"{uid}-tpu-2-3"
        want = [p for bdf in chips[2:4] for f in d.host.functions(bdf) for p in _nodes(d, f)]
        assert [x["hostPath"] for x in cdi_dev["containerEdits"]["deviceNodes"]] == want
        assert len(want) == (4 if preset.startswith("v7x") else 2)  # a v7x chip is two VFIO devices


def _nodes(d, bdf: str) -> tuple[str, ...]:
    from accelnode.hw.tpu import probe

    return probe(d.host.sysfs_root, d.host.dev_root, bdf).nodes


def test_mixed_claims_never_overlap_and_googles_claims_share_the_counters(api, ns, tpu_node):
    node = "mixed-v5e-4"
    tpu_node(node, "v5e-4")
    # Google's form: one chip of the host by generation (class tpu.google.com, chips counted)
    gen = 'device.attributes["tpu.google.com"].tpuGen == "v5litepod"'
    claim(api, ns, "one", {"deviceClassName": DRIVER, "count": 1, "selectors": [{"cel": {"expression": gen}}]})
    pod(api, ns, "one", node, claim_name="one")
    assert allocated(api, ns, "one") == ["tpu-0"]
    # a 2-chip block cannot be 0-1 any more: it is 2-3
    block_claim(api, ns, "pair", 2)
    pod(api, ns, "pair", node, claim_name="pair")
    assert allocated(api, ns, "pair") == ["tpu-2-3"]
    # the whole host (Google's allocationMode: All) is refused while part of it is taken
    claim(api, ns, "host", {"deviceClassName": DRIVER, "allocationMode": "All"})
    pod(api, ns, "host", node, claim_name="host")
    assert "cannot allocate all claims" in unschedulable(api, ns, "host")
    # a single chip still fits: the one left, 1
    block_claim(api, ns, "last", 1)
    pod(api, ns, "last", node, claim_name="last")
    assert allocated(api, ns, "last") == ["tpu-1"]


def test_a_whole_host_claim_as_googles_tutorials_write_it(api, ns, tpu_node):
    node = "all-v6e-8"
    tpu_node(node, "v6e-8")
    claim(api, ns, "all", {"deviceClassName": DRIVER, "allocationMode": "All"})
    pod(api, ns, "all", node, claim_name="all")
    assert allocated(api, ns, "all") == [f"tpu-{i}" for i in range(8)]
    block_claim(api, ns, "more", 1)
    pod(api, ns, "more", node, claim_name="more")
    assert "cannot allocate all claims" in unschedulable(api, ns, "more")


def test_a_google_com_tpu_pod_is_served_through_the_driver(api, ns, tpu_node):
    node = "ext-v5e-4"
    tpu_node(node, "v5e-4")
    pod(api, ns, "old", node, tpus=4)  # an unchanged device-plugin pod spec

    def claim_name():
        st = api.request("GET", f"/api/v1/namespaces/{ns}/pods/old").get("status") or {}
        return (st.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    name = eventually(claim_name, "the pod's extended-resource claim", timeout=30)
    assert allocated(api, ns, name) == ["tpu-0", "tpu-1", "tpu-2", "tpu-3"]
    p = api.request("GET", f"/api/v1/namespaces/{ns}/pods/old")
    assert p["spec"].get("nodeName") == node
    (m,) = p["status"]["extendedResourceClaimStatus"]["requestMappings"]
    assert (m["containerName"], m["resourceName"]) == ("worker", "google.com/tpu")
    # the host is now full for claims too
    block_claim(api, ns, "more", 1)
    pod(api, ns, "more", node, claim_name="more")
    assert "cannot allocate all claims" in unschedulable(api, ns, "more")


# kubernetes-sigs/dra-driver-google-tpu demo/specs/multi-tpu-pod.yaml (2026-08), its claim template as written
GOOGLE_MULTI_TPU = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  namespace: tpu-test
  name: multi-tpu
spec:
  spec:
    devices:
      requests:
      - name: tpus
        exactly:
          deviceClassName: tpu.google.com
          count: 4
"""


def test_googles_demo_claim_and_implicit_extended_resource_run_unchanged(sched, api, tpu_node):
    import yaml

    node = "google-v6e-8"
    tpu_node(node, "v6e-8")
    if not _get(api, "/api/v1/namespaces/tpu-test"):
        api.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                        "metadata": {"name": "tpu-test"}})
        eventually(lambda: _get(api, "/api/v1/namespaces/tpu-test/serviceaccounts/default"), "the default account")
    tmpl = yaml.safe_load(GOOGLE_MULTI_TPU)
    api.request("POST", "/apis/resource.k8s.io/v1/namespaces/tpu-test/resourceclaimtemplates", body=tmpl)
    # their pod (ctr0 holding claim `tpus` from the template), pinned to this node
    pod_body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "multi-tpu-pod", "labels": {"app": "pod"}},
                "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [{"operator": "Exists"}],
                         "containers": [{"name": "ctr0", "image": IMAGE, "resources": {"claims": [{"name": "tpus"}]}}],
                         "resourceClaims": [{"name": "tpus", "resourceClaimTemplateName": "multi-tpu"}]}}
    api.request("POST", "/api/v1/namespaces/tpu-test/pods", body=pod_body)

    def claim_name():
        st = api.request("GET", "/api/v1/namespaces/tpu-test/pods/multi-tpu-pod").get("status") or {}
        return next((s.get("resourceClaimName") for s in st.get("resourceClaimStatuses") or []), None)
    got = allocated(api, "tpu-test", eventually(claim_name, "the pod's claim"))
    assert got == ["tpu-0", "tpu-1", "tpu-2", "tpu-3"]  # four chips (Google's driver: any four)
    # the implicit extended resource of the class, as their README names it: 2 chips of the 4 left
    ns = "tpu-test"
    c = {"name": "ctr0", "image": IMAGE, "resources": {"limits": {"deviceclass.resource.kubernetes.io/tpu.google.com": "2"}}}
    api.request("POST", f"/api/v1/namespaces/{ns}/pods", body={
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "implicit"},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [{"operator": "Exists"}],
                 "containers": [c]}})

    def ext_claim():
        st = api.request("GET", f"/api/v1/namespaces/{ns}/pods/implicit").get("status") or {}
        return (st.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    assert allocated(api, ns, eventually(ext_claim, "the implicit extended-resource claim")) == ["tpu-4", "tpu-5"]
    # a 4-chip block no longer fits (4-7 is half taken), a 2-chip one does: 6-7
    block_claim(api, ns, "quad", 4)
    pod(api, ns, "quad", node, claim_name="quad")
    assert "cannot allocate all claims" in unschedulable(api, ns, "quad")
    block_claim(api, ns, "pair", 2)
    pod(api, ns, "pair", node, claim_name="pair")
    assert allocated(api, ns, "pair") == ["tpu-6-7"]
