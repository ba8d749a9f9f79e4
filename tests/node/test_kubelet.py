"""End to end on a real kubelet (tests/node/conftest.py): the DaemonSets of our own image Ready,
then workload pods that request ``google.com/tpu`` and mount kernel caches through ``csi.gkm.io``,
proving from inside what they got; then what must hold when parts of the node fail."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.rigs.node import DEVICE_PLUGINS, PROBE, inline, workload  # noqa: F401 (re-exported)
from tests.node.conftest import SYSTEM, TPU

V5E = [{"backend": "tpu", "arch": "v5e"}]
FILES = {"xla/module-1.bin": b"\x7fXLA" * 4096, "xla/module-2.bin": b"\x01" * 1000}

def make_cache(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def namespace(world) -> str:
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    world.kubectl("create", "namespace", ns)
    world.wait(lambda: world.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0,
               f"ServiceAccount default in {ns}")
    return ns


def cache_object(name: str, ns: str, image: str) -> dict:
    return {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": name, "namespace": ns},
            "spec": {"image": image}}


def phase(world, ns: str, name: str) -> str:
    return world.get("pod", name, "-n", ns).get("status", {}).get("phase", "")


def finished(world, ns: str, name: str) -> dict:
    """The probe's report once the pod has Succeeded (fails on Failed, with what it printed)."""
    world.wait(lambda: phase(world, ns, name) in ("Succeeded", "Failed"), f"pod {ns}/{name} to finish", timeout=180)
    out = world.node.pod_log(ns, name, "worker")
    assert phase(world, ns, name) == "Succeeded", f"{name}: {out}\n{world.events(ns, name)}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cache(deployed, tmp_path_factory):
    """A JAX cache for tpu/v5e in the registry, a GKMCache naming it by tag, pinned by the controller."""
    ns = namespace(deployed)
    ref = deployed.registry.push(make_cache(tmp_path_factory.mktemp("cache"), FILES), "e2e/jax-v5e", tag="v1",
                                 kind="jax", targets=V5E)
    deployed.apply(cache_object("jax-v5e", ns, f"{deployed.registry.host}/e2e/jax-v5e:v1"))
    digest = ref.split("@")[1]
    deployed.wait(lambda: deployed.get("gkmcache", "jax-v5e", "-n", ns).get("status", {}).get("resolvedDigest") == digest,
                  "the controller to pin the GKMCache")
    return ns, "jax-v5e", digest


def test_the_daemonsets_of_our_image_run_on_the_real_kubelet(deployed):
    node = deployed.get("node", deployed.node.name)
    assert int(node["status"]["capacity"][TPU]) == 4 and deployed.allocatable() == 4
    drivers = json.loads(node["metadata"]["annotations"].get("csi.volume.kubernetes.io/nodeid", "{}"))
    assert "csi.gkm.io" in drivers
    for p in deployed.pods():
        for c in p["status"]["containerStatuses"]:
            assert c["ready"] and c["image"].endswith("accelnode:0.1.0"), (p["metadata"]["name"], c)


def test_a_workload_gets_two_chips_and_the_cache_read_only_inline(deployed, cache):
    ns, name, digest = cache
    deployed.apply(workload("inline", ns, inline(name, ns)))
    check(finished(deployed, ns, "inline"))


def check(got: dict) -> None:
    import hashlib

    assert len(got["devices"]) >= 2, got
    # GKE's env from the Node's labels (v5e 2x2): two chips are a 1x2 host of the slice
    assert got["tpu_env"]["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,2,1" and "TPU_VISIBLE_CHIPS" not in got["tpu_env"], got
    assert got["read_only"] is True
    want = {f"io.jax.cache/{k}": hashlib.sha256(v).hexdigest() for k, v in FILES.items()}
    assert {k: v for k, v in got["files"].items() if k.startswith("io.jax.cache/")} == want, got["files"]


def test_a_workload_mounts_the_same_cache_by_claim(deployed, cache):
    """The controller made PVC <cache name> in the cache's namespace; kubelet mounts the PV through
    csi.gkm.io like an inline volume."""
    ns, name, _ = cache
    deployed.wait(lambda: deployed.claim_phase(name, ns) == "Bound", "the cache's PVC Bound")
    deployed.apply(workload("by-claim", ns, {"persistentVolumeClaim": {"claimName": name, "readOnly": True}}))
    check(finished(deployed, ns, "by-claim"))


def sleeper(name: str, ns: str, cache: str, chips: int = 2) -> dict:
    pod = workload(name, ns, inline(cache, ns), chips=chips,
                   command=["python3", "-c", "import time, signal, sys; signal.signal(signal.SIGTERM, "
                            "lambda *a: sys.exit(0)); time.sleep(3600)"])
    return pod


def running(world, ns: str, name: str) -> None:
    world.wait(lambda: phase(world, ns, name) == "Running", f"pod {ns}/{name} Running")


def test_the_csi_pod_restarted_under_a_mounted_workload_keeps_the_mount_and_unpublishes(deployed, cache):
    ns, name, _ = cache
    deployed.apply(sleeper("held", ns, name))
    running(deployed, ns, "held")
    uid = deployed.get("pod", "held", "-n", ns)["metadata"]["uid"]
    target = deployed.node.root_dir / "pods" / uid / "volumes/kubernetes.io~csi/kernel-cache/mount"
    assert (target / "io.jax.cache/xla/module-1.bin").exists()
    (old,) = deployed.pods(selector="app.kubernetes.io/name=accelnode-csi-node")
    deployed.kubectl("delete", "pod", "-n", SYSTEM, old["metadata"]["name"], "--wait=true")
    deployed.wait(lambda: any(deployed.ready(p) and p["metadata"]["uid"] != old["metadata"]["uid"]
                              for p in deployed.pods(selector="app.kubernetes.io/name=accelnode-csi-node")),
                  "a new CSI pod Ready")
    assert (target / "io.jax.cache/xla/module-1.bin").exists()  # the workload's mount survived
    assert phase(deployed, ns, "held") == "Running"
    deployed.kubectl("delete", "pod", "held", "-n", ns, "--wait=true", "--timeout=90s")
    assert not target.exists() or not any(target.iterdir())  # unpublished by the new driver


def test_kubelet_restarted_the_plugin_registers_again_and_running_pods_keep_their_chips(deployed, cache):
    ns, name, _ = cache
    deployed.apply(sleeper("keeps", ns, name))
    running(deployed, ns, "keeps")
    deployed.node.restart_kubelet()
    deployed.wait(lambda: deployed.node.ready() and deployed.allocatable() == 4
                  and (DEVICE_PLUGINS / "accelnode-tpu.sock").exists() and deployed.system_ready(),
                  "the node Ready with 4 chips again, every accelnode pod Ready")
    assert phase(deployed, ns, "keeps") == "Running"
    # a pod needing the remaining 2 still fits: the running pod keeps its 2
    deployed.apply(workload("after-restart", ns, inline(name, ns)))
    check(finished(deployed, ns, "after-restart"))
    deployed.kubectl("delete", "pod", "keeps", "after-restart", "-n", ns, "--wait=true", "--timeout=90s")


def test_an_unhealthy_chip_leaves_allocatable_and_a_pod_needing_it_pending(deployed, cache):
    ns, name, _ = cache
    host = deployed.host
    bdf = host.chips()[0]
    host.set_vendor(bdf, 0xFFFF)  # falls off the bus
    try:
        deployed.wait(lambda: deployed.allocatable() == 3, "allocatable google.com/tpu 3")
        deployed.apply(workload("needs-four", ns, inline(name, ns), chips=4))
        deployed.wait(lambda: any("Insufficient google.com/tpu" in e for e in deployed.events(ns, "needs-four")),
                      "the scheduler saying Insufficient google.com/tpu")
        assert phase(deployed, ns, "needs-four") == "Pending"
    finally:
        host.set_vendor(bdf, 0x1AE0)
    deployed.wait(lambda: deployed.allocatable() == 4, "allocatable back to 4")
    check_phase = finished(deployed, ns, "needs-four")  # now it fits and runs
    assert check_phase["tpu_env"]["TPU_CHIPS_PER_HOST_BOUNDS"] == "2,2,1"


def test_a_cache_for_another_accelerator_keeps_the_pod_from_starting_and_says_why(deployed, tmp_path):
    ns = namespace(deployed)
    deployed.registry.push(make_cache(tmp_path / "gpu", {"ab/k.cubin": b"\x02" * 1000}), "e2e/triton-h100", tag="v1",
                           kind="triton", targets=[{"backend": "cuda", "arch": "sm_90", "warp_size": 32}])
    deployed.apply(cache_object("triton-h100", ns, f"{deployed.registry.host}/e2e/triton-h100:v1"))
    deployed.apply(workload("wrong-cache", ns, inline("triton-h100", ns), chips=1))
    why = deployed.wait(lambda: [e for e in deployed.events(ns, "wrong-cache")
                                 if e.startswith("FailedMount") and "does not fit this node" in e],
                        "a FailedMount event saying the cache does not fit")
    assert any("cuda/90" in e and "tpu/v5e" in e for e in why), why  # what it wants, what the node has
    assert phase(deployed, ns, "wrong-cache") == "Pending"


def test_the_agent_pod_deleted_mid_pull_the_pod_still_gets_the_whole_cache(deployed, tmp_path):
    """The CSI + agent pod is deleted while the agent unpacks a 256 MiB cache for a waiting pod: the
    DaemonSet brings a new one, kubelet retries the mount, the new agent pulls again and the pod
    gets every byte; no staging directory is left in the store."""
    import hashlib
    import os
    import time

    ns = namespace(deployed)
    files = {f"big/part-{i}.bin": os.urandom(64 << 20) for i in range(4)}
    deployed.registry.push(make_cache(tmp_path / "big", files), "e2e/jax-big", tag="v1", kind="jax", targets=V5E,
                           compression="none", layers=4)
    deployed.apply(cache_object("big", ns, f"{deployed.registry.host}/e2e/jax-big:v1"))
    deployed.wait(lambda: deployed.get("gkmcache", "big", "-n", ns).get("status", {}).get("resolvedDigest"),
                  "the controller to pin the big cache")
    staging = deployed.node.workdir / "caches" / "tmp"
    deployed.apply(workload("after-crash", ns, inline("big", ns), chips=1))
    deployed.wait(lambda: staging.is_dir() and any(staging.iterdir()), "the agent staging the pull", interval=0.02)
    (old,) = deployed.pods(selector="app.kubernetes.io/name=accelnode-csi-node")
    deployed.kubectl("delete", "pod", "-n", SYSTEM, old["metadata"]["name"], "--grace-period=1", "--wait=false")
    got = finished(deployed, ns, "after-crash")
    assert got["read_only"] is True
    want = {f"io.jax.cache/{k}": hashlib.sha256(v).hexdigest() for k, v in files.items()}
    assert {k: v for k, v in got["files"].items() if k.startswith("io.jax.cache/")} == want
    assert any(p["metadata"]["uid"] != old["metadata"]["uid"] for p in
               deployed.pods(selector="app.kubernetes.io/name=accelnode-csi-node"))
    time.sleep(1)
    assert not staging.exists() or not any(staging.iterdir()), sorted(staging.iterdir())
