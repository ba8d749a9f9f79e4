"""TPUs through DRA on a real kubelet and containerd 2 (tests/rigs/dralane.py), end to end:
``accelnode dra`` on a simulated v5e-4 host registers with kubelet and publishes its slice; the
real scheduler allocates claims from ResourceClaimTemplates; kubelet calls NodePrepareResources and
containerd 2 injects the claim's CDI devices. Run under ``flock /tmp/kubelet.lock``."""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from accelnode import IMAGE
from tests.conftest import TOOLS_BIN, require
from tests.rigs.dralane import DRIVER
from tests.rigs.dralane import claim_pod as pod
from tests.rigs.dralane import claim_template as template
from tests.rigs.node import TREE_PROBE
# what a workload container got: device nodes and TPU env, as one JSON line
PROBE = r"""
import glob, json, os, time
def write_as_user():  # the log directory is the pod's user's, whoever that is (the image's: not root)
    try:
        with open(f"/tmp/tpu_logs/probe-{os.getuid()}.log", "w") as f:
            f.write("x")
        return os.getuid()
    except OSError as e:
        return f"uid {os.getuid()}: {e}"
mounts = [line.split(" - ", 1)[1].split() for line in open("/proc/self/mountinfo") if line.split()[4] == "/tmp/tpu_logs"]
print(json.dumps({"devices": sorted(glob.glob("/dev/vfio/*") + glob.glob("/dev/accel*")),
                  "tpu_env": {k: v for k, v in os.environ.items() if k.startswith("TPU_")},
                  "logs": os.path.isdir("/tmp/tpu_logs"), "logs_mount": mounts[-1] if mounts else None,
                  "logs_writer": write_as_user()}), flush=True)
time.sleep(3600)  # hold the claim until the test deletes the pod
"""


@pytest.fixture(scope="module")
def lane():
    yield from started_lane("v5e-4")


def started_lane(preset: str):
    """A running DRA lane of ``preset`` for a module's tests, stopped after them."""
    from tests.rigs import dralane
    from tests.rigs import image as images
    from tests.rigs.node import prerequisites

    for what in prerequisites(TOOLS_BIN):
        require(False, what)
    # short: kubelet's plugin sockets live under it (unix socket paths end at 107 bytes)
    workdir = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    world = dralane.DRALane(workdir, TOOLS_BIN, preset)
    try:
        world.start([images.build(log=lambda m: None)])
        yield world
        world.kubectl("delete", "pods", "--all", "-A", "--grace-period=1", check=False)
    finally:
        world.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def namespace(lane) -> str:
    ns = f"dra-{uuid.uuid4().hex[:8]}"
    lane.kubectl("create", "namespace", ns)
    lane.wait(lambda: lane.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0, "default SA")
    return ns


def report(lane, ns: str, name: str) -> dict:
    """What the pod's container printed, once it runs."""
    out = lane.wait(lambda: lane.node.pod_log(ns, name, "worker").strip(), f"pod {ns}/{name} to report", timeout=180)
    return json.loads(out.splitlines()[-1])


def free_all_chips(lane) -> None:
    """Delete the pods earlier tests left (their claims, and so their chips, go with them)."""
    lane.kubectl("delete", "pods", "--all", "-A", "--grace-period=1", "--timeout=120s")
    lane.wait(lambda: not lane.get("resourceclaims", "-A")["items"], "the claims gone with their pods")


def unschedulable(lane, ns: str, name: str):
    """The pod's PodScheduled=False condition once the scheduler gave up on it (None before)."""
    conds = lane.get("pod", name, "-n", ns)["status"].get("conditions") or []
    return next((c for c in conds if c["type"] == "PodScheduled" and c["status"] == "False"), None)


def tpu_limits_pod(ns: str, name: str, chips: int) -> dict:
    """An unchanged device-plugin pod: ``resources.limits: google.com/tpu: <chips>``, no claim."""
    spec = pod(name, ns, "unused", PROBE)
    del spec["spec"]["resourceClaims"]
    spec["spec"]["containers"][0]["resources"] = {"limits": {"google.com/tpu": str(chips)}}
    return spec


def chip_indices(lane, devices: list[str]) -> list[int]:
    """The host chips whose VFIO group nodes a container holds (the simulated host numbers groups in reverse)."""
    from device_plugin.health import Inventory

    by_group = {f"/dev/vfio/{g}": s.chip.index
                for s in Inventory(lane.host.sysfs_root, lane.host.dev_root).scan() for g in s.chip.iommu_groups}
    return sorted({by_group[d] for d in devices if d != "/dev/vfio/vfio"})


def test_two_pods_get_two_ici_neighbours_each_and_a_third_waits(lane):
    ns = namespace(lane)
    lane.apply(template("pair", ns, 2, ici_block=2, gen="v5litepod"))
    lane.apply(pod("a", ns, "pair", PROBE), pod("b", ns, "pair", PROBE))
    got = {name: report(lane, ns, name) for name in ("a", "b")}
    pairs = []
    for name, r in got.items():
        claim = lane.get("pod", name, "-n", ns)["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        results = lane.get("resourceclaim", claim, "-n", ns)["status"]["allocation"]["devices"]["results"]
        devices = sorted(int(x["device"].split("-")[1]) for x in results)
        pairs.append(devices)
        # exactly its chips (plus the VFIO container node) and the env of two chips of a 2x2 host
        assert "/dev/vfio/vfio" in r["devices"] and chip_indices(lane, r["devices"]) == devices, (name, r)
        assert len(r["devices"]) == 3, r
        env = r["tpu_env"]
        assert (env["TPU_TOPOLOGY"], env["TPU_CHIPS_PER_HOST_BOUNDS"], env["TPU_HOST_BOUNDS"]) == ("2x2", "1,2,1", "2,1,1")
        assert env["TPU_ACCELERATOR_TYPE"] == "v5litepod-4" and r["logs"] is True
        # libtpu's logs: a bounded tmpfs of the container's own, writable by any user (main: a
        # root-owned 0755 host directory per claim, unbounded and never removed)
        fstype, _, options = r["logs_mount"]
        assert fstype == "tmpfs" and "size=65536k" in options.split(",") and "nr_inodes=4096" in options, r
        assert r["logs_writer"] not in (0, None) and isinstance(r["logs_writer"], int), r
        assert {k for k in env if k.endswith("_RESOURCE_CLAIM")} == {f"TPU_DEVICE_{i}_RESOURCE_CLAIM" for i in devices}
    assert sorted(pairs) == [[0, 1], [2, 3]]  # ICI neighbours, and the two pods share nothing

    # a third claim cannot be met while both hold theirs: the scheduler says why it waits
    lane.apply(pod("c", ns, "pair", PROBE))
    cond = lane.wait(lambda: unschedulable(lane, ns, "c"), "pod c unschedulable")
    assert cond["reason"] == "Unschedulable" and "cannot allocate all claims" in cond["message"], cond
    # the claims go with their pods: the chips come back and c runs
    lane.kubectl("delete", "pod", "a", "-n", ns, "--grace-period=1")
    assert len(report(lane, ns, "c")["devices"]) == 3


def test_a_two_chip_block_claim_gets_its_blocks_nodes_and_env(lane):
    """The DeviceClass for ICI blocks: one device of 2 chips is an aligned pair (never 1+2)."""
    free_all_chips(lane)
    ns = namespace(lane)
    sel = [{"cel": {"expression": 'device.attributes["tpu.google.com"].chips == 2'}}]
    lane.apply({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "block", "namespace": ns},
                "spec": {"spec": {"devices": {"requests": [{"name": "tpu", "exactly": {
                    "deviceClassName": "ici-block.tpu.google.com", "count": 1, "selectors": sel}}]}}}})
    lane.apply(pod("blk", ns, "block", PROBE))
    r = report(lane, ns, "blk")
    claim = lane.get("pod", "blk", "-n", ns)["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    (res,) = lane.get("resourceclaim", claim, "-n", ns)["status"]["allocation"]["devices"]["results"]
    first, last = (int(v) for v in res["device"].split("-")[1:])
    assert last == first + 1 and first % 2 == 0, res
    assert chip_indices(lane, r["devices"]) == [first, last] and len(r["devices"]) == 3, r
    env = r["tpu_env"]
    assert (env["TPU_TOPOLOGY"], env["TPU_CHIPS_PER_HOST_BOUNDS"], env["TPU_HOST_BOUNDS"]) == ("2x2", "1,2,1", "2,1,1")
    assert {k for k in env if k.endswith("_RESOURCE_CLAIM")} == {f"TPU_DEVICE_{i}_RESOURCE_CLAIM" for i in (first, last)}
    lane.kubectl("delete", "pod", "blk", "-n", ns, "--grace-period=1")


def test_a_google_com_tpu_pod_runs_through_the_driver(lane):
    """An unchanged device-plugin pod (``resources.limits: google.com/tpu: 4``) on this DRA node:
    the scheduler serves it from the DeviceClass's extendedResourceName, kubelet prepares the claim
    it made, and the container gets the host's chips and the env the device plugin would give."""
    free_all_chips(lane)
    ns = namespace(lane)
    lane.apply(tpu_limits_pod(ns, "old", 4))
    r = report(lane, ns, "old")
    assert chip_indices(lane, r["devices"]) == [0, 1, 2, 3] and "/dev/vfio/vfio" in r["devices"], r
    env = r["tpu_env"]
    assert (env["TPU_TOPOLOGY"], env["TPU_CHIPS_PER_HOST_BOUNDS"], env["TPU_HOST_BOUNDS"]) == ("2x2", "2,2,1", "1,1,1")
    assert (env["TPU_WORKER_ID"], env["TPU_ACCELERATOR_TYPE"]) == ("0", "v5litepod-4")
    status = lane.get("pod", "old", "-n", ns)["status"]["extendedResourceClaimStatus"]
    assert status["requestMappings"][0]["resourceName"] == "google.com/tpu"
    lane.kubectl("delete", "pod", "old", "-n", ns, "--grace-period=1")


def tainted(lane) -> set[str]:
    return {d["name"] for s in lane.slices() for d in s["spec"].get("devices", []) if d.get("taints")}


def test_a_running_pods_status_shows_its_chip_failing(lane):
    """kubelet 1.37 reads the plugin's DRAResourceHealth stream (v1): a chip of a running pod's
    claim fails, and the pod's container status says so (allocatedResourcesStatus), while the
    slice taints it for new claims; it recovers, and both clear."""
    free_all_chips(lane)
    ns = namespace(lane)
    lane.apply(template("one", ns, 1, gen="v5litepod"))
    lane.apply(pod("h", ns, "one", PROBE))
    report(lane, ns, "h")
    claim = lane.get("pod", "h", "-n", ns)["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    obj = lane.get("resourceclaim", claim, "-n", ns)
    (res,) = obj["status"]["allocation"]["devices"]["results"]
    chip = lane.host.chips()[int(res["device"].split("-")[1])]
    # kubelet names the device by the CDI device ID the plugin returned for it
    resource_id = f"k8s.{DRIVER}/tpu={obj['metadata']['uid']}-{res['device']}"

    def health():
        st = lane.get("pod", "h", "-n", ns)["status"]["containerStatuses"][0]
        return {r["resourceID"]: r.get("health") for a in st.get("allocatedResourcesStatus") or []
                for r in a.get("resources") or []}

    assert lane.wait(lambda: health().get(resource_id) == "Healthy" and health(), "the chip Healthy in pod status")
    lane.host.bump_aer_fatal(chip)
    try:
        lane.wait(lambda: health().get(resource_id) == "Unhealthy", "the chip Unhealthy in pod status", timeout=60)
        assert res["device"] in tainted(lane)
        assert lane.get("pod", "h", "-n", ns)["status"]["phase"] == "Running"  # NoSchedule: the pod stays
    finally:
        lane.host.reset_aer(chip)
    lane.wait(lambda: health().get(resource_id) == "Healthy", "the chip Healthy again", timeout=60)
    lane.wait(lambda: not tainted(lane), "the taints lifted")
    lane.kubectl("delete", "pod", "h", "-n", ns, "--grace-period=1")


def test_the_slice_is_republished_after_kubelet_restarts(lane):
    before = {s["metadata"]["uid"] for s in lane.slices()}
    assert len(before) == 2  # the pool: counters and devices
    lane.node.restart_kubelet()
    lane.wait(lambda: len(new := {s["metadata"]["uid"] for s in lane.slices()}) == 2 and not new & before,
              "new slices after kubelet restarted")
    lane.node.wait_ready()
    assert len(lane.chip_devices()) == 4 and len(lane.slice_devices()) == 7


IMAGE_VOLUME_PROBE = TREE_PROBE + """
print(json.dumps({"files": files, "read_only": read_only}), flush=True)
"""


def test_a_cache_image_mounts_as_an_image_volume(lane, registry, tmp_path):
    """KServe's path for kernel caches: the image `accelnode cache build` pushes is an ordinary OCI
    image (config with rootfs.diff_ids, tar layers), so containerd 2 mounts it as a Kubernetes
    ``image`` volume, read-only (containerd mounts no OCI artifacts)."""
    import hashlib

    files = {"xla/module-1.bin": b"\x7fXLA" * 4096, "xla/module-2.bin": b"\x01" * 1000}
    for name, data in files.items():
        (tmp_path / "cache" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cache" / name).write_bytes(data)
    ref = registry.push(tmp_path / "cache", "e2e/jax-image-volume", tag="v1", kind="jax",
                        targets=[{"backend": "tpu", "arch": "v5e"}])
    lane.node.plain_http_registry(registry.host)
    ns = namespace(lane)
    lane.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "iv", "namespace": ns},
                "spec": {"hostNetwork": True, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "worker", "image": IMAGE, "imagePullPolicy": "Never",
                                         "command": ["python3", "-c", IMAGE_VOLUME_PROBE, "/caches/jax"],
                                         "volumeMounts": [{"name": "cache", "mountPath": "/caches/jax",
                                                           "readOnly": True}]}],
                         "volumes": [{"name": "cache", "image": {"reference": ref, "pullPolicy": "IfNotPresent"}}]}})
    r = report(lane, ns, "iv")
    assert r["read_only"] is True, r
    seen = set(r["files"].values())
    assert {hashlib.sha256(d).hexdigest() for d in files.values()} <= seen, r["files"]

