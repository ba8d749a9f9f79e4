"""TPU generations on GCE: machine type -> GKE's ``cloud.google.com/gke-tpu-accelerator`` value,
chips per VM, and which slice topologies can exist (docs/tpu-node-groups.md has the table).

The CRD refuses what cannot exist with CEL rules that encode the same table
(daemonsets/crds/tpu.google.com.yaml); :func:`check` is the controller's own copy, used for
groups whose machine type comes from an existing instance template, and tested against the
CRD's answers. The values are GKE's, not the upstream operator's (wrong for ct5p/ct4p and
non-bulk ct5lp).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# 2D generations: the slice shapes GCE offers (single host: up to 8 chips on one VM).
TOPOLOGIES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")


@dataclass(frozen=True)
class Generation:
    name: str
    accelerator: str  # cloud.google.com/gke-tpu-accelerator
    dims: int  # 2 (v5e, v6e: a torus of chips in a plane) or 3 (v4, v5p, v7x: cubes)


_TYPES = [
    (re.compile(r"^ct4p-hightpu-(4)t$"), Generation("v4", "tpu-v4-podslice", 3)),
    (re.compile(r"^ct5lp-hightpu-(1|4|8)t$"), Generation("v5e", "tpu-v5-lite-podslice", 2)),
    (re.compile(r"^ct5l-hightpu-(1|4|8)t$"), Generation("v5e", "tpu-v5-lite-device", 2)),
    (re.compile(r"^ct5p-hightpu-(4)t$"), Generation("v5p", "tpu-v5p-slice", 3)),
    (re.compile(r"^ct6e-standard-(1|4|8)t$"), Generation("v6e", "tpu-v6e-slice", 2)),
    (re.compile(r"^tpu7x-standard-(1|4)t$"), Generation("v7x", "tpu7x", 3)),
    (re.compile(r"^tpu7-standard-(1|4)t$"), Generation("v7", "tpu7", 3)),
]


@dataclass(frozen=True)
class MachineType:
    name: str
    generation: Generation
    chips: int  # per VM


def machine_type(name: str) -> MachineType | None:
    """The TPU machine type ``name`` (a short name or a URL ending in it), or None."""
    short = name.rsplit("/", 1)[-1]
    for rx, gen in _TYPES:
        m = rx.match(short)
        if m:
            return MachineType(short, gen, int(m.group(1)))
    return None


def chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def check(machine: str, topology: str, node_count: int) -> list[str]:
    """Why (machine type, topology, node count) cannot exist; each message names its field.
    Empty when it can."""
    mt = machine_type(machine)
    if mt is None:
        return [f"spec.instanceConfig.machineType: {machine!r} is not a TPU machine type this controller knows "
                "(ct4p-hightpu-4t, ct5lp-hightpu-1t/4t/8t, ct5l-hightpu-1t/4t/8t, ct5p-hightpu-4t, "
                "ct6e-standard-1t/4t/8t, tpu7x-standard-1t/4t, tpu7-standard-1t/4t)"]
    if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*(x[1-9][0-9]*)?", topology or ""):
        return [f"spec.topology: {topology!r} is not a topology such as 2x2 or 2x2x2"]
    dims = [int(d) for d in topology.split("x")]
    problems = []
    g = mt.generation
    if len(dims) != g.dims:
        problems.append(f"spec.topology: {g.name} ({mt.name}) slices are {g.dims}-dimensional (e.g. "
                        f"{'2x2x1' if g.dims == 3 else '2x2'}), not {topology}")
    elif g.dims == 2 and topology not in TOPOLOGIES_2D:
        problems.append(f"spec.topology: {topology} is not a {g.name} slice shape (one of {', '.join(TOPOLOGIES_2D)})")
    elif g.dims == 3 and topology != "2x2x1" and not all(d == 2 or d % 4 == 0 for d in dims):
        problems.append(f"spec.topology: {topology} is not a {g.name} slice shape (2x2x1, or each side 2 or a "
                        "multiple of 4: 2x2x2, 2x2x4, 4x4x4, ...)")
    if not problems and chips(topology) != node_count * mt.chips:
        problems.append(f"spec.nodeCount: topology {topology} has {chips(topology)} chips, {node_count} VM(s) of "
                        f"{mt.name} have {node_count * mt.chips}")
    return problems
