"""Where the driver may mount, and which mounts it may take away (docs/csi.md).

The driver runs privileged with kubelet's pods directory mounted Bidirectional, so a path it is
handed decides where a mount appears on the host (defence in depth: kubelet is the only expected
caller). Two rules:

* a target path must have kubelet's CSI shape (:data:`SHAPE`), as written and as resolved, so a
  symlink anywhere along it cannot lead elsewhere; anything else is INVALID_ARGUMENT;
* a mount is ours only when it shows a cache directory of the node's store, by identity
  (st_dev, st_ino; :class:`StoreDirs`); unpublish takes nothing else away.

Both cost a bounded number of system calls, whatever the number of mounts, caches or references.
"""

from __future__ import annotations

import collections
import os
import re
import threading
from collections.abc import Callable

from . import mounts

CSI_PLUGIN_DIR = "kubernetes.io~csi"  # kubelet's escaped name of the CSI volume plugin
SHAPE = f"<kubelet-dir>/pods/<pod-uid>/volumes/{CSI_PLUGIN_DIR}/<volume-name>/mount"
# A pod's uid: a UUID; static pods get the hex MD5 kubelet computes for them.
MAX_KNOWN = 1024  # cache directory identities the driver remembers
POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")


class OutsideKubelet(ValueError):
    """A target path that is not where kubelet publishes a CSI volume."""


def target(path: str, kubelet_dir: str) -> str:
    """The resolved target for ``path`` (its parent's real path + ``mount``), or OutsideKubelet
    saying why not. The last component is never resolved: a symlink there is not followed."""
    expected = f"expected {SHAPE} with --kubelet-dir {kubelet_dir}"
    if not os.path.isabs(path):
        raise OutsideKubelet(f"target_path {path!r} is not an absolute path; {expected}")
    parts = path.split("/")
    if "." in parts or ".." in parts:
        raise OutsideKubelet(f"target_path {path!r} contains '.' or '..'; {expected}")
    if path != os.path.normpath(path):
        raise OutsideKubelet(f"target_path {path!r} is not a normalised path; {expected}")
    tail = parts[-6:]
    if (len(parts) < 7 or tail[0] != "pods" or not POD_UID.fullmatch(tail[1])
            or tail[2:4] != ["volumes", CSI_PLUGIN_DIR] or tail[5] != "mount"):
        raise OutsideKubelet(f"target_path {path!r} is not where kubelet publishes a CSI volume; {expected}")
    pods = mounts.resolve(os.path.join(kubelet_dir, "pods"))
    parent, want = mounts.resolve(os.path.dirname(path)), os.path.join(pods, *tail[1:5])
    if parent != want:
        raise OutsideKubelet(f"target_path {path!r} leads to {parent}/mount, not into {want}; {expected}")
    return os.path.join(parent, "mount")


class StoreDirs:
    """The identities (st_dev, st_ino) of the store's cache directories, learnt from the agent.

    Each READY EnsureCache names a cache's path (:meth:`learn`); an identity not known yet is
    asked of the agent (``lookup``: one answer, the one cache whose directory it is, if any).
    A known identity is confirmed by one stat of its path, because a collected cache's inode may
    be reused. The map keeps the :data:`MAX_KNOWN` latest learnt: a forgotten one is asked again.
    """

    def __init__(self):
        self._known: collections.OrderedDict[tuple[int, int], str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def learn(self, path: str) -> None:
        ident = mounts.identity(path)
        with self._lock:
            self._known[ident] = path
            self._known.move_to_end(ident)
            while len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)

    def cache_at(self, ident: tuple[int, int], lookup: Callable[[tuple[int, int]], str]) -> str | None:
        """The store path of the cache directory whose identity is ``ident``, or None."""
        path = self._confirmed(ident)
        if path is not None:
            return path
        path = lookup(ident)
        if not path:
            return None
        try:
            self.learn(path)
        except FileNotFoundError:  # collected since the agent answered
            return None
        return self._confirmed(ident)

    def _confirmed(self, ident: tuple[int, int]) -> str | None:
        with self._lock:
            path = self._known.get(ident)
        try:
            if path is not None and mounts.identity(path) == ident:
                return path
        except FileNotFoundError:
            pass
        return None
