"""What a reconciler is: the contract between one piece of cluster logic and the core that runs
it (:class:`controller.runtime.runner.Controller`), in controller-runtime's terms.

A reconciler is level-based: ``reconcile(key)`` looks at the world as it is now (the watched
objects in :attr:`Reconciler.cache`, the API server for anything else) and makes it as it should
be. It must be idempotent: the same key may be reconciled any number of times (a watch event, a
periodic resync, a retry), never twice at once. It answers with

* ``None`` or ``Result()``: done until something changes;
* ``Result(requeue_after=s)``: look again in ``s`` seconds (backoff is reset: not a failure);
* ``Result(requeue=True)``: look again after the key's backoff delay (not an error, but slow down);
* an exception: an error, logged and retried after the key's backoff delay.

Keys are ``namespace/name``, or ``name`` for a cluster-scoped object. Each :class:`Watch` says
which collection to follow and which keys an object's change queues (by default its own key;
a reconciler of one kind that also watches related kinds maps them to the owner's key).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence


def object_key(obj: dict) -> str:
    """``namespace/name`` (``name`` when cluster-scoped)."""
    md = obj.get("metadata") or {}
    return f"{md['namespace']}/{md['name']}" if md.get("namespace") else md.get("name", "")


def split_key(key: str) -> tuple[str | None, str]:
    """``namespace/name`` -> (namespace, name); ``name`` -> (None, name)."""
    ns, sep, name = key.rpartition("/")
    return (ns or None, name) if sep else (None, key)


@dataclass(frozen=True)
class Result:
    requeue_after: float | None = None
    requeue: bool = False


@dataclass(frozen=True)
class Watch:
    """One collection to follow: ``path`` (e.g. ``/api/v1/configmaps`` or a namespaced path),
    ``query`` (label/field selectors), ``keys(obj)`` -> the keys to reconcile when ``obj``
    changes, ``trim(obj)`` -> what the cache stores of it (memory: keep only what you read)."""

    path: str
    query: dict = field(default_factory=dict)
    keys: Callable[[dict], Iterable[str]] = lambda obj: (object_key(obj),)
    trim: Callable[[dict], dict] = lambda obj: obj


class Cache:
    """Read access to the watched collections, by path (the local copies the watches keep)."""

    def __init__(self, reflectors: dict):
        self._reflectors = reflectors  # path -> accelnode.kube.reflector.Reflector

    def get(self, path: str, key: str) -> dict | None:
        ns, name = split_key(key)
        return self._reflector(path).get(ns, name)

    def list(self, path: str) -> list[dict]:
        return self._reflector(path).snapshot()

    def synced(self) -> bool:
        """Every collection has been listed at least once."""
        return all(r.synced.is_set() for r in self._reflectors.values())

    def _reflector(self, path: str):
        try:
            return self._reflectors[path]
        except KeyError:
            raise KeyError(f"{path} is not watched by this reconciler (watched: {sorted(self._reflectors)})") from None


class Reconciler:
    """Subclass it: set ``name`` (metrics label, log field, unique per process) and ``watches``,
    implement :meth:`reconcile`. The controller running it sets :attr:`cache` before the first
    call."""

    name: str = ""
    watches: Sequence[Watch] = ()
    cache: Cache

    def reconcile(self, key: str) -> Result | None:
        raise NotImplementedError
