"""The DRA Component (overlays/dra): it builds on the base, the API server accepts the result, and
its DaemonSet runs the plugin as the base's node daemons run theirs."""

from __future__ import annotations

import os
import subprocess

import yaml

from tests.conftest import ROOT, tool

COMPONENT = ROOT / "overlays/dra"


def build_with_base(tmp_path) -> tuple[object, list[dict]]:
    k = tmp_path / "kustomization.yaml"
    k.write_text(yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                 "resources": [os.path.relpath(ROOT / "daemonsets", tmp_path)],
                                 "components": [os.path.relpath(COMPONENT, tmp_path)]}))
    out = subprocess.run([tool("kubectl"), "kustomize", "--load-restrictor=LoadRestrictionsNone", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return k, [d for d in yaml.safe_load_all(out.stdout) if d]


def test_the_component_adds_the_plugin_class_rights_and_policy(tmp_path):
    _, docs = build_with_base(tmp_path)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("DeviceClass", "tpu.google.com"), ("ServiceAccount", "accelnode-dra"), ("ClusterRole", "accelnode-dra"),
            ("ValidatingAdmissionPolicy", "accelnode-dra-resourceslices"),
            ("ValidatingAdmissionPolicyBinding", "accelnode-dra-resourceslices"),
            ("DaemonSet", "accelnode-tpu-dra-plugin"), ("DaemonSet", "accelnode-tpu-device-plugin")} <= kinds
    (ds,) = [d for d in docs if d["metadata"]["name"] == "accelnode-tpu-dra-plugin" and d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["accelnode", "dra"] and pod["serviceAccountName"] == "accelnode-dra"
    env = {e["name"]: e for e in c["env"]}
    assert env["ACCELNODE_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["ACCELNODE_POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi"} <= mounts
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == {"drop": ["ALL"]}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["priorityClassName"] == "system-node-critical" and "memory" in c["resources"]["limits"]
    # the policy names the account the DaemonSet runs as
    (vap,) = [d for d in docs
              if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == "accelnode-dra-resourceslices"]
    assert "system:serviceaccount:accelnode-system:accelnode-dra" in vap["spec"]["matchConditions"][0]["expression"]


def test_the_base_with_the_component_is_accepted_by_the_apiserver(kubectl, tmp_path, crds):
    k, _ = build_with_base(tmp_path)
    out = kubectl("admin", "create", "namespace", "accelnode-system")
    assert out.returncode == 0 or "AlreadyExists" in out.stderr, out.stderr
    built = subprocess.run([tool("kubectl"), "kustomize", "--load-restrictor=LoadRestrictionsNone", str(k.parent)],
                           capture_output=True, text=True, timeout=60).stdout
    out = kubectl("admin", "apply", "--dry-run=server", "--validate=strict", "-f", "-", stdin=built)
    assert out.returncode == 0, out.stderr
    assert "deviceclass.resource.k8s.io/tpu.google.com created (server dry run)" in out.stdout, out.stdout
