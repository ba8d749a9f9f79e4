"""The suite's alert rules and dashboard (overlays/monitoring/): checked by Prometheus' own
promtool, unit-tested with series the test writes, and every metric they name is one a daemon
really exports (each daemon is started and scraped)."""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.conftest import ROOT, http_get, require, require_root
from tests.controller.conftest import admin, controller_rbac, controllers, fresh_lease  # noqa: F401 (fixtures)
from tests.csi.conftest import Node, free_ports

RULES = ROOT / "overlays" / "monitoring" / "accelnode.rules.yml"
DASHBOARD = ROOT / "overlays" / "monitoring" / "accelnode-dashboard.json"
METRIC = re.compile(r"\baccelnode_[a-z0-9_]+")


def promtool() -> str:
    found = shutil.which("promtool")
    require(found is not None, "promtool (Debian package prometheus, tools/apt/monitoring.txt)")
    return found


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def test_rules_pass_promtool_check():
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_every_alert_says_what_it_is_and_how_bad():
    for r in rules():
        assert r["alert"].startswith("Accelnode"), r
        assert r["labels"]["severity"] in {"info", "warning", "critical"}, r
        assert r["annotations"]["summary"] and r["annotations"]["description"], r


UNIT_TESTS = {
    "evaluation_interval": "1m",
    "tests": [
        {   # a chip turns unhealthy: fires once it stayed so for 2 minutes, not before
            "interval": "1m",
            "input_series": [
                {"series": 'accelnode_tpu_chips{health="Unhealthy",instance="node-a"}', "values": "0 0 1 1 1 1"},
                {"series": 'accelnode_tpu_chips{health="Healthy",instance="node-a"}', "values": "4 4 3 3 3 3"},
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": "AccelnodeTPUChipUnhealthy", "exp_alerts": []},
                {"eval_time": "5m", "alertname": "AccelnodeTPUChipUnhealthy",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "instance": "node-a"}, "value": 1}]},
            ],
        },
        {   # pulls failing: three failures within 15 minutes fire, two do not
            "interval": "1m",
            "input_series": [
                {"series": 'accelnode_agent_pulls_total{result="failed",instance="node-a"}', "values": "0 1 2 2 3 3 3"},
                {"series": 'accelnode_agent_pulls_total{result="failed",instance="node-b"}', "values": "0 1 1 1 2 2 2"},
            ],
            "alert_rule_test": [
                {"eval_time": "6m", "alertname": "AccelnodeCachePullsFailing",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "instance": "node-a"}}]},
            ],
        },
        {   # a cache failing verification, one unresolved, and a node group stuck; the leader is there
            "interval": "1m",
            "input_series": [
                {"series": 'accelnode_controller_conditions{resource="gkmcaches",type="Verified",status="False",'
                           'reason="WrongKey"}', "values": "1x40"},
                {"series": 'accelnode_controller_conditions{resource="clustergkmcaches",type="Resolved",'
                           'status="False",reason="RegistryUnavailable"}', "values": "0x5 1x40"},
                {"series": 'accelnode_controller_conditions{resource="tpunodegroups",type="Ready",status="False",'
                           'reason="MIGNotReady"}', "values": "2x40"},
                {"series": "accelnode_controller_leader", "values": "1x40"},
            ],
            "alert_rule_test": [
                {"eval_time": "10m", "alertname": "AccelnodeCacheUnverified",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "resource": "gkmcaches", "reason": "WrongKey"},
                                "value": 1}]},
                {"eval_time": "10m", "alertname": "AccelnodeCacheUnresolved", "exp_alerts": []},
                {"eval_time": "25m", "alertname": "AccelnodeCacheUnresolved",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "resource": "clustergkmcaches",
                                                "reason": "RegistryUnavailable"}, "value": 1}]},
                {"eval_time": "35m", "alertname": "AccelnodeNodeGroupNotReady",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "reason": "MIGNotReady"}, "value": 2}]},
                {"eval_time": "35m", "alertname": "AccelnodeControllerNoLeader", "exp_alerts": []},
            ],
        },
        {   # webhook errors and the leader gone
            "interval": "1m",
            "input_series": [
                {"series": 'accelnode_controller_admission_requests_total{path="/mutate-tpu-env-pod",answer="error"}',
                 "values": "0+2x20"},
                {"series": 'accelnode_controller_admission_requests_total{path="/mutate-gkmcache",answer="allowed"}',
                 "values": "0+50x20"},
                {"series": "accelnode_controller_leader", "values": "1 1 0x20"},
            ],
            "alert_rule_test": [
                {"eval_time": "12m", "alertname": "AccelnodeWebhookErrors",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "path": "/mutate-tpu-env-pod"}}]},
                {"eval_time": "12m", "alertname": "AccelnodeControllerNoLeader",
                 "exp_alerts": [{"exp_labels": {"severity": "critical"}}]},
            ],
        },
    ],
}


def rendered(alert: str, labels: dict, value) -> dict:
    """The annotations Prometheus renders for ``alert`` (``$labels.x`` and ``$value`` only)."""
    def fill(text: str) -> str:
        text = text.replace("{{ $value }}", f"{value:g}" if value is not None else "{{ $value }}")
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)
    return {k: fill(v) for k, v in next(r for r in rules() if r["alert"] == alert)["annotations"].items()}


def test_rules_fire_on_the_series_they_are_for(tmp_path):
    spec = {"rule_files": [str(RULES)], **json.loads(json.dumps(UNIT_TESTS))}
    for t in spec["tests"]:  # promtool compares annotations too: the ones our templates render
        for case in t["alert_rule_test"]:
            for a in case["exp_alerts"]:
                a["exp_annotations"] = rendered(case["alertname"], a["exp_labels"], a.pop("value", None))
    (tmp_path / "rules_test.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    out = subprocess.run([promtool(), "test", "rules", str(tmp_path / "rules_test.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_queries_are_promql_and_the_panels_do_not_overlap():
    dash = json.loads(DASHBOARD.read_text())
    boxes = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & boxes, p["title"]
        boxes |= cells
    # promtool parses an expression only inside a rule: one recording rule per panel query
    group = {"groups": [{"name": "dashboard", "rules": [{"record": f"accelnode:panel:{i}", "expr": e}
                                                        for i, e in enumerate(dashboard_exprs())]}]}
    path = Path(DASHBOARD.parent.parent.parent / ".pytest-dashboard-rules.yml")
    try:
        path.write_text(yaml.safe_dump(group))
        out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    finally:
        path.unlink(missing_ok=True)
    assert out.returncode == 0, out.stdout + out.stderr


# -- every metric named is exported ----------------------------------------------------------------

def exported(body: str) -> set[str]:
    """Sample names a daemon's /metrics can produce, from its # TYPE lines (families exist before
    their first sample)."""
    names = set()
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names |= {name, *{"counter": [f"{name}_total"], "histogram": [f"{name}_bucket", f"{name}_sum",
                                                                          f"{name}_count"]}.get(kind, [])}
    return names


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=2)).sign(key, hashes.SHA256()))
    crt, pem = tmp_path / "tls.crt", tmp_path / "tls.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    return crt, pem


def wait_metrics(port: int, what: str, proc_log, timeout: float = 60) -> set[str]:
    end = time.monotonic() + timeout
    while (got := http_get(port, "/metrics"))[0] != 200:
        assert time.monotonic() < end, f"{what} serves no /metrics on {port} ({got[1]}):\n{proc_log()}"
        time.sleep(0.2)
    return exported(got[1])


@pytest.fixture
def all_daemons_metrics(tmp_path, tpu_host, run_plugin, controllers, fresh_lease):  # noqa: F811
    """The union of what the device plugin, the agent, the CSI driver and the controller export."""
    require_root()
    names: set[str] = set()
    port = free_ports(1)[0]
    plugin = run_plugin(tpu_host("v5e-4"), "--metrics-address", f"127.0.0.1:{port}")
    names |= wait_metrics(port, "device plugin", plugin.log)
    short = Path(tempfile.mkdtemp(prefix="an-mon-"))  # kubelet-shaped socket paths must stay under 107 bytes
    node = Node(short)
    try:
        node.agent.start()
        node.csi.start()
        names |= wait_metrics(node.agent_metrics_port, "agent", node.agent.log)
        names |= wait_metrics(node.csi_metrics_port, "csi", node.csi.log)
    finally:
        node.close()
        shutil.rmtree(short, ignore_errors=True)
    crt, pem = self_signed(tmp_path)
    c = controllers("monitoring", "--tls-cert-file", str(crt), "--tls-key-file", str(pem),
                    "--webhook-address", f"127.0.0.1:{free_ports(1)[0]}")
    names |= wait_metrics(c.metrics_port, "controller", c.log)
    return names


def test_every_metric_named_is_exported(all_daemons_metrics):
    named = {m for r in rules() for m in METRIC.findall(r["expr"])}
    named |= {m for e in dashboard_exprs() for m in METRIC.findall(e)}
    assert named, "no metric named"
    missing = sorted(named - all_daemons_metrics)
    assert not missing, f"named by the rules or the dashboard but exported by no daemon: {missing}"
