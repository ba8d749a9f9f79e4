"""The charts (charts/accelnode, charts/accelnode-crds) against their one source, daemonsets/.

No cluster: ``helm lint``, ``helm template`` compared object by object with ``kubectl kustomize``
for the defaults and every overlay choice, the generated templates current, the values schema
refusing bad values with Helm's own message.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT
from tests.helm.chart import CHART, CHOICES, CRDS_CHART, NAMESPACE, diff, helm, key, kustomize, normalised, template


def test_generated_templates_are_current():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "helmchart.py"), "--check"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("chart", [CHART, CRDS_CHART], ids=["accelnode", "accelnode-crds"])
def test_lint(chart):
    out = helm("lint", "--strict", str(chart), "-n", NAMESPACE)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("choice", CHOICES)
def test_template_equals_kustomize(choice, tmp_path):
    sets, kustomization = CHOICES[choice]
    helm_objs = normalised(template(CHART, sets))
    kust = normalised(kustomize(tmp_path, kustomization))
    # The Namespace: Helm users give it with -n/--create-namespace (createNamespace=true adds it)
    kust.pop(("v1", "Namespace", "", NAMESPACE))
    assert sorted(helm_objs) == sorted(kust)
    for k in kust:
        assert helm_objs[k] == kust[k], diff(kust[k], helm_objs[k])


def test_create_namespace_gives_the_base_namespace(tmp_path):
    objs = normalised(template(CHART, ["createNamespace=true"]))
    assert objs[("v1", "Namespace", "", NAMESPACE)] == normalised(kustomize(tmp_path, CHOICES["default"][1]))[
        ("v1", "Namespace", "", NAMESPACE)]


def test_crds_chart_equals_kustomize_and_keeps_every_crd(tmp_path):
    rendered = template(CRDS_CHART)
    assert rendered and all(d["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for d in rendered)
    assert normalised(rendered) == normalised(kustomize(tmp_path, {"resources": ["daemonsets/crds"]}))


def test_every_object_carries_helm_labels_and_selectors_do_not():
    for d in template(CHART, ["monitoring.enabled=true", "draPlugin.enabled=true", "createNamespace=true"]):
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", key(d)
        assert labels["app.kubernetes.io/instance"] == "accelnode", key(d)
        if d["kind"] in ("DaemonSet", "Deployment"):  # immutable: a kustomize install is adopted as is
            assert "app.kubernetes.io/instance" not in d["spec"]["selector"]["matchLabels"]


def objects(rendered: list[dict]) -> dict[tuple, dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in rendered}


def pod(objs, kind, name) -> dict:
    return objs[(kind, name)]["spec"]["template"]["spec"]


def test_values_reach_the_objects(tmp_path):
    kdir = "/var/lib/rancher/k3s/agent/kubelet"
    placement = json.loads((ROOT / "examples/tpu/node-group-rules.json").read_text())
    sets = [f"kubeletDir={kdir}", "containerdHostsDir=/var/lib/rancher/k3s/agent/etc/containerd/certs.d",
            "image.repository=registry.example.com/team/accelnode", "image.digest=sha256:" + "a" * 64,
            "image.pullSecrets[0].name=regcred", "image.pullPolicy=IfNotPresent", "namespaceOverride=tpu-system",
            "csiDriver.nodeSelector.pool=tpu", "csiDriver.tolerations=null", "controller.extraArgs[0]=--workers",
            "controller.webhookPort=443", "controller.gkeTpuEnv=false", "controller.tpuNodeGroups.gceProject=p1",
            "controller.priorityClassName=high", "devicePlugin.resources.limits.memory=200Mi",
            "csiDriver.agent.extraEnv[0].name=ACCELNODE_GC_INTERVAL",
            "gke.criticalPodsQuota=false"]
    capture = {"team-a": ["registry.example.com/team-a/"], "*": ["registry.example.com/shared/captures"]}
    rendered = template(CHART, sets, "--set-json", f"controller.tpuNodeGroups.placement={json.dumps(placement)}",
                        "--set-json", f"controller.captureRepositories={json.dumps(capture)}",
                        "--set-string", "controller.extraArgs[1]=4,csiDriver.agent.extraEnv[0].value=60")
    objs = objects(rendered)
    image = "registry.example.com/team/accelnode@sha256:" + "a" * 64
    for d in rendered:
        # (the join tokens' Roles are in kube-system and kube-public)
        assert d["metadata"].get("namespace", "tpu-system") in ("tpu-system", "kube-system", "kube-public")
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            assert c["image"] == image and c["imagePullPolicy"] == "IfNotPresent"
    csi = pod(objs, "DaemonSet", "accelnode-csi-node")
    assert csi["nodeSelector"] == {"kubernetes.io/os": "linux", "pool": "tpu"} and "tolerations" not in csi
    assert csi["imagePullSecrets"] == [{"name": "regcred"}]
    paths = {v["name"]: v["hostPath"]["path"] for v in csi["volumes"] if "hostPath" in v}
    assert paths["kubelet-pods"] == f"{kdir}/pods" and paths["registration-dir"] == f"{kdir}/plugins_registry"
    assert paths["containerd-hosts"] == "/var/lib/rancher/k3s/agent/etc/containerd/certs.d"
    mounts = {m["name"]: m["mountPath"] for m in csi["containers"][0]["volumeMounts"]}
    assert mounts["kubelet-pods"] == f"{kdir}/pods"  # the same path inside: kubelet hands out host paths
    env = {e["name"]: e.get("value") for e in csi["containers"][0]["env"]}
    assert env["ACCELNODE_ENDPOINT"] == f"unix://{kdir}/plugins/csi.gkm.io/csi.sock"
    assert env["ACCELNODE_KUBELET_DIR"] == kdir
    assert {"name": "ACCELNODE_GC_INTERVAL", "value": "60"} in csi["containers"][1]["env"]
    dp = pod(objs, "DaemonSet", "accelnode-tpu-device-plugin")
    assert dp["containers"][0]["resources"]["limits"]["memory"] == "200Mi"
    ctl = pod(objs, "Deployment", "accelnode-controller")
    c = ctl["containers"][0]
    assert c["args"] == ["--workers", "4"] and ctl["priorityClassName"] == "high"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["ACCELNODE_WEBHOOK_ADDRESS"] == "0.0.0.0:443" and env["ACCELNODE_GKE_TPU_ENV"] == "false"
    assert env["ACCELNODE_TPU_NODE_GROUPS"] == "true" and env["ACCELNODE_GCE_PROJECT"] == "p1"
    assert {"name": "webhook", "containerPort": 443} in c["ports"]
    assert objs[("NetworkPolicy", "accelnode-controller")]["spec"]["ingress"][0]["ports"][0]["port"] == 443
    assert ("ResourceQuota", "accelnode-critical-pods") not in objs
    # the placement rules: the file the controller reads, parsed by the controller's own parser
    from controller.nodegroups.policy import Policy

    rules = json.loads(objs[("ConfigMap", "accelnode-node-group-placement")]["data"]["rules.json"])
    assert rules == placement and Policy.parse(rules)
    assert env["ACCELNODE_NODE_GROUP_PLACEMENT"] == "/etc/accelnode/node-group-placement/rules.json"
    assert {"name": "node-group-placement", "configMap": {"name": "accelnode-node-group-placement"}} in ctl["volumes"]
    # the capture rules: the file --capture-repositories reads, loaded by the controller's own loader
    from accelnode.capture.settings import Rules

    rules_file = tmp_path / "capture.json"
    rules_file.write_text(objs[("ConfigMap", "accelnode-capture-repositories")]["data"]["rules.json"])
    loaded = Rules.load(str(rules_file))
    assert loaded.allows("team-a", "registry.example.com/team-a/jax")
    assert not loaded.allows("team-b", "registry.example.com/team-a/jax")
    assert env["ACCELNODE_CAPTURE_REPOSITORIES"] == "/etc/accelnode/capture-repositories/rules.json"
    assert {"name": "capture-repositories", "mountPath": "/etc/accelnode/capture-repositories",
            "readOnly": True} in c["volumeMounts"]
    assert {"name": "capture-repositories", "configMap": {"name": "accelnode-capture-repositories"}} in ctl["volumes"]
    for d in rendered:
        if d["kind"].endswith("WebhookConfiguration"):
            for w in d["webhooks"]:
                assert w["clientConfig"]["service"]["namespace"] == "tpu-system"


@pytest.mark.parametrize("kdir", ["/var/snap/microk8s/common/var/lib/kubelet", "/var/lib/rancher/k3s/agent/kubelet"])
def test_kubelet_dir_moves_every_kubelet_path(kdir):
    """Every path of the node DaemonSets; the controller's policy on the device-plugin DaemonSet it
    deploys keeps /var/lib/kubelet (node-group VMs are kubeadm nodes, whatever this cluster is)."""
    for d in template(CHART, [f"kubeletDir={kdir}", "draPlugin.enabled=true"]):
        if d["kind"] == "DaemonSet":
            text = yaml.safe_dump(d)
            assert "/var/lib/kubelet" not in text.replace(kdir, "") and kdir in text, d["metadata"]["name"]


def test_node_groups_turn_off():
    objs = objects(template(CHART, ["controller.tpuNodeGroups.enabled=false"]))
    env = {e["name"]: e.get("value") for e in pod(objs, "Deployment", "accelnode-controller")["containers"][0]["env"]}
    assert env["ACCELNODE_TPU_NODE_GROUPS"] == "false"
    assert not {n for k, n in objs if "nodegroups" in n or "jointokens" in n}


def test_components_turn_off():
    off = ["devicePlugin.enabled=false", "csiDriver.enabled=false", "controller.enabled=false"]
    objs = objects(template(CHART, off))
    kinds = {k for k, _ in objs}
    assert not kinds & {"DaemonSet", "Deployment", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
    assert ("ClusterRole", "accelnode-controller") not in objs and ("ServiceAccount", "accelnode-agent") not in objs


BAD = [  # (the value, where Helm's message points)
    ("webhook.certificates=letsencrypt",
     "'/webhook/certificates': value must be one of 'self-managed', 'cert-manager'"),
    ("controller.webhookPort=70000", "'/controller/webhookPort'"),
    ("image.digest=latest", "'/image/digest'"),
    ("kubeletDir=var/lib/kubelet", "'/kubeletDir'"),
    ("controller.gkeTpuEnv=maybe", "'/controller/gkeTpuEnv'"),
    ("devicePlugin.enabled=yes", "'/devicePlugin/enabled': got string, want boolean"),
    ("devicePlugin.tolerations[0].operator=Sometimes", "'/devicePlugin/tolerations/0/operator'"),
    ("controller.tpuNodeGroups.placement.team-a.zones[0]=us-central1-a",
     "'/controller/tpuNodeGroups/placement/team-a': missing property 'projects'"),
    ("controller.replicas=0", "'/controller/replicas'"),
    ("controller.captureRepositories.team-a=registry.example.com/team-a/", "'/controller/captureRepositories/team-a'"),
    ("csiDriver.resource.limits.memory=1Gi", "additional properties 'resource' not allowed"),
    ("namespaceOverride=Bad_NS", "'/namespaceOverride'"),
]


@pytest.mark.parametrize("value,where", BAD, ids=[b[0].split("=")[0] for b in BAD])
def test_schema_refuses_a_bad_value(value, where):
    how = "--set-string" if value.endswith("=yes") else "--set"
    out = helm("template", "accelnode", str(CHART), "-n", NAMESPACE, how, value, check=False)
    assert out.returncode != 0 and out.stdout == ""
    assert "values don't meet the specifications of the schema" in out.stderr and where in out.stderr, out.stderr


def test_schema_describes_every_value():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(v, s, path):
        assert s.get("description"), f"{path}: no description"
        if isinstance(v, dict) and "properties" in s:
            assert set(v) <= set(s["properties"]), f"{path}: {set(v) - set(s['properties'])} not in the schema"
            for k, sub in v.items():
                walk(sub, s["properties"][k], f"{path}.{k}".lstrip("."))

    for k, v in values.items():
        walk(v, schema["properties"][k], k)
    assert set(schema["properties"]) - {"global"} == set(values)
