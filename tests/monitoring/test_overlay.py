"""overlays/monitoring/: the base plus a PodMonitor, a PrometheusRule and the dashboard ConfigMap
for clusters with the Prometheus Operator and Grafana's dashboard sidecar. Rendered by kubectl's
kustomize, accepted by a real kube-apiserver that knows the Prometheus Operator's own CRDs (taken
from its Go module: tools/mk/monitoring.mk), and checked to scrape every daemon where it really
listens."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.rigs.monitoring import MONITORING, prometheus_rule
from tests.conftest import TOOLS_BIN, require, tool
from tests.fixtures.cluster import wait_established

PROM_CRDS = TOOLS_BIN.parent / "prometheus-operator" / "crds"


def build() -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return build()


def test_the_prometheus_rule_holds_the_rule_files_groups_word_for_word():
    assert (MONITORING / "prometheusrule.yaml").read_text() == prometheus_rule(), \
        "overlays/monitoring/prometheusrule.yaml is stale: run `make monitoring-rules`"


def _metrics_port(container: dict) -> int | None:
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    addr = env.get("ACCELNODE_METRICS_ADDRESS")
    return None if addr is None else int(addr.rsplit(":", 1)[1])


def test_every_daemon_is_scraped_where_it_listens(rendered):
    (monitor,) = [d for d in rendered if d["kind"] == "PodMonitor"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoints = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    seen = set()
    for wl in (d for d in rendered if d["kind"] in ("DaemonSet", "Deployment")):
        labels = wl["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{wl['metadata']['name']} is not selected by the PodMonitor"
        for c in wl["spec"]["template"]["spec"]["containers"]:
            port = _metrics_port(c)
            if port is None:
                continue
            addr = next(e["value"] for e in c["env"] if e["name"] == "ACCELNODE_METRICS_ADDRESS")
            assert not addr.startswith("127."), f"{wl['metadata']['name']}/{c['name']} serves metrics on loopback only"
            scraped = {p["containerPort"] for p in c.get("ports", []) if p["name"] in endpoints}
            assert scraped == {port}, f"{wl['metadata']['name']}/{c['name']}: {c.get('ports')} vs {addr}"
            names = [e["name"] for e in c["env"]]
            assert len(names) == len(set(names)), f"{wl['metadata']['name']}/{c['name']}: duplicate env {names}"
            seen.add(wl["metadata"]["name"])
    assert seen == {"accelnode-tpu-device-plugin", "accelnode-csi-node", "accelnode-controller"}


def test_the_dashboard_configmap_is_for_grafanas_sidecar(rendered):
    (cm,) = [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "accelnode-grafana-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["accelnode-dashboard.json"]) == json.loads(
        (MONITORING / "accelnode-dashboard.json").read_text())


@pytest.fixture(scope="module")
def operator_crds(kubectl, kube_api, crds):
    require(PROM_CRDS.is_dir(), f"the Prometheus Operator CRDs in {PROM_CRDS} (tools/mk/monitoring.mk)")
    files = [a for p in sorted(PROM_CRDS.glob("*.yaml")) for a in ("-f", str(p))]
    out = kubectl("admin", "apply", "--server-side", *files)
    assert out.returncode == 0, out.stderr
    wait_established(kube_api, ["podmonitors.monitoring.coreos.com", "prometheusrules.monitoring.coreos.com"])
    out = kubectl("admin", "create", "namespace", "accelnode-system", "--save-config")
    assert out.returncode == 0 or "AlreadyExists" in out.stderr, out.stderr
    yield
    kubectl("admin", "delete", "--ignore-not-found", "--wait=false", *files)


def test_the_overlay_is_accepted_by_the_apiserver(kubectl, operator_crds, rendered):
    out = kubectl("admin", "apply", "--dry-run=server", "--validate=strict", "-f", "-",
                  stdin=yaml.safe_dump_all(rendered))
    assert out.returncode == 0, out.stderr
    warnings = [ln for ln in out.stderr.splitlines() if "Warning" in ln
                and "kubectl.kubernetes.io/last-applied-configuration annotation" not in ln]
    assert not warnings, out.stderr
    assert "podmonitor.monitoring.coreos.com/accelnode created (server dry run)" in out.stdout
    assert "prometheusrule.monitoring.coreos.com/accelnode created (server dry run)" in out.stdout
