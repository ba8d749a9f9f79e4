"""What a reconciler is: the contract between one piece of cluster logic and the core that runs
it (:class:`controller.runtime.runner.Controller`), in controller-runtime's terms
(docs/controller.md, "Reconcilers").

A reconciler is level-based and idempotent: ``reconcile(key)`` makes the world as it should be
from how it is now, may run any number of times for a key, never twice at once, and answers
``None``/``Result()``, ``Result(requeue_after=s)``, ``Result(requeue=True)`` or an exception.
Keys are ``namespace/name`` (``name`` when cluster-scoped); a :class:`Watch` maps an object's
change to the keys it affects.
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
