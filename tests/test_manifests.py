"""Every manifest we ship is accepted by a real kube-apiserver, unchanged.

Server-side dry-run with strict field validation: a misspelt field, a wrong type or a missing
required field fails here, not on an operator's cluster. Nothing is persisted."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from controller.webhooks.certs import service_names
from tests.conftest import accelnode_cmd, tool

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# examples that need CRDs no fixture installs here: kro's ResourceGraphDefinition and the kind it
# defines, applied against the real kro controller in tests/e2e/test_kro.py
NOT_DRY_RUN_HERE = {"kro/rgd.yaml", "kro/instance.yaml"}
KUSTOMIZE_FILES = {"kustomization.yaml", "kustomizeconfig.yaml"}  # kustomize's own, not objects
SHIPPED = sorted(p for p in (ROOT / "daemonsets").glob("*.yaml") if p.name not in KUSTOMIZE_FILES) + sorted(
    p for p in EXAMPLES.rglob("*.yaml") if str(p.relative_to(EXAMPLES)) not in NOT_DRY_RUN_HERE)


def namespaces_used(path: Path) -> set[str]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return {d["metadata"]["namespace"] for d in docs if d.get("metadata", {}).get("namespace")}


@pytest.fixture(scope="module")
def shipped_namespaces(kubectl, crds):
    """The namespaces the manifests name exist (dry-run still resolves the namespace)."""
    wanted = set().union(*(namespaces_used(p) for p in SHIPPED))
    for ns in sorted(wanted):
        out = kubectl("admin", "create", "namespace", ns, "--save-config")
        assert out.returncode == 0 or "AlreadyExists" in out.stderr, out.stderr
    return wanted


def test_every_shipped_manifest_is_listed():
    names = {p.name for p in SHIPPED}
    assert {"csi-driver.yaml", "device-plugin.yaml", "rbac-agent.yaml", "rbac-controller.yaml", "namespace.yaml",
            "pod-inline-cache.yaml", "pod-claim-cache.yaml"} <= names
    assert {"gkm/workloads/deployment-by-claim.yaml", "tpu/walkthrough/20-workload.yaml",
            "tpu-env/gke-indexed-job.yaml"} <= {str(p.relative_to(EXAMPLES)) for p in SHIPPED if EXAMPLES in p.parents}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_manifest_is_accepted_by_the_apiserver(kubectl, shipped_namespaces, path):
    out = kubectl("admin", "apply", "--dry-run=server", "--validate=strict", "-f", str(path))
    assert out.returncode == 0, f"{path.name}: {out.stderr}"
    # an object another test's controller made (the node groups' device-plugin DaemonSet) has no
    # last-applied annotation: kubectl warns that it will add one; that is no fault of the manifest
    warnings = [ln for ln in out.stderr.splitlines() if "Warning" in ln
                and "kubectl.kubernetes.io/last-applied-configuration annotation" not in ln]
    assert not warnings, f"{path.name}: {out.stderr}"
    assert "(server dry run)" in out.stdout


def test_csi_driver_object_matches_what_the_driver_does():
    docs = [d for d in yaml.safe_load_all((ROOT / "daemonsets/csi-driver.yaml").read_text()) if d]
    (drv,) = [d for d in docs if d["kind"] == "CSIDriver"]
    assert drv["metadata"]["name"] == "csi.gkm.io"
    assert drv["spec"]["attachRequired"] is False
    assert drv["spec"]["podInfoOnMount"] is True  # namespace isolation needs the pod's namespace
    assert set(drv["spec"]["volumeLifecycleModes"]) == {"Ephemeral", "Persistent"}


def daemon_containers():
    for path in (p for p in SHIPPED if EXAMPLES not in p.parents):  # ours, not the users' examples
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "DaemonSet":
                pod = doc["spec"]["template"]["spec"]
                for c in pod["containers"]:
                    yield pytest.param(path.name, pod, c, id=f"{path.name}:{c['name']}")


@pytest.mark.parametrize("name,pod,container", list(daemon_containers()))
def test_probes_reach_the_daemon(name, pod, container):
    """/healthz and /readyz on the port the daemon listens on, at an address kubelet can reach:
    kubelet probes the pod IP, or its own loopback when given host 127.0.0.1 - which is the
    pod's only with hostNetwork."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    host, _, port = env["ACCELNODE_METRICS_ADDRESS"].rpartition(":")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert (get["path"], str(get["port"])) == (path, port), (name, container["name"], probe)
        assert container[probe].get("timeoutSeconds", 1) >= 3  # /healthz waits up to 2 s on the gRPC server
        if pod.get("hostNetwork"):
            assert get.get("host") == "127.0.0.1" and host == "127.0.0.1"  # not on the node's network
        else:
            assert "host" not in get and host == "0.0.0.0", (name, container["name"])


CERT_MANAGER = ROOT / "overlays/cert-manager"


def test_the_cert_manager_overlay_builds_and_wires_the_ca_into_our_webhooks(kubectl, shipped_namespaces):
    """The overlay builds with kustomize (kubectl's); what it adds is consistent: the serving
    certificate names the controller's Service as the self-managed one does, and every webhook
    configuration takes caBundle from the CA Certificate it defines. cert-manager's CRDs are not
    installable here (no cert-manager), so only the webhook configurations are dry-run on the
    API server; the cert-manager objects are checked for shape."""
    out = subprocess.run([tool("kubectl"), "kustomize", str(CERT_MANAGER)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    certs = {c["metadata"]["name"]: c for c in by_kind["Certificate"]}
    issuers = {i["metadata"]["name"]: i for i in by_kind["Issuer"]}
    ca, leaf = certs["accelnode-controller-webhook-ca"], certs["accelnode-controller-webhook"]
    assert ca["spec"]["isCA"] and "selfSigned" in issuers[ca["spec"]["issuerRef"]["name"]]["spec"]
    assert issuers[leaf["spec"]["issuerRef"]["name"]]["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    assert leaf["spec"]["dnsNames"] == service_names("accelnode-controller", "accelnode-system")
    assert {c["spec"]["privateKey"]["algorithm"] for c in certs.values()} == {"ECDSA"}
    webhooks = by_kind["MutatingWebhookConfiguration"] + by_kind["ValidatingWebhookConfiguration"]
    assert len(webhooks) == 3  # webhooks-gkm.yaml (mutating + validating), webhooks-tpu-env.yaml
    for w in webhooks:
        assert w["metadata"]["annotations"] == {
            "cert-manager.io/inject-ca-from": "accelnode-system/accelnode-controller-webhook-ca"}
        assert all(h["clientConfig"]["service"]["name"] == "accelnode-controller" for h in w["webhooks"])
    dry = kubectl("admin", "apply", "--dry-run=server", "--validate=strict", "-f", "-",
                  stdin=yaml.safe_dump_all(webhooks))
    assert dry.returncode == 0 and "Warning" not in dry.stderr, dry.stderr


BASE = ROOT / "daemonsets"


def build(path: Path) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def listed(kustomization: Path) -> set[str]:
    return set(yaml.safe_load((kustomization / "kustomization.yaml").read_text())["resources"])


def test_the_kustomize_base_is_every_shipped_manifest_and_no_crd():
    """`kubectl apply -k daemonsets/crds/` then `daemonsets/` deploy everything daemonsets/ ships
    (a new manifest in neither fails here); the CRDs are a kustomization of their own, so
    `kubectl delete -k daemonsets/` can never delete one, and with it every object of its kind."""
    assert listed(BASE) == {p.name for p in BASE.glob("*.yaml")} - KUSTOMIZE_FILES
    assert listed(BASE / "crds") == {p.name for p in BASE.glob("crds/*.yaml")} - KUSTOMIZE_FILES
    crds = build(BASE / "crds")
    assert crds and {d["kind"] for d in crds} == {"CustomResourceDefinition"}
    assert "CustomResourceDefinition" not in {d["kind"] for d in build(BASE)}
    for overlay in (CERT_MANAGER, ROOT / "overlays/monitoring"):  # nor does an overlay of the base
        assert "CustomResourceDefinition" not in {d["kind"] for d in build(overlay)}, overlay


def test_the_base_is_accepted_by_the_apiserver_as_one_apply(kubectl, shipped_namespaces):
    out = kubectl("admin", "apply", "--dry-run=server", "--validate=strict", "-k", str(BASE))
    assert out.returncode == 0, out.stderr
    # the session's CRDs were created by the `crds` fixture, not by apply: kubectl says so
    warnings = [w for w in out.stderr.splitlines() if "last-applied-configuration annotation" not in w]
    assert not any("Warning" in w for w in warnings), out.stderr
    kinds = {line.split("/")[0] for line in out.stdout.splitlines()}
    assert {"deployment.apps", "daemonset.apps", "service", "csidriver.storage.k8s.io", "namespace",
            "resourcequota", "clusterrole.rbac.authorization.k8s.io"} <= kinds, out.stdout


def workloads(docs: list[dict]):
    for d in docs:
        if d["kind"] in ("DaemonSet", "Deployment"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def test_every_workload_is_bounded_prioritised_probed_and_confined():
    """What an operator expects of a node or cluster daemon: requests and a memory limit, a
    priority class, probes on /healthz and /readyz, a read-only root filesystem and no privilege
    escalation; every container that is not privileged (mounts) drops all capabilities, and only
    what must be root runs as root."""
    seen = []
    for name, pod in workloads(build(BASE)):
        assert pod["priorityClassName"] in ("system-node-critical", "system-cluster-critical"), name
        for c in pod["containers"]:
            seen.append(f"{name}/{c['name']}")
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"], (name, c["name"])
            assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            if sc.get("privileged"):
                assert (name, c["name"]) == ("accelnode-csi-node", "csi")  # mount(2), Bidirectional propagation
                continue
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
            uid = sc.get("runAsUser", pod.get("securityContext", {}).get("runAsUser"))
            if name == "accelnode-controller":
                assert uid == 65532 and pod["securityContext"]["runAsNonRoot"] is True
    assert sorted(seen) == ["accelnode-controller/controller", "accelnode-csi-node/agent", "accelnode-csi-node/csi",
                            "accelnode-tpu-device-plugin/device-plugin"]


def test_the_controller_service_reaches_the_webhook_port():
    docs = build(BASE)
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    port = {p["name"]: p["containerPort"] for p in c["ports"]}[svc["spec"]["ports"][0]["targetPort"]]
    assert env["ACCELNODE_WEBHOOK_ADDRESS"] == f"0.0.0.0:{port}" and svc["spec"]["ports"][0]["port"] == 443
    # a GKE private cluster's control plane reaches pods on 443 and 10250 only, and dials the
    # container port (../shared/reference/gke.md section 2); never on the node's network, where
    # kubelet holds 10250. The API server's own routing: tests/controller/test_webhook_routing.py
    assert port == 10250 and not dep["spec"]["template"]["spec"].get("hostNetwork")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    hooks = [h for d in docs if d["kind"].endswith("WebhookConfiguration") for h in d["webhooks"]]
    assert hooks and all(h["clientConfig"]["service"] | {"path": None} == {
        "name": svc["metadata"]["name"], "namespace": svc["metadata"]["namespace"], "port": 443, "path": None}
        for h in hooks if "port" in h["clientConfig"]["service"])
    assert all(h["clientConfig"]["service"]["name"] == svc["metadata"]["name"] for h in hooks)


def test_the_network_policy_admits_the_api_server_to_the_webhooks_and_leaves_the_probes_open():
    """Only addresses (ipBlock), never pods or namespaces, may reach the webhook port; the metrics
    port stays open to kubelet's probes and Prometheus; no other port of the controller is reachable
    and no port it serves is left out (limits per network plugin: docs/security.md)."""
    docs = build(BASE)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (pol,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pod = dep["spec"]["template"]
    assert pol["metadata"]["namespace"] == dep["metadata"]["namespace"]
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    c = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert int(env["ACCELNODE_METRICS_ADDRESS"].rpartition(":")[2]) == ports["metrics"]
    rules = {p["port"]: rule for rule in pol["spec"]["ingress"] for p in rule["ports"]}
    assert set(rules) == set(ports.values())
    webhook = rules[ports["webhook"]]
    assert webhook["from"] and all(set(peer) == {"ipBlock"} for peer in webhook["from"])
    assert {peer["ipBlock"]["cidr"] for peer in webhook["from"]} == {"0.0.0.0/0", "::/0"}
    assert "from" not in rules[ports["metrics"]]


def test_the_cert_manager_overlay_mounts_its_certificate_and_drops_the_self_managed_rights():
    docs = build(CERT_MANAGER)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    mount = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}["webhook-tls"]
    assert env["ACCELNODE_TLS_CERT_FILE"] == f"{mount}/tls.crt" and env["ACCELNODE_TLS_KEY_FILE"] == f"{mount}/tls.key"
    (vol,) = [v for v in pod["volumes"] if v["name"] == "webhook-tls"]
    leaf = [d for d in docs if d["kind"] == "Certificate" and d["metadata"]["name"] == "accelnode-controller-webhook"]
    assert vol["secret"]["secretName"] == leaf[0]["spec"]["secretName"]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not any(n.startswith("accelnode-controller-webhook-") and k in ("Role", "ClusterRole") for k, n in names)


def test_the_cert_manager_overlay_keeps_every_mount_of_the_base():
    """Its patches add the certificate beside the base's volumes (the controller's /tmp among
    them: the read-only root needs it), never instead of them."""
    def mounts(docs):
        (dep,) = [d for d in docs if d["kind"] == "Deployment"]
        pod = dep["spec"]["template"]["spec"]
        return ({v["name"] for v in pod["volumes"]},
                {(m["name"], m["mountPath"]) for m in pod["containers"][0]["volumeMounts"]})

    base_volumes, base_mounts = mounts(build(ROOT / "daemonsets"))
    volumes, mounts_ = mounts(build(CERT_MANAGER))
    assert base_volumes < volumes and base_mounts < mounts_


# -- the image, its version and an operator's registry ---------------------------------------------


def overlay(out: Path, *, components=(), **fields) -> list[dict]:
    """Build an overlay of the base written in ``out`` (as an operator would write it)."""
    (out / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(BASE, out)], **fields,
        **({"components": [os.path.relpath(c, out) for c in components]} if components else {})}))
    return build(out)


def images(docs: list[dict]) -> set[str]:
    return {c["image"] for _, pod in workloads(docs) for c in pod["containers"]}


def pinned_device_plugin_image(docs: list[dict]) -> str:
    """The image the guard lets the controller deploy (daemonsets/rbac-controller-guards.yaml)."""
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "accelnode-device-plugin-image"]
    return cm["data"]["image"]


def test_every_workload_runs_the_one_fully_qualified_image_of_this_version():
    """A name with a registry host and a tag that is this release's version: never a bare
    `accelnode`, which a cluster would look up on Docker Hub."""
    import tomllib

    import accelnode

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert accelnode.__version__ == version and accelnode.IMAGE == f"ghcr.io/accelnode/accelnode:{version}"
    docs = build(BASE)
    assert images(docs) == {accelnode.IMAGE}
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ACCELNODE_DEVICE_PLUGIN_IMAGE"] == accelnode.IMAGE == pinned_device_plugin_image(docs)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{version}]" in changelog, "CHANGELOG.md has no entry for this version"
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert f"org.opencontainers.image.version={version}" in (ROOT / "Containerfile").read_text()


def test_an_overlays_images_entry_moves_every_container_and_the_controllers_device_plugin_image(tmp_path):
    """docs/operations.md's overlay for an image pushed to the operator's registry: the node
    DaemonSets, the controller, and the image the controller gives the node groups' device-plugin
    DaemonSet (and the guard's pin of it) all follow it (daemonsets/kustomizeconfig.yaml); other
    variables stay as they are."""
    ours = "registry.example.com/team/accelnode:0.1.0-rc1"
    docs = overlay(tmp_path, images=[{"name": "ghcr.io/accelnode/accelnode", "newName": ours.rsplit(":", 1)[0],
                                      "newTag": ours.rsplit(":", 1)[1]}])
    assert images(docs) == {ours}
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    base_env = {e["name"]: e.get("value") for d in build(BASE) if d["kind"] == "Deployment"
                for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ACCELNODE_DEVICE_PLUGIN_IMAGE"] == ours == pinned_device_plugin_image(docs)
    assert {k: v for k, v in env.items() if k != "ACCELNODE_DEVICE_PLUGIN_IMAGE"} == {
        k: v for k, v in base_env.items() if k != "ACCELNODE_DEVICE_PLUGIN_IMAGE"}


def test_the_controllers_default_device_plugin_image_is_the_release_image():
    """Run outside the shipped Deployment (no ACCELNODE_DEVICE_PLUGIN_IMAGE), the controller still
    names a pullable image, not a bare name."""
    out = subprocess.run([*accelnode_cmd(), "controller", "--help"], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "ACCELNODE_DEVICE_PLUGIN_IMAGE"})
    assert out.returncode == 0, out.stderr
    import accelnode

    assert f"(default: {accelnode.IMAGE})" in " ".join(out.stdout.split())


# -- beside GKE's own device plugins ---------------------------------------------------------------


def device_plugin_terms(docs: list[dict]) -> list[list[dict]]:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "accelnode-tpu-device-plugin"]
    return [t["matchExpressions"] for t in ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]]


def test_the_node_groups_device_plugin_stays_off_gke_node_pools_too():
    """The DaemonSet the controller makes for TPU node groups when the base's is missing
    (controller/nodegroups/reconciler.py) selects the nodes the base's does."""
    from controller.nodegroups.reconciler import device_plugin_daemonset

    made = device_plugin_daemonset("accelnode-system", "x")
    assert device_plugin_terms([made]) == device_plugin_terms(build(BASE))


def test_the_self_managed_device_plugin_component_adds_the_opted_in_gke_nodes(tmp_path):
    """The base: TPU nodes outside GKE node pools only. The switch (a kustomize Component used
    from an overlay, as docs/operations.md shows): also TPU nodes labelled
    accelnode.io/tpu-device-plugin=true. Which nodes each selects is proven by the DaemonSet
    controller in tests/e2e/test_gke_install.py."""
    base = device_plugin_terms(build(BASE))
    assert base == [[{"key": "cloud.google.com/gke-tpu-accelerator", "operator": "Exists"},
                     {"key": "cloud.google.com/gke-nodepool", "operator": "DoesNotExist"}]]
    switched = device_plugin_terms(overlay(tmp_path, components=[ROOT / "overlays/self-managed-device-plugin"]))
    assert switched == base + [[{"key": "cloud.google.com/gke-tpu-accelerator", "operator": "Exists"},
                                {"key": "accelnode.io/tpu-device-plugin", "operator": "In", "values": ["true"]}]]
