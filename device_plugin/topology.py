"""Where chips sit on a host's ICI mesh, preferred allocations, and the TPU env of a container.

Our model of a host (the same for every generation): chip ``i`` (PCI order) sits at
``x = (i // 2) % 2``, ``y = i % 2 + 2 * (i // 4)`` on a mesh of 1x1 (1 chip), 1x2 (2 chips),
2x2 (4 chips) or 2x4 (8 chips). Consecutive pairs {0,1}, {2,3}, ... are ICI neighbours (a
1x2 block), {0..3} and {4..7} are 2x2 blocks, and all 8 form the 2x4 host. These aligned blocks
are the sub-host slices a container is given; the NUMA halves of v7x and 8-chip hosts
coincide with them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from accelnode.hw.tpu import Chip

# block size -> (x, y) bounds of an aligned block of that many chips
BLOCK_BOUNDS = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}
_TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")


def position(index: int) -> tuple[int, int]:
    return ((index // 2) % 2, index % 2 + 2 * (index // 4))


def bounds(indices) -> tuple[int, int, int] | None:
    """``(x, y, 1)`` bounds of a set of chip indices when they fill a rectangle, else None."""
    pts = {position(i) for i in indices}
    if not pts:
        return None
    xs, ys = {p[0] for p in pts}, {p[1] for p in pts}
    w, h = max(xs) - min(xs) + 1, max(ys) - min(ys) + 1
    return (w, h, 1) if w * h == len(pts) else None


def fmt(b) -> str:
    return ",".join(str(v) for v in b)


# chips a container holds -> the (x, y, z) shape GKE gives them ("chips per host" of a slice whose
# hosts are containers of that size); other counts get no bounds
CHIPS_SHAPE = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
RECIPES = ("gke", "visible-chips")
# GKE's cloud.google.com/gke-tpu-accelerator -> the generation part of TPU_ACCELERATOR_TYPE
ACCELERATOR_GENERATION = {"tpu-v4-podslice": "v4", "tpu-v5-lite-podslice": "v5litepod", "tpu-v5-lite-device": "v5lite",
                          "tpu-v5p-slice": "v5p", "tpu-v6e-slice": "v6e"}
_NEW_STYLE = re.compile(r"^tpu[0-9]+[a-z]?$")  # tpu7x, tpu7: the label is the generation
LITE = ("v5litepod", "v5lite", "v6e")  # one TensorCore per chip; the others have two
TORUS_3D = frozenset({"v4", "v5p", "v7x"})  # chip generations whose slices are 3D (wrap from 4x4x4 on)


def dims3(topology: str) -> tuple[int, int, int]:
    d = [int(v) for v in topology.split("x")]
    return (d[0], d[1], d[2] if len(d) == 3 else 1)


@dataclass(frozen=True)
class NodeConfig:
    """What this node's slice is: GKE's node labels (``accelerator``: the
    ``cloud.google.com/gke-tpu-accelerator`` value, ``topology``: ``cloud.google.com/gke-tpu-topology``)
    or the flags of ``accelnode device-plugin``, and which env recipe containers get."""

    accelerator_type: str | None = None  # TPU_ACCELERATOR_TYPE as given, e.g. "v5litepod-16"
    topology: str | None = None  # slice topology, e.g. "4x4" or "2x2x2"
    accelerator: str | None = None  # GKE's accelerator label, e.g. "tpu-v5-lite-podslice"
    recipe: str = "gke"

    def validate(self) -> None:
        if self.topology is not None and not _TOPOLOGY.match(self.topology):
            raise ValueError(f"topology {self.topology!r} is not AxB or AxBxC (e.g. 2x2, 4x4, 2x2x4)")
        if self.recipe not in RECIPES:
            raise ValueError(f"env recipe {self.recipe!r} is not one of {', '.join(RECIPES)}")
        if self.accelerator is not None and not (self.accelerator in ACCELERATOR_GENERATION
                                                 or _NEW_STYLE.match(self.accelerator)):
            raise ValueError(f"accelerator {self.accelerator!r} is not a GKE TPU accelerator "
                             f"({', '.join(ACCELERATOR_GENERATION)}, tpu7x, ...)")

    def over(self, base: "NodeConfig") -> "NodeConfig":
        """This configuration, with what it leaves unset taken from ``base``."""
        return replace(self, **{f: getattr(base, f) for f in ("accelerator_type", "topology", "accelerator")
                                if getattr(self, f) is None})

    @property
    def is_slice(self) -> bool:
        """Whether GKE gives this node's containers slice bounds: podslice accelerators (not the
        single-host ``-device`` ones); a node configured by flags alone counts as one."""
        a = self.accelerator
        return a is None or a.endswith("slice") or bool(_NEW_STYLE.match(a))

    def type_value(self) -> str | None:
        """TPU_ACCELERATOR_TYPE: as given, else ``<generation>-<TensorCores>`` from the label and topology."""
        if self.accelerator_type or not (self.accelerator and self.topology):
            return self.accelerator_type
        gen = ACCELERATOR_GENERATION.get(self.accelerator, self.accelerator)
        chips = math.prod(dims3(self.topology))
        return f"{gen}-{chips if gen in LITE else 2 * chips}"

    def host_env(self, chips_per_host: int) -> dict[str, str]:
        """Slice-level env of the visible-chips recipe; the bounds only when the topology is a
        whole number of these hosts."""
        env = {}
        if self.type_value():
            env["TPU_ACCELERATOR_TYPE"] = self.type_value()
        host = BLOCK_BOUNDS.get(chips_per_host)
        dims = [int(v) for v in self.topology.split("x")] + [1] if self.topology else []
        if host and dims and dims[0] % host[0] == 0 and dims[1] % host[1] == 0:
            hx, hy = host
            env["TPU_TOPOLOGY"] = self.topology
            env["TPU_CHIPS_PER_HOST_BOUNDS"] = fmt((hx, hy, 1))
            env["TPU_HOST_BOUNDS"] = fmt((dims[0] // hx, dims[1] // hy, dims[2]))
        if env:
            env["TPU_SKIP_MDS_QUERY"] = "true"
        return env


def container_env(chips: list[Chip], host_chips: int, config: NodeConfig) -> dict[str, str]:
    """Env for a container holding ``chips`` (of the host's ``host_chips``), by ``config.recipe``."""
    if config.recipe == "visible-chips":
        return visible_chips_env(chips, host_chips, config)
    return gke_env(chips, host_chips, config)


def gke_env(chips: list[Chip], host_chips: int, config: NodeConfig) -> dict[str, str]:
    """GKE's managed plugin (docs/device-plugin.md, "Allocate"): no ``TPU_VISIBLE_CHIPS`` (libtpu
    uses the chips whose device nodes the container holds); a container of ``n`` chips is a host
    of ``n`` chips in the node's slice: ``TPU_CHIPS_PER_HOST_BOUNDS`` from ``n``,
    ``TPU_HOST_BOUNDS`` the topology divided by it; ``TPU_WORKER_ID=0`` and
    ``TPU_WORKER_HOSTNAMES=localhost`` when the slice is this one node. Nothing without a topology
    (libtpu then asks the metadata server, as on a bare TPU VM)."""
    if not config.topology:
        return {}
    dims = dims3(config.topology)
    env = {"TPU_SKIP_MDS_QUERY": "true", "TPU_TOPOLOGY": config.topology}
    if config.type_value():
        env["TPU_ACCELERATOR_TYPE"] = config.type_value()
    shape = CHIPS_SHAPE.get(len(chips))
    if config.is_slice and shape and all(d % s == 0 for d, s in zip(dims, shape)):
        host_bounds, per_host = fmt(d // s for d, s in zip(dims, shape)), fmt(shape)
        gen = chips[0].generation
        if gen in TORUS_3D:
            wrap = fmt(["true" if all(d >= 4 for d in dims) else "false"] * 3)
        else:
            wrap = fmt("true" if d == 16 else "false" for d in dims)
        env.update({"TPU_HOST_BOUNDS": host_bounds, "HOST_BOUNDS": host_bounds,
                    "TPU_CHIPS_PER_HOST_BOUNDS": per_host, "CHIPS_PER_HOST_BOUNDS": per_host,
                    "TPU_TOPOLOGY_WRAP": wrap, "WRAP": wrap, "TPU_TOPOLOGY_ALT": "false", "ALT": "false"})
    if host_chips == math.prod(dims):
        env.update({"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost"})
    return env


def visible_chips_env(chips: list[Chip], host_chips: int, config: NodeConfig) -> dict[str, str]:
    """The ``--tpu-env visible-chips`` recipe: ``TPU_VISIBLE_CHIPS`` = the chips' host indices (PCI
    order) and process bounds, as on a bare TPU VM running one process per chip group.

    A container holding the whole host is this host's process of the slice the node
    configuration describes: it gets the slice env, and its process bounds are the host bounds.
    A container holding part of the host is a one-process slice of its own: only its chips and
    their bounds (the node's slice env would contradict them)."""
    idx = sorted(c.index for c in chips)
    env = {"TPU_VISIBLE_CHIPS": ",".join(map(str, idx))}
    b = bounds(idx)
    slice_env = config.host_env(host_chips) if len(idx) == host_chips else {}
    if b is not None:  # libtpu needs a rectangle; an irregular set gets only the chip list
        env["TPU_CHIPS_PER_PROCESS_BOUNDS"] = fmt(b)
        env["TPU_PROCESS_BOUNDS"] = slice_env.get("TPU_HOST_BOUNDS", "1,1,1")
    env.update(slice_env)
    return env


def preferred(available: list[Chip], must_include: list[Chip], size: int) -> list[Chip]:
    """``size`` chips from ``available`` including ``must_include``: an aligned ICI block on one
    NUMA node when one fits (best fit: the block whose enclosing larger block has the fewest free
    chips, so big blocks stay whole), else the nearest chips to the required ones."""
    by_index = {c.index: c for c in available}
    must = {c.index for c in must_include}
    if size in BLOCK_BOUNDS:
        candidates = []
        for start in range(0, max(by_index, default=-1) + 1, size):
            block = set(range(start, start + size))
            if block <= by_index.keys() and must <= block:
                numa = {by_index[i].numa_node for i in block}
                outer = set(range(start - start % (2 * size), start - start % (2 * size) + 2 * size))
                free_outside = len((outer - block) & by_index.keys())
                candidates.append((len(numa), free_outside, start, block))
        if candidates:
            return [by_index[i] for i in sorted(min(candidates)[3])]
    chosen = set(must)
    while len(chosen) < size:
        numas = [by_index[i].numa_node for i in chosen] or [None]
        home = max(set(numas), key=numas.count)
        rest = [c for c in available if c.index not in chosen]
        best = min(rest, key=lambda c: (c.numa_node != home, _distance(c.index, chosen), c.index))
        chosen.add(best.index)
    return [by_index[i] for i in sorted(chosen)]


def _distance(index: int, chosen: set[int]) -> int:
    if not chosen:
        return 0
    x, y = position(index)
    return min(abs(x - position(j)[0]) + abs(y - position(j)[1]) for j in chosen)
