"""``accelnode bootstrap``: join this VM to the cluster with the token the controller puts into
its metadata (docs/bootstrap.md)."""

from __future__ import annotations

import argparse
import os
import shutil

from accelnode import cli as acli
from accelnode import exitcodes


EXIT_HELP = """exit codes:
  0    joined (with --dry-run: kubeadm's dry run succeeded)
  1    refused or failed: the cluster's CA does not match kubeadm-ca-hash, malformed metadata, cluster-info
       not signed for the token, or kubeadm join failed every attempt (the message says which)
  2    bad usage
  3    kubeadm not found
  4    the metadata server or API server unreachable, or no token within --wait-timeout
  130  interrupted"""


def _positive(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _attempts(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def register(sub) -> None:
    p = sub.add_parser(
        "bootstrap", help="wait for the join token in the VM's metadata, verify the cluster, kubeadm join",
        description=__doc__ + "\n\n" + EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metadata-host", default=None, metavar="HOST[:PORT]",
                   help="the metadata server (default: $GCE_METADATA_HOST, else 169.254.169.254)")
    p.add_argument("--kubeadm", default="kubeadm", metavar="PATH", help="the kubeadm binary (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="run kubeadm join (and reset) with --dry-run: discovery and TLS bootstrap against the real "
                        "API server, no change to this host")
    p.add_argument("--wait-timeout", type=_positive, default=None, metavar="SECONDS",
                   help="give up when no (new) token appears in the metadata within this long (default: wait "
                        "forever)")
    p.add_argument("--metadata-timeout", type=_positive, default=120.0, metavar="SECONDS",
                   help="how long the metadata server may be unreachable at start (the VM's network coming up) "
                        "before giving up (default: %(default)s)")
    p.add_argument("--discovery-timeout", type=_positive, default=60.0, metavar="SECONDS",
                   help="how long cluster-info may lack the token's signature before the token counts as unknown "
                        "(default: %(default)s)")
    p.add_argument("--attempts", type=_attempts, default=3, metavar="N",
                   help="kubeadm join attempts, kubeadm reset -f between them (default: %(default)s)")
    p.add_argument("--backoff", type=_positive, default=15.0, metavar="SECONDS",
                   help="wait before the second attempt, doubling up to 120 s (default: %(default)s)")
    p.add_argument("--node-name", default=None, help="the Node's name (default: the metadata's instance/name)")
    p.add_argument("--provider-id", default=None,
                   help="the kubelet's provider ID (default: gce://<project-id>/<zone>/<instance name> from the "
                        "metadata)")
    p.add_argument("--ignore-preflight-errors", action="append", default=[], metavar="CHECK",
                   help="kubeadm preflight checks to ignore (repeatable; 'all' ignores every one)")
    p.add_argument("--cri-socket", default=None, help="the container runtime's socket, when kubeadm cannot tell")
    p.add_argument("--patches", default=None, metavar="DIR",
                   help="kubeadm patches for this node (JoinConfiguration patches.directory), e.g. "
                        "kubeletconfiguration+merge.yaml to adjust the cluster's KubeletConfiguration here")
    acli.add_common(p)
    acli.apply_env(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging
    import signal

    from accelnode.gce.metadata import Metadata, MetadataError
    from accelnode.log import kv

    from bootstrap.poller import (BadMetadata, BootstrapError, CAMismatch, Joiner, ServerUnreachable, TokenNotSigned,
                            discover, join_configuration, provider_id, read_retrying, wait_for_join_values)

    log = logging.getLogger("accelnode.bootstrap")

    def on_term(signum, _frame):  # systemctl stop: unwind, so the token's file and kubeadm go too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    if args.patches is not None and not os.path.isdir(args.patches):
        raise exitcodes.CLIError(f"--patches {args.patches}: not a directory", exitcodes.USAGE)
    kubeadm = shutil.which(args.kubeadm)
    if kubeadm is None:
        raise exitcodes.CLIError(f"kubeadm not found ({args.kubeadm}): install it or pass --kubeadm PATH",
                                 exitcodes.PREREQUISITE)
    try:
        md = Metadata(args.metadata_host)
    except ValueError as e:
        raise exitcodes.CLIError(str(e), exitcodes.USAGE) from None
    try:
        name = args.node_name or read_retrying(md, "instance/name", args.metadata_timeout)
        provider = args.provider_id or provider_id(read_retrying(md, "project/project-id", args.metadata_timeout),
                                                   read_retrying(md, "instance/zone", args.metadata_timeout), name)
    except MetadataError as e:
        raise exitcodes.CLIError(f"reading this instance's name, zone and project from the metadata server: {e}",
                                 exitcodes.UNAVAILABLE) from None
    skip = None
    try:
        while True:
            values = wait_for_join_values(md, timeout=args.wait_timeout, skip_token=skip)
            try:
                discover(values, timeout=args.discovery_timeout)
                break
            except TokenNotSigned as e:
                # an expired or revoked token: the controller writes a new one; wait for it
                log.error(str(e) + "; waiting for a new token in the metadata", extra=kv(
                    bootstrap_id=values.token_id))
                skip = values.token
        config = join_configuration(values, node_name=name, provider=provider,
                                    ignore_preflight_errors=args.ignore_preflight_errors, cri_socket=args.cri_socket,
                                    patches=os.path.abspath(args.patches) if args.patches else None)
        Joiner(kubeadm, attempts=args.attempts, backoff_s=args.backoff, dry_run=args.dry_run).join(values, config)
    except CAMismatch as e:
        log.critical(str(e))
        raise exitcodes.CLIError(str(e), exitcodes.FAILURE) from None
    except ServerUnreachable as e:
        raise exitcodes.CLIError(str(e), exitcodes.UNAVAILABLE) from None
    except (BadMetadata, BootstrapError) as e:
        raise exitcodes.CLIError(str(e), exitcodes.FAILURE) from None
    finally:
        md.close()
    log.info("joined" if not args.dry_run else "join dry run succeeded",
             extra=kv(node=name, provider_id=provider))
    return exitcodes.OK
