"""This node's ResourceSlice (``resource.k8s.io/v1``): one device per healthy chip.

Device names are ``tpu-<index>`` (PCI order, as the device plugin numbers chips). Attributes,
unqualified names being the driver's own domain:

* what Google's TPU DRA driver publishes, same names and types, so a claim written for it
  selects the same chips here: ``index`` (int), ``uuid`` (string: ours is the chip's stable ID
  ``tpu-<PCI address>``), ``tpuGen`` (string, GKE's spelling: ``v5litepod`` for v5e), ``brand``
  (``Google``), ``chipCount`` (int: chips on this host), and when the node's slice facts know them
  ``accelerator`` (GKE's accelerator label) and ``topology``;
* what only we know: ``iciX``/``iciY`` (the chip's place on the host's ICI mesh,
  device_plugin/topology.py), ``iciBlock2``/``iciBlock4``/``iciBlock8`` (which aligned ICI block of
  that many chips it sits in: a claim's ``matchAttribute`` constraint on one of them asks for an
  ICI-contiguous part of the host), ``numaNode`` (when the kernel knows it), ``pciAddress``,
  ``healthy`` (true: an unhealthy chip leaves the slice) and the standard
  ``resource.kubernetes.io/pcieRoot``.

The slice is named ``<node>-<driver>``, has pool ``<node>``, is owned by the Node (deleted with
it) and gets a new pool generation whenever its devices change. :class:`Publisher` keeps it so:
it watches the node's slices of our driver, so a slice kubelet deleted at its start (it wipes the
node's slices) or anyone changed is put back within one watch event.
"""

from __future__ import annotations

import logging
import os
import re
import threading
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


def device_name(index: int) -> str:
    return f"tpu-{index}"


def pcie_root(sysfs_root: Path, bdf: str) -> str | None:
    """The PCI root complex a function hangs off (``pci0000:00``), from its sysfs path."""
    try:
        real = Path(os.path.realpath(sysfs_root / "bus/pci/devices" / bdf))
        parts = real.relative_to(os.path.realpath(sysfs_root / "devices")).parts
    except (OSError, ValueError):
        return None
    return parts[0] if parts and _ROOT_COMPLEX.match(parts[0]) else None


def devices(states: tuple[ChipState, ...], config: topology.NodeConfig, sysfs_root: Path) -> list[dict]:
    """The slice's devices: the healthy chips, with their attributes."""
    out = []
    for s in states:
        if s.problem is not None:
            continue
        c = s.chip
        x, y = topology.position(c.index)
        attrs = {"index": {"int": c.index}, "uuid": {"string": c.id},
                 "tpuGen": {"string": TPU_GEN.get(c.generation, c.generation)}, "brand": {"string": "Google"},
                 "chipCount": {"int": len(states)}, "iciX": {"int": x}, "iciY": {"int": y},
                 **{f"iciBlock{n}": {"int": c.index // n} for n in (2, 4, 8)},
                 "pciAddress": {"string": c.bdf}, "healthy": {"bool": True}}
        if config.accelerator:
            attrs["accelerator"] = {"string": config.accelerator}
        if config.topology:
            attrs["topology"] = {"string": config.topology}
        if c.numa_node is not None:
            attrs["numaNode"] = {"int": c.numa_node}
        root = pcie_root(sysfs_root, c.bdf)
        if root:
            attrs[PCIE_ROOT] = {"string": root}
        out.append({"name": device_name(c.index), "attributes": attrs})
    return out


def slice_name(node: str, driver: str) -> str:
    return f"{node}-{driver}"


class Publisher:
    """Keeps ``<node>-<driver>`` equal to the latest devices: on :meth:`set_devices`, and after
    every change the watch reports (kubelet wiping the node's slices at its start included)."""

    def __init__(self, client: Client, node: str, driver: str):
        from accelnode.kube.reflector import Reflector

        self.client, self.node, self.driver = client, node, driver
        self.name = slice_name(node, driver)
        self._devices: list[dict] | None = None  # None: not known yet, publish nothing
        self._owner: dict | None = None
        self._kick = threading.Event()
        self._stop = threading.Event()
        self.published = threading.Event()  # set while the slice in the API is ours and current
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

    def set_devices(self, devs: list[dict]) -> None:
        self._devices = devs
        self.published.clear()
        self._kick.set()

    def kick(self) -> None:
        self._kick.set()

    def _run(self) -> None:
        retry = None
        while not self._stop.is_set():
            self._kick.wait(retry)
            self._kick.clear()
            if self._stop.is_set() or self._devices is None or not self.reflector.synced.is_set():
                retry = None if self._devices is None else 0.2
                continue
            try:
                self.sync()
                retry = None
            except (KubeError, OSError) as e:
                if not is_conflict(e):
                    log.warning("publishing the ResourceSlice failed; retrying", extra=kv(error=str(e)))
                retry = min(5.0, (retry or 0.1) * 2)

    def sync(self) -> None:
        """One pass: create, update or leave the slice, and delete our driver's other slices of this node."""
        devs = self._devices
        have = {o["metadata"]["name"]: o for o in self.reflector.snapshot()}
        for name in sorted(have.keys() - {self.name}):
            self.client.request("DELETE", f"{API}/{name}")
            log.info("removed a stale ResourceSlice", extra=kv(slice=name))
        cur = have.get(self.name)
        if cur is not None and cur["spec"].get("devices", []) == devs and cur["spec"]["pool"]["name"] == self.node:
            self.published.set()
            return
        generation = cur["spec"]["pool"]["generation"] + 1 if cur else 1
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": self.name, "ownerReferences": [self.owner()]},
                "spec": {"driver": self.driver, "nodeName": self.node, "devices": devs,
                         "pool": {"name": self.node, "generation": generation, "resourceSliceCount": 1}}}
        if cur is None:
            self.client.request("POST", API, body=body)
        else:
            body["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
            self.client.request("PUT", f"{API}/{self.name}", body=body)
        self.published.set()
        log.info("ResourceSlice published", extra=kv(slice=self.name, generation=generation, devices=len(devs)))

    def owner(self) -> dict:
        if self._owner is None:
            node = self.client.request("GET", f"/api/v1/nodes/{self.node}")
            self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node["metadata"]["uid"],
                           "controller": True}
        return self._owner

    def delete(self) -> None:
        try:
            self.client.request("DELETE", f"{API}/{self.name}")
        except KubeError as e:
            if not is_not_found(e):
                raise
