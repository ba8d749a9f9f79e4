"""Run as a script: what JAX's own cluster detection derives from TPU worker environments.

stdin: ``{"processes": [{"ENV": "value", ...}, ...], "hosts": ["web-0.nginx", ...]}`` (one env
per TPU process: a container of a pod, as the API server stored it). stdout: one JSON object
per process: ``cluster`` (the first cluster type JAX finds present), ``coordinator``,
``process_count``, ``process_id``, as ``jax.distributed.initialize()`` would get them from
``ClusterEnv.auto_detect_unset_distributed_params``.

Each process's environment replaces ``os.environ`` whole (JAX reads it on every call), plus what
the node provides: ``TPU_SKIP_MDS_QUERY`` (our device plugin's Allocate sets it) and
``GCE_METADATA_IP`` pointing at a closed loopback port, so any metadata-server lookup fails
loudly instead of leaving the machine. Two things stand in for a TPU VM in a cluster, and
nothing of JAX's logic is changed:

* JAX's "running in a Cloud TPU VM" flag (set by its TPU backend init when libtpu and TPU chips
  are found) is set to True;
* the cluster DNS: ``socket.gethostbyname`` answers 127.0.0.1 for the workers' names (what the
  headless Service's records would answer) and fails for any other name, so no lookup leaves
  the machine.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def main() -> None:
    spec = json.load(sys.stdin)
    hosts = set(spec["hosts"])
    real = socket.gethostbyname

    def cluster_dns(name: str) -> str:
        if name in hosts:
            return "127.0.0.1"
        if name in ("localhost", "127.0.0.1"):
            return real(name)
        raise socket.gaierror(socket.EAI_NONAME, f"{name} is not a worker of this slice")

    socket.gethostbyname = cluster_dns
    from jax._src.clusters import cloud_tpu_cluster
    from jax._src.clusters.cluster import ClusterEnv

    cloud_tpu_cluster.running_in_cloud_tpu_vm = True
    keep = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    for env in spec["processes"]:
        os.environ.clear()
        os.environ.update(keep)
        os.environ.update(env)
        os.environ["TPU_SKIP_MDS_QUERY"] = "true"
        os.environ["GCE_METADATA_IP"] = "127.0.0.1:9"
        present = next((c.__name__ for c in ClusterEnv._cluster_types
                        if not c.opt_in_only_method and c.is_env_present()), None)
        coordinator, count, pid, _ = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 5)
        print(json.dumps({"cluster": present, "coordinator": coordinator, "process_count": count,
                          "process_id": pid}), flush=True)


if __name__ == "__main__":
    main()
