"""What slice this node is part of, for the env of containers (docs/device-plugin.md, "Slice facts").

GKE and our node groups label TPU nodes with ``cloud.google.com/gke-tpu-accelerator`` and
``cloud.google.com/gke-tpu-topology``; the node-group controller also writes them into the VM's
``kube-labels`` metadata attribute before the Node exists. The plugin takes them from, in order:

1. ``--accelerator-type``/``--topology``, when given (they win field by field);
2. the Node's labels (``--node-name``): the Node is watched, so labels put on after the plugin
   started (a node group labels its Nodes once they join) apply to the next allocation;
3. the metadata server's ``instance/attributes/kube-labels`` (``--slice-facts-from metadata``),
   read once at start.

A label value that is not a TPU accelerator or topology is logged and ignored (the plugin gives
no slice env rather than a wrong one).
"""

from __future__ import annotations

import logging
import threading

from accelnode.log import kv

from .topology import NodeConfig

log = logging.getLogger("accelnode.device_plugin")

LABEL_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
LABEL_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
KUBE_LABELS = "instance/attributes/kube-labels"


def from_labels(labels: dict, recipe: str = "gke") -> NodeConfig:
    """The slice that GKE's TPU labels describe; a label that does not validate is dropped."""
    config = NodeConfig(recipe=recipe)
    for field, key in (("accelerator", LABEL_ACCELERATOR), ("topology", LABEL_TOPOLOGY)):
        value = (labels or {}).get(key)
        if value is None:
            continue
        candidate = NodeConfig(recipe=recipe, **{field: value})
        try:
            candidate.validate()
        except ValueError as e:
            log.warning("node label ignored", extra=kv(label=key, value=value, reason=str(e)))
            continue
        config = candidate.over(config)
    return config


class NodeFacts:
    """The current :class:`NodeConfig`: the explicit one over what the sources found."""

    def __init__(self, explicit: NodeConfig):
        self.explicit = explicit
        self._found = NodeConfig(recipe=explicit.recipe)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reflector = None
        self._thread: threading.Thread | None = None
        self.on_change = lambda: None  # called after the facts changed (the DRA plugin republishes)

    def __call__(self) -> NodeConfig:
        with self._lock:
            return self.explicit.over(self._found)

    def found(self, labels: dict, source: str) -> None:
        config = from_labels(labels, self.explicit.recipe)
        with self._lock:
            changed, self._found = config != self._found, config
        if changed:
            now = self()
            log.info("slice facts", extra=kv(source=source, accelerator=now.accelerator, topology=now.topology,
                                             accelerator_type=now.type_value()))
            self.on_change()

    def from_metadata(self, metadata) -> None:
        """Read the VM's kube-labels once (a missing attribute or server is logged, not fatal)."""
        from accelnode.gce.metadata import MetadataError, kube_labels

        try:
            self.found(kube_labels(metadata.get(KUBE_LABELS).body), "metadata")
        except MetadataError as e:
            log.warning("no slice facts from the metadata server", extra=kv(error=str(e)))

    def watch_node(self, client, node: str) -> "NodeFacts":
        """Follow the Node's labels on a thread until :meth:`stop`."""
        from accelnode.kube.reflector import Reflector

        def changed() -> None:
            obj = self._reflector.get(None, node)
            if obj is not None:
                self.found(obj["metadata"].get("labels") or {}, f"node {node}")

        self._reflector = Reflector(client, "/api/v1/nodes", name=node, on_change=changed,
                                    trim=lambda o: {"metadata": {"name": o["metadata"]["name"],
                                                                 "labels": o["metadata"].get("labels") or {}}})
        self._thread = threading.Thread(target=self._reflector.run, args=(self._stop,), name="node-labels",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._reflector is not None:
            self._reflector.interrupt()
        if self._thread is not None:
            self._thread.join(5)
