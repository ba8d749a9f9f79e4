"""This node's ResourceSlices (``resource.k8s.io/v1``): its chips as partitionable devices.

The node's pool holds two slices (an API rule: a slice carries shared counters or devices, not
both):

* ``<node>-<driver>-chips``: one counter set, ``chips``, with one counter ``chip-<index>`` of value
  1 per chip of the host (healthy or not: the set is the host);
* ``<node>-<driver>``: the devices. Each is a valid ICI sub-topology of the host (the aligned
  blocks of device_plugin/topology.py: every 1-, 2-, 4- and 8-chip block that fits the host, the
  whole host among them) and consumes its chips' counters. A device holding an unhealthy chip
  stays in the slice with the taint ``<driver>/unhealthy`` (device taints, KEP-5055, GA in 1.37):
  effect NoSchedule (value ``failing``), or NoExecute (value ``off-bus``) once one of its chips left
  the PCI bus; so its name stays valid for running claims and kubelet's health reports, and the
  scheduler gives it to no new claim. The
  scheduler allocates a device only while all its counters are free, so it never hands out
  overlapping or non-contiguous parts of a host, whichever claims ask.

Device names: ``tpu-<index>`` for one chip (PCI order, as the device plugin numbers chips),
``tpu-<first>-<last>`` for a block. Attributes, unqualified names being the driver's own domain:

* what Google's TPU DRA driver publishes, same names and types, so a claim written for it
  selects the same chips here: ``index`` (int: the chip, or a block's first chip), ``uuid``
  (string: the chip's stable ID ``tpu-<PCI address>``; a block's ends ``-x<chips>``), ``tpuGen``
  (string, GKE's spelling: ``v5litepod`` for v5e), ``brand`` (``Google``), ``chipCount`` (int:
  chips on this host), and when the node's slice facts know them ``accelerator`` (GKE's
  accelerator label) and ``topology``;
* what only we know: ``chips`` (int: chips in this device; the DeviceClass ``tpu.google.com``
  selects the 1-chip devices, ``ici-block.tpu.google.com`` the blocks), ``iciShape`` (``1x2``,
  ``2x2``, ...), on 1-chip devices ``iciX``/``iciY`` (the chip's place on the host's ICI mesh) and
  ``iciBlock2``/``iciBlock4``/``iciBlock8`` (which aligned block of that many chips it sits in),
  ``numaNode`` and the standard ``resource.kubernetes.io/pcieRoot`` when all its chips share one,
  ``pciAddress`` (1-chip devices) and ``healthy`` (false while the device is tainted).

Both slices are owned by the Node (deleted with it) and get a new pool generation whenever the
devices change. :class:`Publisher` keeps them so: it watches the node's slices of our driver, so
slices kubelet deleted at its start (it wipes the node's slices) or anyone changed are put back
within one watch event.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import threading
import time
from pathlib import Path

from accelnode.kube.client import Client, KubeError, is_conflict, is_not_found
from accelnode.log import kv

from .. import topology
from ..health import ChipState

log = logging.getLogger("accelnode.dra")

API = "/apis/resource.k8s.io/v1/resourceslices"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
# accelnode.hw.tpu generation -> Google's tpuGen attribute
TPU_GEN = {"v5e": "v5litepod"}
_ROOT_COMPLEX = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")


COUNTER_SET = "chips"
# a device holding an unhealthy chip carries the taint <driver>/unhealthy
TAINT_NAME = "unhealthy"
# the API's limits: devices of a slice when they consume counters, counters of a set
MAX_DEVICES, MAX_COUNTERS = 64, 32
# how long a sync waits for the watch to show the slices it just wrote
SETTLE_S = 1.0


def device_name(first: int, size: int = 1) -> str:
    """``tpu-<index>`` for one chip, ``tpu-<first>-<last>`` for a block."""
    return f"tpu-{first}" if size == 1 else f"tpu-{first}-{first + size - 1}"


_DEVICE = re.compile(r"^tpu-(0|[1-9][0-9]{0,2})(?:-(0|[1-9][0-9]{0,2}))?$")


def device_chips(name: str) -> tuple[int, ...] | None:
    """The chip indices a device name stands for; None when it is not one of ours (or not a block)."""
    m = _DEVICE.match(name)
    if not m:
        return None
    first = int(m.group(1))
    size = int(m.group(2)) - first + 1 if m.group(2) else 1
    if size not in topology.BLOCK_BOUNDS or first % size:
        return None
    return tuple(range(first, first + size))


def counter(index: int) -> str:
    return f"chip-{index}"


def blocks(chips: int) -> list[tuple[int, ...]]:
    """Every aligned ICI block of a host of ``chips`` chips, small to large (the whole host last)."""
    return [tuple(range(start, start + size)) for size in sorted(topology.BLOCK_BOUNDS) if size <= chips
            for start in range(0, chips - size + 1, size)]


def pcie_root(sysfs_root: Path, bdf: str) -> str | None:
    """The PCI root complex a function hangs off (``pci0000:00``), from its sysfs path."""
    try:
        real = Path(os.path.realpath(sysfs_root / "bus/pci/devices" / bdf))
        parts = real.relative_to(os.path.realpath(sysfs_root / "devices")).parts
    except (OSError, ValueError):
        return None
    return parts[0] if parts and _ROOT_COMPLEX.match(parts[0]) else None


def counter_sets(states: tuple[ChipState, ...]) -> list[dict]:
    """The host's counter set: one counter per chip."""
    if len(states) > MAX_COUNTERS:
        raise ValueError(f"{len(states)} chips on one host: a counter set holds at most {MAX_COUNTERS}")
    return [{"name": COUNTER_SET, "counters": {counter(s.chip.index): {"value": "1"} for s in states}}]


def taint_key(driver: str) -> str:
    return f"{driver}/{TAINT_NAME}"


def block_problem(block: tuple[int, ...], by_index: dict[int, ChipState]) -> tuple[str | None, bool]:
    """(why the device of these chips is unhealthy, or None; whether one of them left the PCI bus)."""
    bad = [by_index[i] for i in block if by_index[i].problem is not None]
    if not bad:
        return None, False
    why = bad[0].problem if len(block) == 1 else "; ".join(
        f"chip {s.chip.index} ({s.chip.bdf}): {s.problem}" for s in bad)
    return why, any(s.off_bus for s in bad)


def taint(driver: str, off_bus: bool) -> dict:
    """The taint of a device holding an unhealthy chip: NoSchedule (new claims avoid it), NoExecute
    once a chip left the bus (the pods using it are evicted too: their chip is gone)."""
    return {"key": taint_key(driver), "value": "off-bus" if off_bus else "failing",
            "effect": "NoExecute" if off_bus else "NoSchedule"}


def health(states: tuple[ChipState, ...]) -> list[tuple[str, str | None]]:
    """(device name, why it is unhealthy or None) for every device of the slice, chips and blocks."""
    by_index = {s.chip.index: s for s in states}
    return [(device_name(b[0], len(b)), block_problem(b, by_index)[0]) for b in blocks(len(states))]


def devices(states: tuple[ChipState, ...], config: topology.NodeConfig, sysfs_root: Path,
            driver: str = "tpu.google.com") -> list[dict]:
    """The slice's devices: every block, with its attributes and counters; a block holding an
    unhealthy chip stays, tainted (:func:`taint`) and ``healthy: false``."""
    by_index = {s.chip.index: s for s in states}
    roots = {i: pcie_root(sysfs_root, s.chip.bdf) for i, s in by_index.items()}
    out = []
    for block in blocks(len(states)):
        problem, off_bus = block_problem(block, by_index)
        chips = [by_index[i].chip for i in block]
        first = chips[0]
        w, h, _ = topology.bounds(block)
        attrs = {"index": {"int": first.index},
                 "uuid": {"string": first.id if len(chips) == 1 else f"{first.id}-x{len(chips)}"},
                 "tpuGen": {"string": TPU_GEN.get(first.generation, first.generation)}, "brand": {"string": "Google"},
                 "chipCount": {"int": len(states)}, "chips": {"int": len(chips)}, "iciShape": {"string": f"{w}x{h}"},
                 "healthy": {"bool": problem is None}}
        if len(chips) == 1:
            x, y = topology.position(first.index)
            attrs.update({"iciX": {"int": x}, "iciY": {"int": y}, "pciAddress": {"string": first.bdf},
                          **{f"iciBlock{n}": {"int": first.index // n} for n in (2, 4, 8)}})
        if config.accelerator:
            attrs["accelerator"] = {"string": config.accelerator}
        if config.topology:
            attrs["topology"] = {"string": config.topology}
        if len({c.numa_node for c in chips}) == 1 and first.numa_node is not None:
            attrs["numaNode"] = {"int": first.numa_node}
        if len({roots[i] for i in block}) == 1 and roots[first.index]:
            attrs[PCIE_ROOT] = {"string": roots[first.index]}
        dev = {"name": device_name(first.index, len(chips)), "attributes": attrs,
               "consumesCounters": [{"counterSet": COUNTER_SET,
                                     "counters": {counter(i): {"value": "1"} for i in block}}]}
        if problem is not None:
            dev["taints"] = [taint(driver, off_bus)]
        out.append(dev)
    assert len(out) <= MAX_DEVICES  # 15 on the largest host (8 chips)
    return out


def pool(states: tuple[ChipState, ...], config: topology.NodeConfig, sysfs_root: Path,
         driver: str) -> tuple[list[dict], list[dict]]:
    """(counter sets, devices) of this node's pool."""
    return counter_sets(states), devices(states, config, sysfs_root, driver)


def slice_name(node: str, driver: str) -> str:
    return f"{node}-{driver}"


def counters_slice_name(node: str, driver: str) -> str:
    return f"{node}-{driver}-chips"


class Publisher:
    """Keeps the pool's two slices (``<node>-<driver>-chips``: counters, ``<node>-<driver>``:
    devices) equal to the latest pool: on :meth:`set_pool`, and after every change the watch
    reports (kubelet wiping the node's slices at its start included)."""

    def __init__(self, client: Client, node: str, driver: str):
        from accelnode.kube.reflector import Reflector

        self.client, self.node, self.driver = client, node, driver
        self.name = slice_name(node, driver)
        self.counters_name = counters_slice_name(node, driver)
        self._pool: tuple[list[dict], list[dict]] | None = None  # None: not known yet, publish nothing
        self._owner: dict | None = None
        self._kick = threading.Event()
        self._stop = threading.Event()
        # our last writes: slice -> resourceVersion it had before (None: we created it), and until when
        # (monotonic) a sync waits for the watch to show them rather than republish from a stale copy
        self._wrote: dict[str, str | None] = {}
        self._settle_until = 0.0
        self.published = threading.Event()  # set while the slices in the API are ours and current
        self.reflector = Reflector(client, API, on_change=self._kick.set,
                                   query={"fieldSelector": f"spec.nodeName={node},spec.driver={driver}"})
        self._threads = [threading.Thread(target=self.reflector.run, args=(self._stop,), name="slices-watch",
                                          daemon=True),
                         threading.Thread(target=self._run, name="slices-publish", daemon=True)]

    def start(self) -> "Publisher":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        self.reflector.interrupt()
        for t in self._threads:
            if t.is_alive():
                t.join(5)

    def set_pool(self, counter_sets: list[dict], devs: list[dict]) -> None:
        self._pool = (counter_sets, devs)
        self.published.clear()
        self._kick.set()

    def kick(self) -> None:
        self._kick.set()

    def _run(self) -> None:
        retry = None
        while not self._stop.is_set():
            self._kick.wait(retry)
            self._kick.clear()
            if self._stop.is_set() or self._pool is None or not self.reflector.synced.is_set():
                retry = None if self._pool is None else 0.2
                continue
            if not self._settled():
                retry = 0.02
                continue
            try:
                self.sync()
                retry = None
            except (KubeError, OSError) as e:
                if not is_conflict(e):
                    log.warning("publishing the ResourceSlices failed; retrying", extra=kv(error=str(e)))
                retry = min(5.0, (retry or 0.1) * 2)

    def _settled(self) -> bool:
        """Whether the watch has shown our last writes (or anything newer), or the wait for it is over.
        A copy still holding what we replaced would read as not current and republish in vain."""
        if time.monotonic() >= self._settle_until:
            return True
        for name, before in self._wrote.items():
            seen = self.reflector.get(None, name)
            if (seen and seen["metadata"]["resourceVersion"]) == before:
                return False
        return True

    def sync(self) -> None:
        """One pass: create, update or leave the two slices, and delete our driver's other slices of this node."""
        counter_sets, devs = self._pool
        have = {o["metadata"]["name"]: o for o in self.reflector.snapshot()}
        devs = _keep_taint_times(devs, have.get(self.name, {}).get("spec", {}).get("devices") or [])
        want = {self.counters_name: {"sharedCounters": counter_sets}, self.name: {"devices": devs}}
        for name in sorted(have.keys() - want.keys()):
            self.client.request("DELETE", f"{API}/{name}")
            log.info("removed a stale ResourceSlice", extra=kv(slice=name))
        gens = {o["spec"]["pool"]["generation"] for n, o in have.items() if n in want}
        if len(gens) == 1 and all(n in have and _current(have[n]["spec"], body, self.node, len(want))
                                  for n, body in want.items()):
            self.published.set()
            return
        generation = max(gens, default=0) + 1
        self._wrote = {}
        for name, content in want.items():  # the counters first: a device never refers to a missing set
            body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                    "metadata": {"name": name, "ownerReferences": [self.owner()]},
                    "spec": {"driver": self.driver, "nodeName": self.node, **content,
                             "pool": {"name": self.node, "generation": generation, "resourceSliceCount": len(want)}}}
            cur = have.get(name)
            if cur is None:
                self.client.request("POST", API, body=body)
                self._wrote[name] = None
            else:
                body["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
                self.client.request("PUT", f"{API}/{name}", body=body)
                self._wrote[name] = cur["metadata"]["resourceVersion"]
        self._settle_until = time.monotonic() + SETTLE_S
        self.published.set()
        log.info("ResourceSlices published", extra=kv(slice=self.name, generation=generation, devices=len(devs),
                                                      chips=len(counter_sets[0]["counters"])))

    def owner(self) -> dict:
        if self._owner is None:
            node = self.client.request("GET", f"/api/v1/nodes/{self.node}")
            self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node["metadata"]["uid"],
                           "controller": True}
        return self._owner

    def delete(self) -> None:
        for name in (self.name, self.counters_name):
            try:
                self.client.request("DELETE", f"{API}/{name}")
            except KubeError as e:
                if not is_not_found(e):
                    raise


def _current(spec: dict, want: dict, node: str, count: int) -> bool:
    """Whether a slice's spec already holds ``want`` in this node's pool of ``count`` slices."""
    return (spec["pool"]["name"] == node and spec["pool"].get("resourceSliceCount") == count
            and all(spec.get(k, []) == v for k, v in want.items()))


def _keep_taint_times(devs: list[dict], published: list[dict]) -> list[dict]:
    """``devs`` with each taint's ``timeAdded``: the published one while the same taint stays (the
    API server would stamp an update's taints anew, restarting NoExecute tolerations), else now."""
    times = {(d["name"], t["key"], t.get("value"), t["effect"]): t.get("timeAdded")
             for d in published for t in d.get("taints") or ()}
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return [{**d, "taints": [{**t, "timeAdded": times.get((d["name"], t["key"], t.get("value"), t["effect"])) or now}
                             for t in d["taints"]]} if d.get("taints") else d for d in devs]
