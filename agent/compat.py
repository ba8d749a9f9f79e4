"""Does a cache image fit this node? Image targets against the node's accelerators.

A target fits an accelerator when backend and arch are equal (both normalised the way the
cache format normalises targets, so ``sm_90``/``90`` or ``TPU``/``tpu`` compare equal). An
image fits the node when at least one of its targets fits one of the node's accelerators. An
image that declares no targets is accelerator-neutral and fits anywhere. An accelerator whose
arch could not be told fits nothing: a cache is never mounted on a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from .accelerators import Accelerator
from .cacheformat import normalize_target


@dataclass(frozen=True)
class Mismatch:
    expected: str  # what the image was built for, e.g. "cuda/sm_90, hip/gfx942"
    found: str  # what this node has, e.g. "tpu/v5e x4"

    def __str__(self) -> str:
        return f"built for {self.expected}; this node has {self.found}"


def describe_targets(targets: list[dict]) -> str:
    return ", ".join(sorted({f"{t.get('backend')}/{t.get('arch')}" for t in targets})) or "no targets"


def describe_node(accelerators: list[Accelerator]) -> str:
    return ", ".join(map(str, accelerators)) or "no accelerators"


def check(targets: list[dict], accelerators: list[Accelerator]) -> Mismatch | None:
    """None when the image fits, else what was expected and what was found."""
    if not targets:
        return None
    wanted = {_key(t) for t in targets}
    have = {_key(a.target()) for a in accelerators if a.arch}
    if wanted & have:
        return None
    return Mismatch(describe_targets(targets), describe_node(accelerators))


def _key(target: dict) -> tuple[str, str]:
    t = normalize_target(dict(target))
    return (str(t.get("backend")), str(t.get("arch")))
