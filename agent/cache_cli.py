"""``accelnode cache build|push|pull|inspect|verify|gc``: the operator tool for cache images."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from accelnode import exitcodes
from accelnode.cli import add_common, apply_env
from accelnode.oci.flags import add_registry_flags, registry_options


def _target(text: str) -> dict:
    """``backend=tpu,arch=v5e[,warp_size=32]`` -> dict."""
    try:
        return dict(kv.split("=", 1) for kv in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}") from None


def _label(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return tuple(text.split("=", 1))


def register(sub) -> None:
    p = sub.add_parser("cache", help="build, push, pull, inspect, verify and collect kernel-cache images",
                       description="Kernel-cache images (Triton, vLLM, JAX/XLA) and the node's cache store.")
    actions = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    def action(name, help, func, *, store=False, registry=True):
        a = actions.add_parser(name, help=help, description=help)
        if store:
            a.add_argument("--store", required=True, metavar="DIR", help="the cache store directory")
        if registry:
            add_registry_flags(a.add_argument_group("registry"))
        a.set_defaults(func=func)
        return a

    b = action("build", "package a cache directory as an OCI image and push it", _build)
    b.add_argument("dir", metavar="DIR", help="an image root (io.<kind>.cache/ inside) or, with --kind, a bare cache")
    b.add_argument("image", metavar="IMAGE", help="HOST[:PORT]/REPO[:TAG] to push to")
    _build_flags(b)

    pu = action("push", "re-package a cache installed in the store and push it to another reference", _push,
                store=True)
    pu.add_argument("digest", metavar="DIGEST", help="installed manifest digest (sha256:...)")
    pu.add_argument("image", metavar="IMAGE", help="HOST[:PORT]/REPO[:TAG] to push to")
    _build_flags(pu, kind=False)

    pl = action("pull", "pull, verify and install an image into the store; prints its digest and path", _pull,
                store=True)
    pl.add_argument("image", metavar="IMAGE")
    pl.add_argument("--accelerator", type=_target, action="append", metavar="backend=B,arch=A",
                    help="this node's accelerator (repeatable); picks the manifest of an image index")
    pl.add_argument("--json", action="store_true", help="print the result as JSON")

    i = action("inspect", "show an image's kind, targets, size and digest without pulling its layers", _inspect)
    i.add_argument("image", metavar="IMAGE")
    i.add_argument("--json", action="store_true", help="print JSON")

    v = action("verify", "re-check installed content against the digests recorded at install", _verify,
               store=True, registry=False)
    v.add_argument("digest", nargs="?", metavar="DIGEST", help="one installed digest (default: all)")

    g = action("gc", "remove unreferenced caches, least recently used first", _gc, store=True, registry=False)
    g.add_argument("--max-bytes", type=int, metavar="N", help="stop once at most N bytes remain (default: remove all)")

    for a in actions.choices.values():
        add_common(a)
        apply_env(a)


def _build_flags(p, *, kind=True) -> None:
    if kind:
        p.add_argument("--kind", choices=["triton", "vllm", "jax"],
                       help="kind of a bare cache directory (a TRITON_CACHE_DIR is recognised without it)")
    p.add_argument("--target", type=_target, action="append", default=[], metavar="backend=B,arch=A",
                   help="add a target to the summary label (repeatable; needed for JAX caches)")
    p.add_argument("--label", type=_label, action="append", default=[], metavar="KEY=VALUE",
                   help="extra config label (repeatable)")
    p.add_argument("--layers", type=int, default=1, help="number of layers to spread files over (default: 1)")
    p.add_argument("--compression", choices=["gzip", "zstd", "none"], default="gzip",
                   help="layer compression: gzip (read by every runtime), zstd (smaller, unpacked several times "
                        "faster by our agent; containerd 2 reads it too) or none (default: %(default)s)")
    p.add_argument("--pod-path", metavar="PATH",
                   help="where pods will see io.<kind>.cache, i.e. their TRITON_CACHE_DIR or VLLM_CACHE_ROOT "
                        "(default: /cache/io.<kind>.cache); Triton's group files are rewritten to it")


def _errors(fn):
    """Run ``fn`` mapping store errors to one-line CLI errors with the right exit code."""
    from accelnode.oci import errors
    from accelnode.oci.build import BuildError
    from accelnode.oci.hosts import HostsConfigError

    try:
        return fn()
    except HostsConfigError as e:  # the --hosts-dir the command was given is unusable: no peer is at fault
        raise exitcodes.CLIError(str(e), exitcodes.USAGE) from None
    except errors.RegistryUnavailable as e:
        raise exitcodes.CLIError(str(e), exitcodes.UNAVAILABLE) from None
    except errors.InvalidReference as e:
        raise exitcodes.CLIError(str(e), exitcodes.USAGE) from None
    except (errors.ImageError, BuildError) as e:
        raise exitcodes.CLIError(f"{type(e).__name__}: {e}") from None
    except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
        raise exitcodes.CLIError(str(e), exitcodes.PREREQUISITE) from None


def _progress():
    from .progress import Progress

    return Progress(sys.stderr)


def _store(args, *, create: bool = False):
    """The store at --store; only ``pull`` (``create``) may make a new one: the other actions on a
    directory that is not a store fail rather than create an empty one and report it clean."""
    from .store import CacheStore

    if not create and not (Path(args.store) / "caches").is_dir():
        raise exitcodes.CLIError(f"--store {args.store}: not a cache store (no caches/ directory; `accelnode cache "
                                 "pull` creates one)", exitcodes.PREREQUISITE)
    return CacheStore(args.store, registry=registry_options(args) if hasattr(args, "plain_http") else None)


def _build(args) -> int:
    from accelnode.oci.build import build

    built = _errors(lambda: build(args.dir, args.image, options=registry_options(args), kind=args.kind,
                                  targets=args.target, labels=dict(args.label), layers=args.layers,
                                  compression=args.compression, progress=_progress(), pod_path=args.pod_path))
    print(built.reference)
    return exitcodes.OK


def _push(args) -> int:
    from accelnode.oci.build import build

    def go():
        inst = _store(args).installed(args.digest)
        if inst is None:
            raise exitcodes.CLIError(f"{args.digest}: not installed in {args.store}")
        return build(inst.path, args.image, options=registry_options(args), labels={**inst.labels, **dict(args.label)},
                     targets=args.target, layers=args.layers, compression=args.compression, progress=_progress(),
                     pod_path=args.pod_path)

    print(_errors(go).reference)
    return exitcodes.OK


def _pull(args) -> int:
    inst = _errors(lambda: _store(args, create=True).ensure(args.image, accelerators=args.accelerator,
                                                            progress=_progress()))
    if args.json:
        print(json.dumps(_installed_json(inst), indent=2))
    else:
        print(f"{inst.digest} {inst.path}")
    return exitcodes.OK


def _installed_json(inst) -> dict:
    return {"digest": inst.digest, "path": str(inst.path), "image": inst.image, "kind": inst.kind,
            "targets": inst.targets, "size_bytes": inst.size_bytes, "labels": inst.labels}


def _inspect(args) -> int:
    from accelnode.oci.manifest import inspect

    info = _errors(lambda: inspect(args.image, registry_options(args)))
    if args.json:
        print(json.dumps(info, indent=2))
        return exitcodes.OK
    for m in info["manifests"]:
        print(f"image:   {info['image']}")
        print(f"digest:  {m['digest']}" + (f"  (in index {info['index']})" if info.get("index") else ""))
        print(f"kind:    {m['kind'] or 'unknown (not a kernel-cache image)'}")
        print("targets: " + (", ".join(_fmt_target(t) for t in m["targets"]) or "none recorded"))
        print(f"size:    {m['size_bytes']} bytes in {m['layers']} layer(s), {m['compressed_bytes']} compressed")
        for k, v in sorted(m["labels"].items()):
            print(f"label:   {k}={v}")
    return exitcodes.OK


def _fmt_target(t: dict) -> str:
    return "/".join(str(t[k]) for k in ("backend", "arch", "warp_size") if k in t)


def _verify(args) -> int:
    problems = _errors(lambda: _store(args).verify(args.digest))
    for p in problems:
        print(p)
    if problems:
        raise exitcodes.CLIError(f"{len(problems)} problem(s) found")
    print("ok")
    return exitcodes.OK


def _gc(args) -> int:
    for digest in _errors(lambda: _store(args).gc(args.max_bytes)):
        print(f"removed {digest}")
    return exitcodes.OK
