"""The cache webhooks' decisions without a server (controller/caches/webhooks.py): the JSON Patch,
the pin plan, the rule on who may write the pin, the controller's identity, the registry budget."""

from __future__ import annotations

import threading

import pytest

from accelnode.oci.errors import AuthError, ImageNotFound, RegistryUnavailable
from controller.caches.webhooks import (BadCache, CacheHooks, ControllerIdentity, Unpinned, annotation_patch, check_pin,
                                   image_of, plan_pin)
from controller.caches.pinning import DIGEST_ANNOTATION as D
from controller.caches.pinning import SIZE_ANNOTATION as S
from controller.caches.pinning import Pin

IMAGE = "registry.example.com:5000/caches/jax:v1"
A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
CONTROLLER = "system:serviceaccount:accelnode-system:accelnode-controller"


def cache(image=IMAGE, annotations=None, status=None, **meta) -> dict:
    obj = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache",
           "metadata": {"name": "c", "namespace": "ns", **meta}, "spec": {"image": image}}
    if annotations is not None:
        obj["metadata"]["annotations"] = annotations
    if status is not None:
        obj["status"] = status
    return obj


class Registry:
    """What the Resolver would answer: a digest per image, or an error; counts its calls."""

    def __init__(self, answers=None, error=None):
        self.answers = answers if answers is not None else {IMAGE: (A, 1234)}
        self.error = error
        self.calls: list[str] = []

    def __call__(self, image, namespace=None, public=False):
        self.calls.append(image)
        if self.error is not None:
            raise self.error
        digest, size = self.answers[image]
        return Pin(image, digest, size)

    pin = __call__  # the Resolver's method name


def apply(obj: dict, patch: list) -> dict:
    """A tiny JSON Patch applier for the operations annotation_patch emits."""
    import copy

    out = copy.deepcopy(obj)
    for op in patch:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = out
        for p in parts[:-1]:
            parent = parent[p]
        if op["op"] == "add":
            parent[parts[-1]] = op["value"]
        elif op["op"] == "remove":
            del parent[parts[-1]]
        else:
            raise AssertionError(op)
    return out


# -- annotation_patch ------------------------------------------------------------------------------


def test_patch_adds_the_annotations_map_when_there_is_none():
    assert annotation_patch(None, {D: A, S: "12"}) == [
        {"op": "add", "path": "/metadata/annotations", "value": {D: A, S: "12"}}]
    assert annotation_patch(None, {D: A, S: None}) == [
        {"op": "add", "path": "/metadata/annotations", "value": {D: A}}]
    assert annotation_patch(None, {D: None, S: None}) == []


def test_patch_escapes_keys_and_touches_only_what_differs():
    ann = {"keep": "me", D: B, S: "99"}
    patch = annotation_patch(ann, {D: A, S: None})
    assert patch == [{"op": "add", "path": "/metadata/annotations/gkm.io~1resolvedDigest", "value": A},
                     {"op": "remove", "path": "/metadata/annotations/gkm.io~1cache-size-bytes"}]
    assert apply({"metadata": {"annotations": ann}}, patch)["metadata"]["annotations"] == {"keep": "me", D: A}
    assert annotation_patch({D: A, "x": "y"}, {D: A, S: None}) == []


# -- plan_pin (mutating) ---------------------------------------------------------------------------


def test_create_by_tag_is_pinned_with_size():
    reg = Registry()
    patch, warnings = plan_pin(cache(labels={"a": "b"}), None, reg)
    assert apply(cache(), patch)["metadata"]["annotations"] == {D: A, S: "1234"}
    assert warnings == () and reg.calls == [IMAGE]


def test_a_forged_digest_is_overwritten_and_an_unknown_size_removed():
    reg = Registry({IMAGE: (A, None)})
    obj = cache(annotations={D: B, S: "1", "other": "x"})
    patch, _ = plan_pin(obj, None, reg)
    assert apply(obj, patch)["metadata"]["annotations"] == {D: A, "other": "x"}


def test_reinvocation_of_a_pinned_object_is_an_empty_patch():
    obj = cache(annotations={D: A, S: "1234"})
    assert plan_pin(obj, None, Registry()) == ([], ())


@pytest.mark.parametrize("error, reason", [
    (RegistryUnavailable("connection refused", IMAGE), "unreachable"),
    (ImageNotFound("manifest unknown", IMAGE), "no such image"),
    (AuthError("denied", IMAGE), "credentials"),
])
def test_registry_trouble_admits_unpinned_with_a_warning(error, reason):
    hooks = CacheHooks(Registry(error=error), ControllerIdentity.fixed(CONTROLLER), budget=5)
    obj = cache(annotations={D: B, S: "5"})
    try:
        patch, warnings = plan_pin(obj, None, hooks.resolve)
    finally:
        hooks.close()
    assert apply(obj, patch)["metadata"]["annotations"] == {}
    (w,) = warnings
    assert reason in w and "pins spec.image" in w and "when the registry answers" in w


def test_update_keeping_the_image_keeps_the_pin_without_a_registry_call():
    reg = Registry({IMAGE: (B, 1)})  # the tag moved: the registry now says B
    old = cache(annotations={D: A, S: "1234"})
    new = cache(annotations={D: A, S: "1234"}, labels={"x": "y"})
    assert plan_pin(new, old, reg) == ([], ())
    forged = cache(annotations={D: B})
    patch, _ = plan_pin(forged, old, reg)
    assert apply(forged, patch)["metadata"]["annotations"] == {D: A, S: "1234"}
    assert reg.calls == []


def test_update_changing_the_image_resolves_it_again():
    new_image = IMAGE.replace(":v1", ":v2")
    reg = Registry({new_image: (B, None)})
    old = cache(annotations={D: A, S: "1234"})
    new = cache(new_image, annotations={D: A, S: "1234"})
    patch, _ = plan_pin(new, old, reg)
    assert apply(new, patch)["metadata"]["annotations"] == {D: B}
    assert reg.calls == [new_image]


def test_update_of_an_unpinned_cache_resolves():
    reg = Registry()
    patch, _ = plan_pin(cache(), cache(), reg)
    assert apply(cache(), patch)["metadata"]["annotations"] == {D: A, S: "1234"}


def test_a_digest_image_pins_to_its_digest():
    image = f"registry.example.com/caches/jax@{A}"
    reg = Registry({image: (A, None)})
    patch, _ = plan_pin(cache(image), None, reg)
    assert apply(cache(image), patch)["metadata"]["annotations"] == {D: A}


@pytest.mark.parametrize("obj, fragment", [
    (cache("nginx:latest"), "spec.image 'nginx:latest' is not an image reference"),
    (cache("quay.io/Upper/Case:v1"), "spec.image"),
    (cache(""), "spec.image is required"),
    ({"metadata": {"name": "c"}, "spec": {}}, "spec.image is required"),
    ({"metadata": {"name": "c"}, "spec": "nonsense"}, "spec.image is required"),
    ({"spec": {"image": IMAGE}}, "metadata is missing"),
    ("not an object", "spec.image is required"),
])
def test_bad_objects_are_refused_with_the_field_named(obj, fragment):
    reg = Registry()
    with pytest.raises(BadCache) as e:
        plan_pin(obj, None, reg)
    assert fragment in str(e.value)
    assert reg.calls == []


# -- check_pin (validating, non-controller users) --------------------------------------------------


def test_no_pin_is_fine_and_asks_nothing():
    reg = Registry(error=RegistryUnavailable("down"))
    assert check_pin(cache(), None, reg) is None
    assert check_pin(cache(labels={"a": "b"}), cache(), reg) is None
    assert reg.calls == []


def test_an_unchanged_pin_of_an_unchanged_image_is_fine_without_the_registry():
    reg = Registry(error=RegistryUnavailable("down"))
    old = cache(annotations={D: A, S: "1234"})
    assert check_pin(cache(annotations={D: A, S: "1234"}, labels={"x": "y"}), old, reg) is None
    assert reg.calls == []


def test_a_pin_equal_to_the_resolution_is_fine():
    assert check_pin(cache(annotations={D: A, S: "1234"}), None, Registry()) is None
    assert check_pin(cache(annotations={D: A}), None, Registry()) is None  # a size may be left out


def test_a_forged_digest_is_refused_even_without_the_mutating_webhook():
    msg = check_pin(cache(annotations={D: B}), None, Registry())
    assert msg and D in msg and "not what spec.image" in msg


def test_a_kept_annotation_with_a_changed_image_must_match_the_new_image():
    new_image = IMAGE.replace(":v1", ":v2")
    old = cache(annotations={D: A})
    assert check_pin(cache(new_image, annotations={D: A}), old, Registry({new_image: (B, None)}))
    assert check_pin(cache(new_image, annotations={D: B}), old, Registry({new_image: (B, None)})) is None


def test_a_forged_size_is_refused():
    assert S in check_pin(cache(annotations={D: A, S: "1"}), None, Registry())
    assert S in check_pin(cache(annotations={S: "1"}), None, Registry())
    assert S in check_pin(cache(annotations={D: A, S: "1"}), None, Registry({IMAGE: (A, None)}))


def test_an_unverifiable_pin_is_refused_with_advice():
    hooks = CacheHooks(Registry(error=RegistryUnavailable("refused", IMAGE)), ControllerIdentity.fixed(CONTROLLER),
                       budget=5)
    try:
        msg = check_pin(cache(annotations={D: A}), None, hooks.resolve)
    finally:
        hooks.close()
    assert "cannot be checked" in msg and "remove" in msg


def test_status_digest_is_the_controllers_alone():
    old = cache(status={"resolvedDigest": A})
    assert "status.resolvedDigest" in check_pin(cache(status={"resolvedDigest": B}), old, Registry())
    assert "status.resolvedDigest" in check_pin(cache(status={}), old, Registry())
    assert "status.resolvedDigest" in check_pin(cache(status={"resolvedDigest": A}), cache(), Registry())
    # other status fields are not this webhook's business
    assert check_pin(cache(status={"resolvedDigest": A, "counts": {"nodeCnt": 1}}), old, Registry()) is None


# -- the handlers: identity, operations, denials ---------------------------------------------------


def review(obj, old=None, user="alice", operation=None, sub=None) -> dict:
    req = {"uid": "u", "kind": {"group": "gkm.io", "version": "v1alpha1", "kind": "GKMCache"},
           "operation": operation or ("UPDATE" if old is not None else "CREATE"), "namespace": "ns", "name": "c",
           "object": obj, "oldObject": old, "userInfo": {"username": user, "groups": ["system:authenticated"]}}
    if sub:
        req["subResource"] = sub
    return req


@pytest.fixture
def hooks():
    reg = Registry()
    h = CacheHooks(reg, ControllerIdentity.fixed(CONTROLLER), budget=5)
    h.registry = reg
    yield h
    h.close()


def test_the_controllers_requests_pass_untouched(hooks):
    forged = cache("nginx:latest", annotations={D: B}, status={"resolvedDigest": B})
    for handler in (hooks.mutate, hooks.validate):
        resp = handler(review(forged, cache(), user=CONTROLLER))
        assert resp.allowed and resp.patch is None and not resp.message
    assert hooks.registry.calls == []


def test_handlers_deny_and_allow_with_codes(hooks):
    resp = hooks.mutate(review(cache("cache/app:v1")))
    assert (resp.allowed, resp.code) == (False, 422) and "spec.image" in resp.message
    resp = hooks.validate(review(cache(status={"resolvedDigest": A}), cache(), sub="status"))
    assert (resp.allowed, resp.code) == (False, 403) and "status.resolvedDigest" in resp.message
    resp = hooks.mutate(review(cache()))
    assert resp.allowed and resp.patch == [{"op": "add", "path": "/metadata/annotations", "value": {D: A, S: "1234"}}]
    assert hooks.validate(review(cache(annotations={D: A, S: "1234"}))).allowed
    assert hooks.registry.calls == [IMAGE, IMAGE]  # a Registry stub does not cache; the real Resolver does


def test_other_operations_and_odd_user_info_are_handled(hooks):
    assert hooks.mutate(review(cache(), operation="DELETE")).allowed
    odd = review(cache("bad"))
    odd["userInfo"] = "nonsense"
    assert not hooks.validate(odd).allowed  # treated as anyone: the invalid image is refused


def test_the_registry_budget_bounds_an_admission():
    release = threading.Event()
    calls = []

    class Stuck:
        def pin(self, image, namespace=None, public=False):
            calls.append(image)
            release.wait(30)
            raise RegistryUnavailable("late", image)

    h = CacheHooks(Stuck(), ControllerIdentity.fixed(CONTROLLER), budget=0.2, max_lookups=1)
    try:
        with pytest.raises(Unpinned, match="did not answer within 0.2s"):
            h.resolve(IMAGE)
        resp = h.mutate(review(cache(annotations={D: B})))  # waits on the same lookup
        assert resp.allowed and resp.warnings and resp.patch == [
            {"op": "remove", "path": "/metadata/annotations/gkm.io~1resolvedDigest"}]
        with pytest.raises(Unpinned, match="already under way"):  # over max_lookups: no wait at all
            h.resolve(IMAGE.replace(":v1", ":v2"))
        assert calls == [IMAGE]  # one registry lookup however many admissions wait for it
    finally:
        release.set()
        h.close()


# -- ControllerIdentity ----------------------------------------------------------------------------


def test_identity_is_looked_up_once_and_retried_after_failure():
    answers = [RuntimeError("API down"), CONTROLLER]
    calls = []

    def lookup():
        calls.append(1)
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    ident = ControllerIdentity(lookup, retry=0.0)
    assert ident.username() is None
    assert ident.username() == CONTROLLER
    assert ident.username() == CONTROLLER and len(calls) == 2

    slow = ControllerIdentity(lambda: (_ for _ in ()).throw(RuntimeError("down")), retry=3600)
    assert slow.username() is None and slow.username() is None  # no second try within the retry period


def test_image_of_accepts_what_reference_parse_accepts():
    assert image_of(cache("localhost/x:v1")) == "localhost/x:v1"
    assert image_of(cache(f"127.0.0.1:5000/a/b@{A}")) == f"127.0.0.1:5000/a/b@{A}"
