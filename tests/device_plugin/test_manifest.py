"""The DaemonSet manifest matches the CLI it runs."""

from pathlib import Path

import yaml

from accelnode.cli import build_parser, env_name

MANIFEST = Path(__file__).resolve().parents[2] / "daemonsets/device-plugin.yaml"


def test_daemonset_mounts_and_env_are_real():
    ds = yaml.safe_load(MANIFEST.read_text())
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["accelnode", "device-plugin"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    hostpaths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    for path in ("/dev", "/sys", "/var/lib/kubelet/device-plugins"):
        assert hostpaths[mounts[path]["name"]] == path
    assert mounts["/sys"].get("readOnly") is True
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["device-plugin"]
    flags = {env_name(o) for a in sub._actions for o in a.option_strings if o.startswith("--")}
    assert {e["name"] for e in container["env"]} <= flags
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
