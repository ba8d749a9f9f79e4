"""Content is handed out per (repository, digest, credentials) (docs/security.md), with the agent
core in-process over a real store and a registry of its own (stopped mid-test): a repository that
does not hold the digest gets nothing, and an earlier proof stands while the registry is down."""

from __future__ import annotations

import shutil

from prometheus_client import CollectorRegistry

from agent import core
from agent.store import CacheStore
from tests.conftest import require
from tests.fixtures.registry import RunningRegistry

from .conftest import make_cache


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
