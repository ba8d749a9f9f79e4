"""``accelnode_controller_conditions``: how many objects stand in each condition, read from the
reconcilers' own watches at scrape time (no API call, no per-event work).

For every reconciler's primary watch (its first: the kind it reconciles), each kept object's
``status.conditions`` are counted by ``resource`` (the watched collection's plural, e.g.
``gkmcaches``), condition ``type``, ``status`` and ``reason``. Alert rules read it: a cache
``Resolved=False`` or ``Verified=False`` for long, a node group whose ``Ready`` is not True
(overlays/monitoring/). Only the replica that leads runs reconcilers, so a standby exports no
samples; rules aggregate with ``max``.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client.core import GaugeMetricFamily

NAME = "accelnode_controller_conditions"
HELP = "Objects a reconciler watches, by resource and by each status condition's type, status and reason"


class ConditionsCollector:
    def __init__(self, controllers):
        self.controllers = controllers  # controller.runtime.runner.Controller, each with .reconciler.watches and .reflectors

    def describe(self):
        return [GaugeMetricFamily(NAME, HELP, labels=["resource", "type", "status", "reason"])]

    def collect(self):
        family = GaugeMetricFamily(NAME, HELP, labels=["resource", "type", "status", "reason"])
        counts: Counter = Counter()
        seen = set()
        for c in self.controllers:
            watches = c.reconciler.watches
            if not watches or watches[0].path in seen:
                continue  # two reconcilers of one kind (pinning and claims) count it once
            path = watches[0].path
            seen.add(path)
            resource = path.rstrip("/").rsplit("/", 1)[-1]
            for obj in c.reflectors[path].snapshot():
                conditions = (obj.get("status") or {}).get("conditions") or []
                for cond in conditions if isinstance(conditions, list) else ():
                    if isinstance(cond, dict) and cond.get("type"):
                        counts[(resource, str(cond["type"]), str(cond.get("status", "Unknown")),
                                str(cond.get("reason", "")))] += 1
        for labels, n in sorted(counts.items()):
            family.add_metric(list(labels), n)
        yield family
