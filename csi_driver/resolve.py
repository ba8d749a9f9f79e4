"""Which cache a volume names, and which image holds it (docs/csi.md).

Invariant: the image comes from the cache object, never from the pod. :class:`ApiResolver`
reads the object from a watch-backed view (:mod:`csi_driver.cacheview`), enforces namespace
rules, waits for the controller's pin and refuses a cache whose signature check failed; where
the trust policies themselves require a signature, it mounts only a digest the controller's
verdict (``status.verification``) accepts under the policies covering it now (fail closed,
controller up or down, and while its copy of the policies is too old: docs/security.md). The
``csi.gkm.io/image`` attribute is honoured only with ``--trust-pod-image-attribute``, and then
pulled without the node's registry credentials. :class:`VolumeResolver` picks between them per
volume; the driver depends only on the :class:`Resolver` protocol.
"""

from __future__ import annotations

from accelnode.capture import settings as capture_settings

from dataclasses import dataclass
from typing import Protocol

from accelnode import volumeattrs
from accelnode.oci.errors import InvalidReference
from accelnode.oci.refusal import mount_refusal
from accelnode.oci.reference import DIGEST_PINNED, Reference

CACHE_KEY, NAMESPACE_KEY, IMAGE_KEY = volumeattrs.CACHE, volumeattrs.NAMESPACE, volumeattrs.IMAGE
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_UID = "csi.storage.k8s.io/pod.uid"

TRUST_FLAG = "--trust-pod-image-attribute"
POLICY_MAX_AGE = 300.0  # seconds the trust policies' watch may be broken before nothing mounts (--trust-policy-max-age)


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


@dataclass(frozen=True)
class Image:
    """What holds a volume's cache: a digest-pinned reference, and whether the agent must pull it
    without the node's registry credentials (an image a pod's author named)."""

    reference: str
    anonymous: bool = False
    # the cache captures (docs/capture.md): {"repository", "push_secret"} from its annotations
    capture: dict | None = None


class Resolver(Protocol):
    def image(self, cache: CacheRef, pod: Pod, volume_context: dict[str, str]) -> Image:
        """The image of ``cache`` for ``pod``, or raise :class:`ResolveError`."""


class CacheView(Protocol):
    """The cache objects as the API server has them (:class:`csi_driver.cacheview.CacheView`)."""

    def synced(self, cache: CacheRef) -> bool:
        """Whether the objects of ``cache``'s kind have been listed at least once."""

    def get(self, cache: CacheRef) -> dict | None:
        """The (trimmed) object ``cache`` names, None when there is none."""

    def policies(self) -> list[dict] | None:
        """The ClusterCacheTrustPolicy objects, None until they have been listed once."""

    def policies_stale(self) -> str | None:
        """Why the policies above may not be current (their watch broken too long), or None."""


class AttributeResolver:
    """The volume's ``csi.gkm.io/image`` attribute is the image; its author is the pod's, so it is
    pulled anonymously."""

    def image(self, cache: CacheRef, pod: Pod, volume_context: dict[str, str]) -> Image:
        image = volume_context.get(IMAGE_KEY, "")
        if not image:
            raise ResolveError("NOT_FOUND", f"{cache}: volume attribute {IMAGE_KEY} is not set and no API "
                                            "server is configured to look the cache up")
        if not DIGEST_PINNED.match(image):
            raise ResolveError("INVALID_ARGUMENT", f"{cache}: {IMAGE_KEY}={image!r} is not digest-pinned "
                                                   "(expected REGISTRY/REPO@sha256:<64 hex>)")
        return Image(image, anonymous=True)


class ApiResolver:
    """The cache object, from the local view of the API server: never a request per publish."""

    def __init__(self, view: CacheView):
        self.view = view

    def image(self, cache: CacheRef, pod: Pod, volume_context: dict[str, str]) -> Image:
        if not self.view.synced(cache):
            kind = "GKMCaches" if cache.namespace else "ClusterGKMCaches"
            raise ResolveError("UNAVAILABLE", f"{cache}: the driver has not read the {kind} from the API server "
                                              "yet; retry")
        obj = self.view.get(cache)
        if obj is None:
            raise ResolveError("NOT_FOUND", f"{cache} does not exist")
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        if cache.namespace is None:
            check_workload_namespaces(cache, pod, spec.get("workloadNamespaces") or [])
        image = pinned(cache, spec.get("image", ""), status)
        policies = self.view.policies()
        if policies is None:
            raise ResolveError("UNAVAILABLE", f"{cache}: the driver has not read the ClusterCacheTrustPolicies from "
                                              "the API server yet, so it cannot tell whether a signature is "
                                              "required; retry")
        stale = self.view.policies_stale()
        if stale is not None:  # any cache could be covered by a policy it has not seen: none mounts
            raise ResolveError("UNAVAILABLE", f"{cache}: {stale}, so it cannot tell whether a signature is required "
                                              "or which policies a verdict must be judged under; retry once it "
                                              "watches them again")
        check_verified(cache, (obj.get("metadata") or {}).get("labels") or {}, status, image.rsplit("@", 1)[1],
                       policies)
        return Image(image, capture=capturing(cache, obj))


def capturing(cache: CacheRef, obj: dict) -> dict | None:
    """What a GKMCache's capture annotations ask of the node (repository and push secret), or
    None: capture off, a ClusterGKMCache (never captured: shared by tenants), or settings the
    node cannot use. The operator's repository rules are the controller's to apply (it refuses
    to publish from a repository they do not allow); the node pushes only with the Secret the
    namespace lent, to the repository the namespace named."""
    notes = (obj.get("metadata") or {}).get("annotations") or {}
    if not cache.namespace or notes.get(capture_settings.ON) not in ("on", "true"):
        return None
    repository, secret = notes.get(capture_settings.REPOSITORY, ""), notes.get(capture_settings.PUSH_SECRET, "")
    if not repository or not secret:
        return None
    return {"repository": repository, "push_secret": secret}


class VolumeResolver:
    """Where each volume's image comes from. A volume with ``csi.gkm.io/image`` is refused unless
    ``trust_image_attribute`` (then :class:`AttributeResolver`); every other volume is looked up
    by ``api`` (None: no API server, the attribute is the only source)."""

    def __init__(self, api: Resolver | None, *, trust_image_attribute: bool = False):
        self.api = api
        self.trust_image_attribute = trust_image_attribute
        self.attribute = AttributeResolver()

    def image(self, cache: CacheRef, pod: Pod, volume_context: dict[str, str]) -> Image:
        if IMAGE_KEY in volume_context:
            if not self.trust_image_attribute:
                raise ResolveError("INVALID_ARGUMENT", f"{cache}: volume attribute {IMAGE_KEY} is refused: it lets "
                                                       "a pod's author choose the image, so the driver takes the "
                                                       "image from the cache object only (remove the attribute; "
                                                       f"drivers started with {TRUST_FLAG} accept it)")
            return self.attribute.image(cache, pod, volume_context)
        if self.api is None:
            return self.attribute.image(cache, pod, volume_context)
        return self.api.image(cache, pod, volume_context)


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


def check_workload_namespaces(cache: CacheRef, pod: Pod, namespaces: list[str]) -> None:
    """A ClusterGKMCache that lists ``workloadNamespaces`` is for pods of those namespaces only."""
    if not namespaces:
        return
    if not pod.namespace:
        raise ResolveError("INVALID_ARGUMENT", f"{cache} lists workloadNamespaces but volume_context has no "
                                               f"{POD_NAMESPACE} (set podInfoOnMount: true on the CSIDriver "
                                               "csi.gkm.io)")
    if pod.namespace not in namespaces:
        raise ResolveError("PERMISSION_DENIED", f"{cache} may only be mounted by pods in namespaces "
                                                f"{', '.join(sorted(namespaces))} (spec.workloadNamespaces); pod "
                                                f"{pod.namespace}/{pod.name} is not")


def check_verified(cache: CacheRef, labels: dict, status: dict, digest: str, policies: list[dict]) -> None:
    """A cache whose verdict on ``digest`` is a refusal (``status.verification``) is not mounted
    (FAILED_PRECONDITION naming the reason); one that needs a signature (its label, or the
    policies covering its namespace) without an accepting verdict on ``digest`` under the
    policies covering it now is UNAVAILABLE (kubelet retries). docs/signatures.md."""
    refused = mount_refusal(cache.namespace, labels, status, digest, policies)
    if refused is None:
        return
    status, why = refused
    if status == "False":
        raise ResolveError("FAILED_PRECONDITION", f"{cache} failed verification: {why}")
    raise ResolveError("UNAVAILABLE", f"{cache}: {why}; retry once the controller has verified it")


def pinned(cache: CacheRef, image: str, status: dict) -> str:
    """``<registry>/<repo>@<digest>`` of a cache object: the controller's pin
    (``status.resolvedDigest``), or the digest ``spec.image`` carries while there is none. An
    unresolved cache, or a pin that no longer matches a digest-pinned ``spec.image`` (the status
    lags the spec), is UNAVAILABLE: kubelet retries until the controller has pinned it."""
    try:
        ref = Reference.parse(image)
    except InvalidReference as e:
        raise ResolveError("FAILED_PRECONDITION", f"{cache}: spec.image cannot be pulled: {e}") from None
    digest = status.get("resolvedDigest")
    if not digest and not ref.digest:
        resolved = next((c for c in status.get("conditions") or [] if c.get("type") == "Resolved"), None)
        why = f" ({resolved.get('reason')}: {resolved.get('message', '')})" if resolved else ""
        raise ResolveError("UNAVAILABLE", f"{cache}: {image} is not pinned yet: no status.resolvedDigest{why}; "
                                          "retry once the controller has resolved it")
    if digest and ref.digest and digest != ref.digest:
        raise ResolveError("UNAVAILABLE", f"{cache}: status.resolvedDigest {digest} is not the digest of spec.image "
                                          f"{image}; retry once the controller has pinned it again")
    return ref.pinned(digest or ref.digest)
