"""``accelnode tpu-selftest``: inside a container given TPU chips by a device plugin, does JAX see
exactly those chips? (docs/device-plugin.md, "Self-test on real TPUs")

It reports the chips the container holds (its ``/dev/vfio/<group>`` or ``/dev/accelN`` nodes,
mapped to host chip indices in PCI order through sysfs), the ``TPU_*`` env it was given, and what
``jax.devices()`` shows; it passes when JAX's TPU devices sit on exactly as many chips as the
container holds and a computation runs on each. With ``--try-visible-chips`` it runs JAX again
with ``TPU_VISIBLE_CHIPS`` set to the positions ``0..n-1`` and to the host indices, the two
recipes GKE's behaviour leaves open (docs/device-plugin.md, "Allocate"). One JSON object on
stdout; exit 0 pass, 1 fail, 3 no JAX.

This file needs only the standard library and JAX: ``--copy-to DIR`` puts it in DIR, so that an
image with JAX but without accelnode runs it as ``python DIR/selftest.py`` (examples/tpu/selftest.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from accelnode.decode import SMALL, decode

VENDOR_GOOGLE = "0x1ae0"
DEVICE_V7X = "0x0076"  # two PCI functions per chip
PASS, FAIL, NO_JAX = 0, 1, 3
# run in a child process: what JAX sees, as JSON
_PROBE = """
import json
try:
    import jax, jax.numpy as jnp
except ImportError as e:
    print(json.dumps({"error": f"no JAX: {e}"})); raise SystemExit(0)
try:
    devs = jax.devices()
    out = {"platform": devs[0].platform if devs else None,
           "devices": [{"id": d.id, "kind": getattr(d, "device_kind", ""),
                        "coords": list(getattr(d, "coords", []) or []), "core": getattr(d, "core_on_chip", None)}
                       for d in devs]}
    out["sums"] = [float(jnp.sum(jax.device_put(jnp.ones(8), d))) for d in devs]
except Exception as e:
    out = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


def held_chips(dev_root: Path, sysfs_root: Path) -> list[dict]:
    """The TPU chips whose device nodes this container holds, with their host index (PCI order).

    A TPU7x chip is two PCI functions; they pair as accelnode.hw.tpu.chips_of pairs them (one
    slot, else consecutive), restated here because this file must run without accelnode."""
    pci = sysfs_root / "bus/pci/devices"
    functions = []
    for bdf in sorted(os.listdir(pci)) if pci.is_dir() else []:
        try:
            if (pci / bdf / "vendor").read_text().strip() != VENDOR_GOOGLE:
                continue
            device = (pci / bdf / "device").read_text().strip()
        except OSError:
            continue
        group = os.path.basename(os.readlink(pci / bdf / "iommu_group")) if (pci / bdf / "iommu_group").is_symlink() \
            else None
        accel = sorted(p.name for p in (pci / bdf / "accel").iterdir()) if (pci / bdf / "accel").is_dir() else []
        nodes = ([dev_root / "vfio" / group] if group else []) + [dev_root / a for a in accel]
        functions.append((bdf, device, nodes))
    host: list[list] = []  # chips: [first bdf, nodes]
    v7x = [f for f in functions if f[1] == DEVICE_V7X]
    by_slot = len({f[0].rpartition(".")[0] for f in v7x}) < len(v7x)
    for n, (bdf, device, nodes) in enumerate(functions):
        partner = host and host[-1][2] == device == DEVICE_V7X and len(host[-1][3]) == 1 and (
            host[-1][0].rpartition(".")[0] == bdf.rpartition(".")[0] if by_slot else True)
        if partner:
            host[-1][1] += nodes
            host[-1][3].append(bdf)
        else:
            host.append([bdf, list(nodes), device, [bdf]])
    held = []
    for index, (bdf, nodes, _, _) in enumerate(host):
        present = [str(n) for n in nodes if n.exists()]
        if present:
            held.append({"host_index": index, "bdf": bdf, "nodes": present})
    return held


def probe(env: dict, timeout: float) -> dict:
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"JAX did not answer within {timeout:g}s"}
    try:
        return decode(out.stdout.strip().splitlines()[-1], SMALL, "the JAX probe's answer")
    except (IndexError, ValueError):
        return {"error": f"exit {out.returncode}: {out.stderr.strip()[-2000:]}"}


def verdict(seen: dict, chips: int) -> str | None:
    """Why ``seen`` (a probe) does not show ``chips`` working TPU chips; None when it does."""
    if "error" in seen:
        return seen["error"]
    if seen.get("platform") != "tpu":
        return f"JAX sees no TPU devices (platform {seen.get('platform')})"
    on = {tuple(d["coords"]) for d in seen["devices"]}
    if len(on) != chips:
        return f"JAX's {len(seen['devices'])} TPU device(s) sit on {len(on)} chip(s); the container holds {chips}"
    if any(s != 8.0 for s in seen.get("sums", [])):
        return f"a computation gave a wrong answer: {seen.get('sums')}"
    return None


def run(args) -> int:
    dev_root, sysfs_root = Path(args.dev_root), Path(args.sysfs_root)
    if args.copy_to:
        Path(args.copy_to).mkdir(parents=True, exist_ok=True)
        shutil.copy(__file__, Path(args.copy_to) / "selftest.py")
        return PASS
    held = held_chips(dev_root, sysfs_root)
    chips = args.expect if args.expect is not None else len(held)
    env = dict(os.environ)
    slice_env = re.compile(r"^(TPU_|HOST_BOUNDS$|CHIPS_PER_HOST_BOUNDS$|WRAP$|ALT$)")
    report = {"expect_chips": chips, "held": held,
              "tpu_env": {k: v for k, v in sorted(env.items()) if slice_env.match(k)}}
    runs = {"as given": env}
    if args.try_visible_chips:
        runs["TPU_VISIBLE_CHIPS=positions"] = {**env, "TPU_VISIBLE_CHIPS": ",".join(map(str, range(len(held))))}
        runs["TPU_VISIBLE_CHIPS=host indices"] = {**env, "TPU_VISIBLE_CHIPS": ",".join(
            str(c["host_index"]) for c in held)}
    report["runs"] = {}
    for name, run_env in runs.items():
        seen = probe(run_env, args.timeout)
        report["runs"][name] = {"jax": seen, "problem": verdict(seen, chips)}
    first = report["runs"]["as given"]
    report["pass"] = first["problem"] is None
    print(json.dumps(report, indent=None if args.compact else 2))
    if first["jax"].get("error", "").startswith("no JAX"):
        return NO_JAX
    return PASS if report["pass"] else FAIL


def parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="selftest.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--expect", type=int, default=None, metavar="N",
                   help="chips this container should hold (default: the TPU device nodes it holds)")
    p.add_argument("--try-visible-chips", action="store_true",
                   help="also run JAX with TPU_VISIBLE_CHIPS = positions 0..n-1 and = host indices, and report each")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long one JAX run may take (default: %(default)s)")
    p.add_argument("--dev-root", default="/dev", help="where device nodes live (default: %(default)s)")
    p.add_argument("--sysfs-root", default="/sys", help="where sysfs is mounted (default: %(default)s)")
    p.add_argument("--compact", action="store_true", help="one line of JSON")
    p.add_argument("--copy-to", metavar="DIR", help="copy this self-test to DIR/selftest.py and exit")
    return p


def register(sub) -> None:
    from accelnode import cli as acli

    p = sub.add_parser("tpu-selftest", help="in a container given TPU chips: check that JAX sees exactly those",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser(p)
    acli.apply_env(p)
    p.set_defaults(func=run)


if __name__ == "__main__":
    sys.exit(run(parser().parse_args()))
