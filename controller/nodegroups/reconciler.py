"""TPU node groups on GCE: the reconcilers ``accelnode controller --tpu-node-groups`` runs
(docs/tpu-node-groups.md), and the names other modules and tests use from them.

By responsibility:

* :mod:`.policy` — what a namespace's groups may ask of GCE: the operator's rules;
* :mod:`.children` — ``WorkloadPolicy``, ``InstanceTemplate``, ``ManagedInstanceGroup``: one GCE
  resource each;
* :mod:`.group` — ``TPUNodeGroup``: the rules checked, the children made, teardown;
* :mod:`.nodes` — the group's VMs as nodes: membership, join tokens, labels, drain;
* :mod:`.devplugin` — our device plugin's DaemonSet on those nodes;
* :mod:`.common` — names, labels, :class:`Settings`, conditions.
"""

from __future__ import annotations

from accelnode.kube.client import Client

from controller.nodegroups.children import (ChildReconciler, InstanceTemplateReconciler,  # noqa: F401
                                            ManagedInstanceGroupReconciler, WorkloadPolicyReconciler)
from controller.nodegroups.common import (LABEL_ACCELERATOR, LABEL_COUNT, LABEL_GROUP, LABEL_TOPOLOGY,  # noqa: F401
                                          STARTUP_SCRIPT, TAINT, Settings, condition, get_condition)
from controller.nodegroups.compute import GCE
from controller.nodegroups.devplugin import DEVICE_PLUGIN, device_plugin_daemonset  # noqa: F401
from controller.nodegroups.group import TPUNodeGroupReconciler
from controller.nodegroups.nodes import is_group_node, mig_name_of  # noqa: F401
from controller.nodegroups.policy import Policy  # noqa: F401
from controller.runtime.reconciler import Reconciler


def reconcilers(client: Client, settings: Settings, gce: GCE) -> list[Reconciler]:
    return [WorkloadPolicyReconciler(client, gce, settings), InstanceTemplateReconciler(client, gce, settings),
            ManagedInstanceGroupReconciler(client, gce, settings), TPUNodeGroupReconciler(client, gce, settings)]
