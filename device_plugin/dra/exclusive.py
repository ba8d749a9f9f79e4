"""One node's chips are offered by the device plugin or by the DRA plugin, never both.

Both would hand out the same chips: kubelet's device manager (``google.com/tpu``) and the
scheduler's DRA allocator (claims on our slices) each believe they own them. The rule is
enforced here, in the DRA plugin, from what kubelet itself reports: a device plugin that serves
``google.com/tpu`` on this node (ours, GKE's, anyone's) shows as a non-zero
``status.allocatable["google.com/tpu"]`` on the Node. (When a device plugin goes away, kubelet
marks its devices unhealthy and allocatable drops to 0 at once, while capacity lingers.)

* at start the DRA plugin refuses to run (exit 3) while the Node has such chips;
* while it runs it watches its Node: once a device plugin's chips appear it withdraws its
  ResourceSlices (no new claim gets these chips) and exits 3, so its pod shows the conflict.

The DRA side enforces it because only it can see both: the device plugin's offer is on the Node
for everyone to read, while the device plugin cannot read ResourceSlices (its account has no API
rights beyond its node's objects) and kubelet serves the DRA plugin from another socket tree.
"""

from __future__ import annotations

import logging
import threading

from accelnode.kube.client import KubeError
from accelnode.log import kv

log = logging.getLogger("accelnode.dra")

RESOURCE = "google.com/tpu"


class DevicePluginServes(Exception):
    """A device plugin offers this node's chips."""


def device_plugin_chips(node: dict) -> int:
    """``google.com/tpu`` chips kubelet's device manager offers on this Node (0: none)."""
    value = ((node.get("status") or {}).get("allocatable") or {}).get(RESOURCE, "0")
    try:
        return int(value)
    except ValueError:
        return 1  # not a count we understand: some device plugin is there


def conflict(node_name: str, chips: int) -> str:
    return (f"a device plugin offers {chips} {RESOURCE} on node {node_name} (status.allocatable): the DRA plugin "
            f"does not serve the same chips; remove the device plugin from this node (docs/dra.md, \"One owner per "
            f"node\")")


def check(client, node_name: str) -> None:
    """Raise :class:`DevicePluginServes` when a device plugin offers this node's chips now."""
    try:
        node = client.request("GET", f"/api/v1/nodes/{node_name}")
    except KubeError as e:
        raise DevicePluginServes(f"reading Node {node_name} failed: {e}") from None
    chips = device_plugin_chips(node)
    if chips:
        raise DevicePluginServes(conflict(node_name, chips))


class Guard:
    """Watches the Node; ``on_conflict(reason)`` once when a device plugin's chips appear."""

    def __init__(self, client, node_name: str, on_conflict):
        from accelnode.kube.reflector import Reflector

        self.node_name, self.on_conflict = node_name, on_conflict
        self.reason: str | None = None
        self._stop = threading.Event()
        self._reflector = Reflector(client, "/api/v1/nodes", name=node_name, on_change=self._changed,
                                    trim=lambda o: {"metadata": {"name": o["metadata"]["name"]},
                                                    "status": {"allocatable": {
                                                        RESOURCE: ((o.get("status") or {}).get("allocatable")
                                                                   or {}).get(RESOURCE, "0")}}})
        self._thread = threading.Thread(target=self._reflector.run, args=(self._stop,), name="device-plugin-guard",
                                        daemon=True)

    def start(self) -> "Guard":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._reflector.interrupt()
        if self._thread.is_alive():
            self._thread.join(5)

    def _changed(self) -> None:
        node = self._reflector.get(None, self.node_name)
        chips = device_plugin_chips(node) if node else 0
        if chips and self.reason is None:
            self.reason = conflict(self.node_name, chips)
            log.error("standing down", extra=kv(reason=self.reason))
            self.on_conflict(self.reason)
