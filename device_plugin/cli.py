"""``accelnode device-plugin``: offer this node's TPU chips to kubelet as ``google.com/tpu``."""

from __future__ import annotations

import argparse

from accelnode import cli as acli
from accelnode import exitcodes

from .events import DEFAULT_TICK
from .topology import RECIPES


def _tick(raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not 0.05 <= v <= 3600:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{raw}: must be between 0.05 and 3600 seconds")
    return v


def register(sub) -> None:
    p = sub.add_parser(
        "device-plugin",
        help="kubelet device plugin for TPU chips (google.com/tpu)",
        description="Discover the TPU chips of this node, watch their health, and offer them to kubelet "
        "through the device-plugin API v1beta1 on a unix socket in --kubelet-dir. Runs until SIGTERM/SIGINT.",
    )
    p.add_argument("--sysfs-root", default="/sys", help="where sysfs is mounted (default: %(default)s)")
    p.add_argument("--dev-root", default="/dev", help="where device nodes live (default: %(default)s)")
    p.add_argument("--kubelet-dir", default="/var/lib/kubelet/device-plugins",
                   help="kubelet's device-plugin directory: kubelet.sock and our socket (default: %(default)s)")
    p.add_argument("--socket-name", default="accelnode-tpu.sock",
                   help="file name of our socket in --kubelet-dir (default: %(default)s)")
    p.add_argument("--resource-name", default="google.com/tpu",
                   help="extended resource to offer (default: %(default)s)")
    g = p.add_argument_group("the slice this node is part of (docs/device-plugin.md, \"Slice facts\")")
    g.add_argument("--tpu-env", choices=RECIPES, default="gke",
                   help="the TPU env a container gets: gke (GKE's managed plugin: no TPU_VISIBLE_CHIPS, a container "
                   "of N chips is a host of N chips in the node's slice) or visible-chips (TPU_VISIBLE_CHIPS = host "
                   "chip indices, TPU_*_PROCESS_BOUNDS) (default: %(default)s)")
    g.add_argument("--node-name", default=None, metavar="NODE",
                   help="read the slice from this Node's labels cloud.google.com/gke-tpu-accelerator and "
                   "cloud.google.com/gke-tpu-topology, and follow them (the DaemonSets set it from spec.nodeName; "
                   "needs get and watch on nodes) (default: not read)")
    g.add_argument("--kubeconfig", default=None, metavar="FILE",
                   help="kubeconfig for --node-name (default: as kubectl: $KUBECONFIG, ~/.kube/config, else the "
                   "pod's service account)")
    g.add_argument("--metadata-labels", action="store_true",
                   help="read the same labels from the GCE metadata server's instance/attributes/kube-labels at "
                   "start (GCE_METADATA_HOST or 169.254.169.254) (default: off)")
    g.add_argument("--accelerator-type", default=None,
                   help="TPU_ACCELERATOR_TYPE, e.g. v5litepod-16; wins over the labels (default: from the labels: "
                   "<generation>-<TensorCores>)")
    g.add_argument("--topology", default=None,
                   help="slice topology for TPU_TOPOLOGY and the host bounds, e.g. 4x4 or 2x2x2; wins over the "
                   "labels (default: from the labels, else no slice env)")
    p.add_argument("--metrics-address", default="127.0.0.1:2112",
                   help="HOST:PORT for /metrics, /healthz, /readyz; empty disables (default: %(default)s)")
    p.add_argument("--health-interval", type=_tick, default=DEFAULT_TICK,
                   help="seconds between reads of the chips' sysfs health attributes (PCI vendor, driver binding, "
                   "AER counters), 0.05-3600: these give no event, so a chip falling off the bus, an unbound "
                   "driver or an AER error is seen within this time. Device nodes appearing or vanishing and udev events are seen at once, whatever "
                   "this is (default: %(default)s)")
    acli.add_common(p)
    acli.apply_env(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from accelnode.malloc import TRIM_SECONDS, limit_arenas, trim

    limit_arenas()  # before any thread starts: one malloc arena (accelnode/malloc.py)

    import signal
    import threading
    from pathlib import Path

    from accelnode.health import Health
    from accelnode.httpserve import MetricsServer, parse_address

    from .api import KUBELET_SOCKET, is_extended_resource_name
    from .metrics import Metrics
    from .server import Plugin
    from .nodefacts import NodeFacts
    from .topology import NodeConfig

    if not is_extended_resource_name(args.resource_name):
        raise exitcodes.CLIError(f"--resource-name {args.resource_name!r} is not an extended resource name "
                                 "(<domain>/<name> outside kubernetes.io)", exitcodes.USAGE)
    if "/" in args.socket_name or args.socket_name in ("", ".", "..", KUBELET_SOCKET):
        raise exitcodes.CLIError(f"--socket-name {args.socket_name!r} must be a plain file name other than "
                                 "kubelet.sock", exitcodes.USAGE)
    config = NodeConfig(accelerator_type=args.accelerator_type or None, topology=args.topology or None,
                        recipe=args.tpu_env)
    try:
        config.validate()
    except ValueError as e:
        raise exitcodes.CLIError(f"--topology: {e}", exitcodes.USAGE) from None
    facts = NodeFacts(config)
    client = None
    if args.node_name:
        from accelnode.kube.client import Client, Config

        try:
            client = Client(Config.load(args.kubeconfig), user_agent="accelnode-device-plugin", max_connections=2)
        except (ValueError, OSError) as e:
            raise exitcodes.CLIError(f"--node-name needs the API server: {e}", exitcodes.PREREQUISITE) from None
    if args.metrics_address:
        try:
            parse_address(args.metrics_address)
        except ValueError as e:
            raise exitcodes.CLIError(f"--metrics-address: {e}", exitcodes.USAGE) from None
    sysfs, dev, kdir = Path(args.sysfs_root), Path(args.dev_root), Path(args.kubelet_dir)
    for flag, d in (("--sysfs-root", sysfs), ("--dev-root", dev)):
        if not d.is_dir():
            raise exitcodes.CLIError(f"{flag} {d} is not a directory", exitcodes.PREREQUISITE)
    if not (sysfs / "bus/pci/devices").is_dir():
        raise exitcodes.CLIError(f"--sysfs-root {sysfs} has no bus/pci/devices: not a sysfs tree",
                                 exitcodes.PREREQUISITE)
    try:
        kdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise exitcodes.CLIError(f"--kubelet-dir {kdir}: {e.strerror}", exitcodes.PREREQUISITE) from None

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    metrics = Metrics()
    health = Health()
    if args.metadata_labels:
        from accelnode.gce.metadata import Metadata

        facts.from_metadata(Metadata())
    if client is not None:
        facts.watch_node(client, args.node_name)
    plugin = Plugin(sysfs_root=sysfs, dev_root=dev, kubelet_dir=kdir, config=facts, metrics=metrics,
                    resource=args.resource_name, socket_name=args.socket_name, tick=args.health_interval,
                    health=health)
    http = None
    try:
        if args.metrics_address:
            try:
                http = MetricsServer(args.metrics_address, metrics.registry, plugin.ready, health).start()
            except OSError as e:
                raise exitcodes.CLIError(f"--metrics-address {args.metrics_address}: {e.strerror}",
                                         exitcodes.PREREQUISITE) from None
        try:
            plugin.start()
        except FileExistsError as e:  # something that is not a socket sits where ours goes
            raise exitcodes.CLIError(str(e), exitcodes.PREREQUISITE) from None
        trim()  # what starting freed goes back (accelnode/malloc.py)
        while not stop.wait(TRIM_SECONDS):
            trim()
    finally:
        plugin.stop()
        facts.stop()
        if http is not None:
            http.stop()
    return exitcodes.OK
