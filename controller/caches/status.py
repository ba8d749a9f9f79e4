"""The cluster-wide status of a GKMCache / ClusterGKMCache (docs/cache-controller.md), pure.

* :func:`known_pin`: the pin a cache already has, so the registry is asked only when there is
  none (a digest in ``spec.image``; the pin recorded in ``status`` for this very image; the
  annotation the admission webhook of this process wrote).
* :func:`failure`: a registry error as the ``Resolved`` condition's reason.
* :func:`aggregate`: the agents' per-node entries for one cache summed into ``status.counts``.
* :func:`summary`: the reason and message of the condition listed first (the STATUS column).
* :func:`cache_status` / :func:`wanted_annotations`: the status and annotations to write.

Nothing here talks to a server; :mod:`controller.caches.reconciler` reads the inputs and writes the result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from accelnode.oci import errors
from accelnode.oci.errors import quoted
from accelnode.oci.reference import Reference
from accelnode.oci.refusal import VERIFICATION, Verdict

from controller.caches.pinning import DIGEST_ANNOTATION, SIZE_ANNOTATION, Pin

READY = "Ready"  # the summary condition's type (always first: STATUS reads its reason)
RESOLVED = "Resolved"  # the pin condition's type
VERIFIED = "Verified"  # the signature condition (controller/caches/signatures.py); only when a signature is required
OURS = (READY, RESOLVED, VERIFIED)  # conditions of other types are kept as they are
RESOLVED_IMAGE = "resolvedImage"  # the spec.image status.resolvedDigest was pinned for

# Resolved reasons (the shared contract)
REASON_RESOLVED = "Resolved"
REGISTRY_UNAVAILABLE = "RegistryUnavailable"
IMAGE_NOT_FOUND = "ImageNotFound"
INVALID_IMAGE = "InvalidImage"
AUTH_FAILED = "AuthFailed"
RETRYABLE = (REGISTRY_UNAVAILABLE, IMAGE_NOT_FOUND, AUTH_FAILED)  # may heal without a spec change

# summary reasons, most telling first: the first that applies is the cache's STATUS
UNRESOLVED = "Unresolved"  # no pin (the Resolved condition says why)
ERROR = "Error"  # some node failed to pull it or it does not fit a node's accelerators
OUTDATED = "Outdated"  # some pods still use a digest the cache had before
RUNNING = "Running"  # some node holds the current digest and pods use it
EXTRACTED = "Extracted"  # some node holds the current digest, no pod uses it
DOWNLOADING = "Downloading"  # some node is pulling it
PENDING = "Pending"  # some node should prefetch it and has not started
PINNED = "Resolved"  # pinned; no node reports it (pulled when a pod first asks)
UNVERIFIED = "Unverified"  # pinned, but its signature is not verified (the Verified condition says why)
READY_REASONS = (OUTDATED, RUNNING, EXTRACTED, PINNED)  # Ready=True; the others Ready=False

COUNTS = ("nodeCnt", "nodeInUseCnt", "nodeNotInUseCnt", "nodeErrorCnt", "podRunningCnt", "podOutdatedCnt",
          "podDeletingCnt")
IN_USE = ("Running", "Outdated", "Deleting")
MAX_MESSAGE = 1024  # of a node's error quoted in the summary
_DIGEST = re.compile(r"^sha(?:256:[a-f0-9]{64}|512:[a-f0-9]{128})$")


# ---------------------------------------------------------------------------------------------
# the pin


def pinned_message(image: str, digest: str) -> str:
    """The Resolved=True message, for people (``status.resolvedImage`` records which image the
    digest belongs to, so a changed ``spec.image`` (a roll) is told from an unchanged one after
    any restart)."""
    return f"{image} is pinned to {digest}"


def condition(obj: dict, kind: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or () if c.get("type") == kind), None)


def annotated_size(annotations: dict) -> int | None:
    raw = annotations.get(SIZE_ANNOTATION, "")
    return int(raw) if raw.isdigit() else None


def known_pin(obj: dict) -> Pin | None:
    """The pin of a cache that needs no registry, or None when its image must be resolved.

    In order: ``status.resolvedDigest`` when ``status.resolvedImage`` says it was pinned for this
    same image (both written by the controller's identity only); the ``gkm.io/resolvedDigest`` annotation when ``status`` has no digest yet (only
    the admission webhook of this process or this reconciler writes it, and a changed image gets
    a fresh one there). Both were answered by the registry; a digest ``spec.image`` names was
    not, so it is pinned only once one of them agrees (docs/security.md). Raises
    :class:`~accelnode.oci.errors.InvalidReference` for an image we cannot pull."""
    image = (obj.get("spec") or {}).get("image", "")
    ref = Reference.parse(image)
    ann = (obj.get("metadata") or {}).get("annotations") or {}

    def size_for(digest: str) -> int | None:
        return annotated_size(ann) if ann.get(DIGEST_ANNOTATION) == digest else None

    pin = _known_pin(obj, image, ann, size_for)
    return pin if pin is None or not ref.digest or pin.digest == ref.digest else None


def _known_pin(obj: dict, image: str, ann: dict, size_for) -> Pin | None:
    status = obj.get("status") or {}
    recorded = status.get("resolvedDigest")
    if recorded:
        if status.get(RESOLVED_IMAGE) == image:  # data only the controller writes; no message is read
            return Pin(image, recorded, size_for(recorded))
        return None  # pinned for another image (a roll), or before resolvedImage was recorded: resolve again
    admitted = ann.get(DIGEST_ANNOTATION, "")
    if _DIGEST.match(admitted):
        return Pin(image, admitted, annotated_size(ann))
    return None


def failure(err: errors.ImageError) -> str:
    """The Resolved=False reason for an error of the OCI library."""
    if isinstance(err, errors.ImageNotFound):
        return IMAGE_NOT_FOUND
    if isinstance(err, errors.AuthError):
        return AUTH_FAILED
    if isinstance(err, (errors.RegistryUnavailable, errors.IntegrityError)):
        return REGISTRY_UNAVAILABLE  # unreachable, kept failing, or garbled in transit
    return INVALID_IMAGE  # a malformed reference, or content that is not a usable image


def wanted_annotations(annotations: dict, pin: Pin | None) -> dict:
    """``annotations`` with ``gkm.io/resolvedDigest`` / ``gkm.io/cache-size-bytes`` mirroring
    the pin (both removed when there is none; a size is kept only beside its own digest)."""
    out = dict(annotations)
    if pin is None:
        out.pop(DIGEST_ANNOTATION, None)
        out.pop(SIZE_ANNOTATION, None)
        return out
    if pin.size_bytes is not None:
        out[SIZE_ANNOTATION] = str(pin.size_bytes)
    elif out.get(DIGEST_ANNOTATION) != pin.digest:
        out.pop(SIZE_ANNOTATION, None)
    out[DIGEST_ANNOTATION] = pin.digest
    return out


# ---------------------------------------------------------------------------------------------
# the agents' reports


@dataclass(frozen=True)
class Aggregate:
    counts: dict
    held: int  # nodes holding the current digest (an Extracted or Running entry for the pin)
    downloading: int
    pending: int
    errors: list  # (node, message) of each node with an Error entry, by node name
    outdated: bool  # an Outdated entry somewhere (or a Running one for a digest before the pin)


CACHE_DIGEST = "cacheDigest"  # an entry's field: the cache digest the agent reported it for


def for_pin(key: str, entry: dict, digest: str | None) -> bool:
    """Whether a node's entry (under status key ``key``) is about the pinned ``digest``: its key
    is the pin (a single manifest, or any state keyed by the cache's digest), or the agent says
    it reported the entry for that cache digest (``cacheDigest``: an image index's platform
    manifest is keyed by the manifest). An agent that has not yet seen a new pin still reports
    the old digest as Extracted/Running, with the old ``cacheDigest``; an older agent writes no
    ``cacheDigest``, so its entries count only when keyed by the pin itself."""
    return digest is not None and (key == digest or entry.get(CACHE_DIGEST) == digest)


def _as_seen(key: str, entry: dict, digest: str | None) -> str | None:
    """The state an entry counts as: Extracted/Running only for the pin; an Extracted entry of
    another digest holds nothing the cache names (None), a Running one has its pods on an older
    digest (Outdated, as the agent reports it once it sees the pin). Other states as written."""
    state = entry.get("state")
    if state in ("Extracted", "Running") and not for_pin(key, entry, digest):
        return "Outdated" if state == "Running" else None
    return state


def aggregate(reports: dict[str, dict], digest: str | None) -> Aggregate:
    """Sum one cache's entries over the nodes that report it: ``reports`` maps a node name to
    the cache's ``status.caches[<cache name>]`` of that node's object (digest -> entry);
    ``digest`` is the pin (None without one).

    Per node, as the agent counts one object (docs/agent-status.md), but for this cache only,
    each entry counted as :func:`_as_seen` says:
    ``nodeCnt`` 1 when it reports the cache at all; ``nodeInUseCnt`` when an entry is Running,
    Outdated or Deleting; ``nodeNotInUseCnt`` when not in use and an entry is Extracted;
    ``nodeErrorCnt`` when an entry is Error; pods are distinct per state."""
    counts = dict.fromkeys(COUNTS, 0)
    held = downloading = pending = 0
    errs, outdated = [], False
    for node in sorted(reports):
        entries = [(_as_seen(k, e, digest), e) for k, e in (reports[node] or {}).items() if isinstance(e, dict)]
        if not entries:
            continue
        states = {s for s, _ in entries}
        in_use = bool(states & set(IN_USE))
        counts["nodeCnt"] += 1
        counts["nodeInUseCnt"] += in_use
        counts["nodeNotInUseCnt"] += not in_use and "Extracted" in states
        counts["nodeErrorCnt"] += "Error" in states
        for state, field in (("Running", "podRunningCnt"), ("Outdated", "podOutdatedCnt"),
                             ("Deleting", "podDeletingCnt")):
            counts[field] += len({(p.get("podNamespace"), p.get("podName")) for s, e in entries
                                  if s == state for p in e.get("pods") or ()})
        held += bool(states & {"Extracted", "Running"})
        downloading += "Downloading" in states
        pending += "Pending" in states
        outdated = outdated or "Outdated" in states
        if "Error" in states:
            msg = next((e.get("message") for s, e in sorted(entries, key=lambda se: se[1].get("message") or "")
                        if s == "Error"), None) or "no message"
            errs.append((node, msg[:MAX_MESSAGE]))
    return Aggregate(counts, held, downloading, pending, errs, outdated)


# how often one cache's status may be written (docs/cache-controller.md, "Coalescing")

MIN_WRITE_INTERVAL = 1.0  # seconds between two writes of one cache, at any size
FANOUT_PER_SECOND = 1000.0  # watch events a second one cache's status writes may cause (--cache-status-fanout)


def write_interval(nodes: int, fanout_per_second: float = FANOUT_PER_SECOND) -> float:
    """Seconds between two status writes of a cache counted on ``nodes`` nodes:
    ``max(1, nodes / fanout_per_second)``. Every write of a cache reaches every agent's cache
    watch (one event each), so a cache's writes cause at most about ``fanout_per_second`` watch
    events a second, whatever the fleet's size (docs/scale.md): 1 s up to 1,000 nodes, 5 s at
    5,000. The cost is the status's lag behind the nodes, one interval at most."""
    if not fanout_per_second > 0:
        raise ValueError(f"the status fan-out must be a positive number of events a second, not {fanout_per_second!r}")
    return max(MIN_WRITE_INTERVAL, max(0, nodes) / fanout_per_second)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def summary(pin: Pin | None, unresolved_message: str, agg: Aggregate) -> tuple[str, str]:
    """(reason, message) of the summary condition: the first of Unresolved, Error, Outdated,
    Running, Extracted, Downloading, Pending, Resolved that applies."""
    if pin is None:
        return UNRESOLVED, unresolved_message
    c = agg.counts
    if not c["nodeCnt"]:
        return PINNED, f"pinned to {pin.digest}; no node holds it yet"
    parts = [f"{agg.held} of {_n(c['nodeCnt'], 'node')} hold {pin.digest}"]
    if c["podRunningCnt"]:
        parts.append(f"{_n(c['podRunningCnt'], 'pod')} running")
    if agg.downloading:
        parts.append(f"{agg.downloading} downloading")
    if agg.pending:
        parts.append(f"{agg.pending} pending")
    if c["podOutdatedCnt"]:
        parts.append(f"{_n(c['podOutdatedCnt'], 'pod')} still on an older digest")
    if agg.errors:
        node, msg = agg.errors[0]
        parts.append(f"{_n(len(agg.errors), 'node')} failed ({node}: {quoted(msg, MAX_MESSAGE)})")  # a registry's words
    message = "; ".join(parts)
    if agg.errors:
        return ERROR, message
    if agg.outdated:
        return OUTDATED, message
    if c["podRunningCnt"] or c["nodeInUseCnt"]:
        return RUNNING, message
    if agg.held:
        return EXTRACTED, message
    if agg.downloading:
        return DOWNLOADING, message
    if agg.pending:
        return PENDING, message
    return PINNED, message  # only Deleting entries left from an earlier cache of that name


# ---------------------------------------------------------------------------------------------
# the status to write


def _condition(old: dict | None, kind: str, status: str, reason: str, message: str, generation, now: str) -> dict:
    """A condition; ``lastTransitionTime`` moves only when its status or reason does."""
    cond = {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": now}
    if old and old.get("status") == status and old.get("reason") == reason and old.get("lastTransitionTime"):
        cond["lastTransitionTime"] = old["lastTransitionTime"]
    if isinstance(generation, int):
        cond["observedGeneration"] = generation
    return cond


def cache_status(obj: dict, pin: Pin | None, resolved: tuple[str, str], agg: Aggregate, now: str, *,
                 verified: tuple[str, str, str] | None = None, verification: Verdict | None = None) -> dict:
    """The wanted ``status`` of the cache ``obj``: ``resolvedDigest`` and ``resolvedImage``
    (absent without a pin),
    ``verification`` (the verdict on that digest, absent without one: it never outlives a change
    of digest), ``counts``, ``conditions`` (Ready first, then Resolved, then Verified when
    ``verified`` (status, reason, message) is given, then any other type as it was) and
    ``lastUpdated`` (``now`` when anything else changed, else as it was). Fields written by
    others (``pvcStatus``, ``pvcOwner``) are kept."""
    old = obj.get("status") or {}
    generation = (obj.get("metadata") or {}).get("generation")
    reason, message = summary(pin, resolved[1], agg)
    if verified is not None and verified[0] != "True":  # never pulled: the signature is the story
        reason, message = UNVERIFIED, f"signature not verified ({verified[1]}): {verified[2]}"
    ready = _condition(condition(obj, READY), READY, "True" if reason in READY_REASONS else "False", reason,
                       message, generation, now)
    res = _condition(condition(obj, RESOLVED), RESOLVED, "True" if resolved[0] == REASON_RESOLVED else "False",
                     resolved[0], resolved[1], generation, now)
    others = [c for c in old.get("conditions") or () if c.get("type") not in OURS]
    if verified is not None:
        others.insert(0, _condition(condition(obj, VERIFIED), VERIFIED, *verified, generation, now))
    status = {k: v for k, v in old.items() if k not in ("resolvedDigest", RESOLVED_IMAGE, VERIFICATION, "counts",
                                                         "conditions", "lastUpdated")}
    if pin is not None:
        status["resolvedDigest"], status[RESOLVED_IMAGE] = pin.digest, pin.image
        if verification is not None and verification.digest == pin.digest:
            status[VERIFICATION] = verification.to_status()
    status["counts"] = agg.counts
    status["conditions"] = [ready, res, *others]
    before = {k: v for k, v in old.items() if k != "lastUpdated"}
    status["lastUpdated"] = old["lastUpdated"] if before == status and old.get("lastUpdated") else now
    return status
