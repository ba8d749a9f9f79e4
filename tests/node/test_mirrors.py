"""The agent of the real DaemonSet pulls through the node's containerd mirrors (issue 28).

The rig mounts its containerd hosts directory where the base mounts the node's
``/etc/containerd/certs.d``, and the rig's containerd reads the same directory (``config_path``).
A hosts.toml for the test registry names a pull-through cache (distribution in proxy mode) ahead
of the registry; a workload's cache then arrives through the cache, which its own access log
shows, and the agent counts those bytes as a mirror's."""

from __future__ import annotations

import shutil
import urllib.request

import pytest

from tests.fixtures.registry import RunningRegistry
from tests.node.test_kubelet import V5E, cache_object, finished, make_cache, namespace, workload, inline

FILES = {"xla/mirrored.bin": b"\x42" * 300_000}


@pytest.fixture
def mirror(deployed, tmp_path):
    """A pull-through cache of the test registry, named in the node's hosts.toml for it (the
    ``host_port_`` directory, containerd's first choice for a registry with a port)."""
    proxy = RunningRegistry(tmp_path / "proxy", proxy=f"http://{deployed.registry.host}")
    name, port = deployed.registry.host.rsplit(":", 1)
    d = deployed.node.hosts_dir / f"{name}_{port}_"
    d.mkdir(parents=True)
    (d / "hosts.toml").write_text(f'server = "http://{deployed.registry.host}"\n'
                                  f'[host."http://{proxy.host}"]\n  capabilities = ["pull", "resolve"]\n')
    try:
        yield proxy
    finally:
        shutil.rmtree(d)
        proxy.stop()


def mirror_bytes(deployed) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{deployed.ports['agent']}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('accelnode_agent_pulled_bytes_total{source="mirror"}'))


def test_the_agent_pulls_a_cache_through_the_nodes_pull_through_cache(deployed, mirror, tmp_path):
    ns = namespace(deployed)
    ref = deployed.registry.push(make_cache(tmp_path / "c", FILES), "e2e/jax-mirrored", tag="v1", kind="jax",
                                 targets=V5E)
    digest = ref.split("@")[1]
    before = mirror_bytes(deployed)
    deployed.apply(cache_object("mirrored", ns, f"{deployed.registry.host}/e2e/jax-mirrored:v1"))
    deployed.wait(lambda: deployed.get("gkmcache", "mirrored", "-n", ns).get("status", {}).get("resolvedDigest")
                  == digest, "the controller to pin the GKMCache")
    deployed.apply(workload("through-mirror", ns, inline("mirrored", ns)))
    got = finished(deployed, ns, "through-mirror")
    assert "io.jax.cache/xla/mirrored.bin" in got["files"], got["files"]
    # the cache's own log: the agent asked it, naming the registry (ns=), for the digest's
    # manifest and every blob, and it answered them
    served = [(path, status) for method, path, status, _ in mirror.access_log()
              if method == "GET" and "/e2e/jax-mirrored/" in path]
    ns_param = "ns=" + deployed.registry.host.replace(":", "%3A")
    assert served and all(ns_param in path and status == 200 for path, status in served), served
    assert any("/blobs/sha256:" in path for path, _ in served), served
    assert mirror_bytes(deployed) > before, "the agent did not count the mirror's bytes"
