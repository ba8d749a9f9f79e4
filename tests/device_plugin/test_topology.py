"""Preferred allocations and the env a container gets (pure functions)."""

import pytest

from accelnode.hw.tpu import Chip
from device_plugin.topology import NodeConfig, bounds, container_env, preferred


def chips(n, numa=lambda i: 0):
    return [Chip(i, f"0000:00:{4 + i:02x}.0", "v5e", 0x63, numa(i), ()) for i in range(n)]


def idx(cs):
    return [c.index for c in cs]


@pytest.mark.parametrize("ids,want", [([0], (1, 1, 1)), ([0, 1], (1, 2, 1)), ([0, 1, 2, 3], (2, 2, 1)),
                                      (range(8), (2, 4, 1)), ([0, 2], (2, 1, 1)), ([0, 3], None), ([0, 1, 2], None)])
def test_bounds(ids, want):
    assert bounds(ids) == want


def test_preferred_picks_aligned_blocks():
    host = chips(8, numa=lambda i: i // 4)
    assert idx(preferred(host, [], 8)) == list(range(8))
    assert idx(preferred(host, [], 4)) == [0, 1, 2, 3]
    assert idx(preferred(host, [], 2)) == [0, 1]
    assert idx(preferred(host, [host[6]], 2)) == [6, 7]
    assert idx(preferred(host, [host[5]], 4)) == [4, 5, 6, 7]


def test_preferred_best_fit_keeps_pairs_whole():
    host = chips(4)
    free = [host[i] for i in (1, 2, 3)]  # chip 0 is taken: use its orphaned partner first
    assert idx(preferred(free, [], 1)) == [1]
    free = [host[i] for i in (0, 2, 3)]
    assert idx(preferred(free, [], 2)) == [2, 3]


def test_preferred_stays_on_one_numa_node_when_no_block_fits():
    host = chips(8, numa=lambda i: i // 4)
    free = [host[i] for i in (1, 2, 5, 6, 7)]
    assert idx(preferred(free, [], 2)) == [6, 7]
    got = preferred(free, [host[1]], 2)  # the required chip decides the NUMA node
    assert idx(got) == [1, 2]
    assert idx(preferred(host, [], 3)) == [0, 1, 2]


def test_visible_chips_recipe_subset_and_node_config():
    host = chips(8)
    recipe = dict(recipe="visible-chips")
    subset = {"TPU_VISIBLE_CHIPS": "4,5,6,7", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "TPU_PROCESS_BOUNDS": "1,1,1"}
    assert container_env(host[4:], 8, NodeConfig(**recipe)) == subset
    multi_host = NodeConfig(accelerator_type="v5litepod-16", topology="4x4", **recipe)
    # part of a host is a one-process slice of its own: the node's 16-chip slice env would contradict it
    assert container_env(host[4:], 8, multi_host) == subset
    # the whole host is one process of the 2-host slice: process bounds are the host bounds
    assert container_env(host, 8, multi_host) == {
        "TPU_VISIBLE_CHIPS": "0,1,2,3,4,5,6,7", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,4,1", "TPU_PROCESS_BOUNDS": "2,1,1",
        "TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_TOPOLOGY": "4x4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1",
        "TPU_HOST_BOUNDS": "2,1,1", "TPU_SKIP_MDS_QUERY": "true"}
    single_host = container_env(host, 8, NodeConfig(topology="2x4", **recipe))
    assert (single_host["TPU_PROCESS_BOUNDS"], single_host["TPU_HOST_BOUNDS"]) == ("1,1,1", "1,1,1")
    irregular = container_env([host[0], host[3]], 8, NodeConfig(**recipe))
    assert irregular == {"TPU_VISIBLE_CHIPS": "0,3"}


def gen_chips(gen, n):
    return [Chip(i, f"0000:00:{4 + i:02x}.0", gen, 0, 0, ()) for i in range(n)]


# The env GKE's managed plugin gives (docs/device-plugin.md, "Allocate"), pinned for every
# generation, host size and allocation size: (chip generation, chips on the host, the node's
# cloud.google.com/gke-tpu-accelerator and -topology) -> {chips allocated: TPU_HOST_BOUNDS}, with
# TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY_WRAP and whether the node is the whole slice.
GKE_TABLE = [
    ("v4", 4, "tpu-v4-podslice", "2x2x1", "v4-8", "false,false,false", True, {1: "2,2,1", 2: "2,1,1", 4: "1,1,1"}),
    ("v4", 4, "tpu-v4-podslice", "4x4x4", "v4-128", "true,true,true", False,
     {1: "4,4,4", 2: "4,2,4", 4: "2,2,4"}),
    ("v5e", 1, "tpu-v5-lite-podslice", "1x1", "v5litepod-1", "false,false,false", True, {1: "1,1,1"}),
    ("v5e", 4, "tpu-v5-lite-podslice", "2x2", "v5litepod-4", "false,false,false", True,
     {1: "2,2,1", 2: "2,1,1", 4: "1,1,1"}),
    ("v5e", 8, "tpu-v5-lite-podslice", "2x4", "v5litepod-8", "false,false,false", True,
     {1: "2,4,1", 2: "2,2,1", 4: "1,2,1", 8: "1,1,1"}),
    ("v5e", 4, "tpu-v5-lite-podslice", "16x16", "v5litepod-256", "true,true,false", False,
     {1: "16,16,1", 2: "16,8,1", 4: "8,8,1"}),
    ("v5p", 4, "tpu-v5p-slice", "2x2x1", "v5p-8", "false,false,false", True, {1: "2,2,1", 2: "2,1,1", 4: "1,1,1"}),
    ("v5p", 4, "tpu-v5p-slice", "2x2x4", "v5p-32", "false,false,false", False, {1: "2,2,4", 2: "2,1,4", 4: "1,1,4"}),
    ("v6e", 1, "tpu-v6e-slice", "1x1", "v6e-1", "false,false,false", True, {1: "1,1,1"}),
    ("v6e", 4, "tpu-v6e-slice", "2x2", "v6e-4", "false,false,false", True, {1: "2,2,1", 2: "2,1,1", 4: "1,1,1"}),
    ("v6e", 8, "tpu-v6e-slice", "2x4", "v6e-8", "false,false,false", True,
     {1: "2,4,1", 2: "2,2,1", 4: "1,2,1", 8: "1,1,1"}),
    ("v6e", 4, "tpu-v6e-slice", "4x4", "v6e-16", "false,false,false", False, {1: "4,4,1", 2: "4,2,1", 4: "2,2,1"}),
    ("v7x", 4, "tpu7x", "2x2x1", "tpu7x-8", "false,false,false", True, {1: "2,2,1", 2: "2,1,1", 4: "1,1,1"}),
    ("v7x", 4, "tpu7x", "2x2x2", "tpu7x-16", "false,false,false", False, {1: "2,2,2", 2: "2,1,2", 4: "1,1,2"}),
]
SHAPE = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}


@pytest.mark.parametrize("gen,host,label,topo,acc_type,wrap,whole,host_bounds", GKE_TABLE,
                         ids=[f"{r[0]}-{r[1]}-{r[3]}" for r in GKE_TABLE])
def test_gke_recipe_table(gen, host, label, topo, acc_type, wrap, whole, host_bounds):
    config = NodeConfig(accelerator=label, topology=topo)
    config.validate()
    assert sorted(host_bounds) == [n for n in (1, 2, 4, 8) if n <= host]  # every allocation size
    for n, hb in host_bounds.items():
        want = {"TPU_SKIP_MDS_QUERY": "true", "TPU_TOPOLOGY": topo, "TPU_ACCELERATOR_TYPE": acc_type,
                "TPU_HOST_BOUNDS": hb, "HOST_BOUNDS": hb, "TPU_CHIPS_PER_HOST_BOUNDS": SHAPE[n],
                "CHIPS_PER_HOST_BOUNDS": SHAPE[n], "TPU_TOPOLOGY_WRAP": wrap, "WRAP": wrap,
                "TPU_TOPOLOGY_ALT": "false", "ALT": "false"}
        if whole:
            want |= {"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost"}
        # the same env whichever chips of the host the container holds: no TPU_VISIBLE_CHIPS
        for start in range(0, host, n):
            assert container_env(gen_chips(gen, host)[start:start + n], host, config) == want, (n, start)


def test_gke_recipe_without_facts_or_bounds():
    host = gen_chips("v5e", 4)
    assert container_env(host[:2], 4, NodeConfig()) == {}  # libtpu asks the metadata server itself
    # single-host -device accelerators get no bounds (GKE: podslices only), still the worker env
    device = container_env(host, 4, NodeConfig(accelerator="tpu-v5-lite-device", topology="2x2"))
    assert device == {"TPU_SKIP_MDS_QUERY": "true", "TPU_TOPOLOGY": "2x2", "TPU_ACCELERATOR_TYPE": "v5lite-4",
                      "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost"}
    # three chips have no host shape: no bounds rather than wrong ones
    three = container_env(host[:3], 4, NodeConfig(accelerator="tpu-v5-lite-podslice", topology="2x2"))
    assert "TPU_HOST_BOUNDS" not in three and "TPU_VISIBLE_CHIPS" not in three
    # a flag wins over the label-derived type
    flagged = NodeConfig(accelerator_type="v5litepod-4-custom").over(NodeConfig(accelerator="tpu-v5-lite-podslice",
                                                                                topology="2x2"))
    assert container_env(host, 4, flagged)["TPU_ACCELERATOR_TYPE"] == "v5litepod-4-custom"


def test_topology_is_validated():
    with pytest.raises(ValueError, match="not AxB"):
        NodeConfig(topology="4by4").validate()
    with pytest.raises(ValueError, match="not a GKE TPU accelerator"):
        NodeConfig(accelerator="nvidia-tesla-t4").validate()
    with pytest.raises(ValueError, match="env recipe"):
        NodeConfig(recipe="ray").validate()
    NodeConfig(topology="2x2x4").validate()
