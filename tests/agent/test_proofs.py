"""Content is handed out per (repository, digest, credentials) (docs/security.md), with the agent
core in-process over a real store and real registries (distribution; one of its own, stopped
mid-test): a repository that does not hold the digest gets nothing, nor one whose index lists it,
an earlier proof stands while the registry is down, and a pull-through cache as the server proves
nothing unless the operator says it enforces the registry's access."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil

import pytest
from prometheus_client import CollectorRegistry

from accelnode.oci.errors import AuthError
from accelnode.oci.registry import RegistryOptions
from agent import core
from agent.store import CacheStore
from tests.cache.helpers import Forwarder
from tests.cache.test_hosts_toml import certs_d
from tests.conftest import require
from tests.fixtures.registry import RunningRegistry, _start

from .conftest import make_cache

INDEX, MANIFEST = "application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json"


def test_an_earlier_proof_stands_while_the_registry_is_down(tmp_path, monkeypatch):
    require(shutil.which("docker-registry") is not None, "docker-registry (Debian package docker-registry)")
    (tmp_path / "reg").mkdir()
    reg = RunningRegistry(tmp_path / "reg")
    try:
        image = reg.push(make_cache(tmp_path / "a", {"xla/a.bin": b"\x01" * 100}), "proof/kernels", kind="jax")
        reg.push(make_cache(tmp_path / "b", {"xla/b.bin": b"\x02" * 100}), "proof/other", kind="jax")
        digest = image.rsplit("@", 1)[1]
        agent = core.Agent(CacheStore(tmp_path / "store", registry=reg.options(timeout=5)), [],
                           core.Metrics(CollectorRegistry()))
        tenant = ("team-a", "kernels")  # no API server here: the tenant pulls anonymously
        assert agent.ensure(image, 30, cache=tenant).state == core.READY
        stolen = agent.ensure(f"{reg.host}/proof/other@{digest}", 30, cache=("team-b", "stolen"))
        assert (stolen.state, stolen.failure) == (core.FAILED, core.DENIED), stolen
        assert f"proof/other does not serve {digest} to this pull" in stolen.message
        monkeypatch.setattr(core, "PROOF_TTL", 0.0)  # every proof is due again
        reg.stop()
        assert agent.ensure(image, 30, cache=tenant).state == core.READY  # the earlier proof stands
        never = agent.ensure(f"{reg.host}/proof/other@{digest}", 30, cache=("team-b", "stolen"))
        assert (never.state, never.failure) == (core.FAILED, core.REGISTRY_UNAVAILABLE), never
    finally:
        reg.stop()


def _agent(tmp_path, options, **store_kw) -> core.Agent:
    return core.Agent(CacheStore(tmp_path / "store", registry=options, **store_kw), [],
                      core.Metrics(CollectorRegistry()))


def test_an_index_in_another_repository_does_not_lend_its_child(registry, tmp_path):
    """Attack: tenant A's manifest is installed on the node. Tenant B's repository serves an
    index whose only child is A's manifest (a registry may store an index without checking that
    its children are in the repository: the distribution spec allows it, distribution 3 has
    sparse indexes; the front below stands for such a registry, everything else is the real
    one). B's repository does not hold A's manifest, so B gets nothing (it got A's bytes)."""
    private = registry.push(make_cache(tmp_path / "a", {"xla/a.bin": b"\x03" * 100}), "proofs/team-a", kind="jax")
    child = private.rsplit("@", 1)[1]
    index = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": [
        {"mediaType": MANIFEST, "digest": child, "size": len(registry.blob_file(child).read_bytes())}]}).encode()
    index_digest = "sha256:" + hashlib.sha256(index).hexdigest()

    def sparse(method, path, headers):  # team-b's repository holds the index, not its child
        if path.split("?")[0] == f"/v2/proofs/team-b/manifests/{index_digest}":
            return 200, {"Content-Type": INDEX, "Docker-Content-Digest": index_digest}, index
        return None

    front = Forwarder(registry.host, answer=sparse)
    try:
        agent = _agent(tmp_path, RegistryOptions(plain_http=True, timeout=30))
        mine = agent.ensure(f"{front.host}/proofs/team-a@{child}", 30, cache=("team-a", "kernels"))
        assert mine.state == core.READY and mine.digest == child, mine
        stolen = agent.ensure(f"{front.host}/proofs/team-b@{index_digest}", 30, cache=("team-b", "stolen"))
        assert (stolen.state, stolen.failure) == (core.FAILED, core.DENIED), stolen
        assert f"proofs/team-b does not serve {child} to this pull" in stolen.message
        # the index was read (a real answer), the child asked of team-b's repository, which has none
        assert f"/v2/proofs/team-b/manifests/{child}" in front.paths()
    finally:
        front.close()


@pytest.fixture
def pull_through(auth_registry, tmp_path_factory):
    """A pull-through cache (distribution in proxy mode) holding credentials for the private
    registry ``auth_registry``: it answers anyone who reaches it. (distribution 2.8's proxy
    sends upstream credentials only to token registries; the front hands the registry the
    cache's credentials, as the proxy's own ``proxy.username`` would.)"""
    basic = "Basic " + base64.b64encode(f"{auth_registry.username}:{auth_registry.password}".encode()).decode()

    def with_credentials(handler, path):
        del handler.headers["Authorization"]
        handler.headers["Authorization"] = basic
        accepts = handler.headers.get_all("Accept") or []  # the front forwards one value per name
        del handler.headers["Accept"]
        handler.headers["Accept"] = ", ".join(accepts)
        return False

    front = Forwarder(auth_registry.host, serve=with_credentials)
    cache = _start(tmp_path_factory, proxy=f"http://{front.host}")
    yield cache
    cache.stop()
    front.close()


@pytest.mark.parametrize("how", ["--registry-mirror", "hosts.toml server"])
def test_a_pull_through_cache_as_the_server_proves_nothing(auth_registry, pull_through, tmp_path, how):
    """Attack: the registry is private (htpasswd); the operator sends its requests to a
    pull-through cache (``--registry-mirror``, or a hosts.toml ``server``), which holds
    credentials for it and answers anyone. A tenant with no credentials for the registry names a
    private digest under the registry's name: it is refused, naming the flag that would lend the
    mirror's word (it was pulled and handed out). The node's own pulls go through the mirror as
    before, and the operator's --mirror-enforces-access makes the mirror's answers count."""
    private = auth_registry.push(make_cache(tmp_path / "p", {"xla/p.bin": b"\x04" * 100}), "proofs/private",
                                 kind="jax")
    digest = private.rsplit("@", 1)[1]
    image = f"quay.io/proofs/private@{digest}"
    if how == "--registry-mirror":
        options = RegistryOptions(plain_http=True, timeout=30, mirrors={"quay.io": pull_through.host})
    else:
        hosts = certs_d(tmp_path / "certs.d", {"quay.io": f'server = "http://{pull_through.host}"\n'})
        options = RegistryOptions(plain_http=True, timeout=30, hosts_dir=hosts)
    agent = _agent(tmp_path / "1", options)
    direct = agent.ensure(private, 30, cache=("team-b", "direct"))  # the registry itself says no
    assert (direct.state, direct.failure) == (core.FAILED, core.DENIED), direct
    stolen = agent.ensure(image, 30, cache=("team-b", "stolen"))
    assert (stolen.state, stolen.failure) == (core.FAILED, core.DENIED), stolen
    assert f"go to mirror {pull_through.host}" in stolen.message
    assert f"--mirror-enforces-access {pull_through.host}" in stolen.message
    assert agent.store.installed(digest) is None, "a tenant's refused pull was installed"
    with pytest.raises(AuthError, match="--mirror-enforces-access"):  # the prefetcher's look at it, too
        agent.inspect(image, ("team-b", "stolen"))
    assert agent.inspect(image, None)["manifests"][0]["digest"] == digest
    own = agent.ensure(image, 30)
    assert own.state == core.READY, own  # the node's own request (prefetch, operator)
    again = agent.ensure(image, 30, cache=("team-b", "stolen"))
    assert (again.state, again.failure) == (core.FAILED, core.DENIED), "installed bytes were handed out"
    trusted = _agent(tmp_path / "2", options, access_mirrors=[pull_through.host])
    assert trusted.ensure(image, 30, cache=("team-b", "stolen")).state == core.READY


def test_the_mirror_flag_takes_endpoints_only(tmp_path):
    """--mirror-enforces-access (and ACCELNODE_MIRROR_ENFORCES_ACCESS) names a mirror as the server
    entry writes it, HOST[:PORT]; anything else is a usage error naming the flag or variable,
    before the agent starts."""
    import os
    import subprocess

    from accelnode import exitcodes
    from tests.conftest import accelnode_cmd

    argv = accelnode_cmd() + ["agent", "--store", str(tmp_path / "s"), "--socket", str(tmp_path / "a.sock")]
    proc = subprocess.run(argv + ["--mirror-enforces-access", "https://mirror.local"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == exitcodes.USAGE, proc.stderr
    assert "argument --mirror-enforces-access:" in proc.stderr and "without a scheme" in proc.stderr
    env = dict(os.environ, ACCELNODE_MIRROR_ENFORCES_ACCESS="mirror.local:5000,mirror.local/v2")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == exitcodes.USAGE and "ACCELNODE_MIRROR_ENFORCES_ACCESS" in proc.stderr, proc.stderr
    assert not (tmp_path / "s").exists()
    assert CacheStore(tmp_path / "t", access_mirrors=["Mirror.Local:5000"]).access_mirrors == {"mirror.local:5000"}
