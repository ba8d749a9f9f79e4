"""The event watcher in-process: what it does with the inotify queue (no root needed)."""

import shutil

import pytest

from device_plugin.events import Watcher
from device_plugin.health import Inventory


@pytest.fixture
def watcher(tmp_path):
    """A Watcher on empty sys/dev/kubelet dirs, driven by hand (``step``); kicks count on_kubelet calls."""
    for d in ("sys", "dev", "kubelet"):
        (tmp_path / d).mkdir()
    w = Watcher(Inventory(tmp_path / "sys", tmp_path / "dev"), tmp_path / "kubelet", lambda states: None,
                lambda: w.kicks.append(1))
    w.kicks = []
    w.step(0)  # arms the watches
    yield w
    w.stop()


def test_lost_events_count_as_a_kubelet_change(watcher, tmp_path):
    """When the queue overflows, the kubelet.sock event may be among those lost: the registrar must look."""
    limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())
    churn = tmp_path / "dev" / "churn"
    for _ in range(limit // 2 + 1):  # two events each: the queue overflows
        churn.touch()
        churn.unlink()
    (tmp_path / "kubelet" / "kubelet.sock").touch()  # its event is dropped
    watcher.step(0)
    assert watcher.kicks == [1]
    watcher.step(0)  # the queue was drained in one wake-up: nothing left to report
    assert watcher.kicks == [1]


def test_kubelet_dir_events_kick_and_dev_events_do_not(watcher, tmp_path):
    (tmp_path / "dev" / "accel9").touch()
    watcher.step(0)
    assert watcher.kicks == []
    (tmp_path / "kubelet" / "kubelet.sock").touch()
    watcher.step(0)
    assert watcher.kicks == [1]


def test_kubelet_dir_deleted_and_recreated_is_watched_again(watcher, tmp_path):
    shutil.rmtree(tmp_path / "kubelet")
    watcher.step(0)
    assert watcher.kicks == [1]
    (tmp_path / "kubelet").mkdir()
    watcher.step(0)  # re-armed now that it exists
    (tmp_path / "kubelet" / "kubelet.sock").touch()
    watcher.step(0)
    assert watcher.kicks == [1, 1]
