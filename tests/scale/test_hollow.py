"""The hollow-agent rig (tests/rigs/hollow.py) runs the agent's real API-facing code: 20 agents
in this process, each its own node, against a real kube-apiserver + etcd with the real
controller and its webhooks (docs/scale.md). A cache rolled to every node shows every node in
the cache's status; every list the agent and the controller send is paginated; an idle fleet
(several status resyncs long) writes nothing and reads nothing again."""

from __future__ import annotations

import time

import pytest

from tests.conftest import require, TOOLS_BIN
from tests.rigs.hollow import (AGENT_USER, CONTROLLER_USER, HollowFleet, ScaleCluster, accelnode_writes, by,
                               cache_body, claim_bound, cache_path, node_names, quiet, register_nodes, unpaged_lists, until)

N = 20
RESYNC = 2.0  # the agents' --status-resync: several inside the idle window
IDLE_S = 8.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    for name in ("etcd", "kube-apiserver", "kube-controller-manager"):
        require((TOOLS_BIN / name).exists(), f"{name} in {TOOLS_BIN} (tools/mk/k8s.mk)")
    c = ScaleCluster(tmp_path_factory.mktemp("scale")).start()
    yield c
    c.stop()


def counts(admin, ns, name) -> dict:
    return ((admin.request("GET", cache_path(ns, name)).get("status") or {}).get("counts") or {})


def test_roll_reaches_every_node_paged_and_idle_quiet(cluster):
    admin = cluster.admin
    v1, v2 = cluster.push("scale/roll", "v1"), cluster.push("scale/roll", "v2")
    nodes = node_names("hollow-", 0, N)
    register_nodes(admin, nodes)
    admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": "team"}})
    admin.request("POST", cache_path(None), body=cache_body(None, "roll", v1))
    admin.request("POST", cache_path("team"), body=cache_body("team", "kernels", v1))
    start = cluster.audit().mark()
    fleet = HollowFleet(cluster.cp.kubeconfig("agent"), nodes, pull_seconds=0.2, resync=RESYNC).start()
    try:
        until(fleet.ready, "every hollow agent's watches to list", timeout=60)
        for ns, name in ((None, "roll"), ("team", "kernels")):
            until(lambda: counts(admin, ns, name).get("nodeNotInUseCnt") == N, f"{name} on all {N} nodes", timeout=60)

        # the roll: a new image; the controller pins it, every node pulls it and drops the old one
        digest = v2.rsplit("@", 1)[1]
        admin.request("PATCH", cache_path(None, "roll"), body={"spec": {"image": v2}})

        def rolled() -> bool:  # each node's own object says it: the new digest only, Extracted
            objs = admin.list("/apis/gkm.io/v1alpha1/clustergkmcachenodes")["items"]
            return sum({d: e["state"] for d, e in o["status"]["caches"]["roll"].items()} == {digest: "Extracted"}
                       for o in objs if "roll" in (o.get("status") or {}).get("caches", {})) == N
        until(rolled, f"the roll on all {N} nodes", timeout=60)

        def summed() -> bool:  # and the cache's status sums them
            st = admin.request("GET", cache_path(None, "roll")).get("status") or {}
            return st.get("resolvedDigest") == digest and st["counts"]["nodeCnt"] == N and \
                st["counts"]["nodeNotInUseCnt"] == N and st["conditions"][0]["message"].startswith(f"{N} of {N} nodes")
        until(summed, "the cache's status to count every node", timeout=30)
        assert sum(a.store.pulls for a in fleet.agents) == 2 * N  # v1 once (two caches, one download), then v2

        # idle: agents resync every RESYNC seconds and write nothing; the controller neither (once
        # kube-controller-manager bound the GKMCache's claim, which the controller reports)
        until(lambda: claim_bound(admin.request("GET", cache_path("team", "kernels")), "team"), "the claim bound")
        quiet(cluster.audit())
        mark = cluster.audit().mark()
        time.sleep(IDLE_S)
        idle = cluster.audit().events(mark)
        assert accelnode_writes(idle) == []
        assert by(idle, AGENT_USER, {"list"}) == [] and by(idle, CONTROLLER_USER, {"list"}) == []
        # nor reads anything again: its own Node's watch does not start over (docs/scale.md, 6.)
        assert [e["requestURI"] for e in by(idle, AGENT_USER, {"get"})] == []

        events = cluster.audit().events(start)
        assert len(by(events, AGENT_USER, {"list"})) >= N  # the rig's agents did list (read-back, reflectors)
        assert unpaged_lists(events) == []
    finally:
        fleet.stop()
