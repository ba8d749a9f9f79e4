"""Capture's memory is bounded by its limits, not by how many pods contributed or how large each
made its layer (docs/capture.md): the attack is a fleet of contributions that together would take
the controller past its memory limit, and a node whose pods unpublish faster than pushes go."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

from accelnode.capture import layer, publish
from accelnode.capture.reader import CaptureLimits
from agent.capture import BUSY, QUEUED, Capturer


def contribution(n: int, size: int) -> layer.Layer:
    # incompressible content: the compressed layer is as large as what it holds
    return layer.build({f"junk/{n}/file": os.urandom(size)})


def test_a_publication_holds_at_most_its_budget_of_contributions_newest_first(registry):
    opts, repo = registry.options(), f"{registry.host}/team-a/captured"
    sources = []
    for n in range(5):
        ref = publish.push_contribution(contribution(n, 40_000), repo, opts)
        sources.append((ref, f"node-{n}", f"team-a/pod-{n}", f"2026-11-28T00:00:0{n}Z"))  # oldest first
    limits = CaptureLimits(max_bytes=100_000)
    got, refused, later = publish.fetch_within(sources, opts, limits)
    assert [c.node for c in got] == ["node-3", "node-4"]  # the newest that fit, in source order
    assert sum(len(c.blob) for c in got) <= limits.max_bytes
    assert not refused and len(later) == 3 and all("budget" in line for line in later), later
    # a contribution larger than the whole budget is never read at all, not read and then dropped
    big = publish.push_contribution(contribution(9, 150_000), repo, opts)
    got, refused, later = publish.fetch_within([(big, "node-9", "team-a/big", "t")], opts,
                                               CaptureLimits(max_bytes=100_000))
    assert not got and (refused or later)


class _Store:
    """The one thing a Capturer asks of the store: what the base cache is and where it lies."""

    def __init__(self, root: Path):
        self.root = root

    def installed(self, digest):
        return SimpleNamespace(kind="jax", labels={}, path=str(self.root))


def test_layers_waiting_for_their_push_are_bounded_in_bytes(tmp_path, monkeypatch):
    """A registry that stalls the pushes while pods keep unpublishing: the node drops layers
    (BUSY, said) instead of holding them all in memory."""
    release = threading.Event()
    monkeypatch.setattr(publish, "push_contribution", lambda lay, repo, opts: release.wait(30) and "x@sha256:0")
    lays = iter(contribution(n, 30_000) for n in range(10))
    monkeypatch.setattr(layer, "contribute",
                        lambda upper, kind, pod_path, base, limits: (next(lays), SimpleNamespace(keys=[1], dropped=0)))
    base = tmp_path / "base"
    base.mkdir()
    cap = Capturer(_Store(base), lambda ns, secret: None, limits=CaptureLimits(max_bytes=70_000)).start()
    try:
        answers = [cap.capture(str(tmp_path), "sha256:" + "a" * 64, ("team-a", "c"), {"metadata": {}},
                               "r/x", "push").state for _ in range(6)]
    finally:
        release.set()
        cap.stop()
    assert answers[:2] == [QUEUED, QUEUED] and set(answers[2:]) == {BUSY}, answers
