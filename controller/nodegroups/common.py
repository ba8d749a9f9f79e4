"""What the node-group modules share: the API's names, the node labels, the operator's
:class:`Settings` and conditions (docs/tpu-node-groups.md)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from accelnode import IMAGE
from accelnode.kube.client import Client, custom_path

from controller.nodegroups.policy import Policy

GROUP, VERSION = "tpu.google.com", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
TNG = custom_path(GROUP, VERSION, "tpunodegroups")
NODES = "/api/v1/nodes"

LABEL_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
LABEL_COUNT = "cloud.google.com/gke-accelerator-count"
LABEL_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
LABEL_GROUP = "cloud.google.com/tpu-node-group"
TAINT = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}
TERMINAL_REASONS = ("RequestRejected", "OperationFailed")
CHILD_FAILURES = (*TERMINAL_REASONS, "NotOwned", "NotAllowed")  # a child that will not come up as it is

STARTUP_SCRIPT = """#!/bin/sh
# accelnode TPU node group {group}: join the cluster with kubeadm, Kubernetes {version}
# (the image carries kubeadm and kubelet of that version; docs/bootstrap.md).
exec /usr/local/bin/accelnode bootstrap --log-format text
"""
_NAME = r"[a-z0-9][-a-z0-9.]*"
_STARTUP_SCRIPT_RE = re.compile(re.escape(STARTUP_SCRIPT).replace(r"\{group\}", f"{_NAME}/{_NAME}")
                                .replace(r"\{version\}", r"1\.[0-9]+"))


def is_startup_script(value: str) -> bool:
    """Whether ``value`` is the controller's own ``startup-script`` (for some group and version)."""
    return bool(_STARTUP_SCRIPT_RE.fullmatch(value or ""))


@dataclass
class Settings:
    namespace: str = "accelnode-system"  # where the device-plugin DaemonSet goes
    poll: float = 10.0  # operation polls, joining nodes
    drain_timeout: float = 300.0  # bounded wait for evictions at teardown
    device_plugin_image: str = IMAGE
    api_server_port: int = 6443  # with bootstrapKubernetes.controlPlaneIP: where the VMs join
    # The operator's rules (controller/nodegroups/policy.py): namespace (or "*") -> {"projects": [...],
    # "zones", "images", "serviceAccounts", "subnetworks", "metadata", "instanceTemplates",
    # "deletionPolicies", "maxJoinTokens"}. None: the controller's own project (own_project) only.
    placement: dict | None = None
    own_project: str | None = None
    cluster: str = ""  # the cluster's id in ownership markers; "": the kube-system Namespace's UID
    policy: Policy = field(init=False)

    def __post_init__(self):
        self.policy = Policy.parse(self.placement) if self.placement is not None else \
            Policy.own_project(self.own_project)


def cluster_id(client: Client, settings: Settings) -> str:
    """The cluster's id in the ownership marker of our GCE resources: ``settings.cluster``, or
    the UID of the ``kube-system`` Namespace (read once; it lives as long as the cluster)."""
    if not settings.cluster:
        settings.cluster = client.request("GET", "/api/v1/namespaces/kube-system")["metadata"]["uid"]
    return settings.cluster


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
