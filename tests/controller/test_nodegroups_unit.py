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
