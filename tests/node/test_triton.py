"""Triton is the judge of the Triton cache kind, through the whole CSI path on the real kubelet.

Real kernels compiled ahead of time for cuda:90 (tests/rigs/triton_kernels.py, triton 3.9, no
GPU needed) are packed by ``accelnode cache build`` (labels and targets from Triton's own
metadata, group files rebased to ``/cache/io.triton.cache``) and pushed; the controller pins the
GKMCache. The node (tests/node/conftest.py) is a TPU host, where a cuda:90 cache does not fit, so
a simulated H100 (PCI 10de:2330, arch sm_90 by accelnode/hw/accelerators.py's PCI table) is added
to its sysfs and the CSI + agent pod restarted so that the agent detects it; both are undone at
the end.

Then Triton, in pods running our image with the host's Triton mounted from the checkout's venv:

- pod A mounts the cache inline through csi.gkm.io at ``/cache`` with
  ``TRITON_CACHE_DIR=/cache/io.triton.cache``: Triton's own listener reports a cache hit for
  every kernel and its cache manager writes nothing; a kernel the cache lacks compiles and is
  written (the copy-on-write view, docs/csi.md "Views"); a second process in A hits it;
- pod B, same cache, same node, while A still runs with its view published: B hits every cached
  kernel but not A's new one (it compiles it in its own view);
- the store's copy is unchanged: its files are the built tree's (group files rebased), and they
  match what the agent recorded at install.

With a simulated A100 (sm_80) instead, the same cache is refused: the pod stays Pending and its
FailedMount event names what the cache wants and what the node has.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from accelnode import IMAGE
from tests.conftest import ROOT, accelnode_cmd, require
from tests.node.conftest import SYSTEM
from tests.node.test_kubelet import cache_object, inline, namespace, phase

KERNELS = ["add_1024_w4", "softmax_256_w4", "matmul_32x32x32", "matmul_64x64x32", "softmax_512_w8", "add_256_w8"]
MISSING = "add_64_w8"  # a variant the cache never holds
TARGET = "cuda:90:32"
NVIDIA, H100, A100 = 0x10DE, 0x2330, 0x20B2  # H100 SXM5 (sm_90), A100 SXM4 80GB (sm_80)
GPU_BDF = "0000:00:10.0"  # free on the v5e-4 preset (NIC at 03, chips at 04-07)
CSI_NODE = "app.kubernetes.io/name=accelnode-csi-node"
POD_PATH = "/cache/io.triton.cache"  # `accelnode cache build --pod-path` default
# Triton for the pod: the accelnode image has python3.11 and no Triton, so the host venv's
# site-packages (same Python minor version; resolved: .venv may be a link) and the rig script go
# in read-only through hostPath. Both are root's 0755/0644, so the image's uid 65532 reads them.
SITE_PACKAGES = (ROOT / ".venv" / "lib" / "python3.11" / "site-packages").resolve()
RIGS = ROOT / "tests" / "rigs"
POD_SITE, POD_RIGS = "/opt/triton-site", "/opt/rigs"
RUN = f"python3 {POD_RIGS}/triton_kernels.py --target {TARGET} --kernels"


def require_triton_here() -> None:
    require((SITE_PACKAGES / "triton").is_dir(), f"triton in {SITE_PACKAGES} (the checkout's venv; make deps installs it)")


def listing(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def compile_here(cache_dir: Path, kernels: list[str]) -> dict:
    """tests/rigs/triton_kernels.py in a fresh Python on this host (the cold compile)."""
    import os

    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_HOME", None)
    proc = subprocess.run([sys.executable, "-m", "tests.rigs.triton_kernels", "--target", TARGET,
                           "--kernels", ",".join(kernels)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def restart_csi_node(world) -> None:
    """Delete the CSI + agent pod; the DaemonSet's new one is Ready (its agent detects anew)."""
    (old,) = world.pods(selector=CSI_NODE)
    world.kubectl("delete", "pod", "-n", SYSTEM, old["metadata"]["name"], "--wait=true", "--timeout=90s")
    world.wait(lambda: any(world.ready(p) and p["metadata"]["uid"] != old["metadata"]["uid"]
                           for p in world.pods(selector=CSI_NODE)) and world.system_ready(),
               "a new CSI + agent pod Ready", timeout=180)


def agent_log(world) -> str:
    (pod,) = world.pods(selector=CSI_NODE)
    return world.node.pod_log(SYSTEM, pod["metadata"]["name"], "agent")


@contextlib.contextmanager
def gpu_on_node(world, device: int, arch: str):
    """A simulated NVIDIA GPU on the node's host, seen by a restarted agent; removed (and the agent
    restarted again) afterwards, so the node is as the other tests expect it."""
    world.host.add_pci_device(GPU_BDF, vendor=NVIDIA, device=device)
    try:
        restart_csi_node(world)
        world.wait(lambda: f"cuda/{arch} x1" in agent_log(world), f"the agent detecting cuda/{arch}", timeout=30)
        yield
    finally:
        world.host.remove_pci_device(GPU_BDF)
        restart_csi_node(world)


def triton_pod(name: str, ns: str, cache: str, script: str) -> dict:
    volume = inline(cache, ns)
    volume["csi"]["readOnly"] = False  # a writable request: the cache's kind (triton) then gives copy-on-write
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{
                         "name": "worker", "image": IMAGE, "imagePullPolicy": "Never",
                         "command": ["/bin/sh", "-c", script],
                         "env": [{"name": "TRITON_CACHE_DIR", "value": POD_PATH},
                                 {"name": "PYTHONPATH", "value": POD_SITE},
                                 {"name": "HOME", "value": "/tmp"}],  # the image user's is /nonexistent
                         "volumeMounts": [{"name": "kernel-cache", "mountPath": "/cache"},
                                          {"name": "triton", "mountPath": POD_SITE, "readOnly": True},
                                          {"name": "rigs", "mountPath": POD_RIGS, "readOnly": True}]}],
                     "volumes": [{"name": "kernel-cache", **volume},
                                 {"name": "triton", "hostPath": {"path": str(SITE_PACKAGES), "type": "Directory"}},
                                 {"name": "rigs", "hostPath": {"path": str(RIGS), "type": "Directory"}}]}}


def reports(world, ns: str, name: str) -> list[dict]:
    out = world.node.pod_log(ns, name, "worker")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wait_reports(world, ns: str, name: str, n: int, *, done: str = "") -> list[dict]:
    """The pod's first ``n`` reports: once it has Succeeded, or (``done``) once it printed ``done``
    and runs on; fails with what it printed when it Failed."""
    def ready():
        p = phase(world, ns, name)
        if p == "Failed":
            return "Failed"
        if done:
            return p == "Running" and done in world.node.pod_log(ns, name, "worker").splitlines()
        return p == "Succeeded"

    got = world.wait(ready, f"pod {ns}/{name} to report", timeout=300)
    out = world.node.pod_log(ns, name, "worker")
    assert got is True, f"{name} failed:\n{out[-4000:]}\n{world.events(ns, name)}"
    found = reports(world, ns, name)
    assert len(found) == n, f"{name}: expected {n} reports:\n{out[-4000:]}"
    return found


def hit(k: dict) -> bool:
    return k.get("cache_hit") is True and k.get("puts") == 0 and "error" not in k


def compiled_and_written(k: dict) -> bool:
    return k.get("cache_hit") is False and k.get("puts", 0) >= 1 and "error" not in k


def store_dir(world, repo: str) -> Path:
    """The agent's store directory of the cache pulled from ``repo`` (the store: the node's
    ``caches`` hostPath, layout ``caches/<algo>-<hex>/{content,files.json,meta.json}``)."""
    found = [d for d in (world.node.workdir / "caches" / "caches").glob("sha256-*")
             if f"/{repo}" in json.loads((d / "meta.json").read_text())["image"]]
    assert len(found) == 1, found
    return found[0]


def unchanged(store: Path, built: dict[str, str]) -> None:
    """The store's copy: the built tree file for file (group files rebased to POD_PATH, the rest
    byte for byte), nothing added; and exactly what the agent recorded at install (its verify)."""
    from agent.extract import Entry
    from agent.store import _scan

    tree = store / "content" / "io.triton.cache"
    have = listing(tree)
    assert sorted(have) == sorted(built), (sorted(set(have) ^ set(built)))
    assert {k: v for k, v in have.items() if "__grp__" not in k} == \
        {k: v for k, v in built.items() if "__grp__" not in k}
    want = {p: Entry.from_json(v) for p, v in json.loads((store / "files.json").read_text()).items()}
    assert _scan(store / "content") == want  # agent.store.CacheStore.verify, without touching the store


def mount_fstype(path: Path) -> str:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            return fields[fields.index("-") + 1]
    return ""


@pytest.fixture(scope="module")
def triton_cache(deployed, tmp_path_factory):
    """Kernels compiled cold on this host, built into a cache image by ``accelnode cache build``,
    pushed, named by a GKMCache the controller has pinned: (namespace, name, repo, built tree
    listing, the cold compile's report)."""
    require_triton_here()
    src = tmp_path_factory.mktemp("triton") / "cache"
    cold = compile_here(src, KERNELS)
    assert not any(k["cache_hit"] for k in cold["kernels"].values()) and all(
        k["puts"] >= 1 for k in cold["kernels"].values()), cold
    built = listing(src)

    ns = namespace(deployed)
    repo = "e2e/triton-cuda90"
    image = f"{deployed.registry.host}/{repo}:{cold['triton_version']}"
    proc = subprocess.run([*accelnode_cmd(), "cache", "build", str(src), image, "--plain-http", "--pod-path", POD_PATH],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    inspect = subprocess.run([*accelnode_cmd(), "cache", "inspect", proc.stdout.strip(), "--json", "--plain-http"],
                             capture_output=True, text=True, timeout=60)
    assert inspect.returncode == 0, inspect.stderr
    (manifest,) = json.loads(inspect.stdout)["manifests"]
    assert manifest["kind"] == "triton" and manifest["targets"] == [{"backend": "cuda", "arch": "90", "warp_size": 32}]
    assert manifest["labels"]["cache.triton.image/entry-count"] == str(len(KERNELS))
    deployed.apply(cache_object("triton", ns, image))
    deployed.wait(lambda: deployed.get("gkmcache", "triton", "-n", ns).get("status", {}).get("resolvedDigest"),
                  "the controller to pin the Triton cache")
    return ns, "triton", repo, built, cold


def test_triton_hits_the_cache_in_a_pod_and_writes_only_its_own_view(deployed, triton_cache, capsys):
    ns, name, repo, built, cold = triton_cache
    everything = ",".join(KERNELS)
    with gpu_on_node(deployed, H100, "sm_90"):
        try:
            # A: the cached kernels; the missing one (compiled, written to A's view); the missing one
            # again in a new process (a hit from A's view); then A holds its volume while B runs.
            deployed.apply(triton_pod("triton-a", ns, name,
                                      f"{RUN} {everything} && {RUN} {MISSING} && {RUN} {MISSING} "
                                      "&& echo holding && exec sleep 3600"))
            a_cached, a_miss, a_again = wait_reports(deployed, ns, "triton-a", 3, done="holding")
            assert a_cached["triton_version"] == cold["triton_version"]
            for kernel, k in a_cached["kernels"].items():
                assert hit(k), f"pod A, {kernel}: not a read-only cache hit: {k}"
            assert compiled_and_written(a_miss["kernels"][MISSING]), a_miss
            assert hit(a_again["kernels"][MISSING]), f"pod A did not see its own write: {a_again}"

            uid = deployed.get("pod", "triton-a", "-n", ns)["metadata"]["uid"]
            target = deployed.node.root_dir / "pods" / uid / "volumes/kubernetes.io~csi/kernel-cache/mount"
            assert mount_fstype(target) == "overlay", f"pod A's volume is not a copy-on-write view: {target}"
            store = store_dir(deployed, repo)
            new_in_a = sorted(set(listing(target / "io.triton.cache")) - set(built))
            assert new_in_a and all(n.split("/")[0] not in {b.split("/")[0] for b in built} for n in new_in_a), new_in_a
            unchanged(store, built)

            # B, while A's view is still published: every cached kernel hits, A's new one does not
            deployed.apply(triton_pod("triton-b", ns, name, f"{RUN} {everything},{MISSING}"))
            (b,) = wait_reports(deployed, ns, "triton-b", 1)
            for kernel in KERNELS:
                assert hit(b["kernels"][kernel]), f"pod B, {kernel}: not a cache hit: {b['kernels'][kernel]}"
            assert compiled_and_written(b["kernels"][MISSING]), f"pod B saw pod A's kernel: {b['kernels'][MISSING]}"
            assert phase(deployed, ns, "triton-a") == "Running"
            unchanged(store, built)
        finally:
            deployed.kubectl("delete", "pods", "--all", "-n", ns, "--wait=true", "--timeout=90s", check=False)
    assert not target.exists() or not any(target.iterdir())  # A's view unpublished
    unchanged(store, built)

    with capsys.disabled():
        print(f"\ntriton {cold['triton_version']}, {len(KERNELS)} kernels for {TARGET}: cold on the host "
              f"{cold['seconds']:.2f}s; in pod A from the cache {a_cached['seconds']:.2f}s; "
              f"{MISSING} compiled in pod A {a_miss['seconds']:.2f}s, again from A's view {a_again['seconds']:.2f}s; "
              f"pod B {b['seconds']:.2f}s ({MISSING} compiled {b['kernels'][MISSING]['seconds']:.2f}s)")


def test_on_an_a100_node_the_cuda90_cache_is_refused_and_the_pod_says_why(deployed, triton_cache):
    """The agent's fit check (tests/cache/test_triton.py at agent level) as kubelet reports it."""
    ns, name, _, _, _ = triton_cache
    with gpu_on_node(deployed, A100, "sm_80"):
        try:
            deployed.apply(triton_pod("on-a100", ns, name, f"{RUN} {KERNELS[0]}"))
            why = deployed.wait(lambda: [e for e in deployed.events(ns, "on-a100")
                                         if e.startswith("FailedMount") and "does not fit this node" in e],
                                "a FailedMount event saying the cache does not fit")
            assert any("cuda/90" in e and "cuda/sm_80" in e for e in why), why  # what it wants, what the node has
            assert phase(deployed, ns, "on-a100") == "Pending"
        finally:
            deployed.kubectl("delete", "pod", "on-a100", "-n", ns, "--wait=true", "--timeout=90s", check=False)
