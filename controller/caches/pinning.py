"""Digest pinning of kernel caches: what a GKMCache/ClusterGKMCache's ``spec.image`` resolves to,
the names under which the pin is recorded, and a small cache of resolutions shared by the
admission webhooks and the reconciler of one process.

The pin lives in ``status.resolvedDigest`` (written by the controller only) and, for GKM's
users, in the annotations ``gkm.io/resolvedDigest`` and ``gkm.io/cache-size-bytes``. An image
that names a digest is pinned to it without asking the registry.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from accelnode.oci.manifest import resolve
from accelnode.oci.reference import Reference
from accelnode.oci.registry import RegistryOptions

GROUP, VERSION = "gkm.io", "v1alpha1"
DIGEST_ANNOTATION = "gkm.io/resolvedDigest"
SIZE_ANNOTATION = "gkm.io/cache-size-bytes"
SIGNATURE_FORMAT_LABEL = "gkm.io/signature-format"


@dataclass(frozen=True)
class Pin:
    image: str  # spec.image as written
    digest: str
    size_bytes: int | None

    @property
    def pinned(self) -> str:
        """``registry/repo@digest``: what a node pulls."""
        return Reference.parse(self.image).pinned(self.digest)


class Resolver:
    """Resolves images with the controller's registry options, remembering each answer for
    ``ttl`` seconds: a second admission of the same image (a re-invocation, the validating
    webhook after the mutating one, the reconciler after admission) asks the registry nothing.
    Errors are :class:`accelnode.oci.errors.ImageError` and are not remembered."""

    def __init__(self, options: RegistryOptions, *, ttl: float = 60.0):
        self.options, self.ttl = options, ttl
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[Pin, float]] = {}

    def pin(self, image: str) -> Pin:
        ref = Reference.parse(image)  # InvalidReference for anything we cannot pull
        now = time.monotonic()
        with self._lock:
            hit = self._answers.get(image)
            if hit is not None and now - hit[1] < self.ttl:
                return hit[0]
        if ref.digest:  # pinned already (a tag beside the digest is only a name)
            pin = Pin(image, ref.digest, None)
        else:
            pin = Pin(image, *resolve(image, self.options))
        with self._lock:
            self._answers[image] = (pin, time.monotonic())
            if len(self._answers) > 4096:  # bounded: drop the oldest answers
                for old in sorted(self._answers, key=lambda k: self._answers[k][1])[:1024]:
                    del self._answers[old]
        return pin

    def forget(self, image: str) -> None:
        with self._lock:
            self._answers.pop(image, None)
