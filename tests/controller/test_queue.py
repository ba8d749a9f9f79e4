"""The work queue (controller/runtime/queue.py): dedup, one worker per key, delays, backoff, shutdown.
No timing assertions: delays are read from the backoff, waits are bounded polls."""

from __future__ import annotations

import random
import threading
import time

from controller.runtime.queue import Backoff, WorkQueue


def drain(q: WorkQueue) -> list[str]:
    out = []
    while (key := q.get(timeout=0)) is not None:
        out.append(key)
        q.done(key)
    return out


def test_a_key_queued_twice_is_handed_out_once():
    q = WorkQueue()
    for key in ("a", "b", "a", "a", "c", "b"):
        q.add(key)
    assert len(q) == 3
    assert drain(q) == ["a", "b", "c"]
    assert q.get(timeout=0) is None


def test_a_key_queued_while_held_waits_for_done_and_comes_back_once():
    q = WorkQueue()
    q.add("a")
    assert q.get(timeout=0) == "a"
    q.add("a")
    q.add("a")
    assert q.get(timeout=0) is None  # held by a worker: not handed to another
    q.done("a")
    assert q.get(timeout=0) == "a"
    q.done("a")
    assert q.get(timeout=0) is None


def test_workers_never_hold_the_same_key_at_once():
    q = WorkQueue()
    held, overlaps, seen = set(), [], []
    lock = threading.Lock()

    def worker():
        while (key := q.get()) is not None:
            with lock:
                if key in held:
                    overlaps.append(key)
                held.add(key)
                seen.append(key)
            time.sleep(0.001)
            with lock:
                held.discard(key)
            q.done(key)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    rng = random.Random(7)
    for _ in range(3000):
        q.add(f"k{rng.randrange(4)}")
    end = time.monotonic() + 30
    while (len(q) or held) and time.monotonic() < end:
        time.sleep(0.01)
    q.shutdown()
    for t in threads:
        t.join(10)
    assert overlaps == []
    assert {"k0", "k1", "k2", "k3"} <= set(seen)
    assert len(seen) < 3000  # keys added while queued were merged


def test_add_after_delays_and_keeps_the_earlier_time():
    q = WorkQueue()
    q.add_after("late", 3600)
    q.add_after("soon", 0.05)
    q.add_after("soon", 3600)  # a later time for a waiting key changes nothing
    assert q.get(timeout=10) == "soon"
    q.done("soon")
    assert q.get(timeout=0.1) is None  # "late" is still waiting
    q.add("late")  # an event makes it ready at once
    assert q.get(timeout=0) == "late"


def test_backoff_grows_per_key_is_capped_and_resets_on_success():
    b = Backoff(base=0.1, cap=2.0, jitter=0.0)
    assert [b.when("a") for _ in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert b.when("other") == 0.1  # per key
    assert b.failures("a") == 7
    b.forget("a")
    assert b.failures("a") == 0 and b.when("a") == 0.1


def test_backoff_jitter_stays_within_its_band_and_under_the_cap():
    b = Backoff(base=1.0, cap=8.0, jitter=0.2, rng=random.Random(1))
    for n in range(10):
        d = b.when("k")
        full = min(8.0, 2.0 ** n)
        assert 0.8 * full <= d <= full


def test_rate_limited_requeue_uses_the_key_backoff():
    q = WorkQueue(Backoff(base=0.01, cap=0.05, jitter=0.0))
    delays = [q.add_rate_limited("k") for _ in range(4)]
    assert delays == [0.01, 0.02, 0.04, 0.05]
    assert q.get(timeout=10) == "k"  # queued once whatever the number of requeues


def test_shutdown_wakes_waiting_workers_and_refuses_new_keys():
    q = WorkQueue()
    got = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    q.add_after("never", 3600)
    q.shutdown()
    t.join(10)
    assert not t.is_alive() and got == [None]
    q.add("x")
    assert q.get(timeout=0) is None and len(q) == 0
