"""The trust rules the controller and the nodes share (docs/signatures.md): which caches must be
signed, which ClusterCacheTrustPolicy objects cover a cache (its *covering set*), the verdict as
typed status data (:class:`Verdict`, ``status.verification``), and whether a node may pull or
mount a digest (:func:`pull_refusal`, :func:`mount_refusal`, fail closed).

Its own module, light on imports, so that the node daemons apply the rules without loading the
signature verification of :mod:`accelnode.oci.signatures` (cryptography, the registry client),
which only the controller runs; and so that the rule "must this digest be signed" is written
once. A verdict is data: nothing here (or anywhere) reads a condition's message. Only the
controller's identity may write ``status.verification`` (the ValidatingAdmissionPolicy in
daemonsets/rbac-controller-caches.yaml), so a node trusts it as it trusts ``resolvedDigest``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .reference import DIGEST

POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL = "accelnode.io", "v1alpha1", "clustercachetrustpolicies"
SIGNATURE_FORMAT_LABEL = "gkm.io/signature-format"
V2, V3 = "cosign-v2", "cosign-v3"
FORMATS = (V2, V3)
VERIFICATION = "verification"  # the status field holding the verdict
MAX_POLICIES = 512  # policies one verdict may name (the CRD's maxItems)


# -- the policies: whom each covers ---------------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """What a ClusterCacheTrustPolicy says about whom it covers: all a node needs of it."""

    name: str
    generation: int
    namespaces: tuple[str, ...] = ()  # "*": every namespace
    cluster_caches: bool = False
    require: bool = False

    @classmethod
    def of(cls, obj: dict) -> "Scope":
        md, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        gen = md.get("generation")
        return cls(str(md.get("name") or ""), gen if isinstance(gen, int) else 0,
                   tuple(str(n) for n in spec.get("namespaces") or () if isinstance(n, str)),
                   spec.get("clusterCaches") is True, spec.get("requireSignature") is True)

    @property
    def tag(self) -> str:
        """``name@generation``: a policy as a verdict names it (any edit moves the generation)."""
        return f"{self.name}@{self.generation}"

    def covers(self, namespace: str | None) -> bool:
        """Whether it covers caches of ``namespace`` (None: cluster caches)."""
        if namespace is None:
            return self.cluster_caches
        return "*" in self.namespaces or namespace in self.namespaces


def trim_policy(obj: dict) -> dict:
    """What a node keeps of a policy object: its name, generation and whom it covers."""
    md, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    return {"metadata": {k: md[k] for k in ("name", "generation") if k in md},
            "spec": {k: spec[k] for k in ("namespaces", "clusterCaches", "requireSignature") if k in spec}}


def covering(policies, namespace: str | None) -> list:
    """The policies covering caches of ``namespace`` (None: cluster caches), by name: policy
    objects, or :class:`Scope` (the controller's parsed policies are one)."""
    scopes = [p if isinstance(p, Scope) else Scope.of(p) for p in policies]
    return sorted((p for p in scopes if p.covers(namespace)), key=lambda p: p.name)


def policy_set(policies, namespace: str | None) -> tuple[str, ...]:
    """The covering set as a verdict records it: ``name@generation`` of each covering policy."""
    return tuple(p.tag for p in covering(policies, namespace))


@dataclass(frozen=True)
class Requirement:
    """Why a cache must be signed, and the formats to look for."""

    why: str
    formats: tuple[str, ...] = FORMATS


def requirement(namespace: str | None, labels: dict, policies) -> Requirement | None:
    """Must a cache of ``namespace`` (None: a ClusterGKMCache) with ``labels`` be signed, under
    ``policies`` (objects or parsed)? Its ``gkm.io/signature-format`` label (that format only), a
    covering policy with ``requireSignature``, or, a cluster cache, any covering policy."""
    label = (labels or {}).get(SIGNATURE_FORMAT_LABEL)
    if label is not None:
        return Requirement(f"label {SIGNATURE_FORMAT_LABEL} asks for a signature", (str(label),))
    for p in covering(policies, namespace):
        if namespace is None or p.require:
            return Requirement(f"ClusterCacheTrustPolicy {p.name} requires a verified signature")
    return None


# -- the verdict: typed status data --------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """``status.verification``: the controller's judgment of one digest under one covering set.

    ``verified`` True: a signature of exactly ``digest`` verifies under a key (or identity) of
    the policies ``policies`` (``name@generation``, sorted); ``signer`` names it and
    ``fingerprint`` is the key material's (so an outage keeps a verdict only while that very key
    is still trusted). ``reason``: one of docs/signatures.md's. ``time``: when it was judged."""

    digest: str
    policies: tuple[str, ...]
    verified: bool
    reason: str
    time: str
    formats: tuple[str, ...] = FORMATS
    signer: str = ""
    fingerprint: str = ""

    def to_status(self) -> dict:
        out = {"digest": self.digest, "policies": list(self.policies), "verified": self.verified,
               "reason": self.reason, "time": self.time, "formats": list(self.formats)}
        if self.signer:
            out["signer"] = self.signer
        if self.fingerprint:
            out["fingerprint"] = self.fingerprint
        return out

    @classmethod
    def of(cls, status: dict | None) -> "Verdict | None":
        """The verdict in a cache's ``status``; None when there is none or it is not well formed
        (the CRD's schema refuses such, so none is trusted either)."""
        v = (status or {}).get(VERIFICATION)
        if not isinstance(v, dict):
            return None
        digest, policies, verified = v.get("digest"), v.get("policies"), v.get("verified")
        formats = v.get("formats", list(FORMATS))
        if not (isinstance(digest, str) and DIGEST.match(digest) and isinstance(verified, bool)
                and isinstance(policies, list) and all(isinstance(p, str) for p in policies)
                and isinstance(formats, list) and all(isinstance(f, str) for f in formats)):
            return None
        text = {k: v.get(k) if isinstance(v.get(k), str) else "" for k in ("reason", "time", "signer", "fingerprint")}
        return cls(digest, tuple(policies), verified, text["reason"], text["time"], tuple(formats), text["signer"],
                   text["fingerprint"])


# -- what a node decides ---------------------------------------------------------------------------


def _has_verified_condition(status: dict) -> bool:
    return any(isinstance(c, dict) and c.get("type") == "Verified" for c in (status or {}).get("conditions") or ())


def pull_refusal(labels: dict, status: dict | None, digest: str | None) -> tuple[str, str] | None:
    """Why a node must not pull (or mount) ``digest`` of a cache object now, or None: the rule
    the agent and the CSI driver share, from the object alone. ``("False", ...)``: the verdict on
    this digest is a refusal; ``("Unknown", ...)``: it needs a signature (its label, or the
    controller judges it: a verdict or a ``Verified`` condition exists) and there is no verdict
    on this digest yet."""
    v = Verdict.of(status)
    if v is not None and v.digest == digest:
        return None if v.verified else ("False", f"{v.reason} (verdict of {v.time} on {digest})")
    if v is not None or _has_verified_condition(status or {}):
        return "Unknown", f"the controller has not verified {digest} yet"
    if SIGNATURE_FORMAT_LABEL in (labels or {}):
        return "Unknown", (f"label {SIGNATURE_FORMAT_LABEL} asks for a signature and the controller has not "
                           f"verified {digest} yet")
    return None


def mount_refusal(namespace: str | None, labels: dict, status: dict | None, digest: str,
                  policies) -> tuple[str, str] | None:
    """Why a node must not mount ``digest`` of a cache object, or None: :func:`pull_refusal`,
    and, where the policies themselves say a signature is required, a verdict on this very
    digest, accepted, under exactly the policies that cover the cache now. A missing verdict,
    one on another digest, or one judged under another covering set (a key removed, a policy
    added, edited or deleted) fails closed whether the controller runs or not."""
    refused = pull_refusal(labels, status, digest)
    if refused is not None and refused[0] == "False":
        return refused
    need = requirement(namespace, labels, policies)
    if need is None:
        return refused
    v = Verdict.of(status)
    if v is None or v.digest != digest:
        return "Unknown", f"{need.why} and the controller has not verified {digest} yet"
    now = policy_set(policies, namespace)
    if v.policies != now:
        return "Unknown", (f"{need.why} and the verdict on {digest} was judged under policies "
                           f"{', '.join(v.policies) or 'none'}, not those covering the cache now "
                           f"({', '.join(now) or 'none'}); the controller has not verified it under them yet")
    return None
