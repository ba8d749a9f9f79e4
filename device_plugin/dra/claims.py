"""NodePrepareResources / NodeUnprepareResources: a CDI spec per claim, state on disk.

Preparing a claim reads its allocation (the devices of our driver in our pool) from the
:class:`ClaimWatch`, a watch-fed copy of the claims allocated on this node, or with a GET of the
claim where the copy cannot answer (its watch is down, or has not yet brought the claim, its UID
or its allocation), then writes, each atomically (temporary file, rename), neither fsynced:

1. the claim's **CDI spec** ``<cdi-dir>/<vendor>-<class>_<claim UID>.json`` (in /var/run), kind
   ``k8s.<driver>/tpu``: one CDI device ``<claim UID>-<device>`` per allocated device (a chip
   ``tpu-<index>`` or an ICI block ``tpu-<first>-<last>``, device_plugin/dra/slices.py) with its
   chips' device nodes, and spec-wide edits applied once per container: ``/dev/vfio/vfio`` (VFIO generations),
   the TPU env of exactly these chips (the device plugin's table, device_plugin/topology.py) and
   libtpu's log directory: a tmpfs the runtime mounts per container (``size=``, ``nr_inodes=``:
   bounded; ``mode=1777``: writable by whatever user the pod runs as; nothing of it on the host,
   so nothing is left behind when the claim goes);
2. the claim's **checkpoint** ``<state-dir>/<claim UID>.json``: the answer given to kubelet.
   It is answered from only while the claim's spec exists too, and the spec lives in /var/run:
   a checkpoint that outlives a reboot is never answered from (kubelet prepares the claim again
   and it is read anew), while within one boot the page cache holds it for a restarted plugin.
   An fsync (of the file and its directory) would buy nothing and cost the most of a prepare
   under load; a node crash that leaves it torn or empty is the unreadable case below.

A claim with both files is prepared: preparing it again returns the checkpoint without asking
the API server (kubelet repeats calls after its own restarts). A crash between 1 and 2 leaves a
spec without checkpoint: the next prepare writes both again. Unpreparing removes the spec, then
the checkpoint; a claim that is not (or no longer) prepared is not an error. So a restart of the
plugin between prepare and unprepare loses nothing. A checkpoint that does not parse is that
claim's problem alone: it is prepared anew from the API server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

from accelnode import atomic
from accelnode.decode import FILE, read_file
from accelnode.health import NOBEAT, Heartbeat
from accelnode.kube.client import Client, KubeError, is_not_found
from accelnode.kube.reflector import Reflector
from accelnode.log import kv

from .. import topology
from ..health import ChipState
from .slices import device_chips, device_name

log = logging.getLogger("accelnode.dra")

CDI_VERSION = "0.6.0"
CDI_CLASS = "tpu"
LOG_DIR_IN_CONTAINER = "/tmp/tpu_logs"  # where libtpu writes its logs
LOG_SIZE = 64 << 20  # bytes of a claim's container's log tmpfs (--libtpu-log-size)
LOG_BYTES_PER_INODE = 16384  # files it may hold: one per this many bytes of its size, at least 1024
_UID = re.compile(r"^[0-9a-fA-F-]{1,64}$")
CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
RESULT_KEYS = ("request", "driver", "pool", "device")  # what a prepare reads of an allocation result


def our_results(claim: dict, driver: str, pool: str) -> list[dict]:
    """The allocation results of ``claim`` that are ``driver``'s devices in ``pool`` (trimmed to
    :data:`RESULT_KEYS`); none when it is not allocated."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    return [{k: r.get(k) for k in RESULT_KEYS} for r in (alloc.get("devices") or {}).get("results") or []
            if isinstance(r, dict) and r.get("driver") == driver and r.get("pool") == pool]


class ClaimWatch:
    """The ResourceClaims allocated on this node, from one list+watch of all claims (kubelet's
    NodePrepareResources names a claim but does not carry its allocation; a GET per prepare was
    most of its time). Each claim is kept trimmed to its name, UID and the results of our driver
    in our pool (about 800 bytes of memory for a claim of another node, measured), so memory
    follows the number of claims in the cluster, not their size. :meth:`allocation` answers only while the watch is open and only
    a claim it holds under kubelet's UID with results of ours: anything else (a watch that is
    down or not yet listed, a claim allocated a moment ago whose event has not arrived, RBAC
    without list/watch) is a miss, and the caller GETs the claim."""

    def __init__(self, client: Client, driver: str, node: str, beat: Heartbeat = NOBEAT):
        self.driver, self.node = driver, node
        self.reflector = Reflector(client, CLAIMS, trim=self._trim, beat=beat)
        self._end = lambda timeout: None

    def _trim(self, claim: dict) -> dict:
        md = claim.get("metadata") or {}
        return {"metadata": {k: md[k] for k in ("namespace", "name", "uid", "resourceVersion") if k in md},
                "ours": our_results(claim, self.driver, self.node)}

    def start(self) -> "ClaimWatch":
        self._end = self.reflector.follow("claim watch")
        return self

    def stop(self) -> None:
        self._end(10)

    def allocation(self, namespace: str, name: str, uid: str) -> list[dict] | None:
        """The claim's results of ours as the watch has them; None: ask the API server."""
        if self.reflector.out_of_sync_for() != 0.0:
            return None
        kept = self.reflector.get(namespace, name)
        if kept is None or kept["metadata"].get("uid") != uid or not kept["ours"]:
            return None
        return kept["ours"]


class ClaimError(Exception):
    """This claim cannot be prepared (the message goes to kubelet, which retries)."""


class Claims:
    def __init__(self, *, client: Client, driver: str, node: str, cdi_dir: Path, state_dir: Path, dev_root: Path,
                 states: Callable[[], tuple[ChipState, ...]], config: Callable[[], topology.NodeConfig],
                 log_size: int = LOG_SIZE, watch: ClaimWatch | None = None):
        """``watch``: where allocations are read first (None: a GET per prepare)."""
        self.client, self.driver, self.node, self.watch = client, driver, node, watch
        self.cdi_dir, self.state_dir, self.dev_root = cdi_dir, state_dir, dev_root
        self.states, self.config, self.log_size = states, config, log_size
        self.kind = f"k8s.{driver}/{CDI_CLASS}"
        # claim UID -> (its lock, calls holding or waiting for it): an entry lives only while a
        # call on that claim does, so the map is bounded by the calls in flight
        self._locks: dict[str, list] = {}
        self._locks_lock = threading.Lock()
        vendor, cls = self.kind.split("/")
        for p in atomic.sweep(state_dir) + atomic.sweep(cdi_dir, prefix=f"{vendor}-{cls}_"):
            log.info("removed the temporary file of an interrupted write", extra=kv(path=str(p)))

    # -- paths -------------------------------------------------------------------------------------

    def spec_path(self, uid: str) -> Path:
        vendor, cls = self.kind.split("/")
        return self.cdi_dir / f"{vendor}-{cls}_{uid}.json"

    def checkpoint_path(self, uid: str) -> Path:
        return self.state_dir / f"{uid}.json"

    def prepared(self) -> list[str]:
        """UIDs of the claims with a checkpoint."""
        return sorted(p.stem for p in self.state_dir.glob("*.json"))

    @contextlib.contextmanager
    def _lock(self, uid: str):
        """One call at a time per claim."""
        with self._locks_lock:
            entry = self._locks.setdefault(uid, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._locks_lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._locks[uid]

    # -- the two calls ------------------------------------------------------------------------------

    def prepare(self, namespace: str, name: str, uid: str) -> list[dict]:
        """The claim's devices (``request_names``, ``pool_name``, ``device_name``, ``cdi_device_ids``)."""
        _check_uid(uid)
        t0 = time.perf_counter()
        with self._lock(uid):
            ck = self.checkpoint_path(uid)
            if ck.exists() and self.spec_path(uid).exists():
                devs = self._checkpointed(ck, uid)
                if devs is not None:
                    return devs
            t_read = time.perf_counter()
            results, source = self._allocation(namespace, name, uid)
            t_read = time.perf_counter() - t_read
            states = {s.chip.index: s for s in self.states()}
            devices = {}  # allocated device -> its chips (one chip, or an ICI block)
            for r in results:
                indices = device_chips(r["device"])
                if indices is None or not set(indices) <= states.keys():
                    raise ClaimError(f"claim {namespace}/{name}: device {r['device']} is not on this node")
                for i in indices:
                    if states[i].problem is not None:
                        raise ClaimError(f"claim {namespace}/{name}: chip {device_name(i)} is Unhealthy: "
                                         f"{states[i].problem}")
                devices[r["device"]] = [states[i].chip for i in indices]
            spec = self.spec(uid, devices, len(states))
            # the spec need not survive a reboot (/var/run; the containers do not either), the
            # checkpoint must: it is what tells a restarted plugin the claim is prepared
            atomic.write(self.spec_path(uid), json.dumps(spec, indent=1).encode(), durable=False)
            devs = [{"request_names": [r["request"]], "pool_name": r["pool"], "device_name": r["device"],
                     "cdi_device_ids": [f"{self.kind}={uid}-{r['device']}"]} for r in results]
            atomic.write(ck, json.dumps({"namespace": namespace, "name": name, "uid": uid, "devices": devs}).encode(),
                         durable=False)  # see the module's docstring
            log.info("claim prepared", extra=kv(claim=f"{namespace}/{name}", uid=uid, allocation_from=source,
                                                devices=",".join(r["device"] for r in results),
                                                read_ms=round(t_read * 1000, 2),
                                                took_ms=round((time.perf_counter() - t0) * 1000, 2)))
            return devs

    def unprepare(self, uid: str) -> None:
        _check_uid(uid)
        with self._lock(uid):
            had = self.checkpoint_path(uid).exists()
            self.spec_path(uid).unlink(missing_ok=True)
            self.checkpoint_path(uid).unlink(missing_ok=True)
            if had:
                log.info("claim unprepared", extra=kv(uid=uid))

    # -- internals -----------------------------------------------------------------------------------

    @staticmethod
    def _checkpointed(ck: Path, uid: str) -> list[dict] | None:
        """The devices a checkpoint recorded; None (logged) when it is not one we wrote, so the
        claim is prepared anew: one bad file never fails another claim, nor the plugin."""
        try:
            doc = read_file(ck, FILE)
            devs = doc["devices"]
            if doc.get("uid") != uid or not isinstance(devs, list) or not all(
                    isinstance(d, dict) and isinstance(d.get("device_name"), str) and isinstance(d.get("pool_name"), str)
                    and all(isinstance(d.get(k), list) and all(isinstance(x, str) for x in d[k])
                            for k in ("request_names", "cdi_device_ids")) and set(d) == {
                        "request_names", "pool_name", "device_name", "cdi_device_ids"} for d in devs):
                raise ValueError("not a checkpoint of this claim")
            return devs
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            log.warning("claim checkpoint unreadable; preparing the claim anew", extra=kv(
                uid=uid, checkpoint=str(ck), error=f"{type(e).__name__}: {e}"[:200]))
            return None

    def _allocation(self, namespace: str, name: str, uid: str) -> tuple[list[dict], str]:
        """The claim's results of ours, and where they were read (``watch`` or ``api``)."""
        if self.watch is not None:
            ours = self.watch.allocation(namespace, name, uid)
            if ours is not None:
                return ours, "watch"
        try:
            claim = self.client.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")
        except KubeError as e:
            if is_not_found(e):
                raise ClaimError(f"claim {namespace}/{name} not found") from None
            raise ClaimError(f"claim {namespace}/{name}: reading it failed: {e}") from None
        if claim["metadata"].get("uid") != uid:
            raise ClaimError(f"claim {namespace}/{name} has UID {claim['metadata'].get('uid')}, kubelet asked for {uid}")
        if not (claim.get("status") or {}).get("allocation"):
            raise ClaimError(f"claim {namespace}/{name} is not allocated")
        ours = our_results(claim, self.driver, self.node)
        if not ours:
            raise ClaimError(f"claim {namespace}/{name} has no device of {self.driver} in pool {self.node}")
        return ours, "api"

    def spec(self, uid: str, devices: dict, host_chips: int) -> dict:
        """The claim's CDI spec: one CDI device per allocated device (``{name: [Chip, ...]}``) with
        its chips' nodes; the env of all the claim's chips together (one block: that block's env)."""
        def node(p: str) -> dict:
            return {"path": "/dev/" + os.path.relpath(p, self.dev_root), "hostPath": p, "permissions": "rw"}

        chips = sorted((c for cs in devices.values() for c in cs), key=lambda c: c.index)
        shared = {p for c in chips for p in c.dev_paths if p.endswith("/vfio/vfio")}
        env = topology.container_env(chips, host_chips, self.config())
        edits: dict = {"env": [f"{k}={v}" for k, v in sorted(env.items())],
                       "deviceNodes": [node(p) for p in sorted(shared)]}
        if self.log_size:
            inodes = max(1024, self.log_size // LOG_BYTES_PER_INODE)
            edits["mounts"] = [{"hostPath": "tmpfs", "containerPath": LOG_DIR_IN_CONTAINER, "type": "tmpfs",
                                "options": ["nosuid", "nodev", "noexec", f"size={self.log_size}",
                                            f"nr_inodes={inodes}", "mode=1777"]}]
        return {"cdiVersion": CDI_VERSION, "kind": self.kind, "containerEdits": edits,
                "devices": [{"name": f"{uid}-{dev}",
                             "containerEdits": {"deviceNodes": [node(p) for c in cs for p in c.dev_paths
                                                                if p not in shared],
                                                "env": [f"TPU_DEVICE_{c.index}_RESOURCE_CLAIM={uid}" for c in cs]}}
                            for dev, cs in devices.items()]}


def _check_uid(uid: str) -> None:
    if not _UID.match(uid or ""):
        raise ClaimError(f"claim UID {uid!r} is not a UID")
