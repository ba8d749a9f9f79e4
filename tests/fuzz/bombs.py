"""JSON bombs as a hostile registry serves them (issue 33): documents whose bytes are within every
byte cap but whose parse is a hundred times their size. A 4 MiB manifest of ``{}`` parses into
about 100 MB of Python objects; an image index of eight such children took the controller from
51 MB to over 1 GB during admission. Served by :class:`HostileRegistry` (an HTTP server on
127.0.0.1), asked by the real processes, whose peak RSS (``VmHWM``) the tests read."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from accelnode.oci import cacheformat as fmt
from accelnode.oci.registry import INDEX_TYPES, MANIFEST_TYPES

REPO = "team/cache"
MANIFEST_CAP = 4 << 20  # what distribution (and our Limits) let a manifest be
CHILDREN = 8
RSS_BOUND_KIB = 200 * 1024  # what the controller, the agent and `accelnode cache pull` must stay under


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _padded(doc: dict, size: int) -> bytes:
    """``doc`` with a member ``pad`` of ``{},{},...`` making it ``size`` bytes at most: a document
    every check of its fields accepts, and 1.4 million empty objects at 4 MiB."""
    head = json.dumps(doc)[:-1].encode() + b',"pad":['
    return head + b"{}," * ((size - len(head) - 4) // 3) + b"{}]}"


def manifest_bomb(i: int = 0, size: int = MANIFEST_CAP) -> bytes:
    """A valid image manifest (a config descriptor, no layers) padded to ``size`` bytes."""
    config = {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _digest(b"{}"), "size": 2}
    return _padded({"schemaVersion": 2, "mediaType": MANIFEST_TYPES[0], "annotations": {"i": str(i)},
                    "config": config, "layers": []}, size)


def index_bomb(children: list[bytes], size: int | None = None) -> bytes:
    """An image index of ``children`` (for this host's platform), padded to ``size`` bytes if given."""
    doc = {"schemaVersion": 2, "mediaType": INDEX_TYPES[0], "manifests": [
        {"mediaType": MANIFEST_TYPES[0], "digest": _digest(c), "size": len(c), "platform": fmt.host_platform()}
        for c in children]}
    return _padded(doc, size) if size else json.dumps(doc).encode()


def world() -> dict:
    """A world for :class:`tests.fuzz.test_registry_answers.HostileRegistry`. Tags: ``manifest``,
    one bomb; ``index``, a small index of CHILDREN bombs (each another digest), as the issue's
    admission attack; ``fat-index`` (and its digest, :func:`pinned_index`), that index padded to a
    bomb itself, so that a parser holding the index while it parses a child holds two bombs."""
    children = [manifest_bomb(i) for i in range(CHILDREN)]
    manifests = {_digest(c): c for c in children}
    fat = index_bomb(children, MANIFEST_CAP)
    manifests.update({"manifest": children[0], "index": index_bomb(children), "fat-index": fat, _digest(fat): fat})
    return {"challenge": None, "manifest_status": 200, "content_type": MANIFEST_TYPES[0], "manifests": manifests,
            "blobs": {}, "anonymous": True, "token_status": 404, "token": b""}


def pinned_index(host: str) -> str:
    """The fat index by digest, on the registry at ``host`` (what the agent is asked for)."""
    return f"{host}/{REPO}@{_digest(index_bomb([manifest_bomb(i) for i in range(CHILDREN)], MANIFEST_CAP))}"


def vm_hwm(pid: int) -> int:
    """The peak resident set of process ``pid`` so far, KiB (/proc/PID/status VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise KeyError("VmHWM")

