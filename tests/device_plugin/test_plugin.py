"""The real ``accelnode device-plugin`` process, seen through a kubelet-faithful harness."""

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import pytest

from device_plugin import api
from tests.rigs.kubelet_harness import KubeletHarness
from tests.conftest import accelnode_cmd
from tests.fixtures.device_plugin import free_port

TPU = "google.com/tpu"


def eventually(predicate, what: str, timeout: float = 10.0):
    """For conditions no harness event announces (files, HTTP): check every 20 ms."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def registered(k, n=4):
    return k.wait(lambda k: len(k.devices()) == n and k.devices(), what=f"{n} devices listed")


def test_registers_and_lists_chips(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    run_plugin(host)
    devices = registered(kubelet)
    _, req = kubelet.registrations[0]
    assert (req.version, req.endpoint, req.resource_name) == ("v1beta1", "accelnode-tpu.sock", TPU)
    assert req.options.get_preferred_allocation_available and not req.options.pre_start_required
    assert kubelet.endpoint().options.get_preferred_allocation_available
    assert sorted(devices) == [f"tpu-{b}" for b in host.chips()]
    assert {d.health for d in devices.values()} == {"Healthy"}
    assert {d.numa_nodes for d in devices.values()} == {(0,)}
    assert kubelet.rejections == []


def test_allocate_vfio_generation(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    run_plugin(host)
    registered(kubelet)
    first = f"tpu-{host.chips()[0]}"  # index 0 has IOMMU group 3 in the preset
    resp = kubelet.allocate([first, f"tpu-{host.chips()[1]}"])
    specs = [(d.container_path, d.host_path, d.permissions) for d in resp.devices]
    dev = host.dev_root
    assert specs == [("/dev/vfio/3", f"{dev}/vfio/3", "rw"), ("/dev/vfio/vfio", f"{dev}/vfio/vfio", "rw"),
                     ("/dev/vfio/2", f"{dev}/vfio/2", "rw")]
    assert dict(resp.envs) == {}  # GKE's recipe and no slice facts: nothing, and no TPU_VISIBLE_CHIPS


def test_allocate_v4_accel_nodes(tpu_host, kubelet, run_plugin):
    host = tpu_host("v4-4")
    run_plugin(host, "--topology", "2x2x1")
    ids = sorted(registered(kubelet))
    resp = kubelet.allocate(ids)
    assert [d.container_path for d in resp.devices] == ["/dev/accel0", "/dev/accel1", "/dev/accel2", "/dev/accel3"]
    assert (resp.envs["TPU_CHIPS_PER_HOST_BOUNDS"], resp.envs["TPU_HOST_BOUNDS"]) == ("2,2,1", "1,1,1")


def test_node_config_env(tpu_host, kubelet, run_plugin):
    host = tpu_host("v6e-8")
    run_plugin(host, "--accelerator-type", "v6e-16", "--topology", "4x4", "--tpu-env", "visible-chips")
    ids = sorted(registered(kubelet, 8))
    whole = kubelet.allocate(ids).envs
    assert whole["TPU_VISIBLE_CHIPS"] == "0,1,2,3,4,5,6,7"
    assert (whole["TPU_ACCELERATOR_TYPE"], whole["TPU_TOPOLOGY"], whole["TPU_HOST_BOUNDS"]) == ("v6e-16", "4x4", "2,1,1")
    assert (whole["TPU_CHIPS_PER_PROCESS_BOUNDS"], whole["TPU_PROCESS_BOUNDS"]) == ("2,4,1", "2,1,1")
    part = kubelet.allocate(ids[4:]).envs
    assert dict(part) == {"TPU_VISIBLE_CHIPS": "4,5,6,7", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
                          "TPU_PROCESS_BOUNDS": "1,1,1"}


def test_numa_and_preferred_allocation_v7x(tpu_host, kubelet, run_plugin):
    host = tpu_host("v7x-4")
    bdf = host.add_chip("v7x", numa_node=-1)
    run_plugin(host)
    devices = registered(kubelet, 5)
    ids = [f"tpu-{b}" for b in host.chips()]
    assert [devices[i].numa_nodes for i in ids] == [(0,), (0,), (1,), (1,), ()]
    assert devices[f"tpu-{bdf}"].numa_nodes == ()  # numa_node -1: no topology at all
    four = ids[:4]
    assert kubelet.preferred(four, [], 2) == ids[:2]
    assert kubelet.preferred(four, [ids[3]], 2) == ids[2:4]  # the NUMA-1 half, honouring must_include
    assert kubelet.preferred(four[1:], [], 1) == [ids[1]]  # best fit: keep the free pair whole
    assert kubelet.preferred(four, [], 4) == four


def test_a_v7x_host_offers_chips_and_a_chip_mounts_both_its_vfio_devices(tpu_host, kubelet, run_plugin):
    """TPU7x: each chip is two VFIO functions; google.com/tpu counts chips, a chip is both."""
    host = tpu_host("v7x-4")  # 4 chips, 8 functions (groups 7..0 in PCI order)
    run_plugin(host, "--tpu-env", "visible-chips")
    ids = [f"tpu-{b}" for b in host.chips()]
    assert sorted(registered(kubelet, 4)) == sorted(ids)
    resp = kubelet.allocate(ids[2:])
    assert [d.container_path for d in resp.devices] == ["/dev/vfio/3", "/dev/vfio/2", "/dev/vfio/vfio",
                                                        "/dev/vfio/1", "/dev/vfio/0"]
    assert resp.envs["TPU_VISIBLE_CHIPS"] == "2,3" and resp.envs["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
    second = host.functions(host.chips()[1])[1]  # either function down: the chip is Unhealthy
    host.unbind_driver(second)
    kubelet.wait(lambda k: k.devices()[ids[1]].health == "Unhealthy", what="chip 1 Unhealthy")
    assert [kubelet.devices()[i].health for i in ids] == ["Healthy", "Unhealthy", "Healthy", "Healthy"]


@pytest.mark.parametrize("knob", ["vendor", "driver", "aer", "node"])
def test_health_flip_and_recovery_on_the_same_stream(tpu_host, kubelet, run_plugin, knob):
    host = tpu_host("v5e-4")
    run_plugin(host)
    registered(kubelet)
    ep = kubelet.endpoint()
    bdf = host.chips()[1]
    breaks, heals = {
        "vendor": (lambda: host.set_vendor(bdf, 0xFFFF), lambda: host.set_vendor(bdf, 0x1AE0)),
        "driver": (lambda: host.unbind_driver(bdf), lambda: host.bind_driver(bdf)),
        "aer": (lambda: host.bump_aer_fatal(bdf), lambda: host.reset_aer(bdf)),
        "node": (lambda: host.remove_dev_node(bdf), lambda: host.restore_dev_node(bdf)),
    }[knob]
    breaks()
    kubelet.wait(lambda k: k.devices()[f"tpu-{bdf}"].health == "Unhealthy", what="chip 1 Unhealthy")
    assert [d.health for _, d in sorted(kubelet.devices().items())] == ["Healthy", "Unhealthy", "Healthy", "Healthy"]
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate([f"tpu-{bdf}"])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"tpu-{bdf}" in e.value.details() and "Unhealthy" in e.value.details()
    heals()
    kubelet.wait(lambda k: k.devices()[f"tpu-{bdf}"].health == "Healthy", what="chip 1 Healthy again")
    assert kubelet.endpoint() is ep and ep.connected and len(kubelet.registrations) == 1


def test_chip_unreadable_at_start_is_listed_once_it_reads(tpu_host, kubelet, run_plugin):
    """A function reading 0xffff can't be identified yet; it must not be written off for good."""
    host = tpu_host("v5e-4")
    late = host.chips()[2]
    host.set_vendor(late, 0xFFFF)
    run_plugin(host, "--tpu-env", "visible-chips")
    assert f"tpu-{late}" not in registered(kubelet, 3)
    host.set_vendor(late, 0x1AE0)
    devices = registered(kubelet, 4)
    assert devices[f"tpu-{late}"].health == "Healthy"
    assert kubelet.allocate([f"tpu-{late}"]).envs["TPU_VISIBLE_CHIPS"] == "2"


def test_every_open_stream_gets_each_change(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    run_plugin(host)
    registered(kubelet)
    second = kubelet.endpoint().stub.ListAndWatch(api.Empty(), timeout=20)
    try:
        assert {d.health for d in next(second).devices} == {"Healthy"}  # the full list first
        bdf = host.chips()[0]
        host.unbind_driver(bdf)
        kubelet.wait(lambda k: k.devices()[f"tpu-{bdf}"].health == "Unhealthy", what="first stream sees it")
        while (got := {d.ID: d.health for d in next(second).devices})[f"tpu-{bdf}"] != "Unhealthy":
            assert len(got) == 4
    finally:
        second.cancel()
    host.bind_driver(bdf)  # the first stream lives on after the second one is cancelled
    kubelet.wait(lambda k: k.devices()[f"tpu-{bdf}"].health == "Healthy", what="first stream sees recovery")
    assert len(kubelet.registrations) == 1


def test_hotplug_add_and_remove(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    run_plugin(host, "--tpu-env", "visible-chips")
    registered(kubelet)
    new = host.add_chip("v5e", iommu_group=17)
    kubelet.wait(lambda k: f"tpu-{new}" in k.devices(), what="hot-added chip listed")
    host.remove_chip(host.chips()[0])
    devices = kubelet.wait(lambda k: len(k.devices()) == 4 and f"tpu-{host.chips()[0]}" in k.devices()
                           and k.devices(), what="removed chip gone")
    assert sorted(devices) == sorted(f"tpu-{b}" for b in host.chips())
    resp = kubelet.allocate([f"tpu-{new}"])
    assert resp.envs["TPU_VISIBLE_CHIPS"] == "3"  # renumbered in PCI order after the removal
    assert "/dev/vfio/17" in [d.container_path for d in resp.devices]
    assert len(kubelet.registrations) == 1


def test_kubelet_restart_re_registers(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    plugin = run_plugin(host, "--tpu-env", "visible-chips")
    registered(kubelet)
    for n in (2, 3):
        kubelet.restart()
        kubelet.wait(lambda k: len(k.registrations) == n and len(k.devices()) == 4, what=f"registration {n}")
    assert kubelet.allocate([f"tpu-{host.chips()[0]}"]).envs["TPU_VISIBLE_CHIPS"] == "0"
    assert plugin.proc.poll() is None


def test_own_socket_deleted_re_serves(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    run_plugin(host)
    registered(kubelet)
    os.unlink(kubelet.dir / "accelnode-tpu.sock")
    kubelet.wait(lambda k: len(k.registrations) == 2 and len(k.devices()) == 4, what="re-registration")
    assert (kubelet.dir / "accelnode-tpu.sock").exists()


def test_kubelet_absent_at_start(tpu_host, tmp_path, run_plugin):
    host = tpu_host("v5e-4")
    kdir = tmp_path / "device-plugins"
    run_plugin(host)
    eventually(lambda: (kdir / "accelnode-tpu.sock").exists(), "the plugin to serve before kubelet exists")
    assert not (kdir / "kubelet.sock").exists()
    with KubeletHarness(kdir) as k:  # kubelet.sock appearing triggers Register
        registered(k)
        assert len(k.registrations) == 1


def test_stale_socket_is_replaced(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    stale = kubelet.dir / "accelnode-tpu.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # a socket file nobody listens on, like one left by a killed plugin
    run_plugin(host)
    registered(kubelet)


def test_non_socket_in_the_way_is_an_error(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    (kubelet.dir / "accelnode-tpu.sock").write_text("not a socket")
    p = run_plugin(host)
    assert p.proc.wait(20) == 3
    assert "is not a socket; refusing to remove it" in p.log()
    assert (kubelet.dir / "accelnode-tpu.sock").read_text() == "not a socket"


def test_bad_requests(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    run_plugin(host, "--topology", "2x2")
    ids = sorted(registered(kubelet))
    stub = kubelet.endpoint().stub
    cases = [
        (lambda: kubelet.allocate(["tpu-0000:00:1f.0"]), grpc.StatusCode.INVALID_ARGUMENT, "'tpu-0000:00:1f.0'"),
        (lambda: kubelet.allocate([]), grpc.StatusCode.INVALID_ARGUMENT, "names no devices"),
        (lambda: kubelet.allocate([ids[0], ids[0]]), grpc.StatusCode.INVALID_ARGUMENT, "listed twice"),
        (lambda: kubelet.preferred(ids, [], 5), grpc.StatusCode.INVALID_ARGUMENT, "allocation_size 5"),
        (lambda: kubelet.preferred(ids[:2], [ids[3]], 2), grpc.StatusCode.INVALID_ARGUMENT, "must_include"),
        (lambda: kubelet.preferred(["nope"], [], 1), grpc.StatusCode.INVALID_ARGUMENT, "'nope'"),
    ]
    for call, code, text in cases:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == code and text in e.value.details()
    # a request mixing good and bad containers is refused whole
    req = api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=[ids[0]]),
                                                  api.ContainerAllocateRequest(devices_ids=["x"])])
    with pytest.raises(grpc.RpcError) as e:
        stub.Allocate(req, timeout=5)
    assert "container request 1" in e.value.details()
    assert kubelet.allocate([ids[0]]).envs["TPU_HOST_BOUNDS"] == "2,2,1"


def test_harness_rejects_what_kubelet_rejects(kubelet):
    kubelet.dial_timeout = 0.5
    stub = api.RegistrationStub(grpc.insecure_channel(f"unix://{kubelet.dir}/kubelet.sock"))
    for version, name, text in [("v1alpha", "google.com/tpu", "not supported"),
                                ("v1beta1", "tpu", "is invalid"),
                                ("v1beta1", "kubernetes.io/tpu", "is invalid"),
                                ("v1beta1", "google.com/tpu", "failed to dial")]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Register(api.RegisterRequest(version=version, endpoint="none.sock", resource_name=name), timeout=15)
        assert text in e.value.details()
    assert len(kubelet.rejections) == 4 and kubelet.registrations == []


def test_metrics_and_readiness(tpu_host, tmp_path, run_plugin):
    host = tpu_host("v5e-4")
    port = free_port()
    run_plugin(host, "--metrics-address", f"127.0.0.1:{port}")
    base = f"http://127.0.0.1:{port}"

    def get(path):
        try:
            with urllib.request.urlopen(base + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    # serving, but no kubelet yet: not ready, and /readyz says why
    eventually(lambda: _try(get, "/readyz") == (503, "not ready: not registered with kubelet\n"), "not-ready reason")
    with KubeletHarness(tmp_path / "device-plugins") as k:
        registered(k)
        eventually(lambda: get("/readyz")[0] == 200, "ready")
        host.set_vendor(host.chips()[0], 0xFFFF)
        k.wait(lambda k: "Unhealthy" in {d.health for d in k.devices().values()}, what="unhealthy chip")
        k.allocate([f"tpu-{host.chips()[1]}"])
        text = get("/metrics")[1]
    assert 'accelnode_tpu_chips{health="Healthy"} 3.0' in text
    assert 'accelnode_tpu_chips{health="Unhealthy"} 1.0' in text
    assert "accelnode_tpu_allocations_total 1.0" in text
    assert 'accelnode_device_plugin_registrations_total{result="ok"} 1.0' in text


def _try(get, path):
    try:
        return get(path)
    except OSError:
        return None


def test_sigterm_stops_cleanly(tpu_host, kubelet, run_plugin):
    host = tpu_host("v5e-4")
    p = run_plugin(host)
    registered(kubelet)
    assert p.stop() == 0
    assert not (kubelet.dir / "accelnode-tpu.sock").exists()
    assert "device plugin stopped" in p.log()
    kubelet.wait(lambda k: not k.endpoint().connected, what="stream closed")


@pytest.mark.parametrize("flags,code,text", [
    (["--sysfs-root", "/nonexistent"], 3, "--sysfs-root /nonexistent is not a directory"),
    (["--topology", "4by4"], 2, "--topology"),
    (["--resource-name", "tpu"], 2, "not an extended resource name"),
    (["--socket-name", "a/b.sock"], 2, "plain file name"),
    (["--health-interval", "0.01"], 2, "between 0.05 and 3600"),
    (["--metrics-address", "2112"], 2, "--metrics-address: metrics address '2112' is not HOST:PORT"),
])
def test_bad_flags(tmp_path, flags, code, text):
    argv = accelnode_cmd() + ["device-plugin", "--kubelet-dir", str(tmp_path / "k"), "--dev-root", str(tmp_path),
                              "--sysfs-root", str(tmp_path)] + flags
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == code, r.stderr
    assert text in r.stderr


def test_metrics_port_in_use_is_one_line(tpu_host, tmp_path):
    host = tpu_host("v5e-4")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        addr = "127.0.0.1:%d" % busy.getsockname()[1]
        r = subprocess.run(accelnode_cmd() + ["device-plugin", "--sysfs-root", str(host.sysfs_root), "--dev-root",
                                              str(host.dev_root), "--kubelet-dir", str(tmp_path / "k"),
                                              "--metrics-address", addr, "--log-level", "error"],
                           capture_output=True, text=True, timeout=30)
    assert r.returncode == 3, r.stderr
    assert r.stderr == f"accelnode device-plugin: --metrics-address {addr}: Address already in use\n"
    assert not (tmp_path / "k" / "accelnode-tpu.sock").exists()
