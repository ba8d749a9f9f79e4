"""Whether a node may pull or mount a cache object, judged from the object alone (its labels and its
``Verified`` condition): the rule the agent and the CSI driver share. Its own module so that the
node daemons apply it without loading the signature verification of :mod:`accelnode.oci.signatures`
(cryptography, the registry client), which only the controller runs."""

from __future__ import annotations

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
