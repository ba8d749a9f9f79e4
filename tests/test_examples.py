"""No example can rot: every file under examples/ is exercised by a test.

Each YAML example is dry-run server-side with strict validation (tests/test_manifests.py, our
CRDs installed); the table below names, per file, the tests that apply it for real (to the API
server with our controller and webhooks, or on the real kubelet in tests/node/). A new example
without a row, a row whose test does not name its file, or a stale row fails here."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT
from tests.test_manifests import NOT_DRY_RUN_HERE, SHIPPED

EXAMPLES = ROOT / "examples"
NODE = "tests/node/test_examples.py"  # the real kubelet
E2E_GKM = "tests/e2e/test_gkm_examples.py"  # GKM's manifests applied unchanged, controller + CSI driver
CRDS = "tests/crds/test_crds.py"  # applied unchanged and read back
ENVHOOKS = "tests/controller/test_tpuenv_webhooks.py"  # created through the TPU env webhooks
MANIFESTS = "tests/test_manifests.py"  # server-side dry-run only
KRO = "tests/e2e/test_kro.py"  # on the real kro controller
THIS = "tests/test_examples.py"

EXERCISED: dict[str, list[str]] = {
    "gkm/README.md": [THIS],
    "gkm/00-namespaces.yaml": [E2E_GKM, NODE],
    "gkm/10-gkmcache.yaml": [E2E_GKM, CRDS, NODE],
    "gkm/20-clustergkmcache.yaml": [E2E_GKM, CRDS, NODE],
    "gkm/30-cache-stuck-pending.yaml": [E2E_GKM, CRDS, NODE],
    "gkm/workloads/deployment-by-claim.yaml": [NODE],
    "gkm/workloads/deployment-inline.yaml": [NODE],
    "gkm/workloads/gkm-daemonset.yaml": [NODE],
    "pod-claim-cache.yaml": ["tests/controller/test_claim_volumes.py", NODE],
    "pod-inline-cache.yaml": [NODE],
    "lend-pull-secrets.yaml": ["tests/agent/test_pull_secrets.py"],
    "signatures/policy-cosign-v2.yaml": [MANIFESTS],
    "signatures/policy-cosign-v3.yaml": [MANIFESTS],
    "signatures/policy-keyless.yaml": ["tests/controller/test_signatures.py"],
    "tpu-env/gke-indexed-job.yaml": [ENVHOOKS, NODE],
    "tpu-env/injector-readme-statefulset.yaml": [ENVHOOKS, NODE],
    "tpu/children.yaml": [CRDS],
    "tpu/node-group-rules.json": ["tests/controller/test_nodegroups.py", "tests/controller/test_nodegroups_unit.py"],
    "tpu/tpunodegroup-from-template.yaml": [CRDS],
    "tpu/tpunodegroup-multi-host.yaml": [CRDS, "tests/controller/test_nodegroups.py"],
    "tpu/tpunodegroup-single-host.yaml": [CRDS, "tests/e2e/test_nodegroup_join.py"],
    "tpu/selftest/jobs.yaml": ["tests/device_plugin/test_selftest.py", "tests/test_manifests.py"],
    "tpu/walkthrough/10-tpunodegroup.yaml": [CRDS],
    "tpu/walkthrough/20-workload.yaml": [NODE],
    "kro/README.md": [THIS],
    "kro/rgd.yaml": [KRO],
    "kro/instance.yaml": [KRO],
    "kro/platform.yaml": [KRO],
    "kro/rbac-kro.yaml": [KRO],
}


def example_files() -> set[str]:
    return {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*") if p.is_file()}


def names_it(test: str, example: str) -> bool:
    """The test's source names the example: its path or file name, or (for a file directly in a
    directory the test applies whole) that directory."""
    text = (ROOT / test).read_text()
    rel = Path(example)
    if example in text or rel.name in text:
        return True
    parent = rel.parent
    return parent != Path(".") and len(parent.parts) == 1 and (
        f'"examples" / "{parent}"' in text or f"examples/{parent}\"" in text)


def test_every_example_has_a_row():
    missing = sorted(example_files() - set(EXERCISED))
    assert not missing, f"examples no test exercises (add them to EXERCISED with their test): {missing}"


def test_every_row_is_an_example_and_its_tests_name_it():
    stale = sorted(set(EXERCISED) - example_files())
    assert not stale, f"rows for examples that do not exist: {stale}"
    for example, tests in EXERCISED.items():
        assert tests, example
        for test in tests:
            assert (ROOT / test).is_file(), (example, test)
            if test != MANIFESTS:
                assert names_it(test, example), f"{test} does not name {example}"


def test_every_yaml_example_is_dry_run_server_side():
    dry = {str(p.relative_to(EXAMPLES)) for p in SHIPPED if EXAMPLES in p.parents}
    want = {e for e in example_files() if e.endswith(".yaml") and e not in NOT_DRY_RUN_HERE}
    assert want and want <= dry, sorted(want - dry)
    assert all(EXERCISED[e] for e in NOT_DRY_RUN_HERE)  # those are applied to their own peer instead


def test_every_readme_links_only_files_that_exist():
    """A README under examples/ (the GKM guide, kro's) points at files that are there."""
    for readme in EXAMPLES.rglob("README.md"):
        links = re.findall(r"\]\(([^)#:]+)\)", readme.read_text())
        local = [link for link in links if not link.startswith(("http", "/"))]
        missing = [link for link in local if not (readme.parent / link).exists() and not (ROOT / link).exists()]
        assert not missing, (str(readme.relative_to(ROOT)), missing)


def test_the_gkm_readme_table_covers_every_scenario_file():
    """examples/gkm/README.md: scenario | GKM's concession | accelnode; every manifest of
    examples/gkm/ is linked from it and every link is a file."""
    text = (EXAMPLES / "gkm/README.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
    assert rows[0].split("|")[1:4] == [" scenario ", " GKM's concession ", " accelnode "], rows[0]
    assert len(rows) >= 7, rows  # header + the scenarios
    links = set(re.findall(r"\]\(([^)#]+\.yaml)\)", text))
    assert all((EXAMPLES / "gkm" / link).is_file() for link in links), links
    gkm = {str(p.relative_to(EXAMPLES / "gkm")) for p in (EXAMPLES / "gkm").rglob("*.yaml")}
    assert gkm <= links, sorted(gkm - links)
