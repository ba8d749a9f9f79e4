"""JAX is the judge of the JAX/XLA cache kind, through the whole CSI path on the real kubelet.

A real JAX run (the CPU wheel) writes a persistent compilation cache; ``accelnode cache build``
packs it as a kernel-cache image and pushes it; the controller pins the GKMCache, kubelet mounts it
read-only into a pod through csi.gkm.io; a second JAX process with ``JAX_COMPILATION_CACHE_DIR`` on
that mount (the pod's volume as kubelet published it; the accelnode image carries no JAX) gets
persistent-cache hits - counted from JAX's own monitoring events - and recompiles nothing, read-only
mount and all.

What a JAX cache needs (docs/cache-format.md): ``JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=none`` on
both sides (else JAX places XLA's own caches under the cache directory and its path enters the
cache keys, so a cache written at one path misses at another), and the same JAX/jaxlib version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import accelnode_cmd
from tests.node.test_kubelet import cache_object, inline, namespace, phase, running, workload

JAX_ENV = {"JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none", "JAX_PLATFORMS": "cpu"}
PROBE = r"""
import json, sys
import jax, jax.numpy as jnp
from jax import monitoring
seen = {}
monitoring.register_event_listener(lambda event, **kw: seen.__setitem__(event, seen.get(event, 0) + 1))
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

@jax.jit
def step(x):
    return jnp.tanh(x @ x.T) * 2 + jnp.sin(x).sum()

step(jnp.ones((128, 128))).block_until_ready()
print(json.dumps({"version": jax.__version__,
                  "hits": seen.get("/jax/compilation_cache/cache_hits", 0),
                  "misses": seen.get("/jax/compilation_cache/cache_misses", 0)}))
"""


def jax_run(cache_dir) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(cache_dir)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **JAX_ENV})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_jax_cache_mounted_through_csi_gives_jax_persistent_cache_hits(deployed, tmp_path):
    written = tmp_path / "jax-cache"
    first, _ = jax_run(written)
    assert first["misses"] >= 1 and first["hits"] == 0 and any(written.iterdir()), first

    ns = namespace(deployed)
    image = f"{deployed.registry.host}/e2e/jax-cpu:{first['version']}"
    built = subprocess.run([*accelnode_cmd(), "cache", "build", str(written), image, "--kind", "jax", "--plain-http",
                            "--target", "backend=tpu,arch=v5e",  # the node it is for (the fit check)
                            "--label", f"io.accelnode.jax.version={first['version']}",
                            "--label", "io.accelnode.jax.env=JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=none"],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    deployed.apply(cache_object("jax-cpu", ns, image))
    deployed.wait(lambda: deployed.get("gkmcache", "jax-cpu", "-n", ns).get("status", {}).get("resolvedDigest"),
                  "the controller to pin the JAX cache")
    pod = workload("jax-holder", ns, inline("jax-cpu", ns), chips=1,
                   command=["python3", "-c", "import time; time.sleep(3600)"])
    deployed.apply(pod)
    running(deployed, ns, "jax-holder")
    uid = deployed.get("pod", "jax-holder", "-n", ns)["metadata"]["uid"]
    mount = deployed.node.root_dir / "pods" / uid / "volumes/kubernetes.io~csi/kernel-cache/mount"
    cache_dir = mount / "io.jax.cache"
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted(p.name for p in written.iterdir())

    second, log = jax_run(cache_dir)
    assert second["hits"] == first["misses"] and second["misses"] == 0, second  # nothing recompiled
    probe = cache_dir / "probe"
    try:
        probe.write_text("x")
        raise AssertionError("the cache mount is writable")
    except OSError as e:
        assert e.errno == 30  # EROFS
    assert phase(deployed, ns, "jax-holder") == "Running"
    deployed.kubectl("delete", "pod", "jax-holder", "-n", ns, "--wait=true", "--timeout=90s")
