"""Does a cache image fit this node? Image targets against the node's accelerators.

A target fits an accelerator when backend and arch are equal, and warp size too when the target
names one. Both sides are normalised the way the cache format normalises targets
(``TPU``/``tpu``, ``v5litepod``/``v5e``), and further for comparing only: a CUDA arch is its
compute capability digits (``sm_90``, ``sm90``, ``90``, ``9.0``, ``compute_90`` and the
arch-specific ``sm_90a`` all read ``90``), an AMD arch drops its target features
(``gfx90a:sramecc+:xnack-`` reads ``gfx90a``). An image fits the node when at least one of its
targets fits one of the node's accelerators; an image that declares no targets is
accelerator-neutral and fits anywhere. An accelerator whose arch could not be told fits
nothing: a cache is never mounted on a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from accelnode.hw.accelerators import Accelerator
from accelnode.oci.cacheformat import normalize_target

_CUDA_ARCH = re.compile(r"^(?:sm_?|compute_)?(\d+)\.?(\d*)[af]?$")


@dataclass(frozen=True)
class Mismatch:
    expected: str  # what the image was built for, e.g. "cuda/sm_90, hip/gfx942"
    found: str  # what this node has, e.g. "tpu/v5e x4"

    def __str__(self) -> str:
        return f"built for {self.expected}; this node has {self.found}"


def describe_targets(targets: list[dict]) -> str:
    """``cuda/90, hip/gfx942 (warp 64)``: each target as the image states it."""
    def one(t: dict) -> str:
        return f"{t.get('backend')}/{t.get('arch')}" + (f" (warp {t['warp_size']})" if t.get("warp_size") else "")

    return ", ".join(sorted({one(t) for t in targets})) or "no targets"


def describe_node(accelerators: list[Accelerator], warp: bool = False) -> str:
    """``tpu/v5e x4``; with ``warp``, warp sizes where known: ``hip/gfx1100 x1 (warp 32)``."""
    return ", ".join(f"{a} (warp {a.warp_size})" if warp and a.warp_size and a.arch else str(a)
                     for a in accelerators) or "no accelerators"


def check(targets: list[dict], accelerators: list[Accelerator]) -> Mismatch | None:
    """None when the image fits, else what was expected and what was found."""
    if not targets:
        return None
    have = [_canonical(a.target()) for a in accelerators if a.arch]
    for target in map(_canonical, targets):
        if any(target[:2] == acc[:2] and (target[2] is None or target[2] == acc[2]) for acc in have):
            return None
    warp = any(t.get("warp_size") for t in targets)
    return Mismatch(describe_targets(targets), describe_node(accelerators, warp=warp))


def _canonical(target: dict) -> tuple[str, str, int | None]:
    """(backend, arch, warp size or None) in the form targets are compared in."""
    t = normalize_target(dict(target))
    backend, arch = t["backend"], t["arch"]
    if backend == "cuda" and (m := _CUDA_ARCH.match(arch)):
        arch = m.group(1) + m.group(2)
    elif backend == "hip":
        arch = arch.split(":", 1)[0]
    return backend, arch, t.get("warp_size")
