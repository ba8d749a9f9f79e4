"""The three child reconcilers of a TPU node group, each owning one GCE resource:
``WorkloadPolicy``, ``InstanceTemplate`` and ``ManagedInstanceGroup`` (docs/tpu-node-groups.md).

A child (:class:`ChildReconciler`) inserts its resource, keeps the operation's name in its
status, polls it on later reconciles (a worker never blocks on GCE) and deletes it through a
finalizer. A terminal GCE answer is a ``Ready=False`` condition, not retried for that
generation; a transient one raises and the runtime retries with backoff. A child that no
TPUNodeGroup controls, or that asks for what the operator's rules do not allow its namespace
(controller/nodegroups/policy.py), makes nothing.
"""

from __future__ import annotations

import logging
import uuid

from accelnode.kube.client import Client, KubeError, custom_path, is_not_found
from accelnode.log import kv

from controller.nodegroups.common import (GROUP, TERMINAL_REASONS, VERSION, Settings, cluster_id, condition,
                                          get_condition, is_startup_script, short)
from controller.nodegroups.compute import BASE, GCE, TERMINAL, GCEError, Owner
from controller.nodegroups.policy import matches
from controller.runtime.reconciler import Reconciler, Result, Watch
from controller.runtime.writes import ReadYourWrites, update_if_changed, update_status

log = logging.getLogger("accelnode.controller.nodegroups")



class ChildReconciler(Reconciler):
    kind = ""
    plural = ""
    uri_field = "uri"

    def __init__(self, client: Client, gce: GCE, settings: Settings):
        self.client, self.gce, self.settings = client, gce, settings
        self.name = f"{self.plural}"
        self.path = custom_path(GROUP, VERSION, self.plural)
        self.finalizer = f"tpu.google.com/{self.kind.lower()}-cleanup"
        self.watches = (Watch(self.path),)
        self.rw = ReadYourWrites()

    # per kind
    def scope(self, obj: dict) -> tuple[str, str, str]:  # (operation kind, project, location)
        raise NotImplementedError

    def place(self, obj: dict) -> tuple[str, str | None, str | None]:  # (project, zone, region) to allow
        raise NotImplementedError

    def get(self, obj: dict):
        raise NotImplementedError

    def insert(self, obj: dict, owner: Owner, request_id: str) -> str:
        raise NotImplementedError

    def delete(self, obj: dict) -> str:
        raise NotImplementedError

    def observe(self, obj: dict, res) -> tuple[dict, tuple[str, str, str], float | None]:
        """(extra status fields, (Ready status, reason, message), requeue_after)."""
        return {}, ("True", "Created", f"{self.kind} {obj['metadata']['name']} exists in GCE"), None

    # shared
    def _obj_path(self, obj: dict) -> str:
        md = obj["metadata"]
        return custom_path(GROUP, VERSION, self.plural, md["namespace"], md["name"])

    def _write_status(self, key: str, obj: dict, status: dict) -> dict:
        written = update_status(self.client, self._obj_path(obj), obj, status)
        if written is None:
            return obj
        self.rw.remember(key, obj, written)
        return written

    def _status(self, obj: dict, ready: tuple[str, str, str], **fields) -> dict:
        st = {k: v for k, v in (obj.get("status") or {}).items() if k not in ("operationName", "operationType")}
        st.update({k: v for k, v in fields.items() if v is not None})
        for k in [k for k, v in fields.items() if v is None]:
            st.pop(k, None)
        st["conditions"] = condition(st.get("conditions") or [], "Ready", *ready,
                                     generation=obj["metadata"].get("generation"))
        return st

    def owner(self, obj: dict) -> Owner | None:
        """The marker of the group controlling ``obj`` (None: no TPUNodeGroup controls it)."""
        md = obj["metadata"]
        ref = next((r for r in md.get("ownerReferences") or [] if r.get("controller") and
                    r.get("kind") == "TPUNodeGroup" and r.get("apiVersion", "").startswith(GROUP + "/")), None)
        if ref is None:
            return None
        return Owner(cluster_id(self.client, self.settings), ref["uid"], f"{md['namespace']}/{ref['name']}")

    def _refused(self, obj: dict) -> str | None:
        if self.owner(obj) is None:
            return f"{self.kind} {obj['metadata']['name']} is not controlled by a TPUNodeGroup: nothing is made for it"
        ns = obj["metadata"]["namespace"]
        refused = self.settings.policy.placement(ns, *self.place(obj))
        return str(refused) if refused else self.allowed(obj)

    def allowed(self, obj: dict) -> str | None:
        """Why the operator's rules refuse this child's spec beyond its placement (None: they do not)."""
        return None

    def _learn(self, key: str, obj: dict, owner: Owner, request_id: str, creating: str) -> Result:
        """Insert the resource with ``request_id`` (recorded in the status first: a crash after
        GCE accepted the insert is answered, on the next try with the same id, by the same
        operation) and keep the operation to poll."""
        if (obj.get("status") or {}).get("requestId") != request_id:
            obj = self._write_status(key, obj, self._status(obj, ("False", "Provisioning", creating),
                                                            requestId=request_id))
        name = self.insert(obj, owner, request_id)
        log.info("GCE resource creating", extra=kv(kind=self.kind, key=key, operation=name))
        st = self._status(obj, ("False", "Provisioning", creating), requestId=request_id)
        st.update(operationName=name, operationType="CREATE")
        self._write_status(key, obj, st)
        return Result(requeue_after=self.settings.poll)

    def reconcile(self, key: str) -> Result | None:
        obj = self.rw.current(key, self.cache.get(self.path, key))
        if obj is None:
            self.rw.forget(key)
            return None
        md = obj["metadata"]
        if md.get("deletionTimestamp"):
            return self._teardown(key, obj)
        refused = self._refused(obj)
        if refused:  # before the finalizer: nothing was made, nothing to clean up
            self._write_status(key, obj, self._status(obj, ("False", "NotAllowed", refused)))
            log.warning("GCE resource refused", extra=kv(kind=self.kind, key=key, reason=refused))
            return None
        owner = self.owner(obj)
        if self.finalizer not in (md.get("finalizers") or []):
            written = update_if_changed(self.client, self._obj_path(obj), obj,
                                        lambda o: o["metadata"].setdefault("finalizers", []).append(self.finalizer))
            self.rw.remember(key, obj, written)
            obj = written
        status = obj.get("status") or {}
        kind, project, location = self.scope(obj)
        creating = f"creating {self.kind} {md['name']}"
        if status.get("operationName") and status.get("operationType") == "CREATE":
            op = self.gce.operation(kind, project, location, status["operationName"])
            if not op.done:
                return Result(requeue_after=self.settings.poll)
            if op.error_code and op.error_code != 409:  # 409: it exists; whose it is is checked below
                transient = op.error_code not in TERMINAL
                self._write_status(key, obj, self._status(obj, ("False", "Provisioning" if transient else
                                                                "OperationFailed",
                                                                f"GCE {op.error_code}: {op.error_message}"),
                                                          requestId=None))
                log.warning("GCE operation failed", extra=kv(kind=self.kind, key=key, code=op.error_code,
                                                              error=op.error_message))
                if transient:  # a new request (new id) after the runtime's backoff
                    raise GCEError(op.error_code, f"operation failed: {op.error_message}")
                return None
            # done: the status written below (with the resource's URI) drops the operation
        ready = get_condition(obj, "Ready")
        if ready.get("reason") in TERMINAL_REASONS and ready.get("observedGeneration") == md.get("generation"):
            return None  # GCE refused this spec: retrying cannot help until it changes
        res = self.get(obj)
        if res is None:
            try:
                return self._learn(key, obj, owner, status.get("requestId") or str(uuid.uuid4()), creating)
            except GCEError as e:
                if e.code == 409:  # exists after all: whose it is is checked below
                    res = self.get(obj)
                if res is None:
                    if not e.terminal:
                        raise
                    obj = self.rw.current(key, obj)
                    self._write_status(key, obj, self._status(obj, ("False", "RequestRejected",
                                                                    f"GCE {e.code}: {e.message}"),
                                                              **{self.uri_field: None, "requestId": None}))
                    log.warning("GCE refused the request", extra=kv(kind=self.kind, key=key, code=e.code,
                                                                    error=e.message))
                    return None
        if not owner.owns(res):
            obj = self.rw.current(key, obj)
            self._write_status(key, obj, self._status(obj, ("False", "NotOwned", (
                f"GCE already has {self.kind} {md['name']} in project {project} without this group's ownership "
                f"marker ({owner.token}): it is neither adopted, changed nor deleted")), requestId=None))
            log.warning("GCE resource exists without our marker; left alone", extra=kv(kind=self.kind, key=key))
            return None
        fields, ready, requeue = self.observe(obj, res)
        self._write_status(key, obj, self._status(obj, ready, **{self.uri_field: res.self_link, "requestId": None},
                                                  **fields))
        return Result(requeue_after=requeue) if requeue else None

    def _teardown(self, key: str, obj: dict) -> Result | None:
        """Delete the GCE resource, once every operation of ours on it has finished (a pending
        insert is waited for, a lost one learnt again by its request id), and only when it
        carries the group's marker; ``spec.deletionPolicy: Orphan`` leaves it in GCE."""
        md = obj["metadata"]
        if self.finalizer not in (md.get("finalizers") or []):
            return None
        status = obj.get("status") or {}
        kind, project, location = self.scope(obj)
        owner = self.owner(obj)
        if status.get("operationName"):
            op = self.gce.operation(kind, project, location, status["operationName"])
            if not op.done:
                return Result(requeue_after=self.settings.poll)
            if status.get("operationType") == "CREATE":  # finished: what it made is looked at below
                obj = self._write_status(key, obj, self._status(obj, ("False", "Deleting", "insert finished"),
                                                                requestId=None))
                status = obj["status"]
            elif op.error_code and op.error_code != 404:
                self._write_status(key, obj, self._status(obj, ("False", "OperationFailed",
                                                                f"delete: GCE {op.error_code}: {op.error_message}")))
                return Result(requeue_after=3 * self.settings.poll)  # in use a little longer: try again
        orphan = (obj.get("spec") or {}).get("deletionPolicy") == "Orphan" and \
            self.settings.policy.orphan_allowed(md["namespace"])  # the operator's decision, not the child's
        if orphan or owner is None:
            return self._release(key, obj, "GCE resource orphaned")
        res = self.get(obj)  # even with nothing recorded: a crash may have lost the operation's name
        if res is None and status.get("requestId") and not status.get(self.uri_field):
            # an insert may have been accepted and its answer lost: the same request id answers
            # with its operation (or makes the resource now, deleted next)
            try:
                return self._learn(key, obj, owner, status["requestId"], f"insert of {md['name']} being finished")
            except GCEError as e:
                if not e.terminal:
                    raise
                res = self.get(obj)
        if res is not None and not owner.owns(res):
            log.warning("GCE resource without our marker left alone", extra=kv(kind=self.kind, key=key))
            res = None
        if res is not None:
            try:
                name = self.delete(obj)
            except GCEError as e:
                if e.not_found:
                    name = None
                elif e.terminal:
                    self._write_status(key, obj, self._status(obj, ("False", "RequestRejected",
                                                                    f"delete: GCE {e.code}: {e.message}")))
                    return Result(requeue_after=3 * self.settings.poll)
                else:
                    raise
            if name:
                st = self._status(obj, ("False", "Deleting", f"deleting {self.kind} {md['name']}"))
                st.update(operationName=name, operationType="DELETE")
                self._write_status(key, obj, st)
                log.info("GCE resource deleting", extra=kv(kind=self.kind, key=key, operation=name))
                return Result(requeue_after=self.settings.poll)
        return self._release(key, obj, "GCE resource deleted")

    def _release(self, key: str, obj: dict, what: str) -> None:
        md = obj["metadata"]
        self.client.request("PUT", self._obj_path(obj), body={
            **obj, "metadata": {**md, "finalizers": [f for f in md.get("finalizers") or [] if f != self.finalizer]}})
        self.rw.forget(key)
        log.info(what, extra=kv(kind=self.kind, key=key))
        return None


class WorkloadPolicyReconciler(ChildReconciler):
    kind, plural = "WorkloadPolicy", "workloadpolicies"

    def scope(self, obj):
        return "regions", obj["spec"]["project"], obj["spec"]["region"]

    def place(self, obj):
        return obj["spec"]["project"], None, obj["spec"]["region"]

    def get(self, obj):
        s = obj["spec"]
        return self.gce.get_policy(s["project"], s["region"], obj["metadata"]["name"])

    def insert(self, obj, owner, request_id):
        s = obj["spec"]
        return self.gce.insert_policy(s["project"], s["region"], obj["metadata"]["name"],
                                      s.get("type") or "HIGH_THROUGHPUT", s["acceleratorTopology"], owner, request_id)

    def delete(self, obj):
        s = obj["spec"]
        return self.gce.delete_policy(s["project"], s["region"], obj["metadata"]["name"])


class InstanceTemplateReconciler(ChildReconciler):
    kind, plural = "InstanceTemplate", "instancetemplates"

    def scope(self, obj):
        return "global", obj["spec"]["project"], ""

    def place(self, obj):
        return obj["spec"]["project"], None, None

    def get(self, obj):
        return self.gce.get_template(obj["spec"]["project"], obj["metadata"]["name"])

    def insert(self, obj, owner, request_id):
        s = obj["spec"]
        return self.gce.insert_template(s["project"], obj["metadata"]["name"], s, dict(s.get("metadata") or {}),
                                        owner, request_id)

    def delete(self, obj):
        return self.gce.delete_template(obj["spec"]["project"], obj["metadata"]["name"])

    def allowed(self, obj):
        """What runs on the VMs, checked again here: a template is what GCE boots. The controller's
        own ``kube-labels`` and its bootstrap ``startup-script`` are the only keys it adds."""
        namespace, spec = obj["metadata"]["namespace"], obj["spec"]
        md = spec.get("metadata") or {}
        own = ("kube-labels",) + (("startup-script",) if is_startup_script(md.get("startup-script", "")) else ())
        refused = self.settings.policy.instance(namespace, spec, "spec", controller_keys=own)
        return "; ".join(map(str, refused)) or None


class ManagedInstanceGroupReconciler(ChildReconciler):
    kind, plural, uri_field = "ManagedInstanceGroup", "managedinstancegroups", "url"

    def scope(self, obj):
        return "zones", obj["spec"]["project"], obj["spec"]["location"]

    def place(self, obj):
        return obj["spec"]["project"], obj["spec"]["location"], None

    def get(self, obj):
        s = obj["spec"]
        return self.gce.get_mig(s["project"], s["location"], obj["metadata"]["name"])

    def insert(self, obj, owner, request_id):
        s = obj["spec"]
        return self.gce.insert_mig(s["project"], s["location"], obj["metadata"]["name"], s, owner, request_id)

    def delete(self, obj):
        s = obj["spec"]
        return self.gce.delete_mig(s["project"], s["location"], obj["metadata"]["name"])

    def allowed(self, obj):
        """The VMs boot from the group's own InstanceTemplate child (same namespace, same group)
        or from a template the operator allows (``instanceTemplates``), never another's."""
        ns, spec = obj["metadata"]["namespace"], obj["spec"]
        path = spec["instanceTemplate"].removeprefix(BASE)
        rule = self.settings.policy.rule(ns)
        if rule is not None and matches(rule.instance_templates, path):
            return None
        own = f"projects/{spec['project']}/global/instanceTemplates/"
        child = None
        if path.startswith(own) and "/" not in path[len(own):]:
            try:
                child = self.client.request("GET", custom_path(GROUP, VERSION, "instancetemplates", ns,
                                                               path[len(own):]))
            except KubeError as e:
                if not is_not_found(e):
                    raise
        if child is not None and self.owner(child) == self.owner(obj):
            return None
        return (f"spec.instanceTemplate: {path!r} is neither the group's own InstanceTemplate nor allowed in "
                f"namespace {ns} (instanceTemplates)")

    def observe(self, obj, res):
        if res.status.is_stable:
            return {"isStable": True}, ("True", "Created", f"{obj['metadata']['name']} is stable"), None
        s = obj["spec"]
        errors = []
        for mi in self.gce.managed_instances(s["project"], s["location"], obj["metadata"]["name"]):
            for e in mi.last_attempt.errors.errors:
                errors.append(f"{short(mi.instance) or mi.name}: {e.code}: {e.message}")
        if errors:
            return ({"isStable": False}, ("False", "InstancesCreationFailed", "; ".join(sorted(set(errors)))[:4000]),
                    self.settings.poll)
        return {"isStable": False}, ("False", "Unstable", "instances are being created"), self.settings.poll
