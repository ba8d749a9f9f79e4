"""Copy-on-write views with real overlay and tmpfs mounts: private, bounded, crash-safe, chosen by
kind and by attribute, never for a read-only request (docs/csi.md, "Views")."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import grpc
import pytest

from csi_driver import mounts
from csi_driver.api import csi

from .conftest import error_of, make_cache
from .test_publish import assert_published

Code = grpc.StatusCode
KERNEL = "io.triton.cache/ab12/kernel.cubin"
MiB = 1 << 20


@pytest.fixture(scope="module")
def kinds(registry, tmp_path_factory):
    """Images that fit the simulated v5e host: a Triton-labelled cache (its fake kernels carry no
    Triton metadata, so its targets are declared: the host's), a vLLM-labelled one (no targets),
    and a Triton tree whose config carries no cache.<kind>.image/* label."""
    d = tmp_path_factory.mktemp("kinds")
    triton = registry.push(make_cache(d / "triton", {"ab12/kernel.cubin": b"\x01" * 2048,
                                                      "ab12/kernel.json": b'{"name": "k"}'}),
                           "caches/triton-any", kind="triton", targets=[{"backend": "tpu", "arch": "v5e"}])
    vllm = registry.push(make_cache(d / "vllm", {"torch_compile_cache/x/graph.py": b"# graph\n"}),
                         "caches/vllm-any", kind="vllm")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"\x02" * 512
        info = tarfile.TarInfo("io.triton.cache/cd34/kernel.cubin")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    unlabelled = registry.push_raw("caches/triton-unlabelled", "v1", config={"config": {"Labels": {}}},
                                   layers=[("application/vnd.oci.image.layer.v1.tar", buf.getvalue())])
    return {"triton": triton, "vllm": vllm, "unlabelled": unlabelled}


def view_dir(node, vol) -> Path:
    where = os.path.join(os.path.realpath(vol.target.parent), "mount")
    return node.views_dir / hashlib.sha256(os.fsencode(where)).hexdigest()[:32]


def store_content(node, image: str) -> Path:
    return node.store / "caches" / image.rsplit("@", 1)[1].replace(":", "-") / "content"


def assert_view(node, vol) -> None:
    assert mounts.is_mountpoint(vol.target)
    top = mounts.top_mount(vol.target)
    assert top.fstype == "overlay" and {"nosuid", "nodev"} <= top.options and "ro" not in top.options
    assert mounts.is_mountpoint(view_dir(node, vol))
    assert {"nosuid", "nodev"} <= mounts.top_mount(view_dir(node, vol)).options


def assert_gone(node, vol) -> None:
    assert not vol.target.exists()
    assert not view_dir(node, vol).exists()
    assert str(view_dir(node, vol)) not in mounts.mount_points()


def metric(node, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.csi_metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def publish(node, vol, request=None):
    node.node_stub().NodePublishVolume(request or vol.publish_request(), timeout=60)


def unpublish(node, vol):
    node.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=30)


def with_attrs(vol, **attrs) -> csi.NodePublishVolumeRequest:
    req = vol.publish_request()
    req.volume_context.update(attrs)
    return req


def test_writes_stay_in_their_own_view(running_node, kinds):
    a, b = (running_node.volume(kinds["triton"], pod_name=f"worker-{i}") for i in range(2))
    publish(running_node, a)
    publish(running_node, b)
    publish(running_node, a)  # kubelet retries: same answer, one overlay
    for v in (a, b):
        assert_view(running_node, v)
    assert [m.point for m in mounts.mounts()].count(str(a.target)) == 1
    store = store_content(running_node, kinds["triton"])

    (a.target / "io.triton.cache/new0/kernel.json").parent.mkdir()  # a cache miss: Triton writes a kernel
    (a.target / "io.triton.cache/new0/kernel.json").write_bytes(b"{}")
    (a.target / KERNEL).write_bytes(b"rewritten")  # copied up, never written through
    assert (a.target / "io.triton.cache/new0/kernel.json").read_bytes() == b"{}"
    assert not (b.target / "io.triton.cache/new0").exists() and not (store / "io.triton.cache/new0").exists()
    assert (b.target / KERNEL).read_bytes() == (store / KERNEL).read_bytes() == b"\x01" * 2048

    # a pod's non-root user may add entries to the cache tree (the upper's top directories are 1777)
    subprocess.run([sys.executable, "-c", "import os; os.setgid(65534); os.setuid(65534); "
                    "os.makedirs('io.triton.cache/new1'); open('io.triton.cache/new1/k.json', 'w').write('{}')"],
                   cwd=b.target, check=True)  # entered as root: the test's directories are 0700
    assert (b.target / "io.triton.cache/new1/k.json").stat().st_uid == 65534
    assert not (a.target / "io.triton.cache/new1").exists()

    assert metric(running_node, "accelnode_csi_views") == 2
    assert metric(running_node, "accelnode_csi_view_bytes") > 0
    assert metric(running_node, "accelnode_csi_view_limit_bytes") == 2 * 1024 * MiB
    stats = running_node.node_stub().NodeGetVolumeStats(
        csi.NodeGetVolumeStatsRequest(volume_id=a.volume_id, volume_path=str(a.target)), timeout=30)
    assert stats.usage[0].total == 1024 * MiB and stats.usage[0].used > 0
    assert not stats.volume_condition.abnormal, stats.volume_condition.message

    for v in (a, b):
        unpublish(running_node, v)
        assert_gone(running_node, v)
    unpublish(running_node, a)  # again: still success
    assert running_node.references() == {}
    assert metric(running_node, "accelnode_csi_views") == 0


def test_write_past_the_bound_fails_enospc(running_node, kinds):
    small = running_node.volume(kinds["vllm"], pod_name="small")
    other = running_node.volume(kinds["vllm"], pod_name="other")
    publish(running_node, small, with_attrs(small, **{"accelnode.io/writable-size": "1Mi"}))
    publish(running_node, other)
    with pytest.raises(OSError) as info:
        (small.target / "io.vllm.cache/big.bin").write_bytes(b"\x00" * (2 * MiB))
    assert info.value.errno == errno.ENOSPC
    (small.target / "io.vllm.cache/big.bin").unlink()
    assert sorted(p.name for p in (other.target / "io.vllm.cache").iterdir()) == ["torch_compile_cache"]
    assert not (store_content(running_node, kinds["vllm"]) / "io.vllm.cache/big.bin").exists()
    (small.target / "io.vllm.cache/fits.bin").write_bytes(b"\x00" * (MiB // 2))  # within the bound: fine
    for v in (small, other):
        unpublish(running_node, v)
        assert_gone(running_node, v)


def test_files_past_the_inode_bound_fail_enospc(running_node, kinds):
    """Empty files take no pages: ``size=`` alone let a pod make files without end in a 1 MiB
    view (kernel memory the bound does not count). ``nr_inodes=`` stops them."""
    vol = running_node.volume(kinds["vllm"], pod_name="inodes")
    publish(running_node, vol, with_attrs(vol, **{"accelnode.io/writable-size": "1Mi"}))
    d = vol.target / "io.vllm.cache/many"
    d.mkdir()
    made = 0
    with pytest.raises(OSError) as info:
        for made in range(20_000):  # each an inode, none a page
            (d / str(made)).touch()
    from csi_driver.views import inodes_for

    assert info.value.errno == errno.ENOSPC and made <= inodes_for(MiB)
    unpublish(running_node, vol)
    assert_gone(running_node, vol)


def test_restart_keeps_a_view_and_unpublish_cleans_it(running_node, kinds):
    vol = running_node.volume(kinds["triton"])
    publish(running_node, vol)
    (vol.target / "io.triton.cache/written").write_bytes(b"kept")
    running_node.csi.restart()
    assert (vol.target / "io.triton.cache/written").read_bytes() == b"kept"  # not swept: still in use
    publish(running_node, vol)  # recognised as this volume's overlay
    assert [m.point for m in mounts.mounts()].count(str(vol.target)) == 1
    running_node.csi.stop()
    running_node.csi.start()
    unpublish(running_node, vol)
    assert_gone(running_node, vol)
    assert running_node.references() == {}


def test_orphaned_views_are_swept_at_start(running_node, kinds):
    vol = running_node.volume(kinds["triton"])
    publish(running_node, vol)
    running_node.csi.stop()
    mounts.unmount(vol.target)  # the overlay went away without the driver (its pod's dir removed)
    leftover = running_node.views_dir / ("0" * 32)
    leftover.mkdir()  # a publish that crashed before mounting its tmpfs
    assert mounts.is_mountpoint(view_dir(running_node, vol))
    running_node.csi.start()
    assert not view_dir(running_node, vol).exists() and not leftover.exists()
    assert not [m for m in mounts.mount_points() if m.startswith(str(running_node.views_dir) + "/")]
    unpublish(running_node, vol)
    assert running_node.references() == {}


def test_default_view_by_kind(running_node, images, kinds):
    jax, unlabelled, triton = (running_node.volume(i, pod_name=n) for i, n in
                               ((images.tpu, "jax"), (kinds["unlabelled"], "unlabelled"), (kinds["triton"], "triton")))
    for v in (jax, unlabelled, triton):
        publish(running_node, v)
    assert_published(jax)
    assert_published(unlabelled, "io.triton.cache/cd34/kernel.cubin")
    assert_view(running_node, triton)
    assert not view_dir(running_node, jax).exists() and not view_dir(running_node, unlabelled).exists()
    for v in (jax, unlabelled, triton):
        unpublish(running_node, v)
        assert_gone(running_node, v)


def test_attribute_overrides_the_kind(running_node, images, kinds):
    jax = running_node.volume(images.tpu, pod_name="jax")
    triton = running_node.volume(kinds["triton"], pod_name="triton")
    publish(running_node, jax, with_attrs(jax, **{"accelnode.io/view": "copy-on-write"}))
    publish(running_node, triton, with_attrs(triton, **{"accelnode.io/view": "read-only"}))
    assert_view(running_node, jax)
    (jax.target / "io.jax.cache/xla/new.bin").write_bytes(b"x")
    assert_published(triton, KERNEL)
    # the same target asked with another view: not what is mounted there
    err = error_of(running_node.node_stub().NodePublishVolume, triton.publish_request())
    assert err.code() == Code.ALREADY_EXISTS
    for v in (jax, triton):
        unpublish(running_node, v)
        assert_gone(running_node, v)


RO = csi.VolumeCapability.AccessMode


def test_a_claims_reader_only_mode_still_gets_the_view_by_kind(running_node, images, kinds):
    """The controller's claims are ReadOnlyMany (a reader-only access mode) without csi.readOnly:
    a Triton cache mounted by claim gets its private copy-on-write view, a JAX one stays a
    read-only bind, and the store's copy is never written either way."""
    triton = running_node.volume(kinds["triton"], pod_name="by-claim-triton")
    jax = running_node.volume(images.tpu, pod_name="by-claim-jax")
    for v in (triton, jax):
        req = v.publish_request()
        req.volume_capability.access_mode.mode = RO.MULTI_NODE_READER_ONLY
        publish(running_node, v, req)
    assert_view(running_node, triton)
    (triton.target / "io.triton.cache/new-kernel.cubin").write_bytes(b"miss")
    assert not (store_content(running_node, kinds["triton"]) / "io.triton.cache/new-kernel.cubin").exists()
    assert_published(jax)
    assert not view_dir(running_node, jax).exists()
    for v in (triton, jax):
        unpublish(running_node, v)
        assert_gone(running_node, v)


@pytest.mark.parametrize("how", ["readonly", "ro-flag"])
def test_a_read_only_request_never_gets_a_writable_view(running_node, kinds, how):
    vol = running_node.volume(kinds["triton"])
    req = with_attrs(vol, **{"accelnode.io/view": "copy-on-write"})
    if how == "readonly":
        req.readonly = True
    else:
        req.volume_capability.mount.mount_flags.append("ro")
    running_node.node_stub().NodePublishVolume(req, timeout=60)
    assert_published(vol, KERNEL)
    assert not view_dir(running_node, vol).exists()
    unpublish(running_node, vol)
    assert_gone(running_node, vol)


@pytest.mark.parametrize("attrs,named", [
    ({"accelnode.io/view": "rw"}, "accelnode.io/view"),
    ({"accelnode.io/view": "copy-on-write,upperdir=/"}, "accelnode.io/view"),
    ({"accelnode.io/writable-size": "-1"}, "accelnode.io/writable-size"),
    ({"accelnode.io/writable-size": "0"}, "accelnode.io/writable-size"),
    ({"accelnode.io/writable-size": "1Gi,nr_inodes=0"}, "accelnode.io/writable-size"),
    ({"accelnode.io/writable-size": "1Ei"}, "--max-writable-size"),
    ({"accelnode.io/writable-size": "9" * 5000}, "accelnode.io/writable-size"),
    ({"accelnode.io/view": "read-only", "accelnode.io/writable-size": "1Gi"}, "accelnode.io/writable-size"),
    ({"accelnode.io/writeable-size": "1Gi"}, "accelnode.io/writeable-size"),
])
def test_hostile_attributes_are_refused(running_node, kinds, attrs, named):
    vol = running_node.volume(kinds["triton"])
    err = error_of(running_node.node_stub().NodePublishVolume, with_attrs(vol, **attrs))
    assert err.code() == Code.INVALID_ARGUMENT and named in err.details(), err.details()
    assert not vol.target.exists() and running_node.references() == {}
    assert list(running_node.views_dir.iterdir()) == []


def test_unpublish_leaves_a_foreign_overlay(running_node, kinds, tmp_path):
    vol = running_node.volume(kinds["triton"])
    vol.target.parent.mkdir(parents=True)
    vol.target.mkdir()
    for d in ("lower", "upper", "work"):
        (tmp_path / d).mkdir()
    subprocess.run(["mount", "-t", "overlay", "foreign", "-o",
                    f"lowerdir={tmp_path}/lower,upperdir={tmp_path}/upper,workdir={tmp_path}/work", str(vol.target)],
                   check=True)
    err = error_of(running_node.node_stub().NodeUnpublishVolume, vol.unpublish_request())
    assert err.code() == Code.FAILED_PRECONDITION and "overlay foreign" in err.details()
    assert mounts.top_mount(vol.target).fstype == "overlay"
    mounts.unmount(vol.target)
