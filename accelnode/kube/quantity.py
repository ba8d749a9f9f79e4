"""Kubernetes resource quantities in bytes: ``1Gi``, ``512Mi``, ``3k``, ``1e3``, ``1.5G``.

One parser for what the API server writes (a PV's capacity, compared by value because the server
rewrites ``3000`` as ``3k``) and what a user writes (a volume's ``accelnode.io/writable-size``).
Fractions round up to a whole byte; the number has at most 40 characters and an exponent at most
three digits, so no input makes a number of more than about a thousand digits (Python refuses to
print an int of over 4300).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|[eE][+-]?[0-9]{1,3})?")
_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def to_bytes(text: str) -> int | None:
    """``text`` (exactly a quantity, no blanks around it) in bytes, rounded up; None when it is
    not a quantity."""
    m = _QUANTITY.fullmatch(text)
    if not m or len(m.group(1)) > 40:
        return None
    suffix = m.group(2) or ""
    try:
        scale = Decimal(_SUFFIX[suffix]) if suffix in _SUFFIX else Decimal(10) ** int(suffix[1:])  # E is exa
        value = Decimal(m.group(1)) * scale
    except (InvalidOperation, ValueError):
        return None
    return int(value.to_integral_value(rounding="ROUND_CEILING"))
