"""The one JSON decoder for documents from outside the process, each under a budget (design §3,
docs/security.md): registry answers (manifests, indexes, configs, token answers, signatures),
admission bodies, objects read from the API server, and files we did not write.

``json.loads`` turns 4 MiB of ``[{},{},...]`` into 1.4 million dicts, about 100 MB: a document's
bytes say little about what parsing it costs. :func:`decode` refuses a document before anything
is parsed when it is over its budget (:class:`Budget`): its bytes, the JSON values it holds (every
string, number, literal, array and object, keys included) and how deep its arrays and objects
nest. The values are counted on the bytes themselves (strings squeezed out by one regular
expression, then the structural characters counted by C-speed scans): about 8 ms per MiB, and
a step per string, of which there are at most ``max_values`` (quotes are counted first); only a
document within its budget reaches ``json.loads``, so parsing one costs at most about
``4 * max_bytes + 100 * max_values`` bytes of memory. The budgets of the documents we read are
named here, near what real producers emit.

Input must be UTF-8 (RFC 8259 §8.1; the other encodings ``json.loads`` guesses would hide
strings from the scan); NaN and Infinity are refused, as Go's decoder refuses them. Every
refusal is :class:`DocumentError`, whose message names the document.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, replace
from typing import Any

MiB = 1 << 20


@dataclass(frozen=True)
class Budget:
    """What one document may hold: ``max_bytes`` bytes, ``max_values`` JSON values, arrays and
    objects nested at most ``max_depth`` deep."""

    max_bytes: int
    max_values: int
    max_depth: int

    def __post_init__(self):
        if min(self.max_bytes, self.max_values, self.max_depth) < 1:
            raise ValueError(f"a decoding budget must be positive: {self}")

    def bytes(self, max_bytes: int) -> "Budget":
        """This budget with another byte cap (an operator's limit)."""
        return replace(self, max_bytes=max_bytes)


# -- the budgets of the documents we read ----------------------------------------------------------
# OCI manifests and indexes: distribution refuses manifests over 4 MiB; a real one holds tens to a
# few thousand values (an index of 256 entries with platforms and annotations: about 5,000).
MANIFEST = Budget(4 * MiB, 100_000, 32)
# An image config blob (labels, history, rootfs diff ids).
CONFIG = Budget(4 * MiB, 100_000, 32)
# A registry token server's answer ({"token", "access_token", "expires_in", "issued_at"}).
TOKEN = Budget(1 * MiB, 1_000, 8)
# Signature documents: simple-signing payloads, Sigstore bundles (a few KiB each; a bundle's
# transparency log entries and certificate chain: some hundred values).
SIGNATURE = Budget(1 * MiB, 20_000, 32)
# A Triton kernel's metadata file (a few hundred values), read from a cache tree a pod wrote.
KERNEL_METADATA = Budget(1 * MiB, 20_000, 16)
# A JSON document inside a label or annotation (a cache's targets).
LABEL = Budget(64 * 1024, 10_000, 8)
# Objects of the API server nest as deep as their schema lets them: an object with a field that
# preserves unknown fields (a pod template's affinity) may nest deeper than any kind we know; the
# API server allows 10,000 levels, Python's parser about 1,000 (the recursion limit).
KUBE_DEPTH = 500
# An AdmissionReview: the API server takes writes of at most 3 MiB; a review carries object and
# oldObject, under 7 MiB as controller-runtime caps it. 500,000 values: what the admission
# server's shared parse budget (64 MiB at 100 bytes a value) lets one review hold.
ADMISSION_REVIEW = Budget(7 * MiB, 500_000, KUBE_DEPTH)
# One object from the API server, or one watch event: etcd keeps at most 1.5 MiB per object (at
# 1.5 to 3 bytes a value, under a million values), and its JSON may be larger than what etcd
# stores (built-in kinds are stored as protobuf). Anything etcd holds fits: an object refused
# here would stop a watch for good.
KUBE_OBJECT = Budget(4 * MiB, 1_000_000, KUBE_DEPTH)
# One page of a list: Client.list asks for fewer items while a page is over this, and a page of
# one object is held to KUBE_OBJECT (what any object fits).
KUBE_LIST_PAGE = Budget(16 * MiB, 500_000, KUBE_DEPTH)
# Error Status bodies of the API server and other small answers (metadata server's attributes).
SMALL = Budget(1 * MiB, 10_000, 32)
# A Docker config JSON: a file, or a tenant's dockerconfigjson pull Secret (etcd: 1.5 MiB at most).
DOCKER_CONFIG = Budget(4 * MiB, 50_000, 16)
# The GCE metadata server's answers (all of an instance's custom metadata: 512 KiB at most).
METADATA = Budget(1 * MiB, 10_000, 32)
# Files kept on a node or given by the operator (docker config.json, checkpoints, rules files).
FILE = Budget(16 * MiB, 500_000, 64)


class DocumentError(ValueError):
    """A document that is not JSON, not what was expected, or over its budget (``over_budget``:
    ``over`` times what the budget allows, by its bytes or its values). ``document`` names it,
    ``problem`` says what is wrong (``is ...``); the message is both."""

    def __init__(self, document: str, problem: str, *, over_budget: bool = False, over: float = 1.0):
        self.document, self.problem, self.over_budget, self.over = document, problem, over_budget, over
        super().__init__(f"{document} {problem}")


_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)  # possessive: no backtracking state
_SPACE = b" \t\r\n"
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [0] * 256
for _c in b"[{":
    _DEPTH_STEP[_c] = 1
for _c in b"]}":
    _DEPTH_STEP[_c] = -1


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // 1024} KiB" if n % 1024 == 0 else f"{n} bytes"


def _squeeze(body: bytes) -> bytes:
    """``body`` with each string replaced by one quote, in one buffer (``re.sub`` would first make
    two objects per string: 100 MB for 4 MiB of ``"",``); at most max_values strings get here."""
    out, pos, view = bytearray(), 0, memoryview(body)
    for m in _STRING.finditer(body):
        start, end = m.span()
        out += view[pos:start]
        out += b'"'
        pos = end
    out += view[pos:]
    return bytes(out)


def check(body: bytes, budget: Budget, document: str) -> None:
    """Raise :class:`DocumentError` unless ``body`` is within ``budget`` (nothing is parsed)."""
    if len(body) > budget.max_bytes:
        raise DocumentError(document, f"is {len(body)} bytes, over the {_size(budget.max_bytes)} budget",
                            over_budget=True, over=len(body) / budget.max_bytes)
    if body[:3] == b"\xef\xbb\xbf" or (len(body) >= 2 and (not body[0] or not body[1])):
        raise DocumentError(document, "is not valid JSON: UTF-8 only (it starts with a byte-order mark or a NUL byte)")
    # every string is a value: more quotes than twice the budget (escaped ones aside) refuse at once
    strings = (body.count(b'"') - body.count(b'\\"')) // 2
    if strings > budget.max_values:
        raise DocumentError(document, f"holds at least {strings} JSON values (strings) in {len(body)} bytes, over "
                                      f"the budget of {budget.max_values}", over_budget=True,
                            over=strings / budget.max_values)
    # strings squeezed out, then: a value per comma (an element or member after the first), per colon
    # (a member's value; its key came with the comma), per opening bracket (the container itself, and
    # its first element unless it is empty), and the document itself
    skeleton = (_squeeze(body) if b'"' in body else body).translate(None, _SPACE)
    values = (1 + skeleton.count(b",") + skeleton.count(b":") + skeleton.count(b"{") + skeleton.count(b"[")
              - skeleton.count(b"{}") - skeleton.count(b"[]"))
    if values > budget.max_values:
        raise DocumentError(document, f"holds {values} JSON values in {len(body)} bytes, over the budget of "
                                      f"{budget.max_values}", over_budget=True, over=values / budget.max_values)
    brackets = skeleton.translate(None, _NOT_BRACKET)
    if len(brackets) > budget.max_depth:  # fewer brackets than that cannot nest deeper (about 5 ms per 100,000)
        depth = max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)))
        if depth > budget.max_depth:
            raise DocumentError(document, f"nests arrays and objects {depth} deep, over the budget of "
                                          f"{budget.max_depth}", over_budget=True)


def values_at_most(body: bytes) -> int:
    """A bound on the array elements and object members (a key and its value) in ``body``,
    cheaper than :func:`check`'s count (no string is scanned: every one but a container's first
    follows a comma; brackets and commas inside strings only raise the bound). For a memory
    budget shared by bodies not yet parsed."""
    return 1 + body.count(b",") + body.count(b"{") + body.count(b"[")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def decode(body: bytes | bytearray | memoryview | str, budget: Budget, document: str,
           expect: type | None = dict) -> Any:
    """The JSON value of ``body`` (its UTF-8 bytes, for a str) once :func:`check` passed;
    ``expect`` (dict by default, None: any) is the type the top value must have. Every problem
    is :class:`DocumentError`."""
    if not isinstance(body, (bytes, bytearray, memoryview, str)):
        raise DocumentError(document, f"is not a JSON text but a {type(body).__name__}")
    try:
        body = body.encode() if isinstance(body, str) else bytes(body)
    except UnicodeEncodeError:
        raise DocumentError(document, "is not valid JSON: not UTF-8 (a lone surrogate)") from None
    check(body, budget, document)
    try:
        doc = json.loads(body, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise DocumentError(document, f"is not valid JSON: {str(e)[:200]}") from None
    except RecursionError:  # within a depth budget this cannot happen; kept for a caller's deep stack
        raise DocumentError(document, "is nested too deeply to parse", over_budget=True) from None
    if expect is not None and not isinstance(doc, expect):
        kind = {dict: "object", list: "array"}.get(expect, expect.__name__)
        raise DocumentError(document, f"is not a JSON {kind}")
    return doc


def read_file(path, budget: Budget = FILE, document: str | None = None, expect: type | None = dict) -> Any:
    """A JSON file decoded under ``budget``: at most ``max_bytes + 1`` bytes are read."""
    chunks, total = [], 0
    with open(path, "rb") as f:  # in chunks: read(n) allocates n bytes up front, and budgets may be large
        while total <= budget.max_bytes:
            chunk = f.read(min(1 << 20, budget.max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    return decode(b"".join(chunks), budget, document or str(path), expect)
