"""The VM's software: daemonsets/systemd/node-startup.sh on a fresh Debian 12 boot disk
(mmdebstrap minbase + curl, tests/rigs/vmroot.py) installs, from the sources the instance
metadata names (served here over loopback HTTP, the metadata from the metadata server emulator),
containerd 2 (a release-shaped tarball of the containerd 2.2 we build; a 1.x one is refused),
pinned runc, kubeadm/kubelet and accelnode (the node bundle make-node-bundle.sh builds
of this checkout), the units, and the kernel settings kubeadm checks; then accelnode bootstrap
*from that disk* completes a join dry run against the real API server. Bad sources change
nothing."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from tests.conftest import ROOT, TOOLS_BIN, require, require_root
from tests.rigs.metadata import MetadataServer
from tests.rigs.node import CONTAINERD_NAMES, containerd_bin

SYSTEMD = ROOT / "daemonsets" / "systemd"


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _deb_version(root: Path, package: str) -> str:
    (deb,) = (root / "var/cache/apt/archives").glob(f"{package}_*.deb")
    return subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture(scope="module")
def disk():
    from tests.rigs import vmroot

    require(shutil.which("mmdebstrap") is not None, "mmdebstrap (tools/apt/kubelet.txt)")
    require_root()
    require(shutil.which("unshare") is not None, "unshare (util-linux)")
    return vmroot.boot_disk(log=lambda m: None)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A loopback HTTP server with kubeadm, kubelet and the node bundle: (base URL, directory)."""
    d = tmp_path_factory.mktemp("sources")
    for name in ("kubeadm", "kubelet"):
        require((TOOLS_BIN / name).exists(), f"{name} in {TOOLS_BIN}")
        (d / name).symlink_to(TOOLS_BIN / name)
    subprocess.run(["sh", str(SYSTEMD / "make-node-bundle.sh"), str(d / "bundle.tar.gz"), "3.11"], check=True,
                   capture_output=True, env={**os.environ, "PYTHON": sys.executable})
    # containerd's release tarball has bin/containerd, bin/containerd-shim-runc-v2, bin/ctr, ...
    for name in CONTAINERD_NAMES:
        require((containerd_bin(TOOLS_BIN) / name).exists(), f"{name} (tools/mk/containerd2.mk)")
    _tarball(d / "containerd.tar.gz", {n: (containerd_bin(TOOLS_BIN) / n).read_bytes() for n in CONTAINERD_NAMES})
    old = b"#!/bin/sh\necho 'containerd github.com/containerd/containerd v1.6.20 1.6.20~ds1-1+b1'\n"
    _tarball(d / "containerd-1.6.tar.gz", {"containerd": old, "containerd-shim-runc-v2": old, "ctr": old})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(d)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", d
    srv.shutdown()
    srv.server_close()


def _tarball(out: Path, bins: dict[str, bytes]) -> None:
    with tarfile.open(out, "w:gz") as tar:
        for name, data in bins.items():
            info = tarfile.TarInfo(f"bin/{name}")
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))


def _metadata(root: Path, url: str, d: Path) -> dict[str, str]:
    return {"accelnode-containerd-url": f"{url}/containerd.tar.gz",
            "accelnode-containerd-sha256": _sha(d / "containerd.tar.gz"),
            "accelnode-runc-version": _deb_version(root, "runc"),
            "accelnode-kubernetes-url": url,
            "accelnode-kubeadm-sha256": _sha(d / "kubeadm"), "accelnode-kubelet-sha256": _sha(d / "kubelet"),
            "accelnode-node-bundle-url": f"{url}/bundle.tar.gz",
            "accelnode-node-bundle-sha256": _sha(d / "bundle.tar.gz")}


def _boot(root: Path, md: MetadataServer, *argv: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run ``argv`` (default: the startup script, as GCE does at boot) on the disk."""
    from tests.rigs.vmroot import chroot_argv

    shutil.copy(SYSTEMD / "node-startup.sh", root / "node-startup.sh")
    return subprocess.run(chroot_argv(root, list(argv or ["/bin/sh", "/node-startup.sh"])), capture_output=True,
                          text=True, timeout=timeout,
                          env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                               "GCE_METADATA_HOST": md.host, **env})


@pytest.fixture
def fresh_root(disk, tmp_path):
    """The boot disk unpacked for one test (removed after: it is large)."""
    from tests.rigs.vmroot import unpack

    root = unpack(disk, tmp_path / "root")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_fresh_disk_gets_what_the_join_needs_and_joins(fresh_root, sources, join_tokens, control_plane_endpoint):
    url, d = sources
    root = fresh_root
    with MetadataServer(name="tpu-vm-0", zone="us-central1-c", project="my-tpu-project") as md:
        want = _metadata(root, url, d)
        md.set_attributes(want)
        out = _boot(root, md)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "not booted with systemd: files installed, nothing started" in out.stderr
        for name in ("kubeadm", "kubelet"):
            assert _sha(root / "usr/local/bin" / name) == want[f"accelnode-{name}-sha256"]
        q = _boot(root, md, "dpkg-query", "-W", "-f", "${Package} ${Version} ${Status}\\n", "runc")
        assert q.stdout.splitlines() == [f"runc {want['accelnode-runc-version']} hold ok installed"], q.stdout
        # containerd 2 from the tarball, not the image's 1.x package, started by our unit
        assert not (root / "var/lib/dpkg/info/containerd.list").exists()
        for name in CONTAINERD_NAMES:
            assert _sha(root / "usr/local/bin" / name) == _sha(containerd_bin(TOOLS_BIN) / name)
        v = _boot(root, md, "/usr/local/bin/containerd", "--version")
        assert v.stdout.split()[2].startswith("v2."), v.stdout
        assert (root / "etc/systemd/system/containerd.service").read_text() == (SYSTEMD / "containerd.service").read_text()
        assert "ExecStart=/usr/local/bin/containerd\n" in (SYSTEMD / "containerd.service").read_text()
        assert "SystemdCgroup = true" in (root / "etc/containerd/config.toml").read_text()
        assert "net.ipv4.ip_forward = 1" in (root / "etc/sysctl.d/99-kubernetes.conf").read_text()
        for unit in ("kubelet.service", "accelnode-bootstrap.service"):
            assert (root / "etc/systemd/system" / unit).read_text() == (SYSTEMD / unit).read_text()
            assert (root / "etc/systemd/system/multi-user.target.wants" / unit).is_symlink()
        assert (root / "etc/systemd/system/kubelet.service.d/10-kubeadm.conf").read_text() == \
            (SYSTEMD / "kubelet.service.d/10-kubeadm.conf").read_text()
        for unit in ("kubelet.service", "accelnode-bootstrap.service", "containerd.service"):  # as systemctl enable
            assert os.readlink(root / "etc/systemd/system/multi-user.target.wants" / unit) == f"/etc/systemd/system/{unit}"
        # a second boot with the same metadata installs nothing
        again = _boot(root, md)
        assert again.returncode == 0 and "already installed" in again.stderr, again.stderr

        # the unit's command, from this disk: the controller's token -> a join dry run against the real API server
        info = join_tokens.ensure("startup-test", control_plane_endpoint)
        md.set_attributes(info.metadata_items())
        joined = _boot(root, md, "/usr/local/bin/accelnode", "bootstrap", "--dry-run", "--ignore-preflight-errors",
                       "all", "--log-format", "text", "--discovery-timeout", "60", timeout=180,
                       KUBEADM_JOIN_DRYRUN_DIR="/tmp/kubeadm-dryrun")
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert "This node has joined the cluster" in joined.stdout + joined.stderr
        flags = (root / "tmp/kubeadm-dryrun/kubeadm-flags.env").read_text()
        assert "--provider-id=gce://my-tpu-project/us-central1-c/tpu-vm-0" in flags


def test_bad_sources_install_nothing(fresh_root, sources):
    url, d = sources
    root = fresh_root
    with MetadataServer(name="tpu-vm-1") as md:
        want = _metadata(root, url, d)
        md.set_attributes({**want, "accelnode-kubelet-sha256": "0" * 64})
        out = _boot(root, md)
        assert out.returncode == 1
        assert f"{url}/kubelet has sha256 {want['accelnode-kubelet-sha256']}, the metadata pins {'0' * 64}: " \
               f"not installed" in out.stderr
        md.replace_attributes({k: v for k, v in want.items() if k != "accelnode-runc-version"})
        out = _boot(root, md)
        assert out.returncode == 1 and "instance metadata accelnode-runc-version is not set" in out.stderr
        md.replace_attributes({**want, "accelnode-node-bundle-url": "ftp://example.com/x; rm -rf /"})
        out = _boot(root, md)
        assert out.returncode == 1 and "accelnode-node-bundle-url" in out.stderr and "malformed" in out.stderr
        # the examples' metadata, not filled in yet
        from tests.crds.test_crds import example

        items = example("tpu/tpunodegroup-single-host.yaml", "v7x-single-host")["spec"]["instanceConfig"]["metadata"]
        md.replace_attributes(items)
        out = _boot(root, md)
        assert out.returncode == 1 and "instance metadata accelnode-containerd-sha256=" in out.stderr \
            and "is malformed" in out.stderr, out.stderr
        # a containerd 1.x tarball (what the images' packages are): refused before anything is installed
        md.replace_attributes({**want, "accelnode-containerd-url": f"{url}/containerd-1.6.tar.gz",
                               "accelnode-containerd-sha256": _sha(d / "containerd-1.6.tar.gz")})
        out = _boot(root, md)
        assert out.returncode == 1 and f"{url}/containerd-1.6.tar.gz is containerd 'v1.6.20', not 2.x: not installed" \
            in out.stderr, out.stderr
        for path in ("usr/local/bin/kubeadm", "usr/local/bin/kubelet", "usr/local/bin/containerd", "opt/accelnode",
                     "etc/containerd",
                     "var/lib/accelnode", "etc/systemd/system/kubelet.service"):
            assert not (root / path).exists(), path
        assert not (root / "var/lib/dpkg/info/containerd.list").exists()
        assert not (root / "var/lib/dpkg/info/python3-venv.list").exists()
