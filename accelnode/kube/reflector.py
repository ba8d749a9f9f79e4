"""A local copy of one collection (or one named object) of the Kubernetes API: list, then watch
with resume, ``410 Gone`` re-lists (docs/controller.md, "Kubernetes client"; docs/agent-status.md).
Lists are paged (:meth:`Client.list`); one named object is read by GET and watched from the most
recent revision (its own resourceVersion may be older than the server keeps); a ``410`` re-lists
at once the first time, then after a jittered exponential backoff while 410s follow each other (a
list served by a lagging cache must not become a hot list loop), reset by a watch that works.

Invariants: :meth:`Reflector.run` never raises, and every failure, malformed answers included,
is retried with backoff, never a dead thread; the copy is rebuilt from a whole answer rather
than patched from a doubtful event; a re-list reports what differs from the copy it replaces,
so a deletion missed while the watch was down still arrives as ``DELETED``; a ``MODIFIED`` that
leaves the trimmed copy as it was (a trim that drops the resourceVersion and the changed
fields) is no change and calls nothing. The heartbeat's
promise (``stall_after``) covers a quiet watch waiting on the network, so only a reflector stuck
in a callback or dead of a bug breaks it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable
from urllib.parse import quote

from accelnode.health import GRACE_DEFAULT, NOBEAT, Heartbeat
from accelnode.log import kv

from .client import Client, KubeError, Unreachable, WATCH_READ_SLACK, is_gone, is_not_found

log = logging.getLogger("accelnode.kube")


class Malformed(ValueError):
    """An answer of the API server the reflector cannot use (retried like an unreachable one)."""


class Backoff:
    """Capped exponential delays with jitter: the n-th :meth:`next` is ``base * factor**(n-1)``,
    at most ``cap``, shortened at random by up to ``jitter`` of itself (``rand()`` in [0, 1)) so
    that many clients do not retry in step; :meth:`reset` starts over."""

    def __init__(self, base: float = 0.8, cap: float = 30.0, *, factor: float = 2.0, jitter: float = 0.5,
                 rand: Callable[[], float] = random.random):
        if not 0 < base <= cap or factor < 1 or not 0 <= jitter < 1:
            raise ValueError(f"backoff needs 0 < base <= cap, factor >= 1 and 0 <= jitter < 1 (base={base!r}, "
                             f"cap={cap!r}, factor={factor!r}, jitter={jitter!r})")
        self.base, self.cap, self.factor, self.jitter, self.rand = base, cap, factor, jitter, rand
        self.steps = 0  # delays handed out since the last reset

    def next(self) -> float:
        delay = min(self.cap, self.base * self.factor ** min(self.steps, 64))
        self.steps += 1
        return delay * (1 - self.jitter * self.rand())

    def reset(self) -> None:
        self.steps = 0


class Reflector:
    """A local copy of the objects at ``path`` (``query`` may hold field/label selectors),
    kept current by watching; ``on_change()`` runs after every change and ``on_event(type,
    obj)`` once per object that changed (both optional, both called on the reflector's thread).

    With ``name`` set, the reflector follows that one object: GET instead of list (for
    identities that may get and watch but not list), watch with ``metadata.name=<name>``.
    ``trim(obj)`` trims an object before it is stored (memory: keep only what you read).
    ``expired_backoff`` paces the re-lists of 410s in a row (the first one re-lists at once);
    ``wait(stop, seconds)`` waits before each attempt and returns True to stop (default
    ``stop.wait``; tests record the delays instead of waiting them out). ``watch_jitter``: each
    watch asks the server to end it after ``watch_seconds`` times 1 to ``1 + watch_jitter``, drawn
    at random (client-go's reflector: 1 to 2), so that the watches of a whole fleet, opened at
    once (a rollout, an API server restart), do not all end and re-open at once every period.
    """

    MIN_WATCH = 5.0  # a watch that ends sooner without events counts as a failure (no hot loop)

    def __init__(self, client: Client, path: str, *, on_change: Callable[[], None] | None = None,
                 on_event: Callable[[str, dict], None] | None = None, query: dict | None = None,
                 name: str | None = None, trim: Callable[[dict], dict] = lambda o: o,
                 watch_seconds: int = 300, max_backoff: float = 30.0, beat: Heartbeat = NOBEAT,
                 stall_after: float | None = None, expired_backoff: Backoff | None = None,
                 wait: Callable[[threading.Event, float], bool] | None = None, watch_jitter: float = 0.0,
                 rand: Callable[[], float] = random.random):
        if not 0 <= watch_jitter <= 1:
            raise ValueError(f"watch_jitter must be from 0 to 1, not {watch_jitter!r}")
        self.client, self.path, self.name = client, path, name
        self.watch_jitter, self._rand = watch_jitter, rand
        self.expired_backoff = expired_backoff or Backoff(min(0.8, max_backoff), max_backoff)
        self._wait = wait or (lambda stop, seconds: stop.wait(seconds))
        self.beat = beat
        if stall_after is None:  # a list (client timeout), then a watch that may be silent to its end
            stall_after = client.timeout + watch_seconds * (1 + watch_jitter) + WATCH_READ_SLACK + GRACE_DEFAULT
        self.stall_after = stall_after
        self.query = dict(query or {})
        if name:
            self.query["fieldSelector"] = f"metadata.name={name}"
        self.on_change = on_change or (lambda: None)
        self.on_event, self.trim = on_event, trim
        self.watch_seconds, self.max_backoff = watch_seconds, max_backoff
        self._items: dict[str, dict] = {}
        self._lock = threading.Lock()  # items are read by the reporter's thread
        self.synced = threading.Event()
        self.resource_version: str | None = None
        self.relists = 0  # lists done (the first one included)
        self.expired = 0  # 410s in a row (since the last watch that worked)
        self._watch_events = 0  # events of the watch in flight
        self.retry_in = 0.0  # the current backoff (0 while all is well)
        self._resp = None
        self._watching = False  # a watch is open: the copy follows the server
        self._current_at: float | None = None  # monotonic time the copy was last known current

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self._items.values())

    def get(self, namespace: str | None, name: str) -> dict | None:
        """One stored object (``namespace`` None or empty for a cluster-scoped kind)."""
        with self._lock:
            return self._items.get(f"{namespace or ''}/{name}")

    def out_of_sync_for(self) -> float | None:
        """Seconds since the copy was last known current: 0 while a watch is open (one that hangs
        silently is dropped by the client's read timeout, ``watch_seconds`` plus slack), None
        before the first list."""
        at = self._current_at
        if at is None:
            return None
        return 0.0 if self._watching else max(0.0, time.monotonic() - at)

    def interrupt(self) -> None:
        """End the watch in flight (after setting :meth:`run`'s ``stop``, so it returns promptly)."""
        _shutdown(self._resp)

    def follow(self, name: str) -> Callable[[float], None]:
        """:meth:`run` on a daemon thread called ``name``; returns the function that stops it
        (and waits up to its argument, in seconds, for the thread to end)."""
        stop = threading.Event()
        thread = threading.Thread(target=self.run, args=(stop,), name=name, daemon=True)
        thread.start()

        def end(timeout: float) -> None:
            stop.set()
            self.interrupt()
            thread.join(timeout)
        return end

    def run(self, stop: threading.Event) -> None:
        self._run(stop)
        self.beat.close()  # stopped on purpose (an exception out of _run leaves the heartbeat dead)

    def _run(self, stop: threading.Event) -> None:
        delay = 0.0
        while True:
            self.beat.beat(delay + self.stall_after)
            if self._wait(stop, delay):
                return
            self._watch_events = 0
            try:
                if self.resource_version is None:
                    self._list()
                started, events = time.monotonic(), self._watch(stop)
                if events or time.monotonic() - started >= self.MIN_WATCH:
                    delay = 0.0  # the server ended a healthy watch: resume at once
                    self.expired = 0
                    self.expired_backoff.reset()
                else:
                    delay = self._backoff(delay, "the watch ended at once without events")
            except KubeError as e:
                if is_gone(e):  # our resourceVersion was compacted away: start over
                    self.resource_version = None
                    if self._watch_events:  # this watch worked before it expired: not one in a row
                        self.expired = 0
                        self.expired_backoff.reset()
                    self.expired += 1
                    delay = 0.0 if self.expired == 1 else self.expired_backoff.next()
                    log.info("watch expired, re-listing", extra=kv(path=self.path, message=e.message,
                                                                   in_a_row=self.expired, retry_in=delay))
                elif is_not_found(e) and not self.name:
                    delay = self._backoff(delay, f"{self.path} is not served by the API server (is its "
                                                 f"CustomResourceDefinition installed?): {e}")
                else:
                    delay = self._backoff(delay, e)
            except (Unreachable, ValueError, OSError) as e:
                if stop.is_set():
                    return
                delay = self._backoff(delay, e)
            self.retry_in = delay

    def _backoff(self, delay: float, err) -> float:
        delay = min(self.max_backoff, max(0.5, delay * 2))
        log.warning("watch failed, retrying", extra=kv(path=self.path, error=str(err), retry_in=delay))
        return delay

    def _key(self, obj: dict) -> str:
        md = obj.get("metadata") or {}
        return f"{md.get('namespace', '')}/{md.get('name', '')}"

    def _list(self) -> None:
        if self.name:  # a missing object is an error like any other: retried with backoff
            obj = self.client.request("GET", f"{self.path}/{quote(self.name, safe='')}")
            pairs, rv = [(self._key(obj), self.trim(obj))], _rv(obj)
        else:  # each page trimmed as it comes: one page of whole objects at most is held
            doc = self.client.list(self.path, query=self.query, each=lambda o: (self._key(o), self.trim(o)))
            pairs, rv = doc.get("items") or [], _rv(doc)
        if not rv:
            raise Malformed(f"the answer to GET {self.path} has no metadata.resourceVersion to watch from")
        fresh = dict(pairs)
        with self._lock:
            old, self._items = self._items, fresh
        # A list's resourceVersion is the collection's, current; one object's is when it last
        # changed, which for a quiet object falls behind the server's watch window while others
        # change: a watch from it ends in 410 Gone at once, and GET, watch, 410 would repeat for
        # as long as the object stays quiet. So a GET is followed by a watch from the most recent
        # revision (resourceVersion unset), which first replays the object as it is, then bookmarks.
        self.resource_version = FROM_NOW if self.name else rv
        self.relists += 1
        self._current_at = time.monotonic()
        self.synced.set()
        if self.on_event is not None:
            for key, obj in fresh.items():
                before = old.get(key)
                if before is None:
                    self.on_event("ADDED", obj)
                elif _rv(before) != _rv(obj):
                    self.on_event("MODIFIED", obj)
            for key in old.keys() - fresh.keys():
                self.on_event("DELETED", old[key])
        self.on_change()

    def _watch(self, stop: threading.Event) -> int:
        """Follow one watch until it ends; the number of events it brought."""
        query = dict(self.query)
        if self.resource_version != FROM_NOW:
            query["resourceVersion"] = self.resource_version

        def opened(resp) -> None:
            self._resp, self.retry_in, self._watching = resp, 0.0, True
            if stop.is_set():  # stopped while the watch was being opened
                _shutdown(resp)

        try:
            seconds = round(self.watch_seconds * (1 + self.watch_jitter * self._rand()))
            return self._follow(self.client.watch(self.path, query, seconds, on_open=opened), stop)
        finally:
            if self._watching:  # current up to its end
                self._current_at, self._watching = time.monotonic(), False
            self._resp = None

    def _follow(self, events, stop: threading.Event) -> int:
        n = 0
        for event in events:
            n += 1
            self._watch_events = n
            self.beat.beat(self.stall_after)
            self._apply(event)
            event = None  # the whole object is not held while the next event is parsed
            if stop.is_set():
                break
        return n

    def _apply(self, event: dict) -> None:
        obj = event.get("object") or {}
        rv = _rv(obj)
        kind = event.get("type")
        if kind == "BOOKMARK":  # only a resourceVersion to resume from (none: nothing to learn)
            self.resource_version = rv or self.resource_version
            return
        if not rv or not (obj.get("metadata") or {}).get("name"):
            log.warning("malformed watch event, re-listing", extra=kv(
                path=self.path, type=kind, name=(obj.get("metadata") or {}).get("name", "")))
            self.resource_version = None
            raise Malformed(f"a {kind} event of {self.path} has no metadata.name or metadata.resourceVersion")
        kept = None
        with self._lock:
            if kind in ("ADDED", "MODIFIED"):
                key, kept = self._key(obj), self.trim(obj)
                if self._items.get(key) == kept:  # nothing this copy keeps changed (a trim without the
                    kept = None  # resourceVersion; the replay that starts a watch from the most recent revision)
                else:
                    self._items[key] = kept
            elif kind == "DELETED":
                kept = self._items.pop(self._key(obj), None) or self.trim(obj)
        self.resource_version = rv
        if kept is None and kind in ("ADDED", "MODIFIED"):
            return  # no cue: the agents' cache copies ignore the controller's count writes (docs/scale.md)
        if self.on_event is not None and kept is not None:
            self.on_event(kind, kept)
        self.on_change()


FLEET_JITTER = 1.0  # watch_jitter of a component that runs on every node (the agent, the CSI node plugin)
FROM_NOW = ""  # the resourceVersion of a watch that starts at the most recent revision (sent unset)


def _rv(obj: dict) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


def _shutdown(resp) -> None:
    if resp is not None:
        try:
            resp.shutdown()
        except (RuntimeError, ValueError, OSError):  # the watch ended on its own meanwhile
            pass
