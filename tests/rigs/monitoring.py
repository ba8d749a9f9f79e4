"""overlays/monitoring/prometheusrule.yaml from overlays/monitoring/accelnode.rules.yml.

The rule file is the source (plain Prometheus loads it with ``rule_files:``); the Prometheus
Operator wants the same groups inside a PrometheusRule object. ``make monitoring-rules`` writes
it; tests/monitoring/ fails when the committed file differs from what this renders.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parents[2] / "overlays" / "monitoring"
HEADER = ("# The alert rules of accelnode.rules.yml for the Prometheus Operator: the same groups, word for\n"
          "# word (tests/monitoring/ fails when they differ; regenerate with `make monitoring-rules`).\n")


def prometheus_rule(rules_file: Path = MONITORING / "accelnode.rules.yml") -> str:
    groups = yaml.safe_load(rules_file.read_text())["groups"]
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "accelnode", "namespace": "accelnode-system",
                        "labels": {"app.kubernetes.io/part-of": "accelnode"}},
           "spec": {"groups": groups}}
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(prometheus_rule())
