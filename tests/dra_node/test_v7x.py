"""A TPU7x host through DRA on a real kubelet and containerd 2 (tests/rigs/dralane.py): a
tpu7x-standard-4t has 4 chips of two VFIO functions each. The slice offers 4 chips, four 1-chip
claims pack the host exactly and a fifth waits, and every chip a container holds is both of its
VFIO devices. Run under ``flock /tmp/kubelet.lock``."""

from __future__ import annotations

import pytest

from tests.rigs.dralane import claim_pod as pod
from tests.rigs.dralane import claim_template as template

from .test_dra import PROBE, chip_indices, free_all_chips, namespace, report, started_lane, tpu_limits_pod, unschedulable


@pytest.fixture(scope="module")
def lane():
    yield from started_lane("v7x-4")


def vfio_groups(r: dict) -> list[str]:
    return [d for d in r["devices"] if d.startswith("/dev/vfio/") and d != "/dev/vfio/vfio"]


def test_four_one_chip_claims_pack_a_v7x_host_and_each_holds_both_functions(lane):
    assert len(lane.host.chips()) == 4 and sum(len(lane.host.functions(c)) for c in lane.host.chips()) == 8
    assert sorted(lane.chip_devices()) == ["tpu-0", "tpu-1", "tpu-2", "tpu-3"]
    ns = namespace(lane)
    lane.apply(template("one", ns, 1, gen="v7x"))
    names = ["a", "b", "c", "d"]
    lane.apply(*(pod(n, ns, "one", PROBE) for n in names))
    got = {n: report(lane, ns, n) for n in names}
    held = []
    for n, r in got.items():
        assert len(vfio_groups(r)) == 2 and "/dev/vfio/vfio" in r["devices"], (n, r)  # one chip: two functions
        (chip,) = chip_indices(lane, r["devices"])
        held.append(chip)
        env = r["tpu_env"]
        assert (env["TPU_TOPOLOGY"], env["TPU_CHIPS_PER_HOST_BOUNDS"], env["TPU_HOST_BOUNDS"]) == ("2x2x1", "1,1,1", "2,2,1")
        assert env["TPU_ACCELERATOR_TYPE"] == "tpu7x-8"  # TensorCores: 2 a chip
    assert sorted(held) == [0, 1, 2, 3]
    lane.apply(pod("e", ns, "one", PROBE))
    cond = lane.wait(lambda: unschedulable(lane, ns, "e"), "pod e unschedulable")
    assert "cannot allocate all claims" in cond["message"], cond


def test_a_google_com_tpu_2_pod_mounts_four_vfio_devices(lane):
    free_all_chips(lane)
    ns = namespace(lane)
    lane.apply(tpu_limits_pod(ns, "old", 2))
    r = report(lane, ns, "old")
    assert len(vfio_groups(r)) == 4 and "/dev/vfio/vfio" in r["devices"], r
    assert len(chip_indices(lane, r["devices"])) == 2, r
    assert r["tpu_env"]["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,2,1"
    lane.kubectl("delete", "pod", "old", "-n", ns, "--grace-period=1")
