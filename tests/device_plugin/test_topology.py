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


def test_container_env_subset_and_node_config():
    host = chips(8)
    subset = {"TPU_VISIBLE_CHIPS": "4,5,6,7", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "TPU_PROCESS_BOUNDS": "1,1,1"}
    assert container_env(host[4:], 8, NodeConfig()) == subset
    multi_host = NodeConfig(accelerator_type="v5litepod-16", topology="4x4")
    # part of a host is a one-process slice of its own: the node's 16-chip slice env would contradict it
    assert container_env(host[4:], 8, multi_host) == subset
    # the whole host is one process of the 2-host slice: process bounds are the host bounds
    assert container_env(host, 8, multi_host) == {
        "TPU_VISIBLE_CHIPS": "0,1,2,3,4,5,6,7", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,4,1", "TPU_PROCESS_BOUNDS": "2,1,1",
        "TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_TOPOLOGY": "4x4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1",
        "TPU_HOST_BOUNDS": "2,1,1", "TPU_SKIP_MDS_QUERY": "true"}
    single_host = container_env(host, 8, NodeConfig(topology="2x4"))
    assert (single_host["TPU_PROCESS_BOUNDS"], single_host["TPU_HOST_BOUNDS"]) == ("1,1,1", "1,1,1")
    irregular = container_env([host[0], host[3]], 8, NodeConfig())
    assert irregular == {"TPU_VISIBLE_CHIPS": "0,3"}


def test_topology_is_validated():
    with pytest.raises(ValueError, match="not AxB"):
        NodeConfig(topology="4by4").validate()
    NodeConfig(topology="2x2x4").validate()
