"""TPU node groups on GCE: the parent ``TPUNodeGroup`` reconciler and its three child reconcilers,
``WorkloadPolicy``, ``InstanceTemplate`` and ``ManagedInstanceGroup`` (docs/tpu-node-groups.md).

* A child (:class:`ChildReconciler`) owns one GCE resource: insert, keep the operation's name in
  its status, poll it on later reconciles (a worker never blocks on GCE), delete it through a
  finalizer. A terminal GCE answer is a ``Ready=False`` condition, not retried for that
  generation; a transient one raises and the runtime retries with backoff.
* The parent offers the join metadata (:class:`controller.nodegroups.jointokens.JoinTokens`) to
  a RUNNING instance whose Node has not joined, takes it back once the Node exists, and labels
  and taints the Node.
* Every write is made only when something changed: in steady state neither GCE nor the API
  server sees one.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import uuid
from dataclasses import dataclass

from accelnode import IMAGE
from accelnode.gce.metadata import kube_labels
from accelnode.kube.bootstraptoken import METADATA_KEYS
from accelnode.kube.client import Client, KubeError, custom_path, is_conflict, is_not_found, is_too_many_requests
from accelnode.log import kv

from controller.nodegroups import generations
from controller.nodegroups.compute import BASE, GCE, TERMINAL, GCEError, Owner
from controller.runtime import events
from controller.runtime.reconciler import Reconciler, Result, Watch, object_key, split_key
from controller.runtime.writes import ReadYourWrites, update_if_changed, update_status

log = logging.getLogger("accelnode.controller.nodegroups")

GROUP, VERSION = "tpu.google.com", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
TNG = custom_path(GROUP, VERSION, "tpunodegroups")
NODES = "/api/v1/nodes"
GROUP_FINALIZER = "tpu.google.com/nodegroup-cleanup"
DRAIN_ANNOTATION = "tpu.google.com/drain-started"

LABEL_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
LABEL_COUNT = "cloud.google.com/gke-accelerator-count"
LABEL_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
LABEL_GROUP = "cloud.google.com/tpu-node-group"
TAINT = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}
DEVICE_PLUGIN = "accelnode-tpu-device-plugin"
MANAGED_BY = {"app.kubernetes.io/managed-by": "accelnode-controller"}
TERMINAL_REASONS = ("RequestRejected", "OperationFailed")
CHILD_FAILURES = (*TERMINAL_REASONS, "NotOwned", "NotAllowed")  # a child that will not come up as it is


@dataclass
class Settings:
    namespace: str = "accelnode-system"  # where the device-plugin DaemonSet goes
    poll: float = 10.0  # operation polls, joining nodes
    drain_timeout: float = 300.0  # bounded wait for evictions at teardown
    device_plugin_image: str = IMAGE
    api_server_port: int = 6443  # with bootstrapKubernetes.controlPlaneIP: where the VMs join
    # Where groups may put resources: namespace (or "*", every other one) -> {"projects": [...],
    # optional "zones": [...]}. None: the controller's own project (own_project) only, any zone.
    placement: dict | None = None
    own_project: str | None = None
    cluster: str = ""  # the cluster's id in ownership markers; "": the kube-system Namespace's UID


def cluster_id(client: Client, settings: Settings) -> str:
    """The cluster's id in the ownership marker of our GCE resources: ``settings.cluster``, or
    the UID of the ``kube-system`` Namespace (read once; it lives as long as the cluster)."""
    if not settings.cluster:
        settings.cluster = client.request("GET", "/api/v1/namespaces/kube-system")["metadata"]["uid"]
    return settings.cluster


def placement_problem(settings: Settings, namespace: str, project: str, zone: str | None = None,
                      region: str | None = None) -> str | None:
    """Why a group in ``namespace`` may not use ``project`` (and ``zone`` or ``region``); None
    when it may. The operator's configuration decides, never the namespace's user."""
    rules = settings.placement
    if rules is None:
        rules = {"*": {"projects": [settings.own_project]}} if settings.own_project else {}
    rule = rules.get(namespace) or rules.get("*")
    if not rule:
        return (f"namespace {namespace} may not create node groups in any GCE project: the operator allows "
                "projects per namespace (--node-group-placement, --gce-project; docs/security.md)")
    if project not in (rule.get("projects") or []):
        return f"GCE project {project!r} is not allowed for namespace {namespace} (allowed: {rule.get('projects')})"
    zones = rule.get("zones")
    if zones is not None and zone is not None and zone not in zones:
        return f"zone {zone!r} is not allowed for namespace {namespace} (allowed: {zones})"
    if zones is not None and region is not None and not any(z.rsplit("-", 1)[0] == region for z in zones):
        return f"region {region!r} is not allowed for namespace {namespace} (allowed zones: {zones})"
    return None


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def condition(conds: list[dict], kind: str, status: str, reason: str, message: str, generation=None) -> list[dict]:
    """``conds`` with condition ``kind`` set; ``lastTransitionTime`` moves only when its status
    or reason does."""
    old = next((c for c in conds if c.get("type") == kind), None)
    new = {"type": kind, "status": status, "reason": reason, "message": message[:32000],
           "lastTransitionTime": now_rfc3339()}
    if old and old.get("status") == status and old.get("reason") == reason:
        new["lastTransitionTime"] = old.get("lastTransitionTime") or new["lastTransitionTime"]
    if isinstance(generation, int):
        new["observedGeneration"] = generation
    return [c for c in conds if c.get("type") != kind] + [new] if old is None else \
        [new if c.get("type") == kind else c for c in conds]


def get_condition(obj: dict | None, kind: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def short(url: str) -> str:
    return url.rsplit("/", 1)[-1]


# ---------------------------------------------------------------------------------------------
# children


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
        return placement_problem(self.settings, obj["metadata"]["namespace"], *self.place(obj))

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
        if (obj.get("spec") or {}).get("deletionPolicy") == "Orphan" or owner is None:
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


# ---------------------------------------------------------------------------------------------
# the group


def device_plugin_daemonset(namespace: str, image: str) -> dict:
    """Our device plugin (daemonsets/device-plugin.yaml) on every node a group labelled."""
    labels = {"app.kubernetes.io/name": DEVICE_PLUGIN, "app.kubernetes.io/part-of": "accelnode"}
    mounts = [("dev", "/dev", False, "Directory"), ("sys", "/sys", True, "Directory"),
              ("device-plugins", "/var/lib/kubelet/device-plugins", False, "DirectoryOrCreate"),
              ("udev", "/run/udev", True, "DirectoryOrCreate")]
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": DEVICE_PLUGIN, "namespace": namespace, "labels": {**labels, **MANAGED_BY}},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": DEVICE_PLUGIN}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "priorityClassName": "system-node-critical", "hostNetwork": True,
                    "serviceAccountName": "accelnode-device-plugin",  # rbac-device-plugin.yaml: its Node's labels
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [  # as daemonsets/device-plugin.yaml: off GKE pools
                            {"key": LABEL_ACCELERATOR, "operator": "Exists"},
                            {"key": "cloud.google.com/gke-nodepool", "operator": "DoesNotExist"}]}]}}},
                    "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"},
                                    {"operator": "Exists", "effect": "NoExecute"}],
                    "containers": [{
                        "name": "device-plugin", "image": image, "command": ["accelnode", "device-plugin"],
                        "env": [{"name": "ACCELNODE_SYSFS_ROOT", "value": "/sys"},
                                {"name": "ACCELNODE_DEV_ROOT", "value": "/dev"},
                                {"name": "ACCELNODE_KUBELET_DIR", "value": "/var/lib/kubelet/device-plugins"},
                                {"name": "ACCELNODE_METRICS_ADDRESS", "value": "127.0.0.1:2112"},
                                {"name": "ACCELNODE_NODE_NAME",  # the slice facts: the Node's labels
                                 "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                        "resources": {"requests": {"cpu": "20m", "memory": "48Mi"}, "limits": {"memory": "96Mi"}},
                        "securityContext": {"runAsUser": 0, "allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
                        "volumeMounts": [{"name": n, "mountPath": p, **({"readOnly": True} if ro else {})}
                                         for n, p, ro, _ in mounts]}],
                    "volumes": [{"name": n, "hostPath": {"path": p, "type": t}} for n, p, _, t in mounts]}}}}


def mig_name_of(g: dict) -> str:
    """The group's MIG: its VMs are named ``<this>-<4 characters>`` (GCE's base instance name)."""
    md = g["metadata"]
    return f"{md['name']}-mig-{hashlib.sha256(md['uid'].encode()).hexdigest()[:8]}"


def is_group_node(g: dict, node: dict) -> bool:
    """Whether ``node`` is a VM of group ``g``, by its providerID alone (project, zone and the
    MIG's instance names): found after a restart, labelled or not."""
    m = re.fullmatch(r"gce://([^/]+)/([^/]+)/([^/]+)", (node.get("spec") or {}).get("providerID") or "")
    spec = g.get("spec") or {}
    return bool(m and m[1] == spec.get("project") and m[2] == spec.get("nodeLocation")
                and re.fullmatch(re.escape(mig_name_of(g)) + r"-[a-z0-9]{4}", m[3]))


STARTUP_SCRIPT = """#!/bin/sh
# accelnode TPU node group {group}: join the cluster with kubeadm, Kubernetes {version}
# (the image carries kubeadm and kubelet of that version; docs/bootstrap.md).
exec /usr/local/bin/accelnode bootstrap --log-format text
"""


class TPUNodeGroupReconciler(Reconciler):
    name = "tpunodegroups"

    def __init__(self, client: Client, gce: GCE, settings: Settings, tokens=None):
        self.client, self.gce, self.settings = client, gce, settings
        self.rw = ReadYourWrites()
        self._tokens = tokens  # controller.nodegroups.jointokens.JoinTokens, made on first use
        self._withdrawn: set[str] = set()  # providerIDs whose join metadata is known gone
        self._pending_meta: dict[str, str] = {}  # instance path -> setMetadata operation
        self._labels: dict[str, dict] = {}  # providerID -> the VM's kube-labels
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
            Watch(f"/apis/apps/v1/namespaces/{settings.namespace}/daemonsets",
                  query={"fieldSelector": f"metadata.name={DEVICE_PLUGIN}"},
                  keys=lambda _o: [object_key(g) for g in self.cache.list(TNG)]),
        )

    # -- mapping -------------------------------------------------------------------------------

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
        refused = placement_problem(self.settings, ns, project, zone)
        if refused:
            self._set_status(key, g, condition(conds, "Ready", "False", "NotAllowed", refused, gen))
            log.warning("node group refused", extra=kv(group=key, reason=refused))
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
        summary, message, again = self._nodes(key, box, project, zone, mig_name, labels)
        g = box[0]
        self._ensure_device_plugin()
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
        spec = {**spec, "deletionPolicy": g["spec"].get("deletionPolicy") or "Delete"}
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

    # -- instances and nodes -------------------------------------------------------------------

    def _nodes(self, key: str, box: list, project: str, zone: str, mig: str, labels: dict):
        """Offer the join to RUNNING VMs of the group's MIG, label their Nodes. ``box[0]`` is the
        group, replaced when the join tokens' ledger in its status is written."""
        boot = box[0]["spec"].get("bootstrapKubernetes")
        nodes = {(n.get("spec") or {}).get("providerID"): n for n in self.cache.list(NODES)}
        ready = reconciling = failed = 0
        problems, again, joining = [], None, False
        for mi in self.gce.managed_instances(project, zone, mig):
            inst = short(mi.instance) if mi.instance else mi.name
            errors = [f"{inst}: {e.code}: {e.message}" for e in mi.last_attempt.errors.errors]
            if errors and not mi.instance_status:
                failed += 1
                problems += errors
                continue
            pid = f"gce://{project}/{zone}/{inst}"
            node = nodes.get(pid)
            if node is None:
                reconciling += 1
                status = mi.instance_status or "PROVISIONING"
                if boot and status == "RUNNING":
                    joining = True
                    ip, port = boot["controlPlaneIP"], self.settings.api_server_port
                    endpoint = ip if port == 6443 else (f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
                    again = self._offer_join(key, box, project, zone, mig, inst, endpoint) or again
                elif status != "RUNNING":
                    problems.append(f"{inst} is {status}")
                continue
            if boot and pid not in self._withdrawn:
                self._withdraw_join(project, zone, inst, pid)
            self._label(node, pid, project, zone, inst, labels)
            conds = (node.get("status") or {}).get("conditions") or []
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds):
                ready += 1
            else:
                reconciling += 1
        if not joining:
            self._revoke(key, box)
        return {"ready": ready, "reconciling": reconciling, "failed": failed}, "; ".join(problems)[:4000], again

    def _reserve(self, key: str, box: list, ids: list[str]) -> None:
        """Record the group's join token ids (its ledger: the only Secrets it may read or delete)."""
        g = box[0]
        written = update_status(self.client, self._path(key), g, {**(g.get("status") or {}), "joinTokens": ids})
        if written is not None:
            self.rw.remember(key, g, written)
            box[0] = written

    def _revoke(self, key: str, box: list) -> None:
        ids = (box[0].get("status") or {}).get("joinTokens") or []
        if ids:
            self._join_tokens().revoke(key, ids)
            self._reserve(key, box, [])

    def _join_tokens(self):
        if self._tokens is None:
            from controller.nodegroups.jointokens import JoinTokens

            cm = self.client.request("GET", "/api/v1/namespaces/kube-system/configmaps/kube-root-ca.crt")
            self._tokens = JoinTokens(self.client, ca_pem=cm["data"]["ca.crt"].encode())
        return self._tokens

    def _meta_op_pending(self, project: str, zone: str, inst: str) -> bool:
        path = f"{project}/{zone}/{inst}"
        op = self._pending_meta.get(path)
        if op is None:
            return False
        if self.gce.operation("zones", project, zone, op).done:
            del self._pending_meta[path]
            return False
        return True

    def _set_items(self, project: str, zone: str, inst: str, change) -> bool:
        """Apply ``change(items) -> items`` to the instance's metadata with its fingerprint;
        a 412 (someone wrote in between) re-reads and tries again. Whether it wrote."""
        for _ in range(5):
            res = self.gce.get_instance(project, zone, inst)
            if res is None:
                return False
            items = {i.key: i.value for i in res.metadata.items}
            wanted = change(dict(items))
            if wanted == items:
                return False
            try:
                op = self.gce.set_metadata(project, zone, inst, res.metadata.fingerprint, wanted)
            except GCEError as e:
                if e.code == 412:
                    continue
                raise
            self._pending_meta[f"{project}/{zone}/{inst}"] = op
            return True
        raise GCEError(503, f"instance {inst}: metadata kept changing under five attempts (412)")

    def _offer_join(self, key: str, box: list, project: str, zone: str, mig: str, inst: str,
                    control_plane: str) -> float | None:
        if self._meta_op_pending(project, zone, inst):
            return 1.0
        tokens = self._join_tokens()
        taken = {t for o in self.cache.list(TNG) if object_key(o) != key
                 for t in (o.get("status") or {}).get("joinTokens") or []}
        info = tokens.ensure(key, control_plane, list((box[0].get("status") or {}).get("joinTokens") or []), taken,
                             lambda ids: self._reserve(key, box, ids))
        if not tokens.signed(info):  # the bootstrap signer signs cluster-info within seconds
            return 1.0

        def offer(items: dict) -> dict:
            # only to a VM our MIG made (GCE writes the MIG into created-by): never to another's
            if not items.get("created-by", "").endswith(f"/zones/{zone}/instanceGroupManagers/{mig}"):
                log.warning("VM not made by the group's MIG: no join token for it", extra=kv(group=key, instance=inst))
                return items
            return {**items, **info.metadata_items()}
        if self._set_items(project, zone, inst, offer):
            log.info("join metadata offered", extra=kv(group=key, instance=inst, bootstrap_id=info.token_id))
        return None

    def _withdraw_join(self, project: str, zone: str, inst: str, pid: str) -> None:
        if self._meta_op_pending(project, zone, inst):
            return
        if self._set_items(project, zone, inst, lambda items: {k: v for k, v in items.items() if k not in METADATA_KEYS}):
            log.info("join metadata withdrawn", extra=kv(instance=inst))
            return
        self._withdrawn.add(pid)

    def _label(self, node: dict, pid: str, project: str, zone: str, inst: str, labels: dict) -> None:
        if pid not in self._labels:
            res = self.gce.get_instance(project, zone, inst)
            items = {i.key: i.value for i in res.metadata.items} if res is not None else {}
            self._labels[pid] = kube_labels(items.get("kube-labels", ""))
        wanted = {**self._labels[pid], **labels}

        def mutate(n):
            n["metadata"].setdefault("labels", {}).update(wanted)
            taints = n.setdefault("spec", {}).setdefault("taints", [])
            if not any(t.get("key") == TAINT["key"] and t.get("effect") == TAINT["effect"] for t in taints):
                taints.append(dict(TAINT))
        if update_if_changed(self.client, f"{NODES}/{node['metadata']['name']}", node, mutate) is not None:
            log.info("node labelled", extra=kv(node=node["metadata"]["name"], group=labels[LABEL_GROUP]))

    def _ensure_device_plugin(self) -> None:
        path = f"/apis/apps/v1/namespaces/{self.settings.namespace}/daemonsets"
        if self.cache.get(path, f"{self.settings.namespace}/{DEVICE_PLUGIN}") is not None:
            return
        try:
            self.client.request("POST", path, body=device_plugin_daemonset(self.settings.namespace,
                                                                           self.settings.device_plugin_image))
            log.info("device plugin DaemonSet created", extra=kv(namespace=self.settings.namespace))
        except KubeError as e:
            if not is_conflict(e):
                raise

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
        self._revoke(key, box)
        log.info("node group orphaned: its GCE resources stay", extra=kv(group=key))
        return box[0]

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

        if g["spec"].get("deletionPolicy") == "Orphan":
            return self._release(key, self._orphan(key, g))
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
            left = self._drain(nodes)
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
        self._revoke(key, box)
        g = box[0]
        others = [o for o in self.cache.list(TNG) if object_key(o) != key and not o["metadata"].get("deletionTimestamp")]
        if not others:
            path = f"/apis/apps/v1/namespaces/{self.settings.namespace}/daemonsets"
            ds = self.cache.get(path, f"{self.settings.namespace}/{DEVICE_PLUGIN}")
            if ds is not None and (ds["metadata"].get("labels") or {}).get("app.kubernetes.io/managed-by") == \
                    MANAGED_BY["app.kubernetes.io/managed-by"]:
                try:
                    self.client.request("DELETE", f"{path}/{DEVICE_PLUGIN}")
                except KubeError as e:
                    if not is_not_found(e):
                        raise
        for n in nodes:
            pid = (n.get("spec") or {}).get("providerID")
            self._withdrawn.discard(pid)
            self._labels.pop(pid, None)
        return self._release(key, g)

    def _release(self, key: str, g: dict) -> None:
        md = g["metadata"]
        self.client.request("PUT", self._path(key), body={
            **g, "metadata": {**md, "finalizers": [f for f in md.get("finalizers") or [] if f != GROUP_FINALIZER]}})
        self._machine.pop(key, None)
        self.rw.forget(key)
        log.info("node group released", extra=kv(group=key))
        return None

    def _drain(self, nodes: list[dict]) -> list[str]:
        """Evict the pods on ``nodes`` through the Eviction API (PodDisruptionBudgets decide);
        the pods still there."""
        left = []
        for n in nodes:
            pods = self.client.list("/api/v1/pods", query={"fieldSelector": f"spec.nodeName={n['metadata']['name']}"})
            for p in pods.get("items") or []:
                pm = p["metadata"]
                if any(r.get("kind") == "DaemonSet" for r in pm.get("ownerReferences") or []):
                    continue
                if "kubernetes.io/config.mirror" in (pm.get("annotations") or {}):
                    continue
                if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                left.append(f"{pm['namespace']}/{pm['name']}")
                if pm.get("deletionTimestamp"):
                    continue
                try:
                    self.client.request("POST", f"/api/v1/namespaces/{pm['namespace']}/pods/{pm['name']}/eviction",
                                        body={"apiVersion": "policy/v1", "kind": "Eviction",
                                              "metadata": {"name": pm["name"], "namespace": pm["namespace"]}})
                except KubeError as e:
                    if not (is_not_found(e) or is_too_many_requests(e)):  # 429: a PodDisruptionBudget says not now
                        raise
        return left


def reconcilers(client: Client, settings: Settings, gce: GCE) -> list[Reconciler]:
    return [WorkloadPolicyReconciler(client, gce, settings), InstanceTemplateReconciler(client, gce, settings),
            ManagedInstanceGroupReconciler(client, gce, settings), TPUNodeGroupReconciler(client, gce, settings)]
