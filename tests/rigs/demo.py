"""``make demo-plugin``: the device plugin on a simulated TPU host, and what kubelet sees of it.

Builds a simulated host (v5e-4 unless ``--preset`` says otherwise) in a temporary directory,
starts the real ``accelnode device-plugin`` against it with a kubelet harness in a temporary
device-plugins directory, and prints: the registration request, the device list with health and
NUMA node, a chip going Unhealthy and recovering, a kubelet restart, a preferred allocation and
an Allocate response. Then it stops everything and removes the directory. Needs root (the
simulated host has real device nodes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from accelnode import exitcodes

TPU = "google.com/tpu"


def say(title: str) -> None:
    print(f"\n== {title}", flush=True)


def show_devices(devices) -> None:
    for dev_id, d in sorted(devices.items()):
        numa = ",".join(map(str, d.numa_nodes)) or "-"
        print(f"   {dev_id:22} {d.health:9} numa={numa}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.rigs.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="v5e-4", help="simulated host, <generation>-<chips> (default: %(default)s)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("demo: needs root: the simulated TPU host has real character device nodes (mknod). "
              "Run it as root, e.g. `sudo make demo`.", file=sys.stderr)
        return exitcodes.PREREQUISITE
    from .kubelet_harness import KubeletHarness
    from .simhost import SimHost

    with tempfile.TemporaryDirectory(prefix="accelnode-demo-") as td:
        try:
            host = SimHost.preset(Path(td) / "host", args.preset)
        except ValueError as e:
            print(f"demo: {e}", file=sys.stderr)
            return exitcodes.USAGE
        kubelet = KubeletHarness(Path(td) / "device-plugins").start()
        log = open(Path(td) / "plugin.log", "wb")
        cmd = [sys.executable, "-m", "accelnode", "device-plugin", "--sysfs-root", str(host.sysfs_root),
               "--dev-root", str(host.dev_root), "--kubelet-dir", str(kubelet.dir), "--metrics-address", "",
               "--log-format", "text"]
        print(f"simulated {args.preset} host under {td}/host; kubelet harness on {kubelet.dir}/kubelet.sock")
        print("starting: accelnode device-plugin --sysfs-root …/sys --dev-root …/dev --kubelet-dir …/device-plugins")
        plugin = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            return run(host, kubelet, plugin)
        finally:
            if plugin.poll() is None:
                plugin.terminate()
            code = plugin.wait(10)
            kubelet.stop()
            log.close()
            print(f"\nplugin stopped (exit {code}); removed {td}")


def run(host, kubelet, plugin) -> int:
    n = len(host.chips())
    devices = kubelet.wait(lambda k: len(k.devices()) == n and k.devices(), what="the chip list")
    _, req = kubelet.registrations[-1]
    say("kubelet received Register")
    print(f"   version={req.version} resource={req.resource_name} endpoint={req.endpoint} "
          f"preferred_allocation={req.options.get_preferred_allocation_available}")
    say("ListAndWatch: the devices kubelet now offers to the scheduler")
    show_devices(devices)

    bdf = host.chips()[1]
    dev_id = f"tpu-{bdf}"
    say(f"chip {dev_id} falls off the bus (its PCI vendor now reads 0xffff)")
    t0 = time.monotonic()
    host.set_vendor(bdf, 0xFFFF)
    kubelet.wait(lambda k: k.devices()[dev_id].health == "Unhealthy", what="the unhealthy chip")
    print(f"   kubelet saw it in {(time.monotonic() - t0) * 1000:.0f} ms, on the same stream:")
    show_devices(kubelet.devices())
    host.set_vendor(bdf, 0x1AE0)
    kubelet.wait(lambda k: k.devices()[dev_id].health == "Healthy", what="the recovered chip")
    print("   ...and recovered:")
    show_devices(kubelet.devices())

    say("kubelet restarts (sockets wiped, kubelet.sock recreated)")
    t0 = time.monotonic()
    kubelet.restart()
    kubelet.wait(lambda k: len(k.devices()) == n, what="re-registration")
    print(f"   plugin re-registered and re-listed {n} chips in {(time.monotonic() - t0) * 1000:.0f} ms")

    ids = sorted(kubelet.devices())
    size = min(2, n)
    chosen = kubelet.preferred(ids, [], size)
    say(f"GetPreferredAllocation of {size} from {len(ids)} chips")
    print(f"   {chosen}  (an ICI-neighbour block on one NUMA node)")
    resp = kubelet.allocate(chosen)
    say(f"Allocate {chosen}")
    for d in resp.devices:
        print(f"   device {d.container_path:16} <- {d.host_path} ({d.permissions})")
    for k, v in sorted(resp.envs.items()):
        print(f"   env    {k}={v}")
    if plugin.poll() is not None:
        print(f"demo: the plugin exited early with {plugin.returncode}", file=sys.stderr)
        return exitcodes.FAILURE
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
