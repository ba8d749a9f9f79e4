"""End to end on a real kubelet (tests/node/conftest.py): the DaemonSets of our own image Ready,
then workload pods that request ``google.com/tpu`` and mount kernel caches through ``csi.gkm.io``,
proving from inside what they got; then what must hold when parts of the node fail."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.node.conftest import SYSTEM, TPU

V5E = [{"backend": "tpu", "arch": "v5e"}]
MOUNT = "/caches/jax"
FILES = {"xla/module-1.bin": b"\x7fXLA" * 4096, "xla/module-2.bin": b"\x01" * 1000}

# Runs in the workload container (the accelnode image's python3): what it got, as one JSON line;
# exit 1 when something is missing, so the pod Succeeds only when everything holds.
PROBE = r"""
import errno, glob, hashlib, json, os, sys
root = sys.argv[1]
files = {}
for d, _, names in os.walk(root):
    for n in names:
        p = os.path.join(d, n)
        files[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
try:
    open(os.path.join(root, "written-by-pod"), "w").close()
    read_only = False
except OSError as e:
    read_only = e.errno == errno.EROFS
devices = sorted(p for p in glob.glob("/dev/vfio/*") + glob.glob("/dev/accel*"))
tpu = {k: v for k, v in os.environ.items() if k.startswith("TPU_")}
print(json.dumps({"devices": devices, "tpu_env": tpu, "files": files, "read_only": read_only}))
sys.exit(0 if devices and tpu and files and read_only else 1)
"""


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


def workload(name: str, ns: str, volume: dict, *, chips: int = 2, command: list[str] | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "tolerations": [{"key": TPU, "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "worker", "image": "accelnode:0.1.0", "imagePullPolicy": "Never",
                                     "command": command or ["python3", "-c", PROBE, MOUNT],
                                     "resources": {"limits": {TPU: str(chips)}},
                                     "volumeMounts": [{"name": "kernel-cache", "mountPath": MOUNT, "readOnly": True}]}],
                     "volumes": [{"name": "kernel-cache", **volume}]}}


def inline(cache: str, ns: str) -> dict:
    return {"csi": {"driver": "csi.gkm.io", "readOnly": True,
                    "volumeAttributes": {"csi.gkm.io/GKMCache": cache, "csi.gkm.io/namespace": ns}}}


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
    got = finished(deployed, ns, "inline")
    assert len(got["devices"]) >= 2, got
    assert len(got["tpu_env"]["TPU_VISIBLE_CHIPS"].split(",")) == 2, got
    assert got["read_only"] is True
    import hashlib
    want = {f"io.jax.cache/{k}": hashlib.sha256(v).hexdigest() for k, v in FILES.items()}
    assert {k: v for k, v in got["files"].items() if k.startswith("io.jax.cache/")} == want, got["files"]
