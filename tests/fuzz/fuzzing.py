"""What every fuzz test shares: its hypothesis settings and strategies for hostile JSON.

In CI a run is bounded and repeatable: each test tries a fixed number of examples chosen from a
fixed seed (``derandomize``), no example database. ``ACCELNODE_FUZZ_EXAMPLES=N`` runs N examples
per test from a fresh random seed each time (hypothesis prints the seed of any failure; rerun it
with ``--hypothesis-seed``), for a longer hunt on a developer's machine:

    ACCELNODE_FUZZ_EXAMPLES=20000 pytest tests/fuzz -x
"""

from __future__ import annotations

import os
import string

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

LONG = int(os.environ.get("ACCELNODE_FUZZ_EXAMPLES", "0") or 0)


def fuzz_settings(ci_examples: int) -> settings:
    """``ci_examples`` per test in CI (deterministic), else ACCELNODE_FUZZ_EXAMPLES (random)."""
    return settings(max_examples=LONG or ci_examples, derandomize=not LONG, database=None, deadline=None,
                    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                            HealthCheck.filter_too_much,
                                                            HealthCheck.function_scoped_fixture])


# Strings that reach the parsers' corners: empty, huge, control and non-ASCII characters, what
# references, digests, quantities and URLs are made of.
text = st.one_of(st.text(max_size=40), st.text(alphabet=string.printable, max_size=40),
                 st.sampled_from(["", "sha256:", "sha256:" + "a" * 64, "sha512:" + "b" * 128, "latest", "1Gi",
                                  "-1", "1e400", "NaN", "0x10", "../..", "/", "a" * 300, "\x00", "é", "☃",
                                  "http://", "https://x", "127.0.0.1:5000/r@sha256:" + "c" * 64]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=5)), max_leaves=25)


def shaped(template: dict) -> st.SearchStrategy:
    """A dict shaped like ``template`` (a key -> strategy map), each key present or missing and
    some values swapped for any JSON value, plus stray keys: near-valid documents, which reach
    deeper than random ones."""
    def build(draw):
        out = {}
        for key, strategy in template.items():
            choice = draw(st.integers(0, 9))
            if choice == 0:
                continue  # missing
            out[key] = draw(json_values) if choice == 1 else draw(strategy)
        if draw(st.integers(0, 9)) == 0:
            out[draw(text)] = draw(json_values)
        return out
    return st.composite(lambda draw: build(draw))()


# -- objects as the API server stores them ------------------------------------------------------------

_MAX_DEPTH = 12


def from_schema(schema: dict, depth: int = 0) -> st.SearchStrategy:
    """Values that a CRD's structural OpenAPI v3 ``schema`` admits (types, required, enum,
    pattern, lengths, bounds, item counts); CEL rules are not applied, so this is a superset of
    what the API server stores. ``x-kubernetes-preserve-unknown-fields`` objects get any JSON."""
    if depth > _MAX_DEPTH:
        return st.nothing()
    if schema.get("x-kubernetes-int-or-string"):
        return st.one_of(st.integers(), text)
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(
                lambda s: len(s) <= schema.get("maxLength", 1 << 20) and len(s) >= schema.get("minLength", 0))
        if schema.get("format") == "date-time":
            return st.datetimes().map(lambda d: d.strftime("%Y-%m-%dT%H:%M:%SZ"))
        return st.one_of(text, st.text(max_size=schema.get("maxLength", 64))).filter(
            lambda s: schema.get("minLength", 0) <= len(s) <= schema.get("maxLength", 1 << 20))
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**63)), schema.get("maximum", 2**63 - 1))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        items = from_schema(schema.get("items", {}), depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
    props = schema.get("properties")
    if props is None:
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            return st.dictionaries(text, from_schema(extra, depth + 1), max_size=3)
        return json_values if schema.get("x-kubernetes-preserve-unknown-fields") or kind is None else st.just({})
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries({k: from_schema(v, depth + 1) for k, v in props.items() if k in required},
                                 optional={k: from_schema(v, depth + 1) for k, v in props.items()
                                           if k not in required})


# label and annotation keys the daemons read, among any others
_KEYS = st.one_of(text, st.sampled_from(["gkm.io/resolvedDigest", "gkm.io/cache-size-bytes", "gkm.io/signature-format",
                                         "gkm.io/cache-kind", "gkm.io/cache"]))
_VALUES = st.one_of(text, st.sampled_from(["sha256:" + "d" * 64, "1048576", "cosign-v2", "cosign-v3", "GKMCache",
                                           "ClusterGKMCache", "team/cache"]))
_DNS_LABEL = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)


def object_metadata(namespaced: bool) -> st.SearchStrategy:
    """``metadata`` as the API server returns it: a DNS name, a namespace exactly when namespaced."""
    return st.fixed_dictionaries(
        {"name": _DNS_LABEL, **({"namespace": _DNS_LABEL} if namespaced else {})}, optional=_METADATA)


_METADATA = {
    "generation": st.integers(0, 2**40), "uid": st.uuids().map(str), "resourceVersion": text,
    "labels": st.dictionaries(_KEYS, _VALUES, max_size=3), "annotations": st.dictionaries(_KEYS, _VALUES, max_size=3),
    "finalizers": st.lists(text, max_size=2), "deletionTimestamp": st.just("2026-01-01T00:00:00Z")}


def crd_objects(crd_files, kind: str) -> st.SearchStrategy:
    """Objects of ``kind`` as its CRD (in ``crd_files``, multi-document YAML) admits them."""
    import yaml

    for path in crd_files:
        docs = [d for d in yaml.safe_load_all(open(path)) if d]
        for doc in [i for d in docs for i in (d["items"] if d.get("kind") == "List" else [d])]:
            if doc.get("kind") == "CustomResourceDefinition" and doc["spec"]["names"]["kind"] == kind:
                version = next(v for v in doc["spec"]["versions"] if v.get("storage"))
                schema = dict(version["schema"]["openAPIV3Schema"])
                props = {k: v for k, v in schema.get("properties", {}).items() if k not in ("metadata", "apiVersion",
                                                                                            "kind")}
                body = from_schema({**schema, "properties": props})
                group = doc["spec"]["group"]
                metadata = object_metadata(doc["spec"]["scope"] == "Namespaced")
                return st.tuples(body, metadata).map(lambda t: {
                    "apiVersion": f"{group}/{version['name']}", "kind": kind, **t[0], "metadata": t[1]})
    raise LookupError(f"no CRD of kind {kind} in {crd_files}")
