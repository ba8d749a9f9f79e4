"""``accelnode csi``: the CSI node plugin ``csi.gkm.io`` (Identity + Node on a unix socket).

It registers itself with kubelet through the plugin-registration socket and asks the node agent
(``accelnode agent``) for caches; it never writes the cache store itself. A volume names its
cache (csi.gkm.io/GKMCache, csi.gkm.io/namespace); the driver looks the cache object up through
the API server (--kubeconfig, or the pod's service account) and mounts the image its status pins.
"""

from __future__ import annotations

import argparse

from accelnode import cli as acli
from accelnode import exitcodes

from . import resolve

DEFAULT_REGISTRY = "/var/lib/kubelet/plugins_registry"
DEFAULT_KUBELET_DIR = "/var/lib/kubelet"
DEFAULT_VIEWS_DIR = "/var/lib/accelnode/views"
# How often the registration socket is checked: kubelet's plugin watcher only sees sockets being
# created, so one that was removed (registry dir wiped) is made again and registration redone.
REGISTRATION_CHECK_SECONDS = 2.0


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A bad flag value: argparse shows the message for a flag, apply_env for an ACCELNODE_* variable."""


def _name(value: str) -> str:
    if not value.strip():
        raise BadValue("must not be empty")
    return value


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also refuses nan
        raise BadValue(f"{value!r} is not a number of seconds >= 0")
    return seconds


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise BadValue(f"{value!r} is not an absolute path")
    return value


def _size(value: str) -> int:
    from .views import quantity

    try:
        n = quantity(value)
    except ValueError as e:
        raise BadValue(str(e)) from None
    if n <= 0:
        raise BadValue(f"{value!r} must be more than 0")
    return n


def _views_dir(value: str) -> str:
    from .views import check_path

    try:
        check_path(value, "views directory")
    except ValueError as e:
        raise BadValue(str(e)) from None
    return value


def register(sub) -> None:
    p = sub.add_parser("csi", help="CSI node plugin csi.gkm.io: mounts caches read-only into pods",
                       description=__doc__)
    p.add_argument("--endpoint", required=True, metavar="unix://PATH", help="CSI socket to serve on")
    p.add_argument("--node-id", required=True, type=_name, metavar="NAME", help="this node's name (NodeGetInfo)")
    p.add_argument("--agent-socket", required=True, metavar="PATH", help="the node agent's unix socket")
    p.add_argument("--plugins-registry", default=DEFAULT_REGISTRY, metavar="DIR",
                   help="kubelet's plugin registration directory; empty: do not register "
                        "(default: %(default)s)")
    p.add_argument("--kubelet-dir", type=_absolute, default=DEFAULT_KUBELET_DIR, metavar="DIR",
                   help="kubelet's root directory (its --root-dir): volumes are published only at "
                        "DIR/pods/<pod-uid>/volumes/kubernetes.io~csi/<volume-name>/mount, compared by real path "
                        "(default: %(default)s)")
    p.add_argument("--kubelet-endpoint", default="", metavar="PATH",
                   help="the CSI socket's path as kubelet sees it (default: the --endpoint path)")
    p.add_argument("--pull-wait", type=_seconds, default=20.0, metavar="SECONDS",
                   help="how long a publish waits for a pull before answering UNAVAILABLE, at most the "
                        "call's deadline less a second (default: %(default)s)")
    p.add_argument("--views-dir", type=_views_dir, default=DEFAULT_VIEWS_DIR, metavar="DIR",
                   help="where copy-on-write views keep their writable layers, one tmpfs each; must be mounted "
                        "into the driver's container with Bidirectional propagation (default: %(default)s)")
    p.add_argument("--writable-size", type=_size, default="1Gi", metavar="QUANTITY",
                   help="a copy-on-write view's writable layer when the volume names no "
                        "accelnode.io/writable-size (default: %(default)s)")
    p.add_argument("--max-writable-size", type=_size, default="8Gi", metavar="QUANTITY",
                   help="the largest accelnode.io/writable-size a volume may ask (default: %(default)s)")
    p.add_argument("--metrics-address", default="127.0.0.1:9810", metavar="HOST:PORT",
                   help="where /metrics, /healthz and /readyz listen (default: %(default)s)")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="kubeconfig for the API server, where caches are looked up by name (default: as kubectl: "
                        "$KUBECONFIG, ~/.kube/config, else the pod's service account when running in a pod)")
    p.add_argument("--trust-policy-max-age", type=_seconds, default=resolve.POLICY_MAX_AGE, metavar="SECONDS",
                   help="how long the watch of ClusterCacheTrustPolicies may be broken before the driver mounts "
                        "nothing (a policy created or edited meanwhile would go unseen) (default: %(default)s)")
    p.add_argument(resolve.TRUST_FLAG, action="store_true",
                   help="accept the volume attribute csi.gkm.io/image, for clusters without the controller. This "
                        "trusts pod authors: whoever writes a pod may mount any image they name (pulled without "
                        "the node's registry credentials) under any cache name. Without an API server it is the "
                        "only way to name an image")
    acli.add_common(p)
    acli.apply_env(p)
    p.set_defaults(func=run)


def socket_from_endpoint(endpoint: str) -> str:
    """``unix:///p``, ``unix:/p`` or a bare path -> ``/p``."""
    path = endpoint[len("unix:"):] if endpoint.startswith("unix:") else endpoint
    if path.startswith("//"):
        path = path[2:]
    if not path.startswith("/"):
        raise exitcodes.CLIError(f"--endpoint {endpoint!r}: expected unix:///ABSOLUTE/PATH", exitcodes.USAGE)
    return path


def api_config(args: argparse.Namespace):
    """The API server to look caches up in, found as kubectl finds it (--kubeconfig, $KUBECONFIG,
    ~/.kube/config, the pod's service account), else None (allowed only with
    --trust-pod-image-attribute)."""
    from accelnode.kube.client import SA_DIR, Config, NoConfig

    try:
        return Config.load(args.kubeconfig)
    except NoConfig:
        pass
    except (ValueError, OSError) as e:
        raise exitcodes.CLIError(f"API server configuration: {e}", exitcodes.PREREQUISITE) from None
    if not args.trust_pod_image_attribute:
        raise exitcodes.CLIError(f"no API server to look caches up in: give --kubeconfig or run in a pod with a "
                                 f"service account token ({SA_DIR / 'token'}); {resolve.TRUST_FLAG} runs without "
                                 "one, trusting pod authors", exitcodes.PREREQUISITE)
    return None


def run(args: argparse.Namespace) -> int:
    from accelnode.malloc import limit_arenas, trim

    limit_arenas()  # before any thread starts: one malloc arena (accelnode/malloc.py)
    if args.writable_size > args.max_writable_size:
        raise exitcodes.CLIError(f"--writable-size ({args.writable_size} bytes) is more than --max-writable-size "
                                 f"({args.max_writable_size} bytes)", exitcodes.USAGE)

    import logging
    import signal
    import threading
    from pathlib import Path

    from prometheus_client.registry import CollectorRegistry

    from accelnode import grpcutil
    from accelnode.health import GRACE_DEFAULT, Health
    from accelnode.httpserve import MetricsServer
    from accelnode.log import kv

    from accelnode.kube.client import Client

    from . import cacheview, identity, node, registration, views
    from .api import csi_grpc, reg_grpc
    from .metrics import Metrics

    log = logging.getLogger("accelnode.csi")
    sock = socket_from_endpoint(args.endpoint)
    reg_dir = Path(args.plugins_registry) if args.plugins_registry else None
    if reg_dir is not None and not reg_dir.is_dir():
        raise exitcodes.CLIError(f"plugin registration directory {reg_dir} does not exist", exitcodes.PREREQUISITE)
    config = api_config(args)
    view_store = views.Views(args.views_dir)
    try:
        view_store.start()  # before serving: sweeps views whose target no longer shows them
    except OSError as e:
        raise exitcodes.CLIError(f"views directory {args.views_dir}: {e}", exitcodes.PREREQUISITE) from None
    health = Health()
    try:
        view = (cacheview.CacheView(Client(config, user_agent="accelnode-csi"), health,
                                    policy_max_age=args.trust_policy_max_age) if config is not None else None)
    except (ValueError, OSError) as e:  # unreadable certificates or keys (ssl.SSLError is an OSError)
        raise exitcodes.CLIError(f"API server configuration: {e}", exitcodes.PREREQUISITE) from None
    Path(sock).parent.mkdir(parents=True, exist_ok=True)
    resolver = resolve.VolumeResolver(resolve.ApiResolver(view) if view is not None else None,
                                      trust_image_attribute=args.trust_pod_image_attribute)

    metrics = Metrics(CollectorRegistry(), view_store)
    channel = grpcutil.unix_channel(args.agent_socket, options=[
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000)])
    agent = node.AgentClient(channel, args.agent_socket)
    servicers = [
        (identity.IdentityServer(agent.stub, args.agent_socket), csi_grpc.IdentityServicer,
         csi_grpc.add_IdentityServicer_to_server),
        (identity.ControllerCapabilities(), csi_grpc.ControllerServicer, csi_grpc.add_ControllerServicer_to_server),
        (node.NodeServer(args.node_id, agent, resolver, kubelet_dir=args.kubelet_dir, pull_wait=args.pull_wait,
                         view_store=view_store, writable_size=args.writable_size,
                         max_writable_size=args.max_writable_size),
         csi_grpc.NodeServicer, csi_grpc.add_NodeServicer_to_server),
    ]
    for servicer, base, _ in servicers:
        metrics.instrument(servicer, base)
    registered = threading.Event()

    def ready() -> tuple[bool, str]:
        if view is not None:
            ok, why = view.ready()
            if not ok:
                return False, why
        if reg_dir is not None and not registered.is_set():
            return False, "not registered with kubelet"
        return True, ""

    if view is not None:
        view.start()
    http = MetricsServer(args.metrics_address, metrics.registry, ready, health).start()
    server = grpcutil.serve_unix(sock, lambda s: [add(svc, s) for svc, _, add in servicers], max_workers=16)
    health.check("CSI", lambda: grpcutil.serving_problem(sock))
    log.info("CSI driver serving", extra=kv(endpoint=sock, node_id=args.node_id, agent=args.agent_socket,
                                            kubelet_dir=args.kubelet_dir,
                                            api_server=config.server if config else None,
                                            trust_pod_image_attribute=args.trust_pod_image_attribute))

    def on_status(ok: bool) -> None:
        metrics.registered.set(1 if ok else 0)
        if ok:
            registered.set()
        else:
            registered.clear()

    reg_servicer = registration.RegistrationServer(args.kubelet_endpoint or sock, on_status)
    reg_server = None

    def ensure_registration_socket(server):
        """Serve the registration socket again when it is gone (kubelet sees only new sockets)."""
        reg_sock = registration.socket_path(reg_dir)
        if server is not None and reg_sock.is_socket():
            return server
        if server is not None:
            log.warning("registration socket is gone; serving it again", extra=kv(socket=str(reg_sock)))
            server.stop(grace=0)
            on_status(False)
        if not reg_dir.is_dir():
            log.warning("plugin registration directory is missing", extra=kv(dir=str(reg_dir)))
            return None
        server = grpcutil.serve_unix(reg_sock, lambda s: reg_grpc.add_RegistrationServicer_to_server(reg_servicer, s),
                                     max_workers=2)
        log.info("waiting for kubelet's plugin watcher", extra=kv(socket=str(reg_sock)))
        return server

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    loop = health.heartbeat("registration loop", GRACE_DEFAULT)
    while True:
        loop.beat(REGISTRATION_CHECK_SECONDS + GRACE_DEFAULT)
        if reg_dir is not None:
            reg_server = ensure_registration_socket(reg_server)
        trim()  # what starting, and publishing since, freed goes back (accelnode/malloc.py)
        if stop.wait(REGISTRATION_CHECK_SECONDS):
            break
    log.info("CSI driver stopping")
    if reg_server is not None:
        reg_server.stop(grace=1).wait()
        grpcutil.remove_stale_socket(registration.socket_path(reg_dir))  # kubelet deregisters us
    server.stop(grace=5).wait()
    if view is not None:
        view.stop()
    http.stop()
    return exitcodes.OK
