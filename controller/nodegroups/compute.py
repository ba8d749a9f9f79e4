"""The GCE Compute API as the TPU node-group reconcilers use it, through Google's official
``google-cloud-compute`` client, imported on first use (docs/tpu-node-groups.md).

Invariant: no call holds a worker. Mutations return the operation's name at once and the
reconcilers poll it with :meth:`GCE.operation` (the client's ``ExtendedOperation.result()``
would block); calls carry a deadline and none of the client's own retries, so the runtime's
per-key backoff retries instead. :class:`GCEError` says whether a failure is ``terminal`` (the
request is wrong) or transient. ``endpoint`` points every client at another host with anonymous
credentials (the emulator, tests/rigs/gce.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

BASE = "https://www.googleapis.com/compute/v1/"
TERMINAL = (400, 403, 404, 409, 412)


class GCEError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"GCE {code}: {message}" if code else f"GCE unreachable: {message}")
        self.code, self.message = code, message

    @property
    def terminal(self) -> bool:
        return self.code in TERMINAL

    @property
    def not_found(self) -> bool:
        return self.code == 404


@dataclass(frozen=True)
class Owner:
    """The ownership marker of the GCE resources a node group makes: the cluster's id (the
    ``kube-system`` namespace's UID) and the group's UID, in the ``description`` of every resource
    and, where GCE has labels (instance templates, so their VMs), in labels too. Nothing without
    it is adopted, changed or deleted (docs/security.md)."""

    cluster: str
    group_uid: str
    group: str = ""  # namespace/name, for people reading the description

    @property
    def token(self) -> str:
        return f"accelnode-owner={self.cluster}/{self.group_uid}"

    @property
    def description(self) -> str:
        return f"accelnode TPU node group {self.group} {self.token}".replace("  ", " ")

    @property
    def labels(self) -> dict[str, str]:
        return {"accelnode-cluster": self.cluster[:63], "accelnode-group-uid": self.group_uid[:63]}

    def owns(self, res) -> bool:
        """Whether the GCE resource ``res`` carries this marker."""
        return self.token in (getattr(res, "description", "") or "").split()


@dataclass
class Operation:
    name: str
    done: bool
    error_code: int  # HTTP status of a failed operation, 0 when it succeeded or runs
    error_message: str


def scope_of(url: str) -> tuple[str, str, str]:
    """(kind, project, location) of a resource/operation URL or path: kind is ``zones``,
    ``regions`` or ``global``."""
    parts = url.removeprefix(BASE).split("/")
    project = parts[1]
    if parts[2] == "global":
        return "global", project, ""
    return parts[2], project, parts[3]


class GCE:
    def __init__(self, endpoint: str | None = None, *, counters=None, timeout: float = 30.0):
        self.endpoint = endpoint
        self.timeout = timeout  # one call; no retries inside it: the core's per-key backoff retries
        self._clients: dict[str, object] = {}
        self._lock = threading.Lock()
        self.writes = 0
        self.reads = 0
        self._counters = counters  # optional callable(kind: "read"|"write", method: str)

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def compute(self):
        from google.cloud import compute_v1

        return compute_v1

    def _client(self, name: str):
        with self._lock:
            c = self._clients.get(name)
            if c is None:
                kw = {}
                if self.endpoint:
                    from google.auth.credentials import AnonymousCredentials

                    kw = {"credentials": AnonymousCredentials(), "client_options": {"api_endpoint": self.endpoint}}
                c = self._clients[name] = getattr(self.compute, name)(**kw)
            return c

    def _call(self, write: bool, method: str, fn, *args, **kw):
        from google.api_core import exceptions as gexc

        with self._lock:
            if write:
                self.writes += 1
            else:
                self.reads += 1
        if self._counters is not None:
            self._counters("write" if write else "read", method)
        try:
            return fn(*args, **{"retry": None, "timeout": self.timeout, **kw})
        except gexc.GoogleAPICallError as e:
            code = int(e.code) if isinstance(e.code, int) else 0
            raise GCEError(code, e.message or str(e)) from None
        except gexc.RetryError as e:
            raise GCEError(0, str(e)) from None
        except Exception as e:  # requests' connection errors and the like: transient
            if isinstance(e, GCEError):
                raise
            raise GCEError(0, f"{type(e).__name__}: {e}") from None

    def _get(self, client: str, method: str, **kw):
        """The resource, or None when GCE says 404."""
        try:
            return self._call(False, method, getattr(self._client(client), "get"), **kw)
        except GCEError as e:
            if e.not_found:
                return None
            raise

    def _op_name(self, op) -> str:
        return op.name

    def _insert(self, method: str, client: str, request) -> str:
        """An insert carrying a ``requestId``: GCE answers a repeated one with the first one's
        operation, so a caller that lost the answer (a crash, a timeout) learns it again instead
        of creating twice."""
        return self._op_name(self._call(True, method, self._client(client).insert, request=request))

    # -- operations ----------------------------------------------------------------------------

    def operation(self, kind: str, project: str, location: str, name: str) -> Operation:
        if kind == "zones":
            op = self._call(False, "zoneOperations.get", self._client("ZoneOperationsClient").get,
                            project=project, zone=location, operation=name)
        elif kind == "regions":
            op = self._call(False, "regionOperations.get", self._client("RegionOperationsClient").get,
                            project=project, region=location, operation=name)
        else:
            op = self._call(False, "globalOperations.get", self._client("GlobalOperationsClient").get,
                            project=project, operation=name)
        done = op.status == self.compute.Operation.Status.DONE
        code = int(op.http_error_status_code or 0) if done else 0
        message = ""
        if done and op.error and op.error.errors:
            message = "; ".join(f"{e.code}: {e.message}" for e in op.error.errors)
            code = code or 400
        return Operation(op.name, done, code, message)

    # -- resource policies (regional) ----------------------------------------------------------

    def get_policy(self, project: str, region: str, name: str):
        return self._get("ResourcePoliciesClient", "resourcePolicies.get", project=project, region=region,
                         resource_policy=name)

    def insert_policy(self, project: str, region: str, name: str, type_: str, topology: str, owner: Owner,
                      request_id: str) -> str:
        c = self.compute
        body = c.ResourcePolicy(name=name, region=region, description=owner.description,
                                workload_policy=c.ResourcePolicyWorkloadPolicy(type_=type_,
                                                                               accelerator_topology=topology))
        return self._insert("resourcePolicies.insert", "ResourcePoliciesClient", c.InsertResourcePolicyRequest(
            project=project, region=region, resource_policy_resource=body, request_id=request_id))

    def delete_policy(self, project: str, region: str, name: str) -> str:
        return self._op_name(self._call(True, "resourcePolicies.delete", self._client("ResourcePoliciesClient").delete,
                                        project=project, region=region, resource_policy=name))

    # -- instance templates (global) -----------------------------------------------------------

    def get_template(self, project: str, name: str):
        return self._get("InstanceTemplatesClient", "instanceTemplates.get", project=project, instance_template=name)

    def get_template_url(self, url: str):
        """An instance template named by URL (global or regional), or None."""
        parts = url.removeprefix(BASE).split("/")
        if parts[2] == "global":
            return self.get_template(parts[1], parts[-1])
        return self._get("RegionInstanceTemplatesClient", "regionInstanceTemplates.get", project=parts[1],
                         region=parts[3], instance_template=parts[-1])

    def insert_template(self, project: str, name: str, spec: dict, metadata: dict[str, str], owner: Owner,
                        request_id: str) -> str:
        c = self.compute
        sched = c.Scheduling(on_host_maintenance=spec.get("maintenancePolicy") or "TERMINATE",
                             automatic_restart=False)
        model = spec.get("provisioningModel") or ("RESERVATION_BOUND" if spec.get("reservation") else "STANDARD")
        sched.provisioning_model = model
        if model == "SPOT":
            sched.instance_termination_action = "STOP"
        elif model == "RESERVATION_BOUND":
            sched.instance_termination_action = "DELETE"
        init = c.AttachedDiskInitializeParams()
        if spec.get("image"):
            init.source_image = spec["image"]
        if spec.get("bootDiskSizeGB"):
            init.disk_size_gb = int(spec["bootDiskSizeGB"])
        if spec.get("diskType"):
            init.disk_type = spec["diskType"]
        props = c.InstanceProperties(
            machine_type=spec["machineType"],
            disks=[c.AttachedDisk(boot=True, auto_delete=(spec.get("bootDisk") or {}).get("autoDelete", True),
                                  initialize_params=init)],
            scheduling=sched,
            metadata=c.Metadata(items=[c.Items(key=k, value=v) for k, v in sorted(metadata.items())]),
            labels=owner.labels, description=owner.description,
            network_interfaces=[c.NetworkInterface(subnetwork=spec.get("subnetwork") or "default")])
        if spec.get("reservation"):
            props.reservation_affinity = c.ReservationAffinity(
                consume_reservation_type="SPECIFIC_RESERVATION", key="compute.googleapis.com/reservation-name",
                values=[spec["reservation"]])
        if spec.get("networkTags"):
            props.tags = c.Tags(items=list(spec["networkTags"]))
        if spec.get("serviceAccounts"):
            props.service_accounts = [c.ServiceAccount(email=a["email"], scopes=list(a["scopes"]))
                                      for a in spec["serviceAccounts"]]
        body = c.InstanceTemplate(name=name, properties=props, description=owner.description)
        return self._insert("instanceTemplates.insert", "InstanceTemplatesClient", c.InsertInstanceTemplateRequest(
            project=project, instance_template_resource=body, request_id=request_id))

    def delete_template(self, project: str, name: str) -> str:
        return self._op_name(self._call(True, "instanceTemplates.delete", self._client("InstanceTemplatesClient").delete,
                                        project=project, instance_template=name))

    # -- managed instance groups (zonal) -------------------------------------------------------

    def get_mig(self, project: str, zone: str, name: str):
        return self._get("InstanceGroupManagersClient", "instanceGroupManagers.get", project=project, zone=zone,
                         instance_group_manager=name)

    def insert_mig(self, project: str, zone: str, name: str, spec: dict, owner: Owner, request_id: str) -> str:
        c = self.compute
        body = c.InstanceGroupManager(
            name=name, base_instance_name=name, instance_template=spec["instanceTemplate"],
            description=owner.description,
            target_size=int(spec["targetSize"]),
            instance_lifecycle_policy=c.InstanceGroupManagerInstanceLifecyclePolicy(
                default_action_on_failure=spec.get("defaultActionOnFailure") or "DO_NOTHING"))
        if spec.get("targetSizePolicyMode"):
            body.target_size_policy = c.InstanceGroupManagerTargetSizePolicy(mode=spec["targetSizePolicyMode"])
        if spec.get("workloadPolicy"):
            body.resource_policies = c.InstanceGroupManagerResourcePolicies(workload_policy=spec["workloadPolicy"])
        return self._insert("instanceGroupManagers.insert", "InstanceGroupManagersClient",
                            c.InsertInstanceGroupManagerRequest(project=project, zone=zone,
                                                                instance_group_manager_resource=body,
                                                                request_id=request_id))

    def delete_mig(self, project: str, zone: str, name: str) -> str:
        return self._op_name(self._call(True, "instanceGroupManagers.delete",
                                        self._client("InstanceGroupManagersClient").delete,
                                        project=project, zone=zone, instance_group_manager=name))

    def managed_instances(self, project: str, zone: str, mig: str) -> list:
        req = self.compute.ListManagedInstancesInstanceGroupManagersRequest(
            project=project, zone=zone, instance_group_manager=mig)

        def all_pages(retry, timeout):
            return list(self._client("InstanceGroupManagersClient").list_managed_instances(
                request=req, retry=retry, timeout=timeout))
        return self._call(False, "instanceGroupManagers.listManagedInstances", all_pages)

    # -- instances -----------------------------------------------------------------------------

    def get_instance(self, project: str, zone: str, name: str):
        return self._get("InstancesClient", "instances.get", project=project, zone=zone, instance=name)

    def set_metadata(self, project: str, zone: str, name: str, fingerprint: str, items: dict[str, str]) -> str:
        c = self.compute
        body = c.Metadata(fingerprint=fingerprint, items=[c.Items(key=k, value=v) for k, v in items.items()])
        return self._op_name(self._call(True, "instances.setMetadata", self._client("InstancesClient").set_metadata,
                                        project=project, zone=zone, instance=name, metadata_resource=body))
