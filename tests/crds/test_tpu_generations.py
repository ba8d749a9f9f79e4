"""Every TPU generation on the real API server: the CRD's CEL rules and controller/nodegroups/generations.py
agree on which (machine type, topology, node count) can exist, and a refusal names the field."""

from __future__ import annotations

import pytest

from controller.nodegroups import generations
from tests.crds.test_crds import SINGLE, example, objects  # noqa: F401 (a fixture)

CASES = [
    # (machineType, topology, nodeCount, accelerator label or None when refused)
    ("ct4p-hightpu-4t", "2x2x1", 1, "tpu-v4-podslice"),
    ("ct4p-hightpu-4t", "2x2x4", 4, "tpu-v4-podslice"),
    ("ct4p-hightpu-4t", "2x2", 1, None),
    ("ct5lp-hightpu-1t", "1x1", 1, "tpu-v5-lite-podslice"),
    ("ct5lp-hightpu-4t", "4x8", 8, "tpu-v5-lite-podslice"),
    ("ct5lp-hightpu-8t", "2x4", 1, "tpu-v5-lite-podslice"),
    ("ct5lp-hightpu-4t", "3x3", 2, None),
    ("ct5l-hightpu-8t", "2x4", 1, "tpu-v5-lite-device"),
    ("ct5p-hightpu-4t", "2x2x1", 1, "tpu-v5p-slice"),
    ("ct5p-hightpu-4t", "4x4x4", 16, "tpu-v5p-slice"),
    ("ct5p-hightpu-4t", "4x4x4", 8, None),
    ("ct6e-standard-4t", "2x2", 1, "tpu-v6e-slice"),
    ("ct6e-standard-4t", "16x16", 64, "tpu-v6e-slice"),
    ("ct6e-standard-8t", "4x4", 2, "tpu-v6e-slice"),
    ("ct6e-standard-4t", "2x2x1", 1, None),
    ("tpu7x-standard-4t", "2x2x1", 1, "tpu7x"),
    ("tpu7x-standard-4t", "2x2x2", 2, "tpu7x"),
    ("tpu7x-standard-4t", "2x4x6", 12, None),
    ("tpu7-standard-4t", "2x2x1", 1, "tpu7"),
    ("ct6e-standard-2t", "1x2", 1, None),
]


@pytest.mark.parametrize("machine, topology, count, label", CASES, ids=[f"{m}:{t}:{c}" for m, t, c, _ in CASES])
def test_crd_and_controller_agree_on_every_generation(crds, objects, kube_namespace, machine, topology, count, label):
    from kubernetes.client.rest import ApiException

    obj = example(*SINGLE)
    obj["metadata"].update(name="gen", namespace=kube_namespace)
    obj["spec"].update(topology=topology, nodeCount=count)
    obj["spec"]["instanceConfig"]["machineType"] = machine
    if count > 1:
        obj["spec"]["targetSizePolicyMode"] = "BULK"
    problems = generations.check(machine, topology, count)
    if label is None:
        assert problems
        with pytest.raises(ApiException) as err:
            objects.create(obj)
        assert err.value.status == 422
        assert "spec." in err.value.body
    else:
        assert problems == []
        assert generations.machine_type(machine).generation.accelerator == label
        objects.create(obj)


def test_messages_name_the_field():
    assert generations.check("ct6e-standard-4t", "2x2x1", 1)[0].startswith("spec.topology:")
    assert generations.check("ct6e-standard-4t", "4x4", 1)[0].startswith("spec.nodeCount:")
    assert generations.check("n2-standard-8", "2x2", 1)[0].startswith("spec.instanceConfig.machineType:")
    assert generations.machine_type("https://x/zones/z/machineTypes/ct5p-hightpu-4t").chips == 4
