"""Digest pinning of kernel caches: what a GKMCache/ClusterGKMCache's ``spec.image`` resolves to,
the names under which the pin is recorded, and a small cache of resolutions shared by the
admission webhooks and the reconciler of one process.

The pin lives in ``status.resolvedDigest`` (written by the controller only) and, for GKM's
users, in the annotations ``gkm.io/resolvedDigest`` and ``gkm.io/cache-size-bytes``. An image
that names a digest is pinned to it only once its repository has served that digest's manifest:
naming a digest proves nothing about who may read it (docs/security.md).

Whose credentials ask: a ``GKMCache``'s namespace's pull secrets (those its default
ServiceAccount names, where the namespace lends them to the controller; else none), a
``ClusterGKMCache``'s the controller's own (``--registry-config``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from accelnode.kube.pullsecrets import PullSecretError, PullSecretReader
from accelnode.oci.errors import AuthError
from accelnode.oci.manifest import resolve
from accelnode.oci.reference import Reference
from accelnode.oci.registry import RegistryOptions

GROUP, VERSION = "gkm.io", "v1alpha1"
DIGEST_ANNOTATION = "gkm.io/resolvedDigest"
SIZE_ANNOTATION = "gkm.io/cache-size-bytes"


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
    """Resolves images with the credentials of the cache's namespace (``namespace`` None: a
    cluster cache, the controller's registry options), remembering each answer for ``ttl``
    seconds per (image, credentials): a second admission of the same image (a re-invocation, the
    validating webhook after the mutating one, the reconciler after admission) asks the registry
    nothing. Errors are :class:`accelnode.oci.errors.ImageError` and are not remembered."""

    def __init__(self, options: RegistryOptions, *, ttl: float = 60.0, secrets: PullSecretReader | None = None):
        self.options, self.ttl, self.secrets = options, ttl, secrets
        self._anonymous = dataclasses.replace(options, config_file=None, anonymous=True, pull_secrets=())
        self._lock = threading.Lock()
        self._answers: dict[tuple[str, str], tuple[Pin, float]] = {}

    def credentials(self, namespace: str | None, image: str = "") -> tuple[str, RegistryOptions]:
        """(a name for them, the registry options) a cache of ``namespace`` is asked about with;
        :class:`AuthError` when the namespace's pull secrets are unusable."""
        if namespace is None:
            return "controller", self.options
        if self.secrets is None:
            return "anonymous", self._anonymous
        try:
            found = self.secrets.of(namespace)
        except PullSecretError as e:
            raise AuthError(str(e), image) from None
        if not found.secrets:
            return "anonymous", self._anonymous
        return found.key, dataclasses.replace(self._anonymous, anonymous=False, pull_secrets=found.secrets)

    def pin(self, image: str, namespace: str | None = None, *, public: bool = False) -> Pin:
        """``public``: asked anonymously whatever the cache's credentials (what anyone may learn
        from the registry: the admission webhooks' answers, which anyone who reaches the webhook
        port can ask for; docs/cache-webhooks.md)."""
        Reference.parse(image)  # InvalidReference for anything we cannot pull
        whose, options = ("anonymous", self._anonymous) if public else self.credentials(namespace, image)
        key = (image, whose)
        now = time.monotonic()
        with self._lock:
            hit = self._answers.get(key)
            if hit is not None and now - hit[1] < self.ttl:
                return hit[0]
        # a digest in the image is asked about too: its repository must serve it to these credentials
        pin = Pin(image, *resolve(image, options))
        with self._lock:
            self._answers[key] = (pin, time.monotonic())
            if len(self._answers) > 4096:  # bounded: drop the oldest answers
                for old in sorted(self._answers, key=lambda k: self._answers[k][1])[:1024]:
                    del self._answers[old]
        return pin

    def forget(self, image: str) -> None:
        with self._lock:
            for key in [k for k in self._answers if k[0] == image]:
                del self._answers[key]
