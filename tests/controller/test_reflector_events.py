"""The reflector's per-object events (``on_event``), which feed a controller's work queue:
watch events name the object that changed, and a re-list reports only what differs from the
copy it replaces (a deletion missed while the watch was down included)."""

from __future__ import annotations

import threading

from accelnode.kube.reflector import Reflector
from tests.agent.conftest import eventually

# only the test's own ConfigMaps: kube-controller-manager adds kube-root-ca.crt to every namespace
OURS = {"accelnode-test": "events"}


def test_events_name_each_changed_object_and_a_relist_reports_the_difference(admin, kube_namespace):
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    for name in ("a", "b"):
        admin.request("POST", path, body={"metadata": {"name": name, "labels": OURS}})
    events, changes = [], []
    r = Reflector(admin, path, query={"labelSelector": "accelnode-test=events"}, on_event=lambda t, o: events.append((t, o["metadata"]["name"])),
                  on_change=lambda: changes.append(1))
    stop = threading.Event()
    t = threading.Thread(target=r.run, args=(stop,), daemon=True)
    t.start()
    try:
        assert eventually(lambda: sorted(events) == [("ADDED", "a"), ("ADDED", "b")]), events
        admin.request("PUT", f"{path}/a", body={"metadata": {"name": "a", "labels": OURS}, "data": {"k": "v"}})
        admin.request("DELETE", f"{path}/b")
        assert eventually(lambda: events[2:] == [("MODIFIED", "a"), ("DELETED", "b")]), events
        assert r.get(kube_namespace, "a")["data"] == {"k": "v"} and r.get(kube_namespace, "b") is None
    finally:
        stop.set()
        r.interrupt()
        t.join(30)
    assert not t.is_alive()
    # while nobody watched: c added, a deleted; the re-list reports exactly that
    admin.request("POST", path, body={"metadata": {"name": "c", "labels": OURS}})
    admin.request("DELETE", f"{path}/a")
    del events[:]
    r._list()
    assert sorted(events) == [("ADDED", "c"), ("DELETED", "a")]
    assert changes  # on_change still runs beside on_event
