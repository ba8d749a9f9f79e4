"""``accelnode agent``: the node's cache agent, serving proto/agent.proto on a unix socket."""

from __future__ import annotations

import argparse
import re

from accelnode import cli as acli
from accelnode import exitcodes

from accelnode.oci.flags import add_registry_flags, registry_options
from accelnode.oci.mirrors import ACCESS_FLAG, check_endpoint


def register(sub) -> None:
    p = sub.add_parser("agent", help="serve the node's cache store to the CSI driver (local gRPC API)",
                       description=__doc__)
    p.add_argument("--store", required=True, metavar="DIR", help="root of the node's cache store")
    p.add_argument("--socket", required=True, metavar="PATH", help="unix socket to serve the agent API on")
    add_registry_flags(p, timeout_flag="--registry-timeout")
    t = p.add_argument_group("whose credentials pull what (docs/security.md)")
    t.add_argument("--node-credentials-for-cluster-caches", action="store_true",
                   help="pull ClusterGKMCaches with the node's registry credentials (--registry-config, "
                        "~/.docker/config.json); without it they are pulled anonymously. A GKMCache is never "
                        "pulled with them: it gets the pull secrets of its namespace's default ServiceAccount, read "
                        "through the API server (--kubeconfig or the pod's service account), or none")
    t.add_argument("--pull-secrets", choices=("api", "none"), default="api",
                   help="where a GKMCache's pull secrets come from: the API server (default; --kubeconfig, or with "
                        "--node-name the pod's service account), or nowhere (every GKMCache is pulled anonymously, "
                        "as when the agent has no API server)")
    t.add_argument(ACCESS_FLAG, dest="access_mirrors", action="append", type=_endpoint, metavar="HOST[:PORT]",
                   help="a mirror that, as the server of a registry (--registry-mirror, a hosts.toml server), enforces "
                        "that registry's own access control with the credentials each request carries: its answers "
                        "then prove what a tenant's pull may have. Without it, a tenant's pull (a GKMCache, a "
                        "ClusterGKMCache, an image a pod named) through a mirror as the server is refused: a "
                        "pull-through cache serves anyone who reaches it (repeatable; the environment variable "
                        "takes a comma-separated list)")
    p.add_argument("--sysfs-root", default="/sys", help="sysfs to read accelerators from (default: %(default)s)")
    p.add_argument("--dev-root", default="/dev", help="device directory (default: %(default)s)")
    p.add_argument("--accelerator", action="append", metavar="BACKEND/ARCH[:COUNT]",
                   help="declare this node's accelerators instead of detecting them (repeatable), e.g. cuda/sm_90:8, "
                        "hip/gfx942:8, tpu/v5e:4 (default: detected: TPU discovery, NVML/amdsmi, PCI ids)")
    p.add_argument("--metrics-address", default="127.0.0.1:9811", metavar="HOST:PORT",
                   help="where /metrics, /healthz and /readyz listen (default: %(default)s)")
    b = p.add_argument_group("bounded work: pulls, image limits and disk (docs/agent-store.md)")
    b.add_argument("--max-pulls", type=_at_least_one, default=3, metavar="N",
                   help="pulls running at once; more wait in a FIFO queue, answered PULLING (default: %(default)s)")
    b.add_argument("--max-image-size", type=size, default="16Gi", metavar="SIZE",
                   help="file bytes one image may unpack to, all layers together; bytes or with a Ki/Mi/Gi/Ti "
                        "suffix (default: %(default)s)")
    b.add_argument("--max-image-files", type=_at_least_one, default=1_000_000, metavar="N",
                   help="entries (files, directories, links) one image may hold (default: %(default)s)")
    b.add_argument("--pull-headroom", type=size, default="256Mi", metavar="SIZE",
                   help="free space to keep beyond an image's declared size: a pull that would eat into it is "
                        "refused before it starts (default: %(default)s)")
    b.add_argument("--gc-high-percent", type=_percent, default=85.0, metavar="PCT",
                   help="when the store's file system is fuller than this (or a pull would make it so), remove "
                        "unreferenced caches, least recently used first; 0 turns this off (default: %(default)s)")
    b.add_argument("--gc-low-percent", type=_percent, default=70.0, metavar="PCT",
                   help="... until it is at most this full (default: %(default)s)")
    b.add_argument("--gc-min-idle", type=float, default=120.0, metavar="SECONDS",
                   help="never remove a cache used (handed out, referenced or released) less than this long ago: "
                        "a volume that was just told a cache is ready takes its reference next (default: %(default)s)")
    b.add_argument("--gc-interval", type=float, default=60.0, metavar="SECONDS",
                   help="how often the high watermark is checked besides before each pull (default: %(default)s)")
    g = p.add_argument_group("cache status in the Kubernetes API (docs/agent-status.md)")
    g.add_argument("--node-name", metavar="NAME",
                   help="this node's name (downward API spec.nodeName); when set, the agent writes the node's "
                        "GKMCacheNode/ClusterGKMCacheNode objects and prefetches caches meant for it")
    g.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig for the API server (default: as kubectl: $KUBECONFIG, ~/.kube/config, else the "
                        "pod's service account)")
    g.add_argument("--status-resync", type=float, default=30.0, metavar="SECONDS",
                   help="re-read the local store this often even without a change cue (default: %(default)s)")
    acli.add_common(p)
    acli.apply_env(p)
    p.set_defaults(func=run)


_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def size(text: str) -> int:
    """Bytes from ``N`` or ``N<Ki|Mi|Gi|Ti>`` (binary units, as Kubernetes quantities)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or a number with Ki, Mi, Gi or Ti)")
    return int(m[1]) * _UNITS[m[2] or ""]


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _endpoint(text: str) -> str:
    try:
        return check_endpoint(text.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage from 0 to 100")
    return value


def _credentials(args: argparse.Namespace, options):
    """Whose credentials pull what: the namespaces' pull secrets through the API server when the
    agent has one (--kubeconfig, or in a pod its service account)."""
    from accelnode.kube.client import Client, Config
    from accelnode.kube.pullsecrets import PullSecretReader

    from .credentials import Chooser

    reader = None
    if args.pull_secrets == "api" and (args.kubeconfig or args.node_name):
        try:
            config = Config.from_kubeconfig(args.kubeconfig) if args.kubeconfig else Config.in_cluster()
        except (ValueError, OSError) as e:
            raise exitcodes.CLIError(f"API server configuration: {e}", exitcodes.PREREQUISITE) from None
        reader = PullSecretReader(Client(config), who="the accelnode agent")
    return Chooser(options, reader, node_for_cluster_caches=args.node_credentials_for_cluster_caches)


def run(args: argparse.Namespace) -> int:
    from accelnode.malloc import limit_arenas, trim

    limit_arenas()  # before any thread starts: one malloc arena (accelnode/malloc.py)

    import logging
    import signal
    import threading
    from pathlib import Path

    from prometheus_client.registry import CollectorRegistry

    from accelnode import grpcutil
    from accelnode.health import Health
    from accelnode.httpserve import MetricsServer
    from accelnode.log import kv

    from accelnode.hw import accelerators

    from accelnode.oci.limits import Limits

    from . import capture, core, reporter as status_reporter, service
    from .store import CacheStore, Capacity

    log = logging.getLogger("accelnode.agent")
    sock = Path(args.socket)
    if not sock.parent.is_dir():
        raise exitcodes.CLIError(f"socket directory {sock.parent} does not exist", exitcodes.PREREQUISITE)
    options = registry_options(args)
    high = args.gc_high_percent or None
    if high is not None and args.gc_low_percent >= high:
        raise exitcodes.CLIError(f"--gc-low-percent ({args.gc_low_percent:g}) must be below --gc-high-percent "
                                 f"({high:g})", exitcodes.USAGE)
    if args.gc_interval <= 0:
        raise exitcodes.CLIError("--gc-interval must be positive", exitcodes.USAGE)
    try:
        found = accelerators.declared(args.accelerator) if args.accelerator else \
            accelerators.detect(args.sysfs_root, args.dev_root)
    except ValueError as e:
        raise exitcodes.CLIError(f"--accelerator {e}", exitcodes.USAGE) from None
    store = CacheStore(args.store, registry=options,
                       limits=Limits(max_bytes=args.max_image_size, max_files=args.max_image_files),
                       capacity=Capacity(args.pull_headroom, high, args.gc_low_percent,
                                         args.gc_min_idle), access_mirrors=args.access_mirrors or ())
    registry = CollectorRegistry()
    chooser = _credentials(args, options)
    agent = core.Agent(store, found, core.Metrics(registry), max_pulls=args.max_pulls, credentials=chooser)
    capturer = capture.Capturer(store, chooser.push).start()
    health = Health()
    reporter = None  # set below with --node-name; ready once its watches have listed

    def ready() -> tuple[bool, str]:
        if reporter is not None:
            return reporter.ready()
        return (False, "status reporter not started") if args.node_name else (True, "")

    metrics = MetricsServer(args.metrics_address, registry, ready, health).start()
    server = grpcutil.serve_unix(sock, lambda s: service.add_to_server(service.AgentService(agent, capturer), s),
                                 max_workers=32)
    health.check("agent", lambda: grpcutil.serving_problem(sock))
    log.info("agent serving", extra=kv(socket=str(sock), store=args.store,
                                       accelerators=[str(a) for a in agent.accelerators],
                                       hosts_dir=options.hosts_dir,
                                       **({"mirrors": dict(options.mirrors)} if options.mirrors else {})))
    for problem in options.hosts.check():  # refused at each pull too; said once here, before any
        log.warning("unusable mirror configuration: pulls of its registry fail until it is fixed",
                    extra=kv(problem=problem))
    if args.node_name:
        try:
            reporter = status_reporter.for_agent(agent, args.node_name, args.kubeconfig, resync=args.status_resync,
                                                 health=health, capturer=capturer)
        except (ValueError, OSError) as e:
            server.stop(grace=0)
            metrics.stop()
            raise exitcodes.CLIError(f"API server configuration: {e}", exitcodes.PREREQUISITE) from None
        agent.on_change = capturer.on_change = reporter.poke
        reporter.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    trim()  # what starting freed goes back (accelnode/malloc.py)
    while not stop.wait(args.gc_interval):
        try:
            agent.collect_to_watermark()
        except Exception:  # a store problem is logged; serving goes on, the next check tries again
            log.exception("watermark collection failed")
        trim()
    log.info("agent stopping")
    capturer.stop()
    if reporter is not None:
        reporter.stop()
    server.stop(grace=5).wait()
    metrics.stop()
    return exitcodes.OK
