"""What a tenant learns from its node objects (docs/agent-status.md): a cache's GKMCacheNode
entry shows only what was pulled and proved for that cache, with its own credentials. Real API
server, the agent as its own identity reading the namespaces' pull secrets, a private registry
(htpasswd) beside the open one."""

from __future__ import annotations

import base64
import json
import uuid

from tests.agent.conftest import eventually, make_cache
from tests.agent.test_pull_secrets import lending  # noqa: F401 (a fixture)
from tests.agent.test_resilience import settle
from tests.agent.test_status import digest_of, entry, entry_in


def _secret(auth_registry) -> dict:
    auth = base64.b64encode(f"{auth_registry.username}:{auth_registry.password}".encode()).decode()
    return {"creds": ("kubernetes.io/dockerconfigjson",
                      {".dockerconfigjson": json.dumps({"auths": {auth_registry.host: {"auth": auth}}})})}


def test_a_tenant_sees_nothing_of_another_tenants_digest(cluster, node_factory, auth_registry, lending, tmp_path):
    """Attack: tenant A's private cache is installed on the node (A's pull secret). Tenant B names
    the same digest in caches of its own, one the node is meant to prefetch and one it is not,
    and names a digest A's pull failed on. B's node object shows B's own refusal for the first
    two (B's credentials: the prefetch as B's cache), nothing for the third: neither A's install
    and size (it showed Extracted with A's volumeSize) nor A's error (it showed A's message)."""
    team_a = lending(_secret(auth_registry), ["creds"])
    team_b = lending({}, [], lend=False)
    private = auth_registry.push(make_cache(tmp_path / "a", {"xla/a.bin": b"\x05" * 3000}), f"tenants/{team_a}",
                                 kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}])
    d = digest_of(private)
    missing = "sha256:" + uuid.uuid4().hex * 2
    label = {"tenant-status": uuid.uuid4().hex[:8]}  # matches no other test's selector
    node = node_factory(labels=label, pull_secrets=True).start()
    cluster.cache("kernels", private, namespace=team_a)
    cluster.cache("broken", f"{auth_registry.host}/tenants/{team_a}@{missing}", namespace=team_a)
    assert node.ensure(private, (team_a, "kernels")).path  # A's publish: A's credentials
    assert node.ensure(f"{auth_registry.host}/tenants/{team_a}@{missing}", (team_a, "broken")).message
    assert entry_in("Extracted", cluster, node.name, team_a, "kernels", d)["volumeSize"] == 3000
    assert entry_in("Error", cluster, node.name, team_a, "broken", missing)

    cluster.cache("prefetched", private, namespace=team_b, node_selector=label)
    cluster.cache("named", private, namespace=team_b)
    cluster.cache("peek", f"{auth_registry.host}/tenants/{team_b}@{missing}", namespace=team_b)
    mine = entry_in("Error", cluster, node.name, team_b, "prefetched", d)
    assert mine is not None, cluster.node_status(node.name, team_b)
    assert "no credentials" in mine["message"] and "volumeSize" not in mine, mine
    settle(node)
    status = cluster.node_status(node.name, team_b)
    # "named" asks the same repository and digest with the same credentials: B's own refusal too
    assert set(status["caches"]) == {"prefetched", "named"}, status
    named = status["caches"]["named"][d]
    assert (named["state"], named["message"]) == ("Error", mine["message"]) and "volumeSize" not in named, named
    assert status["counts"]["nodeNotInUseCnt"] == 0 and status["counts"]["nodeErrorCnt"] == 1
    # A's own entries are as they were
    assert eventually(lambda: entry(cluster, node.name, team_a, "kernels", d)["state"] == "Extracted")


def test_a_tenants_private_cache_is_prefetched_with_its_own_pull_secret(cluster, node_factory, auth_registry,
                                                                         lending, tmp_path):
    """The prefetch is the cache's own request: a private image the namespace's pull secret
    reads (the node's own credentials do not) is on the node, proved for that cache, before any
    pod asks (it was pulled with the node's credentials, and failed)."""
    team = lending(_secret(auth_registry), ["creds"])
    private = auth_registry.push(make_cache(tmp_path / "p", {"xla/p.bin": b"\x06" * 2000}), f"tenants/{team}",
                                 tag="prefetch", kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}])
    label = {"tenant-prefetch": uuid.uuid4().hex[:8]}
    node = node_factory(labels=label, pull_secrets=True).start()
    cluster.cache("private", private, namespace=team, node_selector=label)
    e = entry_in("Extracted", cluster, node.name, team, "private", digest_of(private))
    assert e is not None and e["volumeSize"] == 2000, cluster.node_status(node.name, team)
    assert node.store.installed(digest_of(private)) is not None
