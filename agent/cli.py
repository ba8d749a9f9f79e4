"""``accelnode agent``: the node's cache agent, serving proto/agent.proto on a unix socket."""

from __future__ import annotations

import argparse

from accelnode import cli as acli
from accelnode import exitcodes

from accelnode.oci.flags import add_registry_flags, registry_options


def register(sub) -> None:
    p = sub.add_parser("agent", help="serve the node's cache store to the CSI driver (local gRPC API)",
                       description=__doc__)
    p.add_argument("--store", required=True, metavar="DIR", help="root of the node's cache store")
    p.add_argument("--socket", required=True, metavar="PATH", help="unix socket to serve the agent API on")
    add_registry_flags(p, timeout_flag="--registry-timeout")
    p.add_argument("--sysfs-root", default="/sys", help="sysfs to read accelerators from (default: %(default)s)")
    p.add_argument("--dev-root", default="/dev", help="device directory (default: %(default)s)")
    p.add_argument("--metrics-address", default="127.0.0.1:9811", metavar="HOST:PORT",
                   help="where /metrics, /healthz and /readyz listen (default: %(default)s)")
    g = p.add_argument_group("cache status in the Kubernetes API (docs/agent-status.md)")
    g.add_argument("--node-name", metavar="NAME",
                   help="this node's name (downward API spec.nodeName); when set, the agent writes the node's "
                        "GKMCacheNode/ClusterGKMCacheNode objects and prefetches caches meant for it")
    g.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig for the API server (default: the pod's service account)")
    g.add_argument("--status-resync", type=float, default=30.0, metavar="SECONDS",
                   help="re-read the local store this often even without a change cue (default: %(default)s)")
    acli.add_common(p)
    acli.apply_env(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading
    from pathlib import Path

    from prometheus_client import CollectorRegistry

    from accelnode import grpcutil
    from accelnode.health import Health
    from accelnode.httpserve import MetricsServer
    from accelnode.log import kv

    from accelnode.hw import accelerators

    from . import core, reporter as status_reporter, service
    from .store import CacheStore

    log = logging.getLogger("accelnode.agent")
    sock = Path(args.socket)
    if not sock.parent.is_dir():
        raise exitcodes.CLIError(f"socket directory {sock.parent} does not exist", exitcodes.PREREQUISITE)
    options = registry_options(args)
    store = CacheStore(args.store, registry=options)
    registry = CollectorRegistry()
    agent = core.Agent(store, accelerators.detect(args.sysfs_root, args.dev_root), core.Metrics(registry))
    health = Health()
    reporter = None  # set below with --node-name; ready once its watches have listed

    def ready() -> tuple[bool, str]:
        if reporter is not None:
            return reporter.ready()
        return (False, "status reporter not started") if args.node_name else (True, "")

    metrics = MetricsServer(args.metrics_address, registry, ready, health).start()
    server = grpcutil.serve_unix(sock, lambda s: service.add_to_server(service.AgentService(agent), s),
                                 max_workers=32)
    health.check("agent", lambda: grpcutil.serving_problem(sock))
    log.info("agent serving", extra=kv(socket=str(sock), store=args.store,
                                       accelerators=[str(a) for a in agent.accelerators],
                                       **({"mirrors": dict(options.mirrors)} if options.mirrors else {})))
    if args.node_name:
        try:
            reporter = status_reporter.for_agent(agent, args.node_name, args.kubeconfig, resync=args.status_resync,
                                                 health=health)
        except (ValueError, OSError) as e:
            server.stop(grace=0)
            metrics.stop()
            raise exitcodes.CLIError(f"API server configuration: {e}", exitcodes.PREREQUISITE) from None
        agent.on_change = reporter.poke
        reporter.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("agent stopping")
    if reporter is not None:
        reporter.stop()
    server.stop(grace=5).wait()
    metrics.stop()
    return exitcodes.OK
