"""Pieces of controller/nodegroups/reconciler.py that need no cluster."""

from __future__ import annotations

import shlex

from accelnode.cli import build_parser
from controller.nodegroups import reconciler as nodegroups


def test_the_startup_script_runs_a_real_bootstrap_command():
    script = nodegroups.STARTUP_SCRIPT.format(group="default/g", version="1.35")
    (line,) = [ln for ln in script.splitlines() if ln.startswith("exec ")]
    argv = shlex.split(line)[2:]
    assert argv[0] == "bootstrap"
    args = build_parser().parse_args(argv)
    assert args.func.__module__.endswith("cli")


def test_conditions_keep_their_transition_time_until_status_or_reason_moves():
    c1 = nodegroups.condition([], "Ready", "False", "AwaitingNodeJoin", "waiting", 1)
    c1[0]["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    c2 = nodegroups.condition(c1, "Ready", "False", "AwaitingNodeJoin", "still waiting", 1)
    assert c2[0]["lastTransitionTime"] == "2020-01-01T00:00:00Z" and c2[0]["message"] == "still waiting"
    c3 = nodegroups.condition(c2, "Ready", "True", "Ready", "All nodes are ready", 1)
    assert c3[0]["lastTransitionTime"] != "2020-01-01T00:00:00Z" and len(c3) == 1


def test_the_device_plugin_daemonset_runs_our_plugin_on_labelled_nodes():
    ds = nodegroups.device_plugin_daemonset("accelnode-system", "img:1")
    spec = ds["spec"]["template"]["spec"]
    assert spec["containers"][0]["command"] == ["accelnode", "device-plugin"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["key"] == nodegroups.LABEL_ACCELERATOR
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_placement_is_the_operators_word():
    s = nodegroups.Settings(own_project="ours")
    where = s.policy.placement
    assert where("team-a", "ours", "us-east5-b") is None
    assert "not allowed" in str(where("team-a", "victim", "us-east5-b"))
    assert "any GCE project" in str(nodegroups.Settings().policy.placement("team-a", "ours"))  # no default
    p = nodegroups.Policy.parse({"team-a": {"projects": ["a"], "zones": ["us-east5-b"]}, "*": {"projects": ["c"]}})
    assert p.placement("team-a", "a", "us-east5-b") is None
    assert p.placement("team-a", "a", region="us-east5") is None
    assert p.placement("team-a", "a", "us-central1-c").field == "spec.nodeLocation"
    assert "region" in str(p.placement("team-a", "a", region="us-central1"))
    assert "not allowed" in str(p.placement("team-a", "c"))  # a namespace's own rule wins
    assert p.placement("team-b", "c", "anywhere-1-a") is None


def test_what_runs_on_the_vms_is_the_operators_word():
    """Issue 33.5: each field a rule does not allow is refused by name; the upstream
    operator's manifests pass where the rule allows their values."""
    from tests.crds.test_crds import example

    ic = example("tpu/tpunodegroup-single-host.yaml", "v7x-single-host")["spec"]["instanceConfig"]
    base = {"projects": ["p"]}
    p = nodegroups.Policy.parse({"*": base})
    fields = {r.field for r in p.instance("ns", ic, "spec.instanceConfig")}
    assert {"spec.instanceConfig.image", "spec.instanceConfig.subnetwork", "spec.instanceConfig.serviceAccounts[0].email",
            "spec.instanceConfig.metadata.startup-script-url", "spec.instanceConfig.metadata.team",
            "spec.instanceConfig.networkTags"} <= fields
    assert p.instance("ns", {"machineType": "tpu7x-standard-4t"}, "spec.instanceConfig") == []  # nothing named
    allowing = nodegroups.Policy.parse({"*": {**base, "images": ["projects/ubuntu-os-accelerator-images/global/images/*"],
                                              "subnetworks": ["default", "regions/us-central1/subnetworks/default"],
                                              "serviceAccounts": [{"email": "default", "scopes": [
                                                  "https://www.googleapis.com/auth/cloud-platform"]}],
                                              "networkTags": ["tpu-nodes"],
                                              "metadata": {k: ["*"] for k in ic["metadata"]}}})
    assert allowing.instance("ns", ic, "x") == []
    sa = dict(ic, serviceAccounts=[{"email": "default", "scopes": ["https://www.googleapis.com/auth/compute"]}])
    assert [r.field for r in allowing.instance("ns", sa, "x")] == ["x.serviceAccounts[0].scopes"]
    for key in ("kube-labels", "kubeadm-join-token", "created-by"):  # the controller's or GCE's, always
        assert [r.field for r in allowing.instance("ns", {"metadata": {key: "x"}}, "x")] == [f"x.metadata.{key}"]
    urls = nodegroups.Policy.parse({"*": {**base, "metadata": {"startup-script-url": ["gs://ops-bucket/*"]}}})
    for bad in ("gs://ops-bucket/../evil/x.sh", "gs://ops-bucket-evil/x.sh", "gs://ops-bucket/%2e%2e/x",
                "gs://ops-bucket/x?y", "gs://ops-bucket/a b"):
        assert urls.instance("ns", {"metadata": {"startup-script-url": bad}}, "x"), bad
    assert urls.instance("ns", {"metadata": {"startup-script-url": "gs://ops-bucket/node-startup.sh"}}, "x") == []
    g = {"project": "p", "nodeLocation": "z-1-a", "instanceTemplateURI": "projects/p/global/instanceTemplates/t",
         "deletionPolicy": "Orphan"}
    assert [r.field for r in p.group("ns", g)] == ["spec.instanceTemplateURI", "spec.deletionPolicy"]
    assert not p.orphan_allowed("ns") and p.max_join_tokens("ns") == 16


def test_a_bad_placement_file_is_a_usage_error(tmp_path):
    import pytest

    from accelnode import exitcodes
    from controller.cli import node_group_placement

    for bad in ("{", "[]", '{"ns": {"projects": "p"}}', '{"ns": {"project": ["p"]}}', '{"ns": {"projects": [1]}}',
                '{"ns": {"projects": ["p"], "metadata": {"kube-labels": ["*"]}}}',
                '{"ns": {"projects": ["p"], "deletionPolicies": ["Keep"]}}', '{"ns": {"projects": ["p"], "maxJoinTokens": 65}}',
                '{"ns": {"projects": ["p"], "serviceAccounts": [{"email": "a"}]}}'):
        f = tmp_path / "p.json"
        f.write_text(bad)
        with pytest.raises(exitcodes.CLIError) as err:
            node_group_placement(str(f))
        assert err.value.code == exitcodes.USAGE and "--node-group-placement" in str(err.value)
    f.write_text('{"*": {"projects": ["p"], "zones": ["us-east5-b"]}}')
    assert node_group_placement(str(f)) == {"*": {"projects": ["p"], "zones": ["us-east5-b"]}}


def test_group_nodes_are_found_by_the_instance_names_not_a_provider_id():
    g = {"metadata": {"name": "g", "namespace": "ns", "uid": "u-1"}, "spec": {"project": "p", "nodeLocation": "z-1-a"}}
    mig = nodegroups.mig_name_of(g)
    node = lambda name, pid=None: {"metadata": {"name": name}, "spec": {"providerID": pid} if pid else {}}  # noqa: E731
    assert nodegroups.is_group_node(g, node(f"{mig}-ab12", f"gce://p/z-1-a/{mig}-ab12"))
    assert nodegroups.is_group_node(g, node(f"{mig}-ab12"))  # before the cloud provider sets it
    for other in (node("n", f"gce://p/z-1-a/{mig}-ab12"),  # a providerID naming our instance: not ours
                  node(f"{mig}-ab12", f"gce://p/z-1-a/{mig}-cd34"), node(f"{mig}-ab12", f"gce://q/z-1-a/{mig}-ab12"),
                  node(f"{mig}-ab12x"), node(mig), node("other-mig-ab12")):
        assert not nodegroups.is_group_node(g, other), other


def test_the_example_rules_allow_every_example_group_and_nothing_else():
    """examples/tpu/node-group-rules.json allows what the upstream operator's manifests ask for:
    they keep working where the operator allows their values."""
    import json

    from tests.conftest import ROOT
    from tests.crds.test_crds import example

    policy = nodegroups.Policy.parse(json.loads((ROOT / "examples/tpu/node-group-rules.json").read_text()))
    for path, name in (("tpu/tpunodegroup-single-host.yaml", "v7x-single-host"),
                       ("tpu/tpunodegroup-multi-host.yaml", "v6e-multi-host"),
                       ("tpu/tpunodegroup-from-template.yaml", "v7x-from-template"),
                       ("tpu/walkthrough/10-tpunodegroup.yaml", "tpu7x-slice")):
        g = example(path, name)
        assert policy.group(g["metadata"]["namespace"], g["spec"]) == [], path
    g = example("tpu/tpunodegroup-single-host.yaml", "v7x-single-host")
    g["spec"]["instanceConfig"]["image"] = "projects/ubuntu-os-accelerator-images/global/images/ubuntu-accel-2404-" \
                                           "amd64-tpu-../../../attacker/global/images/x"
    assert [r.field for r in policy.group("default", g["spec"])] == ["spec.instanceConfig.image"]
