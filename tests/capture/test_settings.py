"""A cache's capture annotations against the operator's repository rules: each refusal names the
annotation, and a namespace never pushes outside the prefixes the operator gave it."""

from __future__ import annotations

import json
import re

import pytest

from accelnode.capture import settings
from accelnode.capture.settings import BadSettings, Rules

RULES = Rules({"team-a": ("registry.example/team-a/",), "*": ("registry.example/shared-captures",)})


def cache(ns="team-a", kind="GKMCache", **notes) -> dict:
    base = {settings.ON: "on", settings.REPOSITORY: "registry.example/team-a/captured",
            settings.PUSH_SECRET: "pusher"}
    return {"kind": kind, "metadata": {"name": "kernels", "namespace": ns, "annotations": {**base, **notes}}}


def test_defaults_and_off():
    s = settings.parse(cache(), RULES)
    assert s == settings.Settings("registry.example/team-a/captured", "pusher", None, settings.MANUAL, 1)
    assert settings.parse(cache(**{settings.ON: "off"}), RULES) is None
    assert settings.parse({"kind": "GKMCache", "metadata": {"namespace": "x"}}, RULES) is None


def test_auto_promotion_with_a_rule():
    s = settings.parse(cache(**{settings.PROMOTION: "auto", settings.SIGNING_SECRET: "cosign-key",
                                settings.MIN_PODS: "3"}), RULES)
    assert (s.promotion, s.signing_secret, s.min_pods) == ("auto", "cosign-key", 3)


@pytest.mark.parametrize("obj, problem", [
    (cache(**{settings.REPOSITORY: "registry.example/team-b/steal"}), "may not push to"),
    (cache(**{settings.REPOSITORY: "registry.example/team-a/../team-b/x"}), "expected HOST/REPOSITORY"),
    (cache(**{settings.REPOSITORY: "registry.example/team-a/x:latest"}), "no tag or digest"),
    (cache(**{settings.REPOSITORY: "registry.example/team-a"}), "may not push to"),  # the prefix's parent
    (cache(ns="team-b"), "may not push to"),  # "*" gives team-b only the shared repository
    (cache(kind="ClusterGKMCache", ns=""), "only a namespaced GKMCache captures"),
    (cache(**{settings.PUSH_SECRET: "../etc"}), settings.PUSH_SECRET),
    (cache(**{settings.PROMOTION: "auto"}), "needs accelnode.io/capture-signing-secret"),
    (cache(**{settings.PROMOTION: "sometimes"}), settings.PROMOTION),
    (cache(**{settings.MIN_PODS: "0"}), settings.MIN_PODS),
    (cache(**{settings.ON: "yes please"}), "expected on or off"),
    (cache(**{"accelnode.io/capture-everything": "on"}), "is not known"),
])
def test_refused(obj, problem):
    with pytest.raises(BadSettings, match=re.escape(problem)):
        settings.parse(obj, RULES)


def test_shared_rule_and_rules_file(tmp_path):
    assert settings.parse(cache(ns="team-b", **{settings.REPOSITORY: "registry.example/shared-captures"}), RULES)
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"team-a": ["registry.example/team-a/"]}))
    rules = Rules.load(str(path))
    assert rules.allows("team-a", "registry.example/team-a/x") and not rules.allows("team-b", "registry.example/team-a/x")
    path.write_text(json.dumps({"team-a": "registry.example/team-a/"}))
    with pytest.raises(ValueError, match="expected a list"):
        Rules.load(str(path))
