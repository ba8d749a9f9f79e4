"""Keeps opted-in StatefulSets' TPU worker environment current when they are scaled through the
``/scale`` subresource (``kubectl scale``, an autoscaler), which no admission webhook can
change (docs/tpu-env.md).

Watches StatefulSets labelled ``gke-tpu-env-injector.aaronbatilo.dev/inject=enabled``; when
what :func:`controller.tpuenv.patches.statefulset_patch` wants differs from the template (the hostnames
name another number of replicas, or another first ordinal), it writes the template (an update
carrying the read ``resourceVersion``: a stale read is a 409 and a retry). The write passes the
StatefulSet webhook, which finds nothing left to do. In steady state: no write at all. A
StatefulSet the webhook would deny (no serviceName) is logged and left alone.
"""

from __future__ import annotations

import logging

from accelnode.kube.client import Client
from accelnode.log import kv

from controller.tpuenv import patches as tpuenv
from controller.runtime.reconciler import Reconciler, Result, Watch, split_key
from controller.runtime.writes import update_if_changed

log = logging.getLogger("accelnode.controller")

STATEFULSETS = "/apis/apps/v1/statefulsets"


def trim_statefulset(obj: dict) -> dict:
    """All but ``managedFields`` and ``status`` (an update writes neither)."""
    md = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": md}


class StatefulSetEnvReconciler(Reconciler):
    name = "tpu-env-statefulsets"

    def __init__(self, client: Client):
        self.client = client
        self.watches = [Watch(STATEFULSETS, {"labelSelector": f"{tpuenv.INJECT_LABEL}={tpuenv.INJECT_VALUE}"},
                              trim=trim_statefulset)]

    def reconcile(self, key: str) -> Result | None:
        obj = self.cache.get(STATEFULSETS, key)
        if obj is None:
            return None
        try:
            ops, _ = tpuenv.statefulset_patch(obj)
        except tpuenv.Refused as e:
            log.warning("opted-in StatefulSet left alone", extra=kv(statefulset=key, reason=str(e)))
            return None
        if not ops:
            return None
        ns, name = split_key(key)

        def mutate(o: dict) -> None:
            o.update(apiVersion="apps/v1", kind="StatefulSet")
            tpuenv.apply_ops(o, ops)

        update_if_changed(self.client, f"/apis/apps/v1/namespaces/{ns}/statefulsets/{name}", obj, mutate)
        log.info("TPU worker environment brought up to date", extra=kv(statefulset=key, ops=len(ops)))
        return None


def statefulset_env_reconciler(client: Client, resolver=None) -> StatefulSetEnvReconciler:
    return StatefulSetEnvReconciler(client)
