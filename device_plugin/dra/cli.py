"""``accelnode dra``: offer this node's TPU chips through Dynamic Resource Allocation (docs/dra.md)."""

from __future__ import annotations

import re

from accelnode import cli as acli
from accelnode import exitcodes

from ..cli import _tick

MAX_LOG_SIZE = 4 << 30  # memory a container's log tmpfs may take at most


def _size(raw: str) -> int:
    import argparse

    from accelnode.kube.quantity import to_bytes

    v = to_bytes(raw)
    if v is None or not 0 <= v <= MAX_LOG_SIZE:
        raise argparse.ArgumentTypeError(f"{raw}: must be a quantity from 0 to 4Gi (e.g. 64Mi)")
    return v
# seconds between sysfs health reads: what gives no event (AER counts, vendor 0xffff) is seen,
# tainted and reported to kubelet within it (the device plugin's 5 s is kubelet's own pace)
HEALTH_TICK = 0.5
from ..topology import RECIPES

# a DNS subdomain (the driver name is a ResourceSlice field and a CDI vendor)
_DRIVER = re.compile(r"^(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+$")
_UID = re.compile(r"^[0-9a-fA-F-]{1,64}$")


def register(sub) -> None:
    p = sub.add_parser(
        "dra",
        help="kubelet DRA plugin for TPU chips (ResourceSlices, CDI per claim)",
        description="Publish this node's healthy TPU chips as ResourceSlices (resource.k8s.io/v1: a counter per chip, a device per ICI block of the host consuming its chips' counters), refuse a node a device plugin serves (google.com/tpu allocatable), register with kubelet as a DRA plugin, and prepare claims by writing a CDI spec per claim (device "
        "nodes, TPU env, libtpu log mount). Needs a CDI-capable runtime (containerd 1.7.2+, 2.x). Runs until "
        "SIGTERM/SIGINT.")
    p.add_argument("--driver-name", default="tpu.google.com",
                   help="DRA driver name: ResourceSlice spec.driver, the DeviceClass's selector, the CDI vendor "
                   "k8s.<driver>; refused when another plugin registered it on this node (default: %(default)s)")
    p.add_argument("--node-name", required=True, metavar="NODE",
                   help="this Node (the pool and owner of the slice; the DaemonSet sets it from spec.nodeName)")
    p.add_argument("--kubeconfig", default=None, metavar="FILE",
                   help="kubeconfig (default: as kubectl: $KUBECONFIG, ~/.kube/config, else the pod's service account)")
    p.add_argument("--kubelet-root", default="/var/lib/kubelet",
                   help="kubelet's --root-dir: plugins_registry/ and plugins/<driver>/ are under it (default: %(default)s)")
    p.add_argument("--pod-uid", default=None,
                   help="this pod's UID: socket names <driver>-<uid>-reg.sock and dra-<uid>.sock, so an old and a "
                   "new pod of a rolling update serve side by side (default: <driver>-reg.sock, dra.sock)")
    p.add_argument("--cdi-dir", default="/var/run/cdi",
                   help="where the per-claim CDI specs go; the runtime must read it (default: %(default)s)")
    p.add_argument("--state-dir", default=None,
                   help="per-claim checkpoints (default: <kubelet-root>/plugins/<driver>/claims)")
    p.add_argument("--libtpu-log-size", type=_size, default="64Mi", metavar="QUANTITY",
                   help="size of the tmpfs mounted at /tmp/tpu_logs in each of a claim's containers for libtpu's logs "
                   "(writable by any user, one file per 16Ki of it; gone with the container); 0: no mount "
                   "(default: %(default)s)")
    p.add_argument("--claim-watch", action="store_true",
                   help="prepare from a watch of all ResourceClaims instead of a GET of each claim kubelet names "
                   "(about 1 ms faster per prepare; needs list and watch on resourceclaims cluster-wide, which "
                   "overlays/dra does not grant, and about 800 bytes of memory per claim in the cluster) "
                   "(default: off)")
    p.add_argument("--sysfs-root", default="/sys", help="where sysfs is mounted (default: %(default)s)")
    p.add_argument("--dev-root", default="/dev", help="where device nodes live (default: %(default)s)")
    p.add_argument("--tpu-env", choices=RECIPES, default="gke",
                   help="the TPU env a claim's containers get, as for the device plugin (default: %(default)s)")
    p.add_argument("--accelerator-type", default=None, help="TPU_ACCELERATOR_TYPE; wins over the Node's labels")
    p.add_argument("--topology", default=None, help="slice topology, e.g. 2x2; wins over the Node's labels")
    p.add_argument("--metrics-address", default="127.0.0.1:2113",
                   help="HOST:PORT for /metrics, /healthz, /readyz; empty disables (default: %(default)s)")
    p.add_argument("--health-interval", type=_tick, default=HEALTH_TICK,
                   help="seconds between reads of the chips' sysfs health attributes (AER counts, PCI vendor): a "
                   "failure without a device event is tainted within it (default: %(default)s)")
    acli.add_common(p)
    acli.apply_env(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import signal
    import threading
    from pathlib import Path

    from accelnode.health import Health
    from accelnode.httpserve import MetricsServer, parse_address
    from accelnode.kube.client import Client, Config
    from prometheus_client.registry import CollectorRegistry

    from ..nodefacts import NodeFacts
    from ..topology import NodeConfig
    from . import exclusive
    from .server import Driver, NameTaken

    if not _DRIVER.match(args.driver_name):
        raise exitcodes.CLIError(f"--driver-name {args.driver_name!r} is not a DNS subdomain with a dot "
                                 "(e.g. tpu.google.com)", exitcodes.USAGE)
    if args.pod_uid is not None and not _UID.match(args.pod_uid):
        raise exitcodes.CLIError(f"--pod-uid {args.pod_uid!r} is not a UID", exitcodes.USAGE)
    config = NodeConfig(accelerator_type=args.accelerator_type or None, topology=args.topology or None,
                        recipe=args.tpu_env)
    try:
        config.validate()
    except ValueError as e:
        raise exitcodes.CLIError(f"--topology: {e}", exitcodes.USAGE) from None
    if args.metrics_address:
        try:
            parse_address(args.metrics_address)
        except ValueError as e:
            raise exitcodes.CLIError(f"--metrics-address: {e}", exitcodes.USAGE) from None
    sysfs, dev, root = Path(args.sysfs_root), Path(args.dev_root), Path(args.kubelet_root)
    if not (sysfs / "bus/pci/devices").is_dir():
        raise exitcodes.CLIError(f"--sysfs-root {sysfs} has no bus/pci/devices: not a sysfs tree",
                                 exitcodes.PREREQUISITE)
    try:
        client = Client(Config.load(args.kubeconfig), user_agent="accelnode-dra", max_connections=6)  # 4 watches, 2 calls
    except (ValueError, OSError) as e:
        raise exitcodes.CLIError(f"the API server: {e}", exitcodes.PREREQUISITE) from None
    facts = NodeFacts(config)
    health = Health()
    state = Path(args.state_dir) if args.state_dir else root / "plugins" / args.driver_name / "claims"
    driver = Driver(driver=args.driver_name, node=args.node_name, client=client, kubelet_root=root, sysfs_root=sysfs,
                    dev_root=dev, cdi_dir=Path(args.cdi_dir), state_dir=state,
                    log_size=args.libtpu_log_size, config=facts,
                    tick=args.health_interval, pod_uid=args.pod_uid, health=health, watch_claims=args.claim_watch)
    try:  # one owner per node: not while a device plugin offers the chips (exclusive.py)
        exclusive.check(client, args.node_name)
    except exclusive.DevicePluginServes as e:
        raise exitcodes.CLIError(str(e), exitcodes.PREREQUISITE) from None
    facts.on_change = driver.facts_changed
    facts.watch_node(client, args.node_name)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    guard = exclusive.Guard(client, args.node_name, lambda reason: stop.set())
    http = None
    try:
        if args.metrics_address:
            http = MetricsServer(args.metrics_address, CollectorRegistry(), driver.ready, health).start()
        try:
            driver.start()
        except (NameTaken, OSError) as e:  # the name is another plugin's, or a socket path is not ours
            raise exitcodes.CLIError(str(e), exitcodes.PREREQUISITE) from None
        guard.start()
        stop.wait()
    finally:
        guard.stop()
        driver.stop()
        if guard.reason is not None:  # a device plugin took the node: no claim may get these chips
            driver.publisher.delete()
        facts.stop()
        if http is not None:
            http.stop()
    if guard.reason is not None:
        raise exitcodes.CLIError(guard.reason, exitcodes.PREREQUISITE)
    return exitcodes.OK
