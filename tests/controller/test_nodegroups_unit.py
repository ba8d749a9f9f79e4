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


def test_kube_labels_parse_and_skip_garbage():
    assert nodegroups.kube_labels("a=1,b=2, c=,=x,junk") == {"a": "1", "b": "2", "c": ""}


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
    assert nodegroups.placement_problem(s, "team-a", "ours", "us-east5-b") is None
    assert "not allowed" in nodegroups.placement_problem(s, "team-a", "victim", "us-east5-b")
    assert "any GCE project" in nodegroups.placement_problem(nodegroups.Settings(), "team-a", "ours")  # no default
    s = nodegroups.Settings(placement={"team-a": {"projects": ["a"], "zones": ["us-east5-b"]}, "*": {"projects": ["c"]}})
    assert nodegroups.placement_problem(s, "team-a", "a", "us-east5-b") is None
    assert nodegroups.placement_problem(s, "team-a", "a", region="us-east5") is None
    assert "zone" in nodegroups.placement_problem(s, "team-a", "a", "us-central1-c")
    assert "region" in nodegroups.placement_problem(s, "team-a", "a", region="us-central1")
    assert "not allowed" in nodegroups.placement_problem(s, "team-a", "c")  # a namespace's own rule wins
    assert nodegroups.placement_problem(s, "team-b", "c", "anywhere-1-a") is None


def test_a_bad_placement_file_is_a_usage_error(tmp_path):
    import pytest

    from accelnode import exitcodes
    from controller.cli import node_group_placement

    for bad in ("{", "[]", '{"ns": {"projects": "p"}}', '{"ns": {"project": ["p"]}}', '{"ns": {"projects": [1]}}'):
        f = tmp_path / "p.json"
        f.write_text(bad)
        with pytest.raises(exitcodes.CLIError) as err:
            node_group_placement(str(f))
        assert err.value.code == exitcodes.USAGE and "--node-group-placement" in str(err.value)
    f.write_text('{"*": {"projects": ["p"], "zones": ["us-east5-b"]}}')
    assert node_group_placement(str(f)) == {"*": {"projects": ["p"], "zones": ["us-east5-b"]}}


def test_group_nodes_are_found_by_provider_id_alone():
    g = {"metadata": {"name": "g", "namespace": "ns", "uid": "u-1"}, "spec": {"project": "p", "nodeLocation": "z-1-a"}}
    mig = nodegroups.mig_name_of(g)
    node = lambda pid: {"metadata": {"name": "n"}, "spec": {"providerID": pid}}  # noqa: E731
    assert nodegroups.is_group_node(g, node(f"gce://p/z-1-a/{mig}-ab12"))
    for other in (f"gce://q/z-1-a/{mig}-ab12", f"gce://p/z-1-b/{mig}-ab12", f"gce://p/z-1-a/{mig}-ab12x",
                  f"gce://p/z-1-a/{mig}", "gce://p/z-1-a/other-mig-ab12", ""):
        assert not nodegroups.is_group_node(g, node(other)), other
