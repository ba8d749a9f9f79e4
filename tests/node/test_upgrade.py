"""Upgrade, rollback and moving from GKM's CSIDriver on the real kubelet (tests/node/conftest.py),
with a workload reading its cache all along (docs/operations.md).

1. Roll back to the previous manifests: ``daemonsets/`` of :data:`PREVIOUS` (the last commit
   before the CRDs left the base and the image became fully qualified), taken from git and fitted
   to this node by the same overlay as the current ones. Its containers name ``accelnode:0.1.0``,
   which is this checkout's image tagged under that name as well (the image content is the same:
   what changes between the two is the manifests, so every DaemonSet's pod template changes and
   every DaemonSet rolls). The node daemons' roles are this checkout's too, for the same reason:
   the code is; old code is never run here.
2. A pod mounts a cache and reads it every half second, printing the file's digest.
3. Upgrade: ``kubectl apply -k daemonsets/crds/``, then the current overlay: the DaemonSets roll
   (the CSI + agent pod is replaced under the mounted workload); the pod keeps reading the same
   bytes, and a new pod mounts the cache.
4. Moving from GKM: the CSIDriver object is deleted and re-created (docs/operations.md, "Moving
   from GKM", step 3): the running pod keeps reading, a new pod mounts once it is back.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import time

import pytest

from tests.conftest import ROOT
from tests.node.conftest import BASE, SYSTEM, _build
from tests.node.test_kubelet import FILES, cache, finished, phase, running  # noqa: F401 (cache: a fixture)
from tests.rigs.node import MOUNT, inline, workload

# main before this layout (CRDs in the base, image `accelnode:0.1.0`): bump to the last release's
# commit when one is tagged
PREVIOUS = "2721ffb9c10e46eabc600a1c191785a07a5899c1"
PREVIOUS_IMAGE = "accelnode:0.1.0"  # as its manifests name it
PREVIOUS_IMAGE_REF = "docker.io/library/accelnode:0.1.0"  # what that name means to kubelet
DAEMONSETS = ("accelnode-csi-node", "accelnode-tpu-device-plugin")
FILE = f"{MOUNT}/io.jax.cache/xla/module-1.bin"
WANT = hashlib.sha256(FILES["xla/module-1.bin"]).hexdigest()
READER = ("import hashlib, json, sys, time\n"
          "while True:\n"
          "    try:\n"
          "        out = {'t': time.time(), 'sha': hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest()}\n"
          "    except OSError as e:\n"
          "        out = {'t': time.time(), 'error': str(e)}\n"
          "    print(json.dumps(out), flush=True)\n"
          "    time.sleep(0.5)\n")


def previous_base(out) -> object:
    """``daemonsets/`` as it was at :data:`PREVIOUS` (git archive), under ``out``."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS, "daemonsets"], capture_output=True, timeout=60)
    if tar.returncode != 0:
        pytest.skip(f"commit {PREVIOUS[:12]} is not in this checkout's history: {tar.stderr.decode()[-200:]}")
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(out, filter="data")
    return out / "daemonsets"


def rolled(world, image: str) -> bool:
    """Every DaemonSet rolled out: each pod of it Ready and running ``image``."""
    for name in DAEMONSETS:
        ds = world.get("daemonset", name, "-n", SYSTEM)
        st = ds["status"]
        if (st.get("observedGeneration") != ds["metadata"]["generation"]
                or st.get("updatedNumberScheduled", 0) != st["desiredNumberScheduled"]
                or st.get("numberReady", 0) != st["desiredNumberScheduled"] or st["desiredNumberScheduled"] < 1):
            return False
    pods = world.pods(selector="app.kubernetes.io/name in (accelnode-csi-node,accelnode-tpu-device-plugin)")
    return bool(pods) and all(world.ready(p) and not p["metadata"].get("deletionTimestamp")
                              and {c["image"] for c in p["spec"]["containers"]} == {image} for p in pods)


def reads(world, ns: str, name: str, since: float) -> list[dict]:
    """The reader's reports after ``since`` (epoch seconds)."""
    out = []
    for line in world.node.pod_log(ns, name, "worker").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r["t"] > since:
            out.append(r)
    return out


def keeps_reading(world, ns: str, name: str, since: float) -> None:
    """Ten reads after ``since``, every one the cache's bytes, and never an error since the pod
    started."""
    world.wait(lambda: len(reads(world, ns, name, since)) >= 10, f"{name} reading after the change")
    every = reads(world, ns, name, 0)
    assert all(r.get("sha") == WANT for r in every), [r for r in every if r.get("sha") != WANT][:3]
    assert phase(world, ns, name) == "Running"


def test_rollback_upgrade_and_csidriver_replacement_under_a_reading_pod(deployed, cache, tmp_path):
    from accelnode import IMAGE
    from tests.rigs.node import write_overlay

    ns, name, _ = cache
    world = deployed
    world.node.ctr("images", "tag", "--force", IMAGE, PREVIOUS_IMAGE_REF)  # the same image, under the old name
    old = tmp_path / "previous-overlay"
    old.mkdir()
    base = previous_base(tmp_path / "previous")
    write_overlay(old, base, world.node, sysfs_root=world.host.sysfs_root, dev_root=world.host.dev_root,
                  api_port=world.cp.port, accelerator_type="v5litepod-4", topology="2x2", base_docs=_build(base))
    current = world.workdir / "overlay"  # what the `deployed` fixture applied
    try:
        # 1. back to the previous release (docs/operations.md, Rollback)
        world.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(old))
        # the image is this checkout's (see above), so the node daemons' roles must be too: the
        # CSI driver now reads ClusterCacheTrustPolicies itself and stays unready without that
        world.kubectl("apply", "--server-side", "--force-conflicts",
                      "-f", str(ROOT / "daemonsets/rbac-csi.yaml"), "-f", str(ROOT / "daemonsets/rbac-agent.yaml"))
        world.wait(lambda: rolled(world, PREVIOUS_IMAGE), "the previous DaemonSets rolled out", timeout=240)
        world.wait(world.system_ready, "every accelnode pod Ready on the previous manifests", timeout=180)

        # 2. a pod reading its cache
        world.apply(workload("reader", ns, inline(name, ns), chips=1, command=["python3", "-c", READER, FILE]))
        running(world, ns, "reader")
        keeps_reading(world, ns, "reader", 0)
        csi_before = {p["metadata"]["uid"] for p in world.pods(selector="app.kubernetes.io/name=accelnode-csi-node")}

        # 3. the upgrade (docs/operations.md, Upgrade)
        world.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(BASE / "crds"))
        world.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(current))
        world.wait(lambda: rolled(world, IMAGE), "the new DaemonSets rolled out", timeout=240)
        world.wait(world.system_ready, "every accelnode pod Ready on the new manifests", timeout=180)
        csi_after = {p["metadata"]["uid"] for p in world.pods(selector="app.kubernetes.io/name=accelnode-csi-node")}
        assert not csi_before & csi_after  # the CSI + agent pod was replaced under the mount
        keeps_reading(world, ns, "reader", time.time())
        world.apply(workload("after-upgrade", ns, inline(name, ns), chips=1))
        check_one(finished(world, ns, "after-upgrade"))

        # 4. moving from GKM: the CSIDriver deleted and made again by the base
        world.kubectl("delete", "csidriver", "csi.gkm.io")
        keeps_reading(world, ns, "reader", time.time())
        world.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(current))
        world.apply(workload("after-csidriver", ns, inline(name, ns), chips=1))
        check_one(finished(world, ns, "after-csidriver"))
        keeps_reading(world, ns, "reader", time.time())
    finally:
        world.kubectl("delete", "pod", "reader", "after-upgrade", "after-csidriver", "-n", ns, "--ignore-not-found",
                      "--wait=true", "--timeout=90s", check=False)
        world.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(current), check=False)
        world.wait(lambda: rolled(world, IMAGE) and world.system_ready(), "the current manifests back", timeout=240)


def check_one(got: dict) -> None:
    """The probe's report for a pod with one chip and the cache: every file's bytes, read-only."""
    assert got["read_only"] is True
    want = {f"io.jax.cache/{k}": hashlib.sha256(v).hexdigest() for k, v in FILES.items()}
    assert {k: v for k, v in got["files"].items() if k.startswith("io.jax.cache/")} == want, got["files"]
