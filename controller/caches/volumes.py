"""The PersistentVolume / PersistentVolumeClaim pair the claims reconciler makes for a cache in
each workload namespace, and the ``status.pvcStatus`` that reports it (docs/cache-claims.md).

Pure: nothing here talks to a server (:mod:`controller.caches.claims` reads and writes). The
pair is statically pre-bound, so it binds without a provisioner whatever StorageClasses exist;
its volume attributes are those of an inline volume, read the same way by the CSI driver;
:func:`is_ours` decides whether a PV/PVC was made by the controller for this very cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from accelnode import volumeattrs
from accelnode.kube.quantity import to_bytes
from controller.caches.pinning import GROUP, SIZE_ANNOTATION, VERSION

FINALIZER = "gkm.io/claims"  # on a cache with claims: they are deleted, in order, before it goes
DRIVER = volumeattrs.DRIVER
# the CSI driver's volume attributes (csi_driver/resolve.py reads them)
CACHE_ATTRIBUTE, NAMESPACE_ATTRIBUTE = volumeattrs.CACHE, volumeattrs.NAMESPACE

KIND_LABEL = "gkm.io/cache-kind"  # GKMCache | ClusterGKMCache: what the reconcilers' watches select
NAME_LABEL = "gkm.io/cache-name"  # the cache's name (left out when longer than a label value may be)
NAMESPACE_LABEL = "gkm.io/cache-namespace"  # the cache's namespace (a GKMCache's only)
WORKLOAD_LABEL = "gkm.io/workload-namespace"  # on the PV: the namespace of its claim
CACHE_ANNOTATION = "gkm.io/cache"  # the cache's key, ``namespace/name`` or ``name``: always complete

PLACEHOLDER_BYTES = 1 << 20  # PV capacity while the cache's size is unknown (1Mi)
MAX_REQUEST_BYTES = 1 << 20  # a claim requests at most this (it provisions nothing)
PVC_OWNER = "Operator"  # GKM's name for "the controller made the claim" (status.pvcOwner)

BOUND = "Bound"  # the condition type of a pvcStatus entry
# its reasons
REASON_BOUND = "Bound"  # True: PV and PVC are Bound to each other
REASON_PENDING = "Pending"  # made, not bound yet
REASON_CONFLICT = "Conflict"  # a claim of that name exists that the controller did not make for this cache
REASON_NO_NAMESPACE = "NamespaceNotFound"  # the workload namespace does not exist (yet)
REASON_NAMESPACE_TERMINATING = "NamespaceTerminating"
REASON_DELETING = "Deleting"  # being removed (cache deleted or namespace no longer listed)
LABEL_VALUE_MAX = 63


@dataclass(frozen=True)
class CacheId:
    cluster: bool
    namespace: str | None  # None for a ClusterGKMCache
    name: str
    uid: str = ""

    @classmethod
    def of(cls, obj: dict, cluster: bool) -> "CacheId":
        md = obj.get("metadata") or {}
        return cls(cluster, None if cluster else md.get("namespace"), md["name"], md.get("uid", ""))

    @property
    def kind(self) -> str:
        return "ClusterGKMCache" if self.cluster else "GKMCache"

    @property
    def key(self) -> str:
        """The reconciler's key: ``namespace/name``, or ``name`` for a ClusterGKMCache."""
        return self.name if self.cluster else f"{self.namespace}/{self.name}"

    def __str__(self) -> str:
        return f"{self.kind} {self.key}"


def workload_namespaces(obj: dict, cluster: bool) -> list[str]:
    """Where the cache gets a claim: a GKMCache in its own namespace; a ClusterGKMCache in each
    of ``spec.workloadNamespaces`` (none listed: nowhere)."""
    if not cluster:
        return [(obj.get("metadata") or {})["namespace"]]
    listed = (obj.get("spec") or {}).get("workloadNamespaces") or []
    return sorted({ns for ns in listed if isinstance(ns, str) and ns})


def pv_name(cache: CacheId, workload_ns: str) -> str:
    """``gkmcache-<first 16 hex of sha256("<cache namespace or ''>/<name>/<workload namespace>")>``."""
    seed = f"{cache.namespace or ''}/{cache.name}/{workload_ns}"
    return "gkmcache-" + hashlib.sha256(seed.encode()).hexdigest()[:16]


def volume_handle(cache: CacheId, workload_ns: str) -> str:
    """``gkmcache:<namespace>/<name>:<workload namespace>`` (``gkmcache:<name>:<workload namespace>``
    for a ClusterGKMCache)."""
    return f"gkmcache:{cache.key}:{workload_ns}"


def volume_attributes(cache: CacheId) -> dict[str, str]:
    """What the CSI driver resolves the cache by: its name, and its namespace unless it is a
    ClusterGKMCache (kubelet adds the pod's namespace, name and uid)."""
    attrs = {CACHE_ATTRIBUTE: cache.name}
    if not cache.cluster:
        attrs[NAMESPACE_ATTRIBUTE] = cache.namespace
    return attrs


def capacity_bytes(annotations: dict) -> int:
    """The PV's capacity: the cache's ``gkm.io/cache-size-bytes`` when known (a positive integer),
    else :data:`PLACEHOLDER_BYTES`. Informational: the volume is read-only and provisions nothing."""
    raw = str((annotations or {}).get(SIZE_ANNOTATION, ""))
    return int(raw) if raw.isdigit() and int(raw) > 0 else PLACEHOLDER_BYTES


def quantity_bytes(quantity) -> int | None:
    """A storage quantity as the API server writes it (``3k``, ``1Mi``, ``1048576``, ``1e3``) in
    bytes, rounded up; None when it is not one. The server rewrites a quantity into its canonical
    form (``3000`` comes back ``3k``), so quantities are compared by value."""
    return to_bytes(str(quantity or "").strip())


def request_bytes(capacity: int) -> int:
    """What the claim requests: the smaller of the PV's capacity and 1Mi, so a claim costs next to
    nothing against a namespace's storage ResourceQuota and never asks more than its PV holds."""
    return min(capacity, MAX_REQUEST_BYTES)


def labels(cache: CacheId, workload_ns: str | None = None) -> dict[str, str]:
    out = {KIND_LABEL: cache.kind}
    if len(cache.name) <= LABEL_VALUE_MAX:  # a DNS subdomain this short is a valid label value
        out[NAME_LABEL] = cache.name
    if not cache.cluster:
        out[NAMESPACE_LABEL] = cache.namespace
    if workload_ns is not None:
        out[WORKLOAD_LABEL] = workload_ns
    return out


def selector(cluster: bool) -> str:
    """The label selector of one reconciler's PV and PVC watches."""
    return f"{KIND_LABEL}={'ClusterGKMCache' if cluster else 'GKMCache'}"


def owner_reference(cache: CacheId) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": cache.kind, "name": cache.name, "uid": cache.uid}


def pvc_body(cache: CacheId, workload_ns: str, capacity: int) -> dict:
    """The claim: named after the cache, in ``workload_ns``, naming its PV (``volumeName``), no
    StorageClass, ReadOnlyMany. Owned by the cache (a backstop for the garbage collector: the
    finalizer drives deletion); a namespaced owner only in its own namespace, which is where a
    GKMCache's claim lives."""
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": cache.name, "namespace": workload_ns, "labels": labels(cache),
                     "annotations": {CACHE_ANNOTATION: cache.key},
                     "ownerReferences": [owner_reference(cache)]},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv_name(cache, workload_ns),
                 "volumeMode": "Filesystem",
                 "resources": {"requests": {"storage": str(request_bytes(capacity))}}},
    }


def claim_ref(cache: CacheId, workload_ns: str, pvc_uid: str) -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": workload_ns, "name": cache.name,
            "uid": pvc_uid}


def pv_body(cache: CacheId, workload_ns: str, pvc_uid: str, capacity: int) -> dict:
    """The volume: CSI ``csi.gkm.io``, read-only, pre-bound to the claim of ``pvc_uid`` (so no
    other claim of that name can take it), Retain (nothing to reclaim: the data is the node's
    shared copy). Owned by a ClusterGKMCache; a GKMCache cannot own a cluster-scoped object."""
    md = {"name": pv_name(cache, workload_ns), "labels": labels(cache, workload_ns),
          "annotations": {CACHE_ANNOTATION: cache.key}}
    if cache.cluster:
        md["ownerReferences"] = [owner_reference(cache)]
    return {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": md,
        "spec": {
            "capacity": {"storage": str(capacity)},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "volumeMode": "Filesystem",
            "claimRef": claim_ref(cache, workload_ns, pvc_uid),
            # no csi.readOnly: the store's copy is immutable whatever the pod does, and the driver
            # chooses a read-only bind or a private copy-on-write view by the cache's kind (docs/csi.md,
            # "Views"); a pod that wants read-only says so on its volume (readOnly: true)
            "csi": {"driver": DRIVER, "volumeHandle": volume_handle(cache, workload_ns),
                    "volumeAttributes": volume_attributes(cache)},
        },
    }


def cache_key_of(obj: dict | None) -> str | None:
    """The key of the cache a PV/PVC of ours was made for."""
    if not obj:
        return None
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(CACHE_ANNOTATION)


def is_ours(obj: dict | None, cache: CacheId) -> bool:
    """Made by the controller for this cache: its kind label and cache annotation say so."""
    md = (obj or {}).get("metadata") or {}
    return (md.get("labels") or {}).get(KIND_LABEL) == cache.kind and cache_key_of(obj) == cache.key


def made_for(obj: dict) -> str | None:
    """``"<kind> <key>"`` of the cache a PV/PVC names in its labels and annotation, if any."""
    md = obj.get("metadata") or {}
    kind, key = (md.get("labels") or {}).get(KIND_LABEL), cache_key_of(obj)
    return f"{kind} {key}" if kind and key else None


def pv_wants_update(pv: dict, cache: CacheId, workload_ns: str, pvc_uid: str, capacity: int) -> dict | None:
    """The PV with its mutable fields as wanted (capacity; a ``claimRef`` to the claim of
    ``pvc_uid``, e.g. after the claim was deleted and made again: a Retain volume stays
    ``Released`` to the old claim otherwise), or None when nothing differs. The CSI source of a
    PV is immutable and never compared."""
    spec = pv.get("spec") or {}
    ref = spec.get("claimRef") or {}
    want_ref = claim_ref(cache, workload_ns, pvc_uid)
    new_spec = dict(spec)
    if quantity_bytes((spec.get("capacity") or {}).get("storage")) != capacity:
        new_spec["capacity"] = {**(spec.get("capacity") or {}), "storage": str(capacity)}
    if any(ref.get(k) != want_ref[k] for k in ("namespace", "name", "uid")):
        new_spec["claimRef"] = want_ref
    return None if new_spec == spec else {**pv, "spec": new_spec}


# ---------------------------------------------------------------------------------------------
# status.pvcStatus


def condition(old_entry: dict | None, status: str, reason: str, message: str, now: str) -> dict:
    """The entry's ``Bound`` condition; ``lastTransitionTime`` moves only when its status or
    reason does."""
    old = next((c for c in (old_entry or {}).get("conditions") or () if c.get("type") == BOUND), None)
    since = old["lastTransitionTime"] if (old and old.get("status") == status and old.get("reason") == reason
                                          and old.get("lastTransitionTime")) else now
    return {"type": BOUND, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}


def entry(old_entry: dict | None, cache: CacheId, workload_ns: str, reason: str, message: str, now: str) -> dict:
    """One ``status.pvcStatus[<workload namespace>]``."""
    return {"pvName": pv_name(cache, workload_ns), "pvcName": cache.name, "pvcOwner": PVC_OWNER,
            "conditions": [condition(old_entry, "True" if reason == REASON_BOUND else "False", reason, message,
                                     now)]}


def binding(pv: dict | None, pvc: dict | None) -> tuple[str, str]:
    """(reason, message) of a pair of ours that exists: Bound when both say so, else Pending with
    their phases (stable while nothing changes: no write on its own)."""
    pv_phase = ((pv or {}).get("status") or {}).get("phase") or ("absent" if pv is None else "unknown")
    pvc_phase = ((pvc or {}).get("status") or {}).get("phase") or ("absent" if pvc is None else "unknown")
    pvc_name = f"{(pvc or {}).get('metadata', {}).get('namespace')}/{(pvc or {}).get('metadata', {}).get('name')}"
    pv_name_ = (pv or {}).get("metadata", {}).get("name")
    if pv_phase == "Bound" and pvc_phase == "Bound":
        return REASON_BOUND, f"PersistentVolumeClaim {pvc_name} is bound to PersistentVolume {pv_name_}"
    return REASON_PENDING, f"waiting for binding: PersistentVolumeClaim {pvc_phase}, PersistentVolume {pv_phase}"


def claims_status(old_status: dict, entries: dict[str, dict]) -> dict:
    """The cache's status with ``pvcStatus`` = ``entries`` and ``pvcOwner`` = Operator (both
    left out when there are no entries); everything else as it was (the cache reconciler's
    pin, counts and conditions)."""
    status = {k: v for k, v in (old_status or {}).items() if k not in ("pvcStatus", "pvcOwner")}
    if entries:
        status["pvcOwner"] = PVC_OWNER
        status["pvcStatus"] = entries
    return status
