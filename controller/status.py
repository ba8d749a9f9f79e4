"""Writes that happen only when something changed: in steady state a reconciler makes no write
at all (design §3: the controller writes to the API server only when something changed).

Both helpers take the object as last read (from the cache or a GET) and compare the wanted
state with it; a write carries the object's ``resourceVersion``, so a stale read fails with
``409 Conflict`` (a :class:`~accelnode.kube.client.KubeError`) instead of overwriting someone
else's change. The reconciler raises it on; the core retries the key after its backoff, with a
fresh read.
"""

from __future__ import annotations

import copy
from typing import Callable

from accelnode.kube.client import Client


def update_status(client: Client, path: str, obj: dict, status: dict) -> dict | None:
    """``PUT <path>/status`` with ``status`` unless ``obj`` already has exactly that status.
    ``path`` is the object's own REST path. The written object, or None when nothing was written."""
    if obj.get("status") == status:
        return None
    return client.request("PUT", path + "/status", body={**obj, "status": status})


def update_if_changed(client: Client, path: str, obj: dict, mutate: Callable[[dict], None]) -> dict | None:
    """``PUT <path>`` with ``mutate(copy of obj)`` applied, unless it changed nothing (for
    status-like fields that live outside ``status``: annotations, labels). The written object, or
    None when nothing was written."""
    wanted = copy.deepcopy(obj)
    mutate(wanted)
    if wanted == obj:
        return None
    return client.request("PUT", path, body=wanted)
