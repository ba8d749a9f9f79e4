"""Admission webhooks that give TPU workers their environment (docs/tpu-env.md; the decisions
are :mod:`controller.tpuenv.patches`'s, these are the routes of
:class:`~controller.webhooks.server.AdmissionServer`).

A request of another kind, version or operation than its route's is admitted unchanged (the
webhook configuration decides what reaches us); an object that is not what its kind says is
denied with the field named (code 422). No API reads: everything comes from the request.
"""

from __future__ import annotations

import logging
from typing import Callable

from accelnode.log import kv

from controller.tpuenv import patches as tpuenv
from controller.webhooks.server import Handler, Response, allow, deny

log = logging.getLogger("accelnode.controller.envhooks")

MUTATE_STATEFULSET = "/mutate-tpu-env-statefulset"
MUTATE_JOB = "/mutate-tpu-env-job"
MUTATE_POD = "/mutate-tpu-env-pod"


def _hook(group: str, version: str, kind: str, operations: tuple[str, ...],
          plan: Callable[[dict], tuple[list, list[str]]]) -> Handler:
    def handle(request: dict) -> Response:
        gvk = request.get("kind")
        if (not isinstance(gvk, dict) or (gvk.get("group"), gvk.get("version"), gvk.get("kind")) != (group, version, kind)
                or request.get("operation") not in operations):
            return allow()
        obj = request.get("object")
        if not isinstance(obj, dict):
            return deny(f"the request carries no {kind} object", code=422)
        try:
            patch, warnings = plan(obj)
        except tpuenv.Refused as e:
            log.info("TPU workload denied", extra=kv(kind=kind, object=_name(request), reason=str(e)))
            return deny(f"TPU worker environment: {e}", code=422)
        if patch:
            log.info("TPU worker environment set", extra=kv(kind=kind, object=_name(request),
                                                             operation=request.get("operation"), ops=len(patch)))
        return allow(patch, warnings)
    return handle


def _name(request: dict) -> str:
    ns, name = request.get("namespace"), request.get("name")
    return f"{ns}/{name}" if ns else str(name)


def routes(platform_jobs: bool = False) -> dict[str, Handler]:
    """The routes of the TPU environment webhooks; ``platform_jobs``: the cluster (GKE) gives
    Indexed Jobs their TPU variables itself (:func:`controller.tpuenv.patches.job_slice`)."""
    return {
        MUTATE_STATEFULSET: _hook("apps", "v1", "StatefulSet", ("CREATE", "UPDATE"), tpuenv.statefulset_patch),
        MUTATE_JOB: _hook("batch", "v1", "Job", ("CREATE",), lambda job: tpuenv.job_patch(job, platform_jobs)),
        MUTATE_POD: _hook("", "v1", "Pod", ("CREATE",), lambda pod: (tpuenv.pod_patch(pod), [])),
    }
