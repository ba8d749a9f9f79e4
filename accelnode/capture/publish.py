"""Merging contributions into a delta image, pushing and signing it, and the promotion rule.

A contribution is one pod's layer (:mod:`.layer`), pushed by the node under the namespace's
push credentials. :func:`merge` reads every one again as hostile input and judges its entries
again (:func:`~accelnode.capture.entries.select`): a poisoned one is refused as a whole with its
reason; the same key from several pods with the same bytes is kept once; a key with different
bytes from two pods is kept from neither and reported. :func:`publish` pushes the base cache's
layers plus one merged layer to the capture repository (a delta: the base layers are copied
only when that repository lacks them, and the registry stores an identical layer once), with the
base's labels updated and the provenance in ``io.accelnode.capture/*`` labels; the controller then
signs it with :func:`accelnode.oci.signatures.sign_v2` (beside the reader of that format) with a
PEM private key from the namespace's Secret.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass, field


from accelnode.oci import cacheformat as fmt
from accelnode.oci.errors import HostileContent, ImageError
from accelnode.oci.limits import Limits
from accelnode.decode import CONFIG
from accelnode.oci.manifest import get_manifest, json_object, read_config
from accelnode.oci.reference import Reference
from accelnode.oci.registry import INDEX_TYPES, Deadline, Registry, RegistryOptions

from . import entries, layer
from .errors import Poisoned
from .reader import CaptureLimits

PROVENANCE_LABEL = "io.accelnode.capture/provenance"
BASE_LABEL = "io.accelnode.capture/base"
MAX_PROVENANCE = 64  # contributions named in the provenance label (the count is always exact)


@dataclass(frozen=True)
class Contribution:
    """One pod's captured layer and where it came from."""

    blob: bytes
    node: str
    pod: str  # namespace/name
    time: str  # RFC 3339


CONTRIBUTION_TYPE = "application/vnd.accelnode.capture.contribution.v1+json"  # the artifactType
EMPTY_CONFIG = b"{}"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _put_manifest(reg: Registry, repository: str, image: str, config: bytes, config_type: str, layers: list,
                  ref: str | None = None, **fields) -> tuple[str, int]:
    """Upload ``config`` and put an OCI manifest of it and ``layers`` (their blobs already in
    ``repository``) under ``ref`` (default: its own digest). Returns (digest, manifest bytes)."""
    cdigest = _digest(config)
    reg.upload_blob(repository, cdigest, config, image)
    body = json.dumps({"schemaVersion": 2, "mediaType": fmt.OCI_MANIFEST, **fields,
                       "config": {"mediaType": config_type, "digest": cdigest, "size": len(config)},
                       "layers": layers}, sort_keys=True, separators=(",", ":")).encode()
    return reg.put_manifest(repository, ref or _digest(body), body, fmt.OCI_MANIFEST, image), len(body)


def push_contribution(lay: layer.Layer, repository: str, options: RegistryOptions) -> str:
    """The node's hand-over: ``lay`` pushed to ``repository`` (the cache's capture repository,
    under the namespace's push credentials) as an artifact manifest pushed by digest, no tag.
    Returns its digest-pinned reference, which the agent records in the node's status."""
    dest = Reference.parse(repository)
    reg = Registry(dest.host, options, Deadline(options.timeout))
    reg.upload_blob(dest.repository, lay.digest, lay.blob, repository)
    digest, _ = _put_manifest(reg, dest.repository, repository, EMPTY_CONFIG, "application/vnd.oci.empty.v1+json",
                              [lay.descriptor], artifactType=CONTRIBUTION_TYPE)
    return dest.pinned(digest)


class OverBudget(Exception):
    """A contribution that does not fit in what is left of one publication's memory budget: not
    poisoned, only not taken this time (a later publication, with fewer sources, may take it)."""


def fetch_contribution(reference: str, node: str, pod: str, time: str, options: RegistryOptions,
                       limits: CaptureLimits = CaptureLimits(), room: int | None = None) -> Contribution:
    """A contribution a node reported (``reference`` digest-pinned); its manifest and layer are
    hostile input: one layer of the contribution media type, no larger than the limits allow.
    ``node``, ``pod`` and ``time`` come from the node's status, never from the pushed artifact.
    ``room``: bytes left of the publication's budget (:func:`fetch_within`); a larger layer is
    :class:`OverBudget`, read not at all."""
    ref = Reference.parse(reference)
    if not ref.digest:
        raise Poisoned(f"{reference[:200]!r} is not digest-pinned")
    reg = Registry(ref.host, options, Deadline(options.timeout))
    lim = Limits()
    _, doc, _, _ = get_manifest(reg, ref, reference, lim)
    lays = doc.get("layers")
    if doc.get("artifactType") != CONTRIBUTION_TYPE or not isinstance(lays, list) or len(lays) != 1:
        raise Poisoned(f"{reference}: not a capture contribution (one layer, artifactType {CONTRIBUTION_TYPE})")
    desc = lays[0]
    cap = limits.max_bytes + (limits.max_files + 16) * 2048
    if not isinstance(desc, dict) or desc.get("mediaType") != layer.MEDIA_TYPE or not isinstance(
            desc.get("size"), int) or not 0 < desc["size"] <= cap:
        raise Poisoned(f"{reference}: its layer is not a gzip tar of at most {cap} bytes")
    if room is not None and desc["size"] > room:
        raise OverBudget(f"{reference}: its layer ({desc['size']} bytes) passes what is left of this "
                         f"publication's budget ({max(room, 0)} bytes)")
    return Contribution(reg.read_blob(ref.repository, desc, reference, limit=cap), node, pod, time)


def fetch_within(sources, options: RegistryOptions, limits: CaptureLimits = CaptureLimits()):
    """The contributions of ``sources`` ((reference, node, pod, time), newest last) that one
    publication holds in memory at once: their compressed layers together at most
    ``limits.max_bytes`` (the merge then holds at most that much content, the new layer about as
    much again), so the controller's memory is bounded by the limits, not by how many nodes
    contributed or how large each made its layer. Newest first; returns (contributions, refused
    lines, left for later lines)."""
    contributions, refused, later = [], [], []
    room = limits.max_bytes
    for ref, node, pod, when in reversed(list(sources)):
        try:
            c = fetch_contribution(ref, node, pod, when, options, limits, room=room)
        except Poisoned as e:
            refused.append(f"{node} {pod}: {e}")
            continue
        except OverBudget as e:
            later.append(f"{node} {pod}: {e}")
            continue
        room -= len(c.blob)
        contributions.append(c)
    contributions.reverse()
    return contributions, refused, later


@dataclass
class Merged:
    files: dict[str, bytes] = field(default_factory=dict)
    sources: dict[str, list[Contribution]] = field(default_factory=dict)  # key -> contributions
    targets: list[dict] = field(default_factory=list)
    refused: list[tuple[Contribution, str]] = field(default_factory=list)
    conflicts: dict[str, list[Contribution]] = field(default_factory=dict)

    @property
    def contributors(self) -> list[Contribution]:
        seen: dict[tuple, Contribution] = {}
        for cs in self.sources.values():
            for c in cs:
                seen.setdefault((c.node, c.pod, c.time), c)
        return sorted(seen.values(), key=lambda c: (c.time, c.node, c.pod))


def merge(contributions: list[Contribution], kind: str, pod_path: str,
          limits: CaptureLimits = CaptureLimits()) -> Merged:
    out = Merged()
    keyed: dict[str, dict[str, bytes]] = {}
    total = 0
    for c in contributions:
        try:
            sel = entries.select(layer.read(c.blob, limits), kind, pod_path)
        except Poisoned as e:
            out.refused.append((c, str(e)))
            continue
        adds = sum(len(sel.files[p]) for key, paths in sel.keys.items() if key not in keyed for p in paths)
        if total + adds > limits.max_bytes:  # refused whole: never a part of a contribution
            out.refused.append((c, f"the merged layer would pass {limits.max_bytes} bytes"))
            continue
        total += adds
        for key, paths in sel.keys.items():
            content = {p: sel.files[p] for p in paths}
            if key in out.conflicts:
                out.conflicts[key].append(c)
            elif key not in keyed:
                keyed[key] = content
                out.sources[key] = [c]
            elif keyed[key] == content:
                out.sources[key].append(c)
            else:
                out.conflicts[key] = out.sources.pop(key) + [c]
                del keyed[key]
        for t in sel.targets:
            if t not in out.targets:
                out.targets.append(t)
    for content in keyed.values():
        out.files.update(content)
    return out


@dataclass(frozen=True)
class Published:
    reference: str  # digest-pinned, in the capture repository
    digest: str
    layer_digest: str
    pushed_bytes: int  # the merged layer, config and manifest (base layers the repository had are not sent)
    entries: int


def publish(base: str, merged: Merged, kind: str, repository: str, options: RegistryOptions, *,
            base_options: RegistryOptions | None = None, tag: str | None = None,
            limits: Limits | None = None) -> Published:
    """Push ``base`` (a digest-pinned single-manifest cache image, read with ``base_options``,
    default ``options``) plus the merged layer to ``repository`` (HOST/REPO) with ``options``;
    returns the new image."""
    if not merged.files:
        raise ValueError("nothing to publish: no entry was kept")
    limits = limits or Limits()
    bref, dest = Reference.parse(base), Reference.parse(repository)
    base_options = base_options or options
    breg = Registry(bref.host, base_options, Deadline(base_options.timeout))
    _, manifest, media_type, base_digest = get_manifest(breg, bref, base, limits)
    if media_type in INDEX_TYPES:
        raise HostileContent("capture onto an image index is not supported: name the per-platform manifest", base)
    base_layers, base_kind, targets, labels = read_config(breg, bref, manifest, base, limits)
    if base_kind != kind:
        raise HostileContent(f"the base cache is a {base_kind or 'unknown'} cache, not {kind}", base)
    config = json_object(breg.read_blob(bref.repository, manifest["config"], base, limit=limits.max_config_bytes),
                         base, "config", CONFIG.bytes(limits.max_config_bytes))
    new = layer.build(merged.files)
    dreg = Registry(dest.host, options, Deadline(options.timeout))
    pushed = 0
    for desc in base_layers:
        if dreg.blob_exists(dest.repository, desc["digest"], repository):
            continue
        if bref.host == dest.host and _mounted(dreg, dest.repository, desc["digest"], bref.repository, repository):
            continue  # the registry shares it between the repositories: nothing sent
        with tempfile.TemporaryFile() as spool, breg.open_blob(bref.repository, desc, base) as blob:
            while chunk := blob.read(1 << 20):
                spool.write(chunk)
            dreg.upload_blob(dest.repository, desc["digest"], spool, repository)
    if not dreg.blob_exists(dest.repository, new.digest, repository):
        dreg.upload_blob(dest.repository, new.digest, new.blob, repository)
        pushed += len(new.blob)
    for t in merged.targets:
        if t not in targets:
            targets.append(t)
    size = int(labels.get(fmt.label(kind, "cache-size-bytes"), "0") or 0) + new.content_bytes
    count = int(labels.get(fmt.label(kind, "entry-count"), "0") or 0) + len(merged.sources)
    who = merged.contributors
    labels.update({
        fmt.label(kind, "summary"): json.dumps({"targets": targets}, sort_keys=True, separators=(",", ":")),
        fmt.label(kind, "cache-size-bytes"): str(size),
        fmt.label(kind, "entry-count"): str(count),
        BASE_LABEL: bref.pinned(base_digest),
        PROVENANCE_LABEL: json.dumps({"contributions": len(who), "entries": len(merged.sources),
                                      "from": [{"node": c.node, "pod": c.pod, "time": c.time}
                                               for c in who[:MAX_PROVENANCE]]},
                                     sort_keys=True, separators=(",", ":")),
    })
    config.setdefault("config", {})["Labels"] = labels
    config.setdefault("rootfs", {"type": "layers", "diff_ids": []})["diff_ids"] = (
        list(config["rootfs"].get("diff_ids") or []) + [new.diff_id])
    config_body = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    digest, size = _put_manifest(dreg, dest.repository, repository, config_body,
                                 manifest["config"].get("mediaType", fmt.CONFIG_TYPES[0]),
                                 [*base_layers, new.descriptor], tag,
                                 annotations={fmt.TITLE_LABEL: dest.repository.rsplit("/", 1)[-1]})
    return Published(dest.pinned(digest), digest, new.digest, pushed + len(config_body) + size,
                     len(merged.sources))


def _mounted(reg: Registry, repository: str, digest: str, source: str, image: str) -> bool:
    """Whether the registry mounted ``digest`` from ``source`` (refused or unsupported: copy it)."""
    try:
        return reg.mount_blob(repository, digest, source, image)
    except ImageError:
        return False


def promotable(promotion: str, min_pods: int, merged: Merged, verified: bool | None) -> tuple[bool, str]:
    """Whether a published capture may move ``spec.image`` by itself, and why (not)."""
    pods = len({c.pod for c in merged.contributors})
    if promotion != "auto":
        return False, "promotion is manual: the new digest is offered in status"
    if merged.refused or merged.conflicts:
        return False, (f"{len(merged.refused)} contribution(s) refused and {len(merged.conflicts)} conflicting "
                       "key(s): not promoted by itself")
    if pods < min_pods:
        return False, f"{pods} pod(s) contributed, the rule asks for {min_pods}"
    if not verified:
        return False, "the signature of the new digest does not verify"
    return True, f"{pods} pod(s) contributed and the signature verifies"
