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


def manifest_bomb(i: int = 0, size: int = MANIFEST_CAP) -> bytes:
    """An image manifest of ``size`` bytes whose layers list is ``{},{},...`` (about 1.4 million
    empty objects at 4 MiB)."""
    head = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_TYPES[0], "annotations": {"i": str(i)},
                       "config": {}})[:-1].encode() + b',"layers":['
    n = (size - len(head) - 4) // 3
    return head + b"{}," * n + b"{}]}"


def index_bomb(children: list[bytes]) -> bytes:
    return json.dumps({"schemaVersion": 2, "mediaType": INDEX_TYPES[0], "manifests": [
        {"mediaType": MANIFEST_TYPES[0], "digest": _digest(c), "size": len(c), "platform": fmt.host_platform()}
        for c in children]}).encode()


def world() -> dict:
    """A world for :class:`tests.fuzz.test_registry_answers.HostileRegistry`: tag ``manifest`` is
    one bomb, tag ``index`` (and its digest, :func:`pinned_index`) an index of CHILDREN bombs,
    each another digest."""
    children = [manifest_bomb(i) for i in range(CHILDREN)]
    manifests = {_digest(c): c for c in children}
    index = index_bomb(children)
    manifests.update({"manifest": children[0], "index": index, _digest(index): index})
    return {"challenge": None, "manifest_status": 200, "content_type": MANIFEST_TYPES[0], "manifests": manifests,
            "blobs": {}, "anonymous": True, "token_status": 404, "token": b""}


def vm_hwm(pid: int) -> int:
    """The peak resident set of process ``pid`` so far, KiB (/proc/PID/status VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise KeyError("VmHWM")


def pinned_index(host: str) -> str:
    """The bomb index by digest, on the registry at ``host``."""
    return f"{host}/{REPO}@{_digest(index_bomb([manifest_bomb(i) for i in range(CHILDREN)]))}"
