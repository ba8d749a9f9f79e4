"""``accelnode controller``: the cluster controller (one Deployment; one replica leads).

Every replica serves the admission webhooks (stateless: any replica may answer) and
``/metrics`` ``/healthz`` ``/readyz``; only the replica holding the leader Lease runs the
reconcilers. The webhooks' certificate is, by default, the controller's own: every replica
keeps a CA and serving certificate in one Secret (made, renewed, reloaded without a restart)
and the leader writes the CA into the caBundle of our webhook configurations; with
--tls-cert-file/--tls-key-file it is someone else's (cert-manager) and the controller writes
neither (docs/webhook-certificates.md). A leader that cannot renew its Lease within the renew
deadline exits with status 1 (its work stops at once; the Deployment restarts it as a
standby). SIGTERM stops the reconcilers, releases the Lease so a standby takes over at once,
and exits 0.
"""

from __future__ import annotations

import argparse
import re

import accelnode
from accelnode.decode import FILE, read_file
from accelnode import cli as acli
from accelnode import exitcodes
from accelnode.oci.flags import add_registry_flags

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
DEFAULT_NAMESPACE = "accelnode-system"


def register(sub) -> None:
    p = sub.add_parser("controller", help="run the cluster controller (leader election, reconcilers, admission "
                                          "webhooks)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig for the API server (default: as kubectl: "
                                                        "$KUBECONFIG, ~/.kube/config, else the pod's service account)")
    g = p.add_argument_group("leader election (a coordination.k8s.io/v1 Lease)")
    g.add_argument("--namespace", metavar="NS",
                   help="namespace of the Lease (default: the pod's namespace from its service account, else "
                        f"{DEFAULT_NAMESPACE})")
    g.add_argument("--lease-name", default="accelnode-controller", metavar="NAME",
                   help="name of the Lease (default: %(default)s)")
    g.add_argument("--identity", metavar="ID",
                   help="this replica's holderIdentity (default: the host name and a random suffix)")
    g.add_argument("--lease-duration", type=float, default=15.0, metavar="SECONDS",
                   help="how long a standby waits, after it last saw the Lease change, before taking it over "
                        "(default: %(default)s)")
    g.add_argument("--renew-deadline", type=float, default=10.0, metavar="SECONDS",
                   help="the leader exits (status 1) when it could not renew for this long; shorter than "
                        "--lease-duration (default: %(default)s)")
    g.add_argument("--retry-period", type=float, default=2.0, metavar="SECONDS",
                   help="how often the leader renews and a standby tries to acquire (default: %(default)s)")
    g = p.add_argument_group("reconcilers")
    g.add_argument("--workers", type=int, default=2, metavar="N",
                   help="concurrent reconciles per reconciler (default: %(default)s)")
    g.add_argument("--resync", type=float, default=300.0, metavar="SECONDS",
                   help="reconcile every watched object again this often, events or not (default: %(default)s)")
    g.add_argument("--cache-status-fanout", type=float, default=1000.0, metavar="EVENTS",
                   help="watch events a second one cache's status writes may send to the agents (each write "
                        "reaches every node's agent): a cache counted on N nodes is written at most every "
                        "max(1, N / EVENTS) seconds (docs/scale.md; default: %(default)s)")
    g.add_argument("--capture-repositories", metavar="FILE",
                   help="JSON file of the repositories each namespace's capturing GKMCaches may publish to: "
                        '{"<namespace>" or "*": ["registry/prefix/", "registry/exact-repo"]} (docs/capture.md); '
                        "a namespace not named and no \"*\" may capture nowhere. Default: capture is refused")
    g = p.add_argument_group("serving")
    g.add_argument("--metrics-address", default="127.0.0.1:9813", metavar="HOST:PORT",
                   help="where /metrics, /healthz and /readyz listen (default: %(default)s)")
    g.add_argument("--webhook-address", default="127.0.0.1:9443", metavar="HOST:PORT",
                   help="where the admission webhooks listen (HTTPS); loopback by default, so a pod must set "
                        "0.0.0.0:PORT (or its pod IP) for the API server to reach it; the Deployment uses "
                        "0.0.0.0:10250, the port GKE private clusters let the control plane reach "
                        "(default: %(default)s)")
    g = p.add_argument_group("webhook certificates (docs/webhook-certificates.md)")
    g.add_argument("--tls-cert-file", metavar="FILE",
                   help="serving certificate of the webhooks (PEM, reloaded when it changes), made by something else "
                        "(cert-manager): with it and --tls-key-file the controller keeps no Secret and writes no "
                        "caBundle. Without them (the default) the controller keeps its own CA and serving "
                        "certificate in --webhook-secret and writes the CA into the caBundle of its webhook "
                        "configurations")
    g.add_argument("--tls-key-file", metavar="FILE", help="the serving certificate's private key (PEM)")
    g.add_argument("--disable-webhooks", action="store_true",
                   help="serve no admission webhook, keep no certificate")
    g.add_argument("--webhook-secret", default="accelnode-controller-webhook-tls", metavar="NAME",
                   help="Secret (in --namespace) holding the self-managed CA and serving certificate "
                        "(default: %(default)s)")
    g.add_argument("--webhook-service", default="accelnode-controller", metavar="NAME",
                   help="Service the API server calls the webhooks through: the serving certificate's names, and "
                        "the webhooks whose caBundle is written (default: %(default)s)")
    g.add_argument("--webhook-service-namespace", metavar="NS",
                   help="namespace of --webhook-service (default: the controller's --namespace)")
    g.add_argument("--ca-lifetime", type=parse_duration, default=parse_duration("87600h"), metavar="DURATION",
                   help="lifetime of a self-managed CA, e.g. 87600h; renewed at two thirds of it (default: 10 years)")
    g.add_argument("--cert-lifetime", type=parse_duration, default=parse_duration("8760h"), metavar="DURATION",
                   help="lifetime of a self-managed serving certificate, at most a third of --ca-lifetime; renewed "
                        "at two thirds of it (default: 1 year)")
    g = p.add_argument_group("TPU environment webhooks (docs/tpu-env.md)")
    g.add_argument("--gke-tpu-env", choices=("auto", "true", "false"), default="auto",
                   help="whether the cluster itself gives Indexed Jobs with a subdomain and google.com/tpu requests "
                        "their TPU_WORKER_ID/TPU_WORKER_HOSTNAMES, as GKE does: then those Jobs are left to it. auto: "
                        "when the API server's version is a GKE one (vX.Y.Z-gke.N) (default: %(default)s)")
    g = p.add_argument_group("TPU node groups on GCE (docs/tpu-node-groups.md)")
    g.add_argument("--tpu-node-groups", action="store_true",
                   help="run the TPUNodeGroup, WorkloadPolicy, InstanceTemplate and ManagedInstanceGroup reconcilers "
                        "(needs the tpu.google.com CRDs and daemonsets/rbac-controller-nodegroups.yaml)")
    g.add_argument("--gce-endpoint", metavar="URL",
                   help="Compute API endpoint with anonymous credentials, e.g. the emulator "
                        "(`make gce-emulator` in a checkout, docs/tpu-node-groups.md); default: compute.googleapis.com with Application "
                        "Default Credentials")
    g.add_argument("--gce-project", metavar="PROJECT",
                   help="the controller's own GCE project: without --node-group-placement, the only project node "
                        "groups may use (default: Application Default Credentials' project; none with --gce-endpoint)")
    g.add_argument("--node-group-placement", metavar="FILE",
                   help="JSON file of the operator's rules for each namespace's node groups: where (projects, "
                        "zones) and what runs on their VMs (images, serviceAccounts, subnetworks, metadata keys and "
                        "values, instanceTemplates), deletionPolicies and maxJoinTokens: "
                        '{"<namespace>" or "*": {"projects": [...], ...}} (docs/tpu-node-groups.md, "Operator '
                        'rules"); a namespace not named and no "*" may use none. Default: --gce-project for every '
                        "namespace, nothing else")
    g.add_argument("--node-group-poll", type=float, default=10.0, metavar="SECONDS",
                   help="how often GCE operations and joining nodes are looked at (default: %(default)s)")
    g.add_argument("--drain-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long a deleted group waits for its pods' evictions before deleting the VMs "
                        "(default: %(default)s)")
    g.add_argument("--join-api-server-port", type=int, default=6443, metavar="PORT",
                   help="port of the API server at bootstrapKubernetes.controlPlaneIP that the VMs join; written into "
                        "kubeadm-control-plane-ip when not 6443 (default: %(default)s)")
    g.add_argument("--device-plugin-image", default=accelnode.IMAGE, metavar="IMAGE",
                   help="image of the device-plugin DaemonSet the node groups deploy; the shipped Deployment sets it "
                        "to the controller's own image (default: %(default)s)")
    add_registry_flags(p.add_argument_group("registry (resolving kernel-cache images to digests)"),
                       timeout_flag="--registry-timeout", timeout=30.0,
                       timeout_help="deadline of resolving one image to its digest (manifests and configs, no layers)")
    acli.add_common(p)
    acli.apply_env(p)
    p.set_defaults(func=run)


def node_group_placement(path: str | None) -> dict | None:
    """--node-group-placement's file, checked (controller/nodegroups/policy.py); None without the flag."""
    if path is None:
        return None
    from controller.nodegroups.policy import Policy

    try:
        rules = read_file(path, FILE, expect=None)
        Policy.parse(rules)
    except (OSError, ValueError) as e:
        raise exitcodes.CLIError(f"--node-group-placement {path}: {e}", exitcodes.USAGE) from None
    return rules


def own_gce_project(endpoint: str | None) -> str | None:
    """The project of Application Default Credentials (none against an emulator, or without them)."""
    if endpoint:
        return None
    try:
        import google.auth

        return google.auth.default()[1]
    except Exception:  # no credentials: no project is allowed until the operator names one
        return None


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``8760h``, ``3650d`` -> seconds (an argparse type)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([smhd])\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30s, 15m, 8760h or 3650d")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def default_identity() -> str:
    import secrets
    import socket

    return f"{socket.gethostname()}_{secrets.token_hex(4)}"


def default_namespace() -> str:
    try:
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip() or DEFAULT_NAMESPACE
    except OSError:
        return DEFAULT_NAMESPACE


def is_gke_version(git_version: str) -> bool:
    """A GKE control plane's version: ``v1.34.1-gke.1127000`` (GKE's release names)."""
    return re.fullmatch(r"v?\d+\.\d+\.\d+-gke\.\d+", git_version or "") is not None


def platform_sets_tpu_env(choice: str, client, log) -> bool:
    """``--gke-tpu-env``: true/false as given; auto asks the API server's /version once."""
    from accelnode.kube.client import KubeError

    if choice != "auto":
        return choice == "true"
    try:
        version = client.request("GET", "/version", timeout=30).get("gitVersion", "")
    except (KubeError, OSError, ValueError, AttributeError) as e:  # decide as off GKE, and say so
        log.warning("could not read the API server's version: TPU env webhooks act on Indexed Jobs too",
                    extra={"error": str(e)})
        return False
    log.info("API server version", extra={"version": version, "gke": is_gke_version(version)})
    return is_gke_version(version)


def capture_rules(path: str | None):
    """--capture-repositories' rules (accelnode/capture/settings.py); none allow anything without the flag."""
    from accelnode.capture.settings import Rules

    if path is None:
        return Rules({})
    try:
        return Rules.load(path)
    except (OSError, ValueError) as e:
        raise exitcodes.CLIError(f"--capture-repositories {path}: {e}", exitcodes.USAGE) from None


def always_running(client, resolver, capture=None, *, status_fanout: float | None = None) -> list:
    """The reconcilers every controller runs; ``--tpu-node-groups`` and the self-managed webhook
    certificate add theirs in :func:`run`. ``resolver`` is the process's
    :class:`controller.caches.pinning.Resolver`, shared with the admission webhooks so that an
    image resolved at admission is not asked of the registry again."""
    from controller.caches.capture import CaptureReconciler
    from controller.caches.claims import clustergkmcache_claims_reconciler, gkmcache_claims_reconciler
    from controller.caches.reconciler import clustergkmcache_reconciler, gkmcache_reconciler
    from controller.caches.status import FANOUT_PER_SECOND
    from controller.tpuenv.scale import statefulset_env_reconciler

    status_fanout = FANOUT_PER_SECOND if status_fanout is None else status_fanout
    return [
        gkmcache_reconciler(client, resolver, fanout_per_second=status_fanout),  # docs/cache-controller.md
        clustergkmcache_reconciler(client, resolver, fanout_per_second=status_fanout),
        gkmcache_claims_reconciler(client, resolver),  # PV/PVC per workload namespace (docs/cache-claims.md)
        clustergkmcache_claims_reconciler(client, resolver),
        statefulset_env_reconciler(client, resolver),  # TPU env of StatefulSets scaled through /scale (docs/tpu-env.md)
        CaptureReconciler(client, resolver, capture or capture_rules(None)),  # docs/capture.md
    ]


def run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading
    import time

    from prometheus_client import CollectorRegistry, Gauge

    from accelnode.httpserve import MetricsServer
    from accelnode.kube.client import Client, Config
    from accelnode.log import kv
    from accelnode.oci.flags import registry_options

    from controller.webhooks.server import AdmissionMetrics, AdmissionServer
    from controller.webhooks.cabundle import CABundleReconciler, TrustGate
    from controller.caches.webhooks import ControllerIdentity
    from controller.caches.webhooks import routes as cache_routes
    from controller.tpuenv.webhooks import routes as env_routes
    from controller.webhooks.certs import Policy, ServingCerts, service_names
    from controller.runtime import events
    from controller.runtime.leader import LeaderElector, Timing
    from controller.runtime.manager import Manager
    from controller.caches.pinning import Resolver

    log = logging.getLogger("accelnode.controller")
    timing = Timing(args.lease_duration, args.renew_deadline, args.retry_period)
    try:
        timing.check()
    except ValueError as e:
        raise exitcodes.CLIError(str(e), exitcodes.USAGE) from None
    if args.workers < 1 or args.resync <= 0:
        raise exitcodes.CLIError("--workers must be at least 1 and --resync positive", exitcodes.USAGE)
    if not args.cache_status_fanout > 0:
        raise exitcodes.CLIError(f"--cache-status-fanout must be a positive number of watch events a second, "
                                 f"not {args.cache_status_fanout!r}", exitcodes.USAGE)
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise exitcodes.CLIError("--tls-cert-file and --tls-key-file go together", exitcodes.USAGE)
    if args.disable_webhooks and args.tls_cert_file:
        raise exitcodes.CLIError("--disable-webhooks serves no webhook: give no --tls-cert-file", exitcodes.USAGE)
    self_managed = not (args.disable_webhooks or args.tls_cert_file)
    policy = Policy(args.ca_lifetime, args.cert_lifetime)
    try:
        policy.check()
    except ValueError as e:
        raise exitcodes.CLIError(str(e), exitcodes.USAGE) from None
    namespace = args.namespace or default_namespace()
    service_namespace = args.webhook_service_namespace or namespace
    identity = args.identity or default_identity()
    try:
        config = Config.load(args.kubeconfig)
        client = Client(config, user_agent="accelnode-controller", max_connections=32)  # a watch per reconciler kind
    except (ValueError, OSError) as e:
        raise exitcodes.CLIError(f"API server configuration: {e}", exitcodes.PREREQUISITE) from None

    from accelnode.kube.pullsecrets import PullSecretReader

    # one per process: webhooks and reconcilers share its answers; a GKMCache is pinned with the
    # pull secrets its namespace lends the controller (docs/security.md)
    resolver = Resolver(registry_options(args), secrets=PullSecretReader(client, who="the accelnode controller"))
    registry = CollectorRegistry()
    reconcilers = always_running(client, resolver, capture_rules(args.capture_repositories),
                                 status_fanout=args.cache_status_fanout)
    if args.tpu_node_groups:
        from controller.nodegroups import reconciler as nodegroups
        from controller.nodegroups.compute import GCE

        if args.node_group_poll <= 0 or args.drain_timeout < 0 or not 0 < args.join_api_server_port < 65536:
            raise exitcodes.CLIError("--node-group-poll must be positive, --drain-timeout not negative and "
                                     "--join-api-server-port a port number", exitcodes.USAGE)
        settings = nodegroups.Settings(namespace=namespace, poll=args.node_group_poll,
                                       drain_timeout=args.drain_timeout, device_plugin_image=args.device_plugin_image,
                                       api_server_port=args.join_api_server_port,
                                       placement=node_group_placement(args.node_group_placement),
                                       own_project=args.gce_project or own_gce_project(args.gce_endpoint))
        from prometheus_client import Counter as _Counter

        gce_calls = _Counter("accelnode_controller_gce_requests", "Compute API calls of the node-group reconcilers, "
                             "by method and kind (read, write)", ["method", "kind"], registry=registry)
        gce = GCE(args.gce_endpoint, counters=lambda kind, method: gce_calls.labels(method, kind).inc())
        reconcilers += nodegroups.reconcilers(client, settings, gce)
    if self_managed:  # the leader copies the CA into our webhook configurations
        reconcilers.append(CABundleReconciler(client, secret_namespace=namespace, secret=args.webhook_secret,
                                              service=args.webhook_service, service_namespace=service_namespace))
    recorder = events.Recorder(client, instance=identity).start()  # Events on users' objects (runtime/events.py)
    events.install(recorder)
    manager = Manager(client, reconcilers, registry, workers=args.workers, resync=args.resync)
    elector = LeaderElector(client, namespace, args.lease_name, identity, timing, on_started_leading=manager.start)
    Gauge("accelnode_controller_leader", "1 while this replica holds the leader Lease",
          registry=registry).set_function(lambda: 1 if elector.leading.is_set() else 0)
    lease = f"{namespace}/{args.lease_name}"

    certs = trust = None
    if self_managed:
        certs = ServingCerts(client, namespace, args.webhook_secret,
                             service_names(args.webhook_service, service_namespace), policy=policy, registry=registry)
        trust = TrustGate(client, lambda: certs.certificate, service=args.webhook_service,
                          service_namespace=service_namespace)
    elif not args.disable_webhooks:  # certificates from files (cert-manager): the one served, as soon as served
        Gauge("accelnode_controller_webhook_cert_expiry_timestamp_seconds",
              "Unix time the served webhook certificate expires (0 before the webhooks are served)",
              registry=registry).set_function(lambda: webhooks.certs.not_after if webhooks is not None else 0)
    admission_metrics = AdmissionMetrics(registry)

    def ready() -> tuple[bool, str]:
        problems = []
        seen = elector.last_contact
        standby_ok = seen is not None and time.monotonic() - seen <= 2 * timing.lease_duration
        if not (elector.leading.is_set() or standby_ok):  # a healthy standby can read the Lease, would take over
            ago = "never" if seen is None else f"{time.monotonic() - seen:.0f}s ago"
            problems.append(f"standing by but cannot read Lease {lease} (last read {ago}): "
                            f"{elector.last_error or 'no answer yet'}")
        if certs is not None and webhooks is None:
            problems.append(f"no webhook serving certificate yet (Secret {namespace}/{args.webhook_secret}): "
                            f"{certs.last_error or 'not read yet'}")
        if trust is not None and webhooks is not None and (untrusted := trust.check()):
            problems.append(untrusted)
        return not problems, "; ".join(problems)

    webhooks = None
    metrics = MetricsServer(args.metrics_address, registry, ready).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    failed: list[str] = []  # why the webhooks cannot be served: the controller exits with it

    def serve(cert_file: str, key_file: str) -> None:
        nonlocal webhooks
        try:
            webhooks = AdmissionServer(args.webhook_address, cert_file, key_file, routes,
                                       metrics=admission_metrics).start()
        except OSError as e:  # the address is taken, a file is missing or not a certificate
            failed.append(f"cannot serve the admission webhooks on {args.webhook_address}: {e}")
            stop.set()

    if args.disable_webhooks:
        log.info("--disable-webhooks: admission webhooks are not served")
    else:
        ident = ControllerIdentity.of(client)
        ident.username()  # learn it now (logged); retried on the first requests if the API server is not up yet
        routes = {**cache_routes(resolver, ident), **env_routes(platform_sets_tpu_env(args.gke_tpu_env, client, log))}
        if certs is None:
            serve(args.tls_cert_file, args.tls_key_file)
        else:  # the first pair comes from the API server: served once installed, leader election meanwhile
            threading.Thread(target=certs.run, args=(stop,), kwargs={"on_first_install": serve}, name="webhook-certs",
                             daemon=True).start()
    log.info("controller starting", extra=kv(identity=identity, lease=lease, reconcilers=len(manager.controllers)))
    try:
        stopped_cleanly = elector.run(stop)
    finally:
        manager.stop(timeout=10.0 if stop.is_set() else 2.0)
        recorder.flush(2.0)
        recorder.stop()
    if stopped_cleanly:
        elector.release()
    if webhooks is not None:
        webhooks.stop()
    if certs is not None:
        certs.close()
    metrics.stop()
    if failed:
        raise exitcodes.CLIError(failed[0], exitcodes.FAILURE)
    if not stopped_cleanly:
        raise exitcodes.CLIError(f"lost the leader Lease {lease}: could not renew within {timing.renew_deadline:g}s; "
                                 "exiting so that no work is done without it", exitcodes.FAILURE)
    log.info("controller stopped", extra=kv(identity=identity))
    return exitcodes.OK
