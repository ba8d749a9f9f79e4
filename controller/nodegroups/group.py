"""The ``TPUNodeGroup`` reconciler: checks the group against the operator's rules
(controller/nodegroups/policy.py), makes its children (workload policy, instance template, MIG:
controller/nodegroups/children.py), brings its VMs in as nodes (controller/nodegroups/nodes.py),
runs our device plugin on them (controller/nodegroups/devplugin.py) and takes it all down again
(docs/tpu-node-groups.md). Every write is made only when something changed: in steady state
neither GCE nor the API server sees one.
"""

from __future__ import annotations

import hashlib
import logging
import time

from accelnode.kube.client import Client, KubeError, custom_path, is_conflict, is_not_found
from accelnode.log import kv

from controller.nodegroups import devplugin, generations
from controller.nodegroups.common import (API_VERSION, CHILD_FAILURES, GROUP, LABEL_ACCELERATOR, LABEL_COUNT,
                                          LABEL_GROUP, LABEL_TOPOLOGY, NODES, STARTUP_SCRIPT, TNG, VERSION, Settings,
                                          condition, get_condition)
from controller.nodegroups.compute import BASE, GCE, GCEError
from controller.nodegroups.nodes import CSRS, Nodes, csr_token_id, is_group_node, mig_name_of
from controller.runtime import events
from controller.runtime.reconciler import Reconciler, Result, Watch, object_key, split_key
from controller.runtime.writes import ReadYourWrites, update_if_changed, update_status

log = logging.getLogger("accelnode.controller.nodegroups")

GROUP_FINALIZER = "tpu.google.com/nodegroup-cleanup"
DRAIN_ANNOTATION = "tpu.google.com/drain-started"


class TPUNodeGroupReconciler(Reconciler):
    name = "tpunodegroups"

    def __init__(self, client: Client, gce: GCE, settings: Settings, tokens=None):
        self.client, self.gce, self.settings = client, gce, settings
        self.rw = ReadYourWrites()
        self.nodes = Nodes(self, client, gce, settings, tokens)
        self._machine: dict[str, str] = {}  # group key -> machine type of an instanceTemplateURI group
        self.children = {p: custom_path(GROUP, VERSION, p)
                         for p in ("workloadpolicies", "instancetemplates", "managedinstancegroups")}
        owner = lambda o: [f"{o['metadata']['namespace']}/{r['name']}"  # noqa: E731
                           for r in o["metadata"].get("ownerReferences") or []
                           if r.get("kind") == "TPUNodeGroup" and r.get("apiVersion", "").startswith(GROUP)]
        self.watches = (
            Watch(TNG),
            *(Watch(p, keys=owner) for p in self.children.values()),
            Watch(NODES, keys=self._node_keys),
            Watch(CSRS, keys=self._csr_keys),  # a join token's first use
            Watch(f"/apis/apps/v1/namespaces/{settings.namespace}/daemonsets",
                  query={"fieldSelector": f"metadata.name={devplugin.DEVICE_PLUGIN}"},
                  keys=lambda _o: [object_key(g) for g in self.cache.list(TNG)]),
        )

    # -- mapping -------------------------------------------------------------------------------

    def _csr_keys(self, csr: dict) -> list[str]:
        tid = csr_token_id(csr)
        return sorted(object_key(g) for g in self.cache.list(TNG) if tid and tid in
                      ((g.get("status") or {}).get("joinTokens") or [])) if tid else []

    def _node_keys(self, node: dict) -> list[str]:
        return sorted(object_key(g) for g in self.cache.list(TNG) if is_group_node(g, node))

    # -- writes ----------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        ns, name = split_key(key)
        return custom_path(GROUP, VERSION, "tpunodegroups", ns, name)

    def _update(self, key: str, g: dict, mutate) -> dict:
        written = update_if_changed(self.client, self._path(key), g, mutate)
        if written is None:
            return g
        self.rw.remember(key, g, written)
        return written

    def _set_status(self, key: str, g: dict, conds: list[dict], summary: dict | None = None) -> dict:
        status = dict(g.get("status") or {})
        status["conditions"] = conds
        if summary is not None:
            status["nodeSummary"] = summary
        written = update_status(self.client, self._path(key), g, status)
        if written is None:
            return g
        events.transitions(g, status, progress=("AwaitingNodeJoin", "Provisioning", "DrainingNodes", "DeletingMIG",
                                                "DeletingTemplate", "DeletingPolicy"))
        self.rw.remember(key, g, written)
        return written

    # -- reconcile -------------------------------------------------------------------------------

    def reconcile(self, key: str) -> Result | None:
        g = self.rw.current(key, self.cache.get(TNG, key))
        if g is None:
            self.rw.forget(key)
            return None
        if g["metadata"].get("deletionTimestamp"):
            return self._teardown(key, g)
        if GROUP_FINALIZER not in (g["metadata"].get("finalizers") or []):
            g = self._update(key, g, lambda o: o["metadata"].setdefault("finalizers", []).append(GROUP_FINALIZER))
        try:
            return self._reconcile(key, g)
        except GCEError as e:
            if e.terminal:  # e.g. the instanceTemplateURI does not exist, permissions
                conds = condition((g.get("status") or {}).get("conditions") or [], "Ready", "False",
                                  "ReconcileError", str(e), g["metadata"].get("generation"))
                self._set_status(key, g, conds)
                return Result(requeue_after=30 * self.settings.poll)
            raise

    def _reconcile(self, key: str, g: dict) -> Result | None:
        spec, md = g["spec"], g["metadata"]
        gen = md.get("generation")
        conds = list((g.get("status") or {}).get("conditions") or [])
        ns, name = split_key(key)
        project, zone = spec["project"], spec["nodeLocation"]
        region = zone.rsplit("-", 1)[0]
        refused = self.settings.policy.group(ns, spec)
        if refused:  # before anything is asked of GCE; the status write's Event names each field
            message = "; ".join(map(str, refused))
            self._set_status(key, g, condition(conds, "Ready", "False", "NotAllowed", message, gen))
            log.warning("node group refused", extra=kv(group=key, fields=[r.field for r in refused]))
            return None
        h = hashlib.sha256(md["uid"].encode()).hexdigest()[:8]
        machine = (spec.get("instanceConfig") or {}).get("machineType")
        if machine is None:
            machine = self._template_machine(key, spec)
        problems = generations.check(machine, spec["topology"], int(spec["nodeCount"])) if machine else []
        if problems:
            conds = condition(conds, "Ready", "False", "InvalidSpec", "; ".join(problems), gen)
            self._set_status(key, g, conds)
            return None
        mt = generations.machine_type(machine)
        group_label = f"{ns}-{name}"
        labels = {LABEL_ACCELERATOR: mt.generation.accelerator, LABEL_COUNT: str(mt.chips),
                  LABEL_TOPOLOGY: spec["topology"], LABEL_GROUP: group_label}
        waiting = []
        bulk = spec.get("targetSizePolicyMode") == "BULK" and int(spec["nodeCount"]) > 1
        policy_url = None
        if bulk:
            child = self._ensure_child(g, "workloadpolicies", "WorkloadPolicy", f"{name}-policy-{h}", {
                "project": project, "region": region, "acceleratorTopology": spec["topology"],
                "type": "HIGH_THROUGHPUT"})
            policy_url = (child.get("status") or {}).get("uri")
            conds = self._child_condition(conds, "WorkloadPolicyReady", child, policy_url, gen)
            waiting += [] if policy_url else ["WorkloadPolicy"]
        if spec.get("instanceConfig"):
            ic = spec["instanceConfig"]
            metadata = dict(ic.get("metadata") or {})
            metadata["kube-labels"] = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            if spec.get("bootstrapKubernetes"):
                metadata["startup-script"] = STARTUP_SCRIPT.format(group=key,
                                                                   version=spec["bootstrapKubernetes"]["version"])
            tspec = {"project": project, **{k: v for k, v in ic.items() if k != "metadata"}, "metadata": metadata}
            child = self._ensure_child(g, "instancetemplates", "InstanceTemplate", f"{name}-template-{h}", tspec)
            template_url = (child.get("status") or {}).get("uri")
            conds = self._child_condition(conds, "InstanceTemplateReady", child, template_url, gen)
            waiting += [] if template_url else ["InstanceTemplate"]
        else:
            template_url = BASE + spec["instanceTemplateURI"]
        if waiting:
            return self._waiting(key, g, conds, ", ".join(waiting))
        mig_name = mig_name_of(g)
        mspec = {"project": project, "location": zone, "instanceTemplate": template_url,
                 "targetSize": int(spec["nodeCount"]), "defaultActionOnFailure": "DO_NOTHING"}
        if spec.get("targetSizePolicyMode"):
            mspec["targetSizePolicyMode"] = spec["targetSizePolicyMode"]
        if policy_url:
            mspec["workloadPolicy"] = policy_url
        child = self._ensure_child(g, "managedinstancegroups", "ManagedInstanceGroup", mig_name, mspec)
        mig_url = (child.get("status") or {}).get("url")
        conds = self._child_condition(conds, "ManagedInstanceGroupReady", child, mig_url, gen)
        if not mig_url:
            return self._waiting(key, g, conds, "ManagedInstanceGroup")
        box = [g]
        summary, message, again = self.nodes.sync(key, box, project, zone, mig_name, labels)
        g = box[0]
        devplugin.ensure(self.client, self.cache, self.settings)
        n = int(spec["nodeCount"])
        if summary["ready"] >= n:
            conds = condition(conds, "Ready", "True", "Ready", "All nodes are ready", gen)
        elif summary["failed"]:
            conds = condition(conds, "Ready", "False", "InstancesCreationFailed", message, gen)
        else:
            conds = condition(conds, "Ready", "False", "AwaitingNodeJoin",
                              f"Waiting for {n - summary['ready']} of {n} nodes to join and become ready"
                              + (f": {message}" if message else ""), gen)
        self._set_status(key, g, conds, summary)
        if summary["ready"] >= n and not again:
            return None
        return Result(requeue_after=min(again or self.settings.poll, self.settings.poll))

    def _waiting(self, key: str, g: dict, conds: list[dict], what: str) -> Result | None:
        """Ready=False while children are made; a child that failed for good fails the group
        with its reason (the children's watch brings the group back when that changes)."""
        gen = g["metadata"].get("generation")
        failed = next((c for c in conds if c["type"] != "Ready" and c.get("status") == "False"
                       and c.get("reason") in CHILD_FAILURES), None)
        if failed:
            self._set_status(key, g, condition(conds, "Ready", "False", failed["reason"],
                                               f"{failed['type']}: {failed['message']}", gen))
            return None
        self._set_status(key, g, condition(conds, "Ready", "False", "AwaitingNodeJoin", f"waiting for {what}", gen))
        return Result(requeue_after=self.settings.poll)

    def _template_machine(self, key: str, spec: dict) -> str | None:
        if key not in self._machine:
            res = self.gce.get_template_url(BASE + spec["instanceTemplateURI"])
            if res is None:
                raise GCEError(404, f"instance template {spec['instanceTemplateURI']} does not exist")
            self._machine[key] = res.properties.machine_type
        return self._machine[key]

    def _ensure_child(self, g: dict, plural: str, kind: str, name: str, spec: dict) -> dict:
        ns = g["metadata"]["namespace"]
        path = self.children[plural]
        child = self.cache.get(path, f"{ns}/{name}")
        spec = {**spec, "deletionPolicy": "Orphan" if self._orphans(g) else "Delete"}
        owner = {"apiVersion": API_VERSION, "kind": "TPUNodeGroup", "name": g["metadata"]["name"],
                 "uid": g["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
        if child is None:
            body = {"apiVersion": API_VERSION, "kind": kind,
                    "metadata": {"name": name, "namespace": ns, "ownerReferences": [owner],
                                 "labels": {LABEL_GROUP: f"{ns}-{g['metadata']['name']}"[:63].rstrip("-._")}},
                    "spec": spec}
            try:
                child = self.client.request("POST", custom_path(GROUP, VERSION, plural, ns), body=body)
                log.info("child created", extra=kv(group=object_key(g), kind=kind, name=name))
            except KubeError as e:
                if not is_conflict(e):
                    raise
                child = self.client.request("GET", custom_path(GROUP, VERSION, plural, ns, name))
            return child
        if any(child["spec"].get(k) != v for k, v in spec.items()):
            written = update_if_changed(self.client, custom_path(GROUP, VERSION, plural, ns, name), child,
                                        lambda o: o["spec"].update(spec))
            return written or child
        return child

    @staticmethod
    def _child_condition(conds, kind, child, uri, gen):
        if uri:
            return condition(conds, kind, "True", "Ready", f"{child['kind']} {child['metadata']['name']}: {uri}", gen)
        ready = get_condition(child, "Ready")
        return condition(conds, kind, "False", ready.get("reason") or "Provisioning",
                         ready.get("message") or f"{child['kind']} {child['metadata']['name']} is being created", gen)

    # -- teardown ------------------------------------------------------------------------------

    def _orphan(self, key: str, g: dict) -> dict:
        """``deletionPolicy: Orphan``: every child keeps its GCE resource (its own teardown reads
        the policy), the join tokens go, the VMs and their Nodes stay."""
        ns = g["metadata"]["namespace"]
        for plural in ("managedinstancegroups", "instancetemplates", "workloadpolicies"):
            for c in self._children(plural, g):
                update_if_changed(self.client, custom_path(GROUP, VERSION, plural, ns, c["metadata"]["name"]), c,
                                  lambda o: o["spec"].update(deletionPolicy="Orphan"))
        box = [g]
        self.nodes.revoke_all(key, box)
        log.info("node group orphaned: its GCE resources stay", extra=kv(group=key))
        return box[0]

    def _orphans(self, g: dict) -> bool:
        """``deletionPolicy: Orphan`` where the operator allows it in the group's namespace;
        otherwise the group is deleted as with ``Delete`` (the teardown says so in an Event)."""
        return g["spec"].get("deletionPolicy") == "Orphan" and \
            self.settings.policy.orphan_allowed(g["metadata"]["namespace"])

    def _children(self, plural: str, g: dict) -> list[dict]:
        md = g["metadata"]
        return [c for c in self.cache.list(self.children[plural])
                if c["metadata"]["namespace"] == md["namespace"] and any(
                    r.get("uid") == md["uid"] for r in c["metadata"].get("ownerReferences") or [])]

    def _teardown(self, key: str, g: dict) -> Result | None:
        md = g["metadata"]
        if GROUP_FINALIZER not in (md.get("finalizers") or []):
            return None
        ns, name = split_key(key)
        conds = list((g.get("status") or {}).get("conditions") or [])
        gen = md.get("generation")

        def step(reason: str, message: str) -> Result:
            self._set_status(key, g, condition(conds, "Ready", "False", reason, message, gen))
            return Result(requeue_after=self.settings.poll)

        if self._orphans(g):
            return self._release(key, self._orphan(key, g))
        if g["spec"].get("deletionPolicy") == "Orphan" and not md.get("annotations", {}).get(DRAIN_ANNOTATION):
            events.record(g, events.WARNING, "NotAllowed", f"spec.deletionPolicy: 'Orphan' is not allowed in "
                          f"namespace {ns} (the operator's deletionPolicies): the group's GCE resources are deleted")
        nodes = [n for n in self.cache.list(NODES) if is_group_node(g, n)]
        for n in nodes:  # cordon: spec.unschedulable, as kubectl cordon does
            update_if_changed(self.client, f"{NODES}/{n['metadata']['name']}", n,
                              lambda o: o.setdefault("spec", {}).update(unschedulable=True))
        if nodes:
            started = (md.get("annotations") or {}).get(DRAIN_ANNOTATION)
            if started is None:
                g = self._update(key, g, lambda o: o["metadata"].setdefault("annotations", {}).update(
                    {DRAIN_ANNOTATION: str(int(time.time()))}))
                started = g["metadata"]["annotations"][DRAIN_ANNOTATION]
            left = self.nodes.drain(nodes)
            if left and time.time() - float(started) < self.settings.drain_timeout:
                return step("DrainingNodes", f"evicting {len(left)} pod(s): {', '.join(left[:5])}")
            if left:
                log.warning("drain timed out; deleting the VMs anyway", extra=kv(group=key, pods=left[:20]))
        for plural, reason in (("managedinstancegroups", "DeletingMIG"), ("instancetemplates", "DeletingTemplate"),
                               ("workloadpolicies", "DeletingPolicy")):
            children = self._children(plural, g)
            if children:
                for c in children:
                    if not c["metadata"].get("deletionTimestamp"):
                        try:
                            self.client.request("DELETE", custom_path(GROUP, VERSION, plural, ns,
                                                                      c["metadata"]["name"]))
                        except KubeError as e:
                            if not is_not_found(e):
                                raise
                return step(reason, f"deleting {children[0]['kind']} {children[0]['metadata']['name']}: "
                                    + (get_condition(children[0], "Ready").get("message") or "waiting"))
        for n in nodes:
            try:
                self.client.request("DELETE", f"{NODES}/{n['metadata']['name']}")
            except KubeError as e:
                if not is_not_found(e):
                    raise
        box = [g]
        self.nodes.revoke_all(key, box)
        g = box[0]
        others = [o for o in self.cache.list(TNG)
                  if object_key(o) != key and not o["metadata"].get("deletionTimestamp")]
        if not others:
            devplugin.remove(self.client, self.cache, self.settings)
        self.nodes.forget(g)
        return self._release(key, g)

    def _release(self, key: str, g: dict) -> None:
        md = g["metadata"]
        self.client.request("PUT", self._path(key), body={
            **g, "metadata": {**md, "finalizers": [f for f in md.get("finalizers") or [] if f != GROUP_FINALIZER]}})
        self._machine.pop(key, None)
        self.rw.forget(key)
        log.info("node group released", extra=kv(group=key))
        return None
