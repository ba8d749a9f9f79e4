"""Events on the objects users own, as ``kubectl describe`` shows them (docs/controller.md, "Events").

Events are core/v1 ``Event`` objects (what ``kubectl describe`` lists, by ``involvedObject``),
written by one background thread so that a reconciler never waits on them, with client-go's
recorder rules so that a failing loop does not flood etcd:

* **correlation**: an event equal to one recorded before (same object, type, reason, message)
  is not a new object: the existing one gets ``count + 1`` and a new ``lastTimestamp`` (a merge
  PATCH); if it is gone (events expire after the API server's ``--event-ttl``), a new one is made;
* **aggregation**: more than :data:`AGGREGATE_AFTER` different messages of one object and reason
  within :data:`AGGREGATE_WINDOW` seconds become one event, "(combined from similar events): "
  and the latest message, counted like a repeat;
* **spam filter**: per object, a token bucket of :data:`BURST` events refilled at one per
  :data:`REFILL` seconds; what exceeds it is dropped (and counted in the log);
* a full queue (:data:`QUEUE`) drops too: events are a courtesy, never a reason to block.

Reconcilers call :func:`transitions` after a status write (one event per condition that changed:
see there) or :func:`record`. Both go to the process's recorder, installed by ``accelnode
controller`` (:func:`install`); without one they do nothing, so reconcilers run unchanged in
tests that do not look at events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from datetime import datetime, timezone

from accelnode.kube.client import Client, KubeError, Unreachable, is_not_found
from accelnode.log import kv

log = logging.getLogger("accelnode.controller")

NORMAL, WARNING = "Normal", "Warning"
COMPONENT = "accelnode-controller"
BURST, REFILL = 25, 300.0  # client-go's EventSourceObjectSpamFilter defaults
AGGREGATE_AFTER, AGGREGATE_WINDOW = 10, 600.0  # client-go's EventAggregator defaults
QUEUE = 1000  # events waiting to be written (client-go's broadcaster queue)
REMEMBERED = 4096  # correlated events kept (client-go's LRU size)
MAX_MESSAGE = 1024
COMBINED = "(combined from similar events): "


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def reference(obj: dict) -> dict:
    """The ``involvedObject`` of an event about ``obj``."""
    md = obj.get("metadata") or {}
    ref = {"apiVersion": obj.get("apiVersion", ""), "kind": obj.get("kind", ""), "name": md.get("name", "")}
    for field in ("namespace", "uid", "resourceVersion"):
        if md.get(field):
            ref[field] = md[field]
    return ref


class Recorder:
    """Writes events through ``client`` on its own thread (:meth:`start`/:meth:`stop`)."""

    def __init__(self, client: Client, *, component: str = COMPONENT, instance: str = "",
                 clock=time.monotonic):
        self.client, self.component, self.instance = client, component, instance
        self._clock = clock
        self._queue: queue.Queue = queue.Queue(QUEUE)
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # object uid/name -> (tokens, when)
        self._recent: OrderedDict[tuple, dict] = OrderedDict()  # correlation key -> the Event as written
        self._messages: OrderedDict[tuple, tuple[float, set]] = OrderedDict()  # (object, reason) -> (since, msgs)
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._pending = 0
        self.dropped = 0

    # -- recording (any thread) ------------------------------------------------------------------

    def record(self, obj: dict, type_: str, reason: str, message: str) -> None:
        """Queue an event about ``obj``; dropped (never blocking) when the spam filter or the queue
        says so."""
        ref = reference(obj)
        if not self._allow(ref):
            self._drop("spam filter", ref, reason)
            return
        with self._idle:
            self._pending += 1
        try:
            self._queue.put_nowait((ref, type_, reason, message[:MAX_MESSAGE]))
        except queue.Full:
            with self._idle:
                self._pending -= 1
            self._drop("queue full", ref, reason)

    def _allow(self, ref: dict) -> bool:
        key = ref.get("uid") or f"{ref['kind']}/{ref.get('namespace', '')}/{ref['name']}"
        with self._lock:  # reconcilers record from their worker threads
            now = self._clock()
            tokens, when = self._buckets.get(key, (float(BURST), now))
            tokens = min(float(BURST), tokens + (now - when) / REFILL)
            allowed = tokens >= 1
            self._buckets[key] = (tokens - 1 if allowed else tokens, now)
            if len(self._buckets) > REMEMBERED:
                self._buckets.pop(next(iter(self._buckets)))
            return allowed

    def _drop(self, why: str, ref: dict, reason: str) -> None:
        with self._lock:
            self.dropped += 1
        log.debug("event dropped", extra=kv(why=why, kind=ref["kind"], name=ref["name"], reason=reason))

    # -- writing (the recorder's thread) -----------------------------------------------------------

    def start(self) -> "Recorder":
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued event is written (or given up); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            except (KubeError, Unreachable, OSError) as e:  # an event is not worth a retry loop
                log.warning("event not written", extra=kv(kind=item[0]["kind"], name=item[0]["name"],
                                                          reason=item[2], error=str(e)))
            except Exception:
                log.exception("event not written")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _aggregate(self, ref: dict, type_: str, reason: str, message: str) -> str:
        """``message``, or the combined message once this object and reason had too many others."""
        key = (ref.get("uid") or ref["name"], ref["kind"], type_, reason)
        now = self._clock()
        since, seen = self._messages.get(key, (now, set()))
        if now - since > AGGREGATE_WINDOW:
            since, seen = now, set()
        seen.add(message)
        self._messages[key] = (since, seen)
        self._messages.move_to_end(key)
        if len(self._messages) > REMEMBERED:
            self._messages.popitem(last=False)
        return COMBINED + message if len(seen) > AGGREGATE_AFTER else message

    def _write(self, ref: dict, type_: str, reason: str, message: str) -> None:
        message = self._aggregate(ref, type_, reason, message)
        ns = ref.get("namespace") or "default"  # events about cluster-scoped objects live in default
        # a combined event is one object whatever its latest message
        key = (ns, ref["kind"], ref["name"], ref.get("uid"), type_, reason,
               COMBINED if message.startswith(COMBINED) else message)
        now = _now()
        old = self._recent.get(key)
        if old is not None:
            try:
                event = self.client.request(
                    "PATCH", f"/api/v1/namespaces/{ns}/events/{old['metadata']['name']}",
                    body={"count": int(old.get("count") or 1) + 1, "lastTimestamp": now, "message": message})
            except KubeError as e:
                if not is_not_found(e):
                    raise
                event = None  # expired: record it anew
            if event is not None:
                self._remember(key, event)
                return
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{ref['name']}.{uuid.uuid4().hex[:16]}", "namespace": ns},
                "involvedObject": ref, "type": type_, "reason": reason, "message": message,
                "source": {"component": self.component}, "reportingComponent": self.component,
                "reportingInstance": self.instance, "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        self._remember(key, self.client.request("POST", f"/api/v1/namespaces/{ns}/events", body=body))

    def _remember(self, key: tuple, event: dict) -> None:
        self._recent[key] = event
        self._recent.move_to_end(key)
        if len(self._recent) > REMEMBERED:
            self._recent.popitem(last=False)


_recorder: Recorder | None = None


def install(recorder: Recorder | None) -> None:
    """Make ``recorder`` the process's (None: events off)."""
    global _recorder
    _recorder = recorder


def record(obj: dict, type_: str, reason: str, message: str) -> None:
    """An event about ``obj`` through the process's recorder (nothing when none is installed)."""
    if _recorder is not None:
        _recorder.record(obj, type_, reason, message)


def transitions(obj: dict, status: dict, *, progress: tuple[str, ...] = (), quiet: tuple[str, ...] = ()) -> None:
    """One event per condition of ``status`` that changed from ``obj``'s status: a new
    condition, a new status, or a new reason while False (a True condition changing its reason is
    routine, not news); conditions of a type in ``quiet`` (a summary of the others) only when
    False. ``Normal`` when True or when its reason is in ``progress`` (work under way), else
    ``Warning``; the event's reason and message are the condition's."""
    if _recorder is None:
        return
    before = {c.get("type"): c for c in ((obj.get("status") or {}).get("conditions") or [])}
    for c in status.get("conditions") or []:
        old = before.get(c.get("type")) or {}
        same = old.get("status") == c.get("status") and (c.get("status") == "True"
                                                         or old.get("reason") == c.get("reason"))
        if same or not c.get("reason") or (c.get("type") in quiet and c.get("status") == "True"):
            continue
        normal = c.get("status") == "True" or c.get("reason") in progress
        _recorder.record(obj, NORMAL if normal else WARNING, c["reason"], c.get("message") or "")
