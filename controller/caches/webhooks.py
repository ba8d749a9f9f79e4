"""Admission webhooks of GKMCache and ClusterGKMCache: the digest pin at admission, and the rule
that only the controller writes it (docs/cache-webhooks.md).

* Mutating: pins ``spec.image`` into the pin annotations; an UPDATE that keeps ``spec.image``
  keeps its pin without asking the registry; a registry that does not answer admits the object
  unpinned (the reconciler pins it later).
* Validating: holds even when the mutating webhook was skipped; for anyone but the controller
  the pin may only be absent, unchanged or exactly what the Resolver answers.
* Who the controller is comes from ``userInfo.username`` against the username learnt at start
  (a SelfSubjectReview), never from anything in the object.
* An answer tells only what anyone may learn from the registry: the image is asked about
  anonymously, never with a namespace's pull secrets or the controller's credentials. The server
  cannot tell the API server from any pod that reaches its port (no client certificate), so a
  review may be forged, and its namespace, user and object with it; a private image is admitted
  unpinned and the reconciler, which reads the cache from the API server, pins it with the
  credentials that are the cache's.

Pure decisions (:func:`plan_pin`, :func:`check_pin`, :func:`annotation_patch`) take the
resolution as a callable; :class:`CacheHooks` adds identity, time bounds and the routes.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from accelnode.log import kv
from accelnode.oci.errors import AuthError, ImageError, ImageNotFound, InvalidReference, RegistryUnavailable
from accelnode.oci.reference import DIGEST, Reference

from controller.webhooks.server import Handler, Response, allow, deny
from controller.caches.pinning import DIGEST_ANNOTATION, SIZE_ANNOTATION, Pin, Resolver

log = logging.getLogger("accelnode.controller.cachehooks")

MUTATE_GKMCACHE = "/mutate-gkm-io-v1alpha1-gkmcache"
MUTATE_CLUSTERGKMCACHE = "/mutate-gkm-io-v1alpha1-clustergkmcache"
VALIDATE_GKMCACHE = "/validate-gkm-io-v1alpha1-gkmcache"
VALIDATE_CLUSTERGKMCACHE = "/validate-gkm-io-v1alpha1-clustergkmcache"

SSR_PATH = "/apis/authentication.k8s.io/v1/selfsubjectreviews"
RESOLVE_BUDGET = 10.0  # seconds one admission waits for the registry (the webhooks' timeoutSeconds is 15)
MAX_LOOKUPS = 16  # distinct images being resolved at once; beyond, an admission does not wait

Resolve = Callable[[str], Pin]


class BadCache(ValueError):
    """The object cannot be admitted as written (the message names the field)."""


class Unpinned(Exception):
    """The registry gave no answer for the image now; ``reason`` says why in a few words."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


# -- reading the object -------------------------------------------------------------------------


def image_of(obj) -> str:
    """``spec.image`` if it is a reference the controller can pull, else :class:`BadCache`."""
    spec = obj.get("spec") if isinstance(obj, dict) else None
    image = spec.get("image") if isinstance(spec, dict) else None
    if not isinstance(image, str) or not image:
        raise BadCache("spec.image is required: the OCI image reference of the cache")
    try:
        Reference.parse(image)
    except InvalidReference:
        raise BadCache(f"spec.image {image!r} is not an image reference the controller can pull: expected "
                       "HOST[:PORT]/REPOSITORY[:TAG][@sha256:HEX], with the registry host named "
                       "(e.g. quay.io/org/cache:v1)") from None
    return image


def annotations_of(obj) -> dict | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        raise BadCache("metadata is missing")
    ann = meta.get("annotations")
    return ann if isinstance(ann, dict) else None


def pin_of(obj) -> tuple[str | None, str | None]:
    """(digest, size) as the object's annotations say (None where absent)."""
    ann = annotations_of(obj) or {}
    return ann.get(DIGEST_ANNOTATION), ann.get(SIZE_ANNOTATION)


def status_digest(obj) -> str | None:
    status = obj.get("status") if isinstance(obj, dict) else None
    return status.get("resolvedDigest") if isinstance(status, dict) else None


def same_image(obj, old) -> bool:
    """``spec.image`` is the same valid reference in both (False when ``old`` is None)."""
    if not isinstance(old, dict):
        return False
    try:
        return image_of(old) == image_of(obj)
    except BadCache:
        return False


# -- mutating: the pin ----------------------------------------------------------------------------


def wanted_annotations(pin: Pin | None) -> dict[str, str | None]:
    """The pin annotations for ``pin`` (None: unpinned); a None value means absent."""
    if pin is None:
        return {DIGEST_ANNOTATION: None, SIZE_ANNOTATION: None}
    return {DIGEST_ANNOTATION: pin.digest,
            SIZE_ANNOTATION: str(pin.size_bytes) if pin.size_bytes is not None else None}


def _pointer(key: str) -> str:
    return "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")


def annotation_patch(annotations: dict | None, wanted: dict[str, str | None]) -> list:
    """JSON Patch operations turning ``annotations`` (None: the object has none) into
    ``wanted`` (a None value: absent); empty when they already agree."""
    if annotations is None:
        adds = {k: v for k, v in wanted.items() if v is not None}
        return [{"op": "add", "path": "/metadata/annotations", "value": adds}] if adds else []
    ops = []
    for key, value in wanted.items():
        if value is None:
            if key in annotations:
                ops.append({"op": "remove", "path": _pointer(key)})
        elif annotations.get(key) != value:
            ops.append({"op": "add", "path": _pointer(key), "value": value})  # add replaces a member
    return ops


def plan_pin(obj, old, resolve: Resolve) -> tuple[list, tuple[str, ...]]:
    """The mutating decision for a non-controller CREATE (``old`` None) or UPDATE: (JSON Patch,
    warnings). ``resolve(image)`` returns a :class:`Pin` or raises :class:`Unpinned`; it is
    not called when an UPDATE keeps ``spec.image`` and ``old`` carries a pin. Raises
    :class:`BadCache` for an object that must be denied."""
    image = image_of(obj)
    annotations = annotations_of(obj)
    old_digest, old_size = pin_of(old) if isinstance(old, dict) else (None, None)
    if same_image(obj, old) and isinstance(old_digest, str) and DIGEST.match(old_digest):
        # the existing pin stands, whatever the tag names today and whatever the user wrote
        if not (isinstance(old_size, str) and old_size.isdigit()):
            old_size = None
        return annotation_patch(annotations, {DIGEST_ANNOTATION: old_digest, SIZE_ANNOTATION: old_size}), ()
    try:
        pin = resolve(image)
    except Unpinned as e:
        warning = (f"{DIGEST_ANNOTATION} not set: {e.reason}; the accelnode controller pins spec.image to a "
                   "digest when the registry answers (condition Resolved)")
        return annotation_patch(annotations, wanted_annotations(None)), (warning,)
    return annotation_patch(annotations, wanted_annotations(pin)), ()


# -- validating: who may write the pin ------------------------------------------------------------


def check_pin(obj, old, resolve: Resolve) -> str | None:
    """The validating decision for a non-controller request: None to allow, else the denial
    message. ``resolve`` is called only when the annotations carry a pin that is neither
    absent nor the unchanged pin of an unchanged image. Raises :class:`BadCache` for an
    invalid ``spec.image``."""
    image = image_of(obj)
    old_status = status_digest(old) if isinstance(old, dict) else None
    if status_digest(obj) != old_status:
        return ("status.resolvedDigest is written only by the accelnode controller: the digest a cache is pinned "
                "to is resolved by the controller from spec.image (to roll a cache, change spec.image)")
    digest, size = pin_of(obj)
    if digest is None:
        if size is not None:
            return (f"annotation {SIZE_ANNOTATION} is written only by the accelnode controller, together with "
                    f"{DIGEST_ANNOTATION}: remove it")
        return None
    if same_image(obj, old) and (digest, size) == pin_of(old):
        return None
    try:
        pin = resolve(image)
    except Unpinned as e:
        return (f"annotation {DIGEST_ANNOTATION} cannot be checked against spec.image now ({e.reason}): remove "
                "it, and the accelnode controller pins the image when the registry answers")
    if digest != pin.digest:
        return (f"annotation {DIGEST_ANNOTATION} {digest!r} is not what spec.image {image!r} resolves to: the pin is "
                "written only by the accelnode controller (remove the annotation; to roll a cache, change spec.image)")
    if size is not None and (pin.size_bytes is None or size != str(pin.size_bytes)):
        return (f"annotation {SIZE_ANNOTATION} {size!r} is not the size of {image!r} "
                f"({pin.size_bytes if pin.size_bytes is not None else 'not declared by the image'}): "
                "it is written only by the accelnode controller (remove it)")
    return None


# -- the controller's identity ---------------------------------------------------------------------


def whoami(client, timeout: float = 5.0) -> str:
    """The username the API server knows ``client`` by (a SelfSubjectReview, which every
    authenticated user may create)."""
    out = client.request("POST", SSR_PATH, timeout=timeout,
                         body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    user = ((out.get("status") or {}).get("userInfo") or {}).get("username")
    if not isinstance(user, str) or not user:
        raise ValueError(f"SelfSubjectReview answered no username: {out.get('status')!r}")
    return user


class ControllerIdentity:
    """The controller's username, looked up once (``lookup()``, a SelfSubjectReview); while it
    is unknown (the API server did not answer), a request is treated as anyone's and the lookup
    is tried again, at most every ``retry`` seconds and by one request at a time."""

    def __init__(self, lookup: Callable[[], str], *, retry: float = 5.0):
        self._lookup, self.retry = lookup, retry
        self._lock = threading.Lock()
        self._name: str | None = None
        self._tried: float | None = None

    @classmethod
    def of(cls, client) -> "ControllerIdentity":
        return cls(lambda: whoami(client))

    @classmethod
    def fixed(cls, username: str) -> "ControllerIdentity":
        ident = cls(lambda: username)
        ident._name = username
        return ident

    def username(self) -> str | None:
        if self._name is not None:
            return self._name
        if not self._lock.acquire(blocking=False):
            return None  # another request is asking right now: never queue admissions behind it
        try:
            now = time.monotonic()
            if self._name is None and (self._tried is None or now - self._tried >= self.retry):
                self._tried = now
                try:
                    self._name = self._lookup()
                except Exception as e:  # the API server's or the network's failure: try again later
                    log.warning("cannot learn the controller's own username; its writes are treated as anyone's "
                                "until it is known", extra=kv(error=f"{type(e).__name__}: {e}"))
                else:
                    log.info("controller identity", extra=kv(username=self._name))
            return self._name
        finally:
            self._lock.release()


def request_user(request: dict) -> str | None:
    info = request.get("userInfo")
    user = info.get("username") if isinstance(info, dict) else None
    return user if isinstance(user, str) else None


# -- the webhooks ---------------------------------------------------------------------------------


class CacheHooks:
    """The four webhooks over one Resolver and one identity. An admission waits for the registry
    at most ``budget`` seconds; the lookup runs in a daemon thread of its own (one per image,
    shared by concurrent admissions of that image, at most ``max_lookups`` at once) and, if it
    finishes later, its answer lands in the Resolver's cache for the reconciler or the next
    admission. A stuck registry never holds the process at exit."""

    def __init__(self, resolver: Resolver, identity: ControllerIdentity, *, budget: float = RESOLVE_BUDGET,
                 max_lookups: int = MAX_LOOKUPS):
        self.resolver, self.identity, self.budget, self.max_lookups = resolver, identity, budget, max_lookups
        self._lock = threading.Lock()
        self._lookups: dict[str, Future] = {}  # image -> its public lookup

    def routes(self) -> dict[str, Handler]:
        return {MUTATE_GKMCACHE: self.mutate, MUTATE_CLUSTERGKMCACHE: self.mutate,
                VALIDATE_GKMCACHE: self.validate, VALIDATE_CLUSTERGKMCACHE: self.validate}

    def resolve(self, image: str) -> Pin:
        """The Resolver's public pin for ``image`` (asked anonymously) within the budget, else
        :class:`Unpinned`."""
        key = image
        with self._lock:
            future = self._lookups.get(key)
            if future is None:
                if len(self._lookups) >= self.max_lookups:
                    raise Unpinned(f"{len(self._lookups)} registry lookups are already under way")
                future = self._lookups[key] = Future()
                threading.Thread(target=self._lookup, args=(key, future), name="cache-pin", daemon=True).start()
        try:
            return future.result(timeout=self.budget)
        except FutureTimeout:
            raise Unpinned(f"the registry did not answer within {self.budget:g}s") from None
        except RegistryUnavailable as e:
            raise Unpinned("the registry is unreachable", str(e)) from None
        except ImageNotFound as e:
            raise Unpinned("the registry has no such image", str(e)) from None
        except AuthError as e:
            raise Unpinned("the registry does not answer anonymously (the controller pins a private image "
                           "with the cache's credentials once it is stored)", str(e)) from None
        except InvalidReference:
            raise  # image_of() checked the reference first: this is a bug, not the registry
        except ImageError as e:
            raise Unpinned(f"the registry's answer was refused ({type(e).__name__})", str(e)) from None

    def _lookup(self, key: str, future: Future) -> None:
        try:
            pin, error = self.resolver.pin(key, public=True), None
        except BaseException as e:  # handed to every waiting admission
            pin, error = None, e
        with self._lock:  # done before answering: an admission after this one asks the Resolver afresh
            self._lookups.pop(key, None)
        if error is None:
            future.set_result(pin)
        else:
            future.set_exception(error)

    def _is_controller(self, request: dict) -> bool:
        user = request_user(request)
        return user is not None and user == self.identity.username()

    @staticmethod
    def _what(request: dict) -> dict:
        kind = request.get("kind") if isinstance(request.get("kind"), dict) else {}
        ns = request.get("namespace")
        return {"kind": kind.get("kind"), "object": f"{ns}/{request.get('name')}" if ns else request.get("name"),
                "operation": request.get("operation"), "user": request_user(request)}

    def mutate(self, request: dict) -> Response:
        if request.get("operation") not in ("CREATE", "UPDATE") or self._is_controller(request):
            return allow()
        obj = request.get("object")
        old = request.get("oldObject") if request.get("operation") == "UPDATE" else None
        try:
            patch, warnings = plan_pin(obj, old, self._resolver_for(request))
        except BadCache as e:
            log.info("cache denied", extra=kv(**self._what(request), reason=str(e)))
            return deny(str(e), code=422)
        if patch:
            log.info("cache pin set", extra=kv(**self._what(request), patch=patch))
        return allow(patch, warnings)

    def validate(self, request: dict) -> Response:
        if request.get("operation") not in ("CREATE", "UPDATE") or self._is_controller(request):
            return allow()
        obj = request.get("object")
        old = request.get("oldObject") if request.get("operation") == "UPDATE" else None
        try:
            message = check_pin(obj, old, self._resolver_for(request))
        except BadCache as e:
            log.info("cache denied", extra=kv(**self._what(request), reason=str(e)))
            return deny(str(e), code=422)
        if message is not None:
            log.info("cache pin refused", extra=kv(**self._what(request), subresource=request.get("subResource"),
                                                   reason=message))
            return deny(message, code=403)
        return allow()

    def _resolver_for(self, request: dict) -> Resolve:
        """Public resolution, whoever the request claims to be and whatever namespace it names
        (both are the request's word only: see the module's doc)."""
        return self._resolve_logged

    def _resolve_logged(self, image: str) -> Pin:
        try:
            return self.resolve(image)
        except Unpinned as e:
            log.warning("image not resolved at admission", extra=kv(image=image, reason=e.reason, error=e.detail))
            raise

    def close(self) -> None:
        """Nothing to release: lookups still running are daemon threads that end on their own."""


def routes(resolver: Resolver, identity: ControllerIdentity, *, budget: float = RESOLVE_BUDGET) -> dict[str, Handler]:
    """The routes of the cache webhooks for :class:`~controller.webhooks.server.AdmissionServer`."""
    return CacheHooks(resolver, identity, budget=budget).routes()
