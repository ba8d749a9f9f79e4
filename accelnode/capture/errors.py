"""The one error of capture: a contribution refused, with the reason (a whole contribution goes:
nothing of a pod that wrote something hostile is kept)."""

from __future__ import annotations


class Poisoned(Exception):
    """A contribution that is refused as a whole; the message says which rule it broke."""
