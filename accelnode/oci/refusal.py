"""Whether a node may pull or mount a cache object, judged from the object (its labels and its
``Verified`` condition) and, to mount, from the ClusterCacheTrustPolicy objects themselves
(:func:`mount_refusal`, fail closed): the rules the agent and the CSI driver share. Its own module so that the
node daemons apply it without loading the signature verification of :mod:`accelnode.oci.signatures`
(cryptography, the registry client), which only the controller runs."""

from __future__ import annotations

import re

SIGNATURE_FORMAT_LABEL = "gkm.io/signature-format"


def pull_refusal(labels: dict, conditions: list[dict]) -> tuple[str, str] | None:
    """Why a node must not pull or mount a cache object now, or None: the rule the agent and the
    CSI driver share. ``("False", ...)``: its signature was refused (condition ``Verified``
    False, reason and message); ``("Unknown", ...)``: it needs a signature (a ``Verified``
    condition that is not True, or the ``gkm.io/signature-format`` label) and has no verdict yet."""
    cond = next((c for c in conditions or () if isinstance(c, dict) and c.get("type") == "Verified"), None)
    if cond is not None and cond.get("status") == "False":
        return "False", f"{cond.get('reason')}: {cond.get('message', '')}"
    if cond is not None and cond.get("status") != "True":
        return "Unknown", f"signature not verified yet ({cond.get('reason')}: {cond.get('message', '')})"
    if cond is None and SIGNATURE_FORMAT_LABEL in (labels or {}):
        return "Unknown", (f"label {SIGNATURE_FORMAT_LABEL} asks for a signature and the controller has not "
                           "verified it yet")
    return None


# -- fail closed: what the node decides from the trust policies themselves --------------------

_STAMPED = re.compile(r"\[digest (sha256:[0-9a-f]{64});")


def stamp(digest: str, policy_tags: list[str]) -> str:
    """The tail of a ``Verified`` message naming the digest and the policies (``name@generation``)
    it was judged under: what a node checks the verdict against."""
    return f"[digest {digest}; policies {','.join(policy_tags) or 'none'}]"


def stamped_digest(message: str) -> str | None:
    m = _STAMPED.search(message or "")
    return m[1] if m else None


def covers(policy_spec: dict, namespace: str | None) -> bool:
    """Whether a ClusterCacheTrustPolicy's spec covers caches of ``namespace`` (None: cluster caches)."""
    if namespace is None:
        return bool(policy_spec.get("clusterCaches"))
    names = policy_spec.get("namespaces") or ()
    return "*" in names or namespace in names


def signature_required(namespace: str | None, labels: dict, policies: list[dict]) -> str | None:
    """Why a cache of ``namespace`` (None: a ClusterGKMCache) needs a verified signature, or None:
    its ``gkm.io/signature-format`` label, a covering policy with ``requireSignature``, or (a
    cluster cache) any covering policy. ``policies``: the ClusterCacheTrustPolicy objects."""
    if SIGNATURE_FORMAT_LABEL in (labels or {}):
        return f"label {SIGNATURE_FORMAT_LABEL} asks for a signature"
    for p in policies:
        spec = p.get("spec") or {}
        if covers(spec, namespace) and (namespace is None or spec.get("requireSignature")):
            name = (p.get("metadata") or {}).get("name")
            return f"ClusterCacheTrustPolicy {name} requires a verified signature"
    return None


def mount_refusal(namespace: str | None, labels: dict, conditions: list[dict], digest: str,
                  policies: list[dict]) -> tuple[str, str] | None:
    """Why a node must not mount ``digest`` of a cache object, or None: :func:`pull_refusal`, and,
    where the policies themselves say a signature is required, a ``Verified`` condition True
    whose message names this very digest. Only the controller can write that condition (the
    ValidatingAdmissionPolicy in daemonsets/rbac-controller-caches.yaml), so a missing or
    unrelated one fails closed whether the controller runs or not."""
    refused = pull_refusal(labels, conditions)
    if refused is not None and refused[0] == "False":
        return refused
    why = signature_required(namespace, labels, policies)
    if why is None:
        return refused
    cond = next((c for c in conditions or () if isinstance(c, dict) and c.get("type") == "Verified"), None)
    if cond is None or cond.get("status") != "True":
        return "Unknown", f"{why} and the controller has not verified {digest} yet"
    if stamped_digest(str(cond.get("message", ""))) != digest:
        return "Unknown", (f"{why} and condition Verified is not about {digest} "
                           f"({cond.get('message', '')!r}); the controller has not verified it yet")
    return None
