"""Writes that happen only when something changed: in steady state a reconciler makes no write
at all (design §3: the controller writes to the API server only when something changed).

Both helpers take the object as last read (from the cache or a GET) and compare the wanted
state with it; a write carries the object's ``resourceVersion``, so a stale read fails with
``409 Conflict`` (a :class:`~accelnode.kube.client.KubeError`) instead of overwriting someone
else's change. The reconciler raises it on; the core retries the key after its backoff, with a
fresh read.

Where a reconciler's watch cache keeps only what it reads of an object (a tenant's padding stays
out of memory: the cache objects, controller.caches.reconciler.trim_cache), sending that copy
back would drop the rest: :func:`patch_status` and :func:`patch_if_changed` write a JSON merge
patch (RFC 7386) of what differs instead, held to the same ``resourceVersion``.
"""

from __future__ import annotations

import copy
import threading
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


_ABSENT = object()


def merge_patch(old: dict, new: dict) -> dict:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``: members that changed
    (objects patched member by member, anything else replaced whole), ``None`` for members
    ``new`` lacks."""
    patch: dict = {k: None for k in old if k not in new}
    for k, v in new.items():
        was = old.get(k, _ABSENT)
        if was != v:
            patch[k] = merge_patch(was, v) if isinstance(was, dict) and isinstance(v, dict) else v
    return patch


def _conditional(obj: dict, patch: dict) -> dict:
    """``patch`` held to ``obj``'s resourceVersion (a 409 when the object changed since)."""
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    if rv:
        patch["metadata"] = {**(patch.get("metadata") or {}), "resourceVersion": rv}
    return patch


def patch_status(client: Client, path: str, obj: dict, status: dict) -> dict | None:
    """:func:`update_status` as a merge patch of ``status`` alone (``obj`` may be a trimmed
    copy). The object as written: ``obj`` with ``status`` and the server's metadata (the answer
    is the metadata alone: a padded object is not read back), or None when nothing was written."""
    if obj.get("status") == status:
        return None
    patch = _conditional(obj, {"status": merge_patch(obj.get("status") or {}, status)})
    written = client.request("PATCH", path + "/status", body=patch, metadata_only=True)
    return {**obj, "status": status, "metadata": written.get("metadata") or {}}


def patch_if_changed(client: Client, path: str, obj: dict, mutate: Callable[[dict], None]) -> dict | None:
    """:func:`update_if_changed` as a merge patch of what ``mutate`` changed (``obj`` may be a
    trimmed copy: what it lacks is left as the server has it). The object as written (the
    server's metadata, ``obj``'s other fields as ``mutate`` left them), or None when nothing was
    written."""
    wanted = copy.deepcopy(obj)
    mutate(wanted)
    if wanted == obj:
        return None
    written = client.request("PATCH", path, body=_conditional(obj, merge_patch(obj, wanted)), metadata_only=True)
    return {**wanted, "metadata": written.get("metadata") or {}}


class ReadYourWrites:
    """What a reconciler last wrote per key, until its watch delivers that write: read through
    :meth:`current`, the next reconcile of the key starts from our own write instead of the
    older stored copy (no ``409`` on the next step)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._written: dict[str, tuple[str | None, dict]] = {}  # key -> (rv we wrote over, what we wrote)

    def remember(self, key: str, over: dict, written: dict) -> None:
        """``written`` replaced ``over`` (the object as read before the write)."""
        with self._lock:
            self._written[key] = ((over.get("metadata") or {}).get("resourceVersion"), written)

    def current(self, key: str, stored: dict | None) -> dict | None:
        """``stored`` (the watch's copy), or our write while ``stored`` is still what it replaced."""
        with self._lock:
            memo = self._written.get(key)
            if memo is None or stored is None:
                return stored
            if (stored.get("metadata") or {}).get("resourceVersion") == memo[0]:
                return memo[1]
            del self._written[key]
            return stored

    def forget(self, key: str) -> None:
        with self._lock:
            self._written.pop(key, None)
