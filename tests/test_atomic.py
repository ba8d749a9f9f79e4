"""accelnode.atomic, the one atomic writer (the agent's references and indexes, views' records,
DRA claims, webhook certificates), on a real file system that fills up."""

from __future__ import annotations

import errno
import os
import time

import pytest

from accelnode import atomic
from tests.conftest import fill


def test_a_write_on_a_full_file_system_fails_and_leaves_nothing(tmpfs):
    target = tmpfs / "ref.json"
    atomic.write(target, b"old")
    fill(tmpfs)
    for durable in (True, False):
        with pytest.raises(OSError) as e:
            atomic.write(target, b"new" * 4096, durable=durable)
        assert e.value.errno == errno.ENOSPC
        assert sorted(os.listdir(tmpfs)) == ["filler", "ref.json"]  # no temporary file
        assert target.read_bytes() == b"old"  # the old content, whole
    os.unlink(tmpfs / "filler")
    atomic.write(target, b"new", mode=0o600)
    assert target.read_bytes() == b"new" and sorted(os.listdir(tmpfs)) == ["ref.json"]


def test_sweep_removes_only_leftovers_of_writes(tmp_path):
    ours = [tmp_path / ".a.json.12.34.tmp", tmp_path / ".b.json.tmp"]  # this module's, an older release's
    theirs = [tmp_path / "a.json", tmp_path / "notes.tmp"]  # never touched
    vendor = tmp_path / ".vendor_x.json.1.2.tmp"  # in a shared directory: swept by its prefix only
    for p in ours + theirs + [vendor]:
        p.write_text("x")
    (tmp_path / ".dir.1.2.tmp").mkdir()  # not a file: not ours
    assert sorted(atomic.sweep(tmp_path, prefix="vendor_y")) == []
    old = time.time() - 3600
    os.utime(ours[0], (old, old))
    assert atomic.sweep(tmp_path, min_age=600) == [ours[0]]  # the young one may be a live write
    assert sorted(atomic.sweep(tmp_path, prefix="b.")) == [ours[1]]
    assert sorted(atomic.sweep(tmp_path, prefix="vendor_x")) == [vendor]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dir.1.2.tmp", "a.json", "notes.tmp"]
    assert atomic.sweep(tmp_path / "missing") == []
