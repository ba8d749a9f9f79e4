"""Which cache a volume names, and which image holds it.

A volume (inline ``csi:`` volume or a PV made by the controller) carries the same attributes:

* ``csi.gkm.io/GKMCache`` — the cache's name (required);
* ``csi.gkm.io/namespace`` — its namespace; absent for a ``ClusterGKMCache``;
* ``csi.gkm.io/image`` — the digest-pinned image, used when no API server is configured.

Looking the cache object up through the API server is a :class:`Resolver` of its own (it will
also enforce ``workloadNamespaces`` of cluster caches); the driver only depends on the protocol.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

CACHE_KEY = "csi.gkm.io/GKMCache"
NAMESPACE_KEY = "csi.gkm.io/namespace"
IMAGE_KEY = "csi.gkm.io/image"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_UID = "csi.storage.k8s.io/pod.uid"

DIGEST_PINNED = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


class ResolveError(Exception):
    """The volume does not name a usable cache; ``code`` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class CacheRef:
    name: str
    namespace: str | None  # None: a ClusterGKMCache

    def __str__(self) -> str:
        return f"GKMCache {self.namespace}/{self.name}" if self.namespace else f"ClusterGKMCache {self.name}"


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    uid: str


class Resolver(Protocol):
    def image(self, cache: CacheRef, pod: Pod, volume_context: dict[str, str]) -> str:
        """The digest-pinned image of ``cache`` for ``pod``, or raise :class:`ResolveError`."""


class AttributeResolver:
    """No API server: the volume's ``csi.gkm.io/image`` attribute is the image."""

    def image(self, cache: CacheRef, pod: Pod, volume_context: dict[str, str]) -> str:
        image = volume_context.get(IMAGE_KEY, "")
        if not image:
            raise ResolveError("NOT_FOUND", f"{cache}: volume attribute {IMAGE_KEY} is not set and no API "
                                            "server is configured to look the cache up")
        if not DIGEST_PINNED.match(image):
            raise ResolveError("INVALID_ARGUMENT", f"{cache}: {IMAGE_KEY}={image!r} is not digest-pinned "
                                                   "(expected REGISTRY/REPO@sha256:<64 hex>)")
        return image


def cache_ref(volume_context: dict[str, str]) -> CacheRef:
    name = volume_context.get(CACHE_KEY, "")
    if not name:
        raise ResolveError("INVALID_ARGUMENT", f"volume_context[{CACHE_KEY!r}] (the cache name) is required")
    return CacheRef(name, volume_context.get(NAMESPACE_KEY) or None)


def pod_of(volume_context: dict[str, str]) -> Pod:
    return Pod(volume_context.get(POD_NAMESPACE, ""), volume_context.get(POD_NAME, ""),
               volume_context.get(POD_UID, ""))


def check_namespace(cache: CacheRef, pod: Pod) -> None:
    """A namespaced cache is for pods of its own namespace only."""
    if cache.namespace is None:
        return
    if not pod.namespace:
        raise ResolveError("INVALID_ARGUMENT", f"{cache} is namespaced but volume_context has no {POD_NAMESPACE} "
                                               "(set podInfoOnMount: true on the CSIDriver csi.gkm.io)")
    if pod.namespace != cache.namespace:
        raise ResolveError("PERMISSION_DENIED", f"{cache} may only be mounted by pods in namespace "
                                                f"{cache.namespace}; pod {pod.namespace}/{pod.name} is not")
