"""The CSI driver's /healthz: alive while its gRPC server answers and its cache-view watches
beat; a watch thread that hangs or dies turns /healthz and /readyz, which name it."""

from __future__ import annotations

import threading
import uuid

import pytest
from prometheus_client import CollectorRegistry

from accelnode.health import Health
from accelnode.httpserve import MetricsServer
from accelnode.kube.client import Client, Config
from csi_driver.cacheview import CacheView
from tests.conftest import eventually, health_turned, http_get

from . import test_by_name
from .test_by_name import make_cache

by_name, csi_rbac, objects = test_by_name.by_name, test_by_name.csi_rbac, test_by_name.objects  # fixtures

WATCH_S = 6  # a quiet watch lasts this long; its promise covers it
STALL_S = WATCH_S + 3


def test_running_driver_is_alive(by_name):
    assert http_get(by_name.csi_metrics_port, "/healthz") == (200, "ok\n")


@pytest.fixture
def view(control_plane, csi_rbac):
    """A cache view in-process on the real API server, with short watches; yields (view, port)."""
    health = Health()
    v = CacheView(Client(Config.from_kubeconfig(str(control_plane.kubeconfig("csi")))), health,
                  watch_seconds=WATCH_S, stall_after=STALL_S, watch_jitter=0.0).start()
    http = MetricsServer("127.0.0.1:0", CollectorRegistry(), v.ready, health).start()
    eventually(lambda: http_get(http.port, "/readyz") == (200, "ok\n"), "cache view synced")
    yield v, http.port
    v.stop()
    http.stop()


def test_the_plugins_watches_end_at_spread_times_as_the_agents_do(control_plane):
    """One plugin a node: its watches last watch_seconds x 1 to 2, drawn per watch (the Reflector
    behaviour is tested in tests/controlplane/test_kube_client.py), so a fleet's re-opens spread."""
    from accelnode.kube.reflector import FLEET_JITTER

    v = CacheView(Client(Config.from_kubeconfig(str(control_plane.kubeconfig("csi")))))
    assert FLEET_JITTER == 1.0 and [r.watch_jitter for r in v._all] == [FLEET_JITTER] * 3


def test_a_quiet_watch_stays_alive_across_its_timeouts(view):
    v, port = view
    relists = v.namespaced.relists
    done = threading.Event()
    seen = []
    while not done.wait(1.0) and len(seen) < 2 * WATCH_S + 2:  # two whole watches end and resume
        seen.append(http_get(port, "/healthz"))
    assert set(seen) == {(200, "ok\n")} and v.namespaced.relists == relists


def test_a_hung_watch_turns_liveness_and_recovers(view, objects):
    v, port = view
    gate = threading.Event()
    v.cluster.on_change = gate.wait  # the next event hangs the watch thread in its callback
    name = f"hang-{uuid.uuid4().hex[:8]}"
    make_cache(objects, name, "registry.invalid/x@sha256:" + "0" * 64)
    try:
        body = health_turned(port, "watch ClusterGKMCaches", STALL_S * 3)
        assert "watch ClusterGKMCaches stuck: no beat for" in body
    finally:
        gate.set()
        objects.delete_cluster_custom_object("gkm.io", "v1alpha1", "clustergkmcaches", name)
    eventually(lambda: http_get(port, "/healthz") == (200, "ok\n"), "watch beating again")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_watch_is_named(view, objects):
    v, port = view

    def die():
        raise SystemExit("injected")

    v.namespaced.on_change = die
    ns = "default"
    name = f"die-{uuid.uuid4().hex[:8]}"
    make_cache(objects, name, "registry.invalid/x@sha256:" + "0" * 64, namespace=ns)
    try:
        assert "thread 'watch-gkmcaches' died" in health_turned(port, "watch GKMCaches thread", STALL_S * 3)
    finally:
        objects.delete_namespaced_custom_object("gkm.io", "v1alpha1", ns, "gkmcaches", name)
