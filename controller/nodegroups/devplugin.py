"""Our device plugin on the nodes of TPU node groups: the DaemonSet the controller creates in its
namespace when missing, and deletes (only the one it made) when the last group goes."""

from __future__ import annotations

import logging

from accelnode.kube.client import Client, KubeError, is_conflict, is_not_found
from accelnode.log import kv

from controller.nodegroups.common import LABEL_ACCELERATOR, Settings

log = logging.getLogger("accelnode.controller.nodegroups")

DEVICE_PLUGIN = "accelnode-tpu-device-plugin"
MANAGED_BY = {"app.kubernetes.io/managed-by": "accelnode-controller"}


def path(settings: Settings) -> str:
    return f"/apis/apps/v1/namespaces/{settings.namespace}/daemonsets"


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


def ensure(client: Client, cache, settings: Settings) -> None:
    if cache.get(path(settings), f"{settings.namespace}/{DEVICE_PLUGIN}") is not None:
        return
    try:
        client.request("POST", path(settings), body=device_plugin_daemonset(settings.namespace,
                                                                             settings.device_plugin_image))
        log.info("device plugin DaemonSet created", extra=kv(namespace=settings.namespace))
    except KubeError as e:
        if not is_conflict(e):
            raise


def remove(client: Client, cache, settings: Settings) -> None:
    """Delete the DaemonSet if the controller made it (labelled managed-by us)."""
    ds = cache.get(path(settings), f"{settings.namespace}/{DEVICE_PLUGIN}")
    if ds is None or (ds["metadata"].get("labels") or {}).get("app.kubernetes.io/managed-by") != \
            MANAGED_BY["app.kubernetes.io/managed-by"]:
        return
    try:
        client.request("DELETE", f"{path(settings)}/{DEVICE_PLUGIN}")
    except KubeError as e:
        if not is_not_found(e):
            raise
