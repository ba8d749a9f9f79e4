"""Manifests, image indexes and config blobs of kernel-cache images, validated as hostile input,
and :func:`inspect` (what an image is, without fetching its layers)."""

from __future__ import annotations

from accelnode.decode import CONFIG, MANIFEST, Budget, DocumentError, decode

from . import cacheformat as fmt
from .errors import HostileContent
from .limits import Limits
from .reference import Reference, check_digest
from .registry import INDEX_TYPES, MANIFEST_TYPES, Deadline, Registry, RegistryOptions


def inspect(image: str, options: RegistryOptions, limits: Limits | None = None) -> dict:
    """What an image is, from its manifest(s) and config only (no layers are fetched). An index's
    children are inspected one at a time, each kept only as its summary: memory holds one child
    document at most, whatever the index lists."""
    limits = limits or Limits()
    ref = Reference.parse(image)
    reg = Registry(ref.host, options, Deadline(options.timeout))
    _, doc, media_type, digest = get_manifest(reg, ref, image, limits)
    out = {"image": image, "index": None, "manifests": []}
    if media_type not in INDEX_TYPES:
        out["manifests"].append(_summary(reg, ref, image, limits, digest, doc))
        return out
    out["index"] = digest
    check_index(doc, image, limits)
    entries = [(check_digest(d.get("digest"), image), {"platform": d.get("platform"),
                                                       "annotations": d.get("annotations") or {}})
               for d in doc["manifests"]]
    del doc
    for child_digest, desc in entries:
        out["manifests"].append(_child_summary(reg, ref, image, limits, child_digest) | desc)
    return out


def _child_summary(reg: Registry, ref: Reference, image: str, limits: Limits, digest: str) -> dict:
    _, child, _, child_digest = get_manifest(reg, ref, image, limits, digest)
    return _summary(reg, ref, image, limits, child_digest, child)


def _summary(reg: Registry, ref: Reference, image: str, limits: Limits, digest: str, manifest: dict) -> dict:
    """What :func:`inspect` says of one image manifest (its config read, its layers not)."""
    layers, kind, targets, labels = read_config(reg, ref, manifest, image, limits)
    size = labels.get(fmt.label(kind, "cache-size-bytes")) if kind else None
    return {"digest": digest, "kind": kind, "targets": targets, "labels": labels,
            "size_bytes": int(size) if size and size.isdigit() else None,
            "layers": len(layers), "compressed_bytes": sum(x["size"] for x in layers)}


def get_manifest(reg: Registry, ref: Reference, image: str, limits: Limits,
                  digest: str | None = None) -> tuple[bytes, dict, str, str]:
    """A manifest or index: (body, parsed document, media type, digest). The type is what the
    document says (its ``mediaType``, else its shape: ``manifests`` is an index, ``config`` or
    ``layers`` a manifest), the Content-Type the registry (or a mirror: a header no digest
    covers) sent only when the document says nothing."""
    body, media_type, digest = reg.get_manifest(ref, image, limit=limits.max_manifest_bytes, digest=digest)
    doc = json_object(body, image, f"manifest {digest}", MANIFEST.bytes(limits.max_manifest_bytes))
    shape = (INDEX_TYPES[0] if "manifests" in doc and "layers" not in doc
             else MANIFEST_TYPES[0] if "config" in doc or "layers" in doc else None)
    return body, doc, doc.get("mediaType") or shape or media_type, digest


def read_config(reg: Registry, ref: Reference, manifest: dict, image: str,
                 limits: Limits) -> tuple[list[dict], str | None, list[dict], dict]:
    """(layer descriptors, kind, targets, labels) of a validated manifest and its config blob."""
    layers, config_desc = validate_manifest(manifest, image, limits)
    config = json_object(reg.read_blob(ref.repository, config_desc, image, limit=limits.max_config_bytes), image,
                         f"config {config_desc['digest']}", CONFIG.bytes(limits.max_config_bytes))
    return (layers, *parse_config(config, image))


def json_object(body: bytes, image: str, what: str, budget: Budget = MANIFEST) -> dict:
    """A registry's JSON document decoded under ``budget``; HostileContent naming ``what`` if not."""
    try:
        return decode(body, budget, what)
    except DocumentError as e:
        raise HostileContent(str(e), image) from None


def parse_config(config: dict, image: str) -> tuple[str | None, list[dict], dict]:
    try:
        return fmt.parse_config(config)
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        raise HostileContent(f"config labels are malformed: {type(e).__name__}: {str(e)[:200]}", image) from None


def check_index(index: dict, image: str, limits: Limits) -> None:
    manifests = index.get("manifests")
    if not isinstance(manifests, list):
        raise HostileContent("image index has no manifests list", image)
    if len(manifests) > limits.max_index_entries:
        raise HostileContent(f"image index lists {len(manifests)} manifests (limit {limits.max_index_entries})",
                             image)
    if not all(isinstance(d, dict) for d in manifests):
        raise HostileContent("image index has an entry that is not an object", image)


def validate_manifest(manifest: dict, image: str, limits: Limits) -> tuple[list[dict], dict]:
    layers, config = manifest.get("layers"), manifest.get("config")
    if not isinstance(layers, list) or not isinstance(config, dict):
        raise HostileContent("manifest lacks a config descriptor or a layers list", image)
    if len(layers) > limits.max_layers:
        raise HostileContent(f"manifest has {len(layers)} layers (limit {limits.max_layers})", image)
    if config.get("mediaType") not in fmt.CONFIG_TYPES:
        raise HostileContent(f"unsupported config media type {config.get('mediaType')!r}", image)
    for i, d in enumerate(layers):
        kind = d.get("mediaType") if isinstance(d, dict) else None
        if not isinstance(kind, str) or kind not in fmt.LAYER_TYPES:  # a list or object: unhashable
            raise HostileContent(f"layer {i} has unsupported media type "
                                 f"{d.get('mediaType') if isinstance(d, dict) else d!r}", image)
        check_digest(d.get("digest"), image)
        if not isinstance(d.get("size"), int) or d["size"] < 0:
            raise HostileContent(f"layer {i} has no valid size", image)
    declared = sum(d["size"] for d in layers)
    if declared > limits.max_tar_bytes:  # even uncompressed, that much tar cannot fit in the limits
        raise HostileContent(f"layers declare {declared} bytes, more than the {limits.max_tar_bytes} "
                             "the limits allow (per image: --max-image-size, --max-image-files)", image)
    return layers, config


def resolve(image: str, options: RegistryOptions, limits: Limits | None = None) -> tuple[str, int | None]:
    """(digest, size in bytes) of what ``image`` names now: the digest of its manifest or image
    index (pinned or resolved from the tag), and the cache's uncompressed size as its config
    labels declare it (the largest of an index's manifests; None when no manifest says)."""
    info = inspect(image, options, limits)
    digest = info["index"] or info["manifests"][0]["digest"]
    sizes = [m["size_bytes"] for m in info["manifests"] if m["size_bytes"] is not None]
    return digest, max(sizes) if sizes else None
