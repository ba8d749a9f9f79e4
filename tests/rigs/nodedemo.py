"""``make demo``: the whole node path as a newcomer sees it, on this machine, then nothing left.

Step by step: the accelnode image built here without a container engine; a local control plane
(etcd, kube-apiserver, kube-controller-manager, kube-scheduler); a simulated v5e-4 TPU host;
containerd 2 + runc and a real kubelet; ``kubectl apply -k daemonsets/`` (through an overlay that fits
it to this loopback node); a kernel cache pushed to a local registry (Debian's docker-registry) and
named by a GKMCache; a workload pod asking for ``google.com/tpu: 2`` with that cache mounted, which
reports from inside what it got. Everything lives in a temporary directory and is removed at the
end, kubelet's changes to the host put back. Needs root and the tools of ``make tools``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from accelnode import exitcodes

ROOT = Path(__file__).resolve().parents[2]
NS = "demo"
LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice", "cloud.google.com/gke-tpu-topology": "2x2",
          "cloud.google.com/gke-accelerator-count": "4"}


def say(title: str) -> None:
    print(f"\n== {title}", flush=True)


class Demo:
    def __init__(self, workdir: Path, tools_bin: Path, *, kubelet_verbosity: int = 1):
        self.workdir, self.tools_bin = workdir, tools_bin
        self.kubelet_verbosity = kubelet_verbosity
        self.cp = self.node = self.registry = None
        self.reg_host = ""
        self.timings: dict[str, float] = {}

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        out = subprocess.run([str(self.tools_bin / "kubectl"), f"--kubeconfig={self.cp.kubeconfig('admin')}", *args],
                             input=stdin, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args[:3])}: {out.stderr.strip()}")
        return out.stdout

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def wait(self, predicate, what: str, timeout: float = 180.0):
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.5)
        return value

    def start_registry(self) -> str:
        from tests.rigs.devcluster import free_port

        port = free_port()
        cfg = self.workdir / "registry.yml"
        cfg.write_text(json.dumps({"version": 0.1, "log": {"level": "warn"}, "http": {"addr": f"127.0.0.1:{port}"},
                                   "storage": {"filesystem": {"rootdirectory": str(self.workdir / "registry")}}}))
        log = open(self.workdir / "registry.log", "ab")
        self.registry = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=log, stderr=log)
        self.wait(lambda: _answers(f"http://127.0.0.1:{port}/v2/"), "the registry", 30)
        return f"127.0.0.1:{port}"

    def run(self) -> None:
        self.up()
        self.workload()

    def up(self) -> None:
        """Steps 1-5: image, control plane, simulated host, node, the suite applied and Ready."""
        from tests.rigs import image as images
        from tests.rigs.devcluster import ControlPlane
        from tests.rigs.node import Node, write_overlay
        from tests.rigs.simhost import SimHost

        say("1. the accelnode image, built without a container engine (mmdebstrap + the wheel -> OCI archive)")
        t0 = time.monotonic()
        image = images.build(log=lambda m: print(f"   {m}", flush=True))
        print(f"   {image.name}: {image.archive} ({image.archive.stat().st_size >> 20} MiB, "
              f"{time.monotonic() - t0:.0f}s; cached by a hash of its inputs)")

        say("2. a local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler on loopback")
        self.cp = ControlPlane(self.workdir / "cp", self.tools_bin, kubelets=True)
        self.cp.start()
        print(f"   API server {self.cp.url}; kubeconfig {self.cp.kubeconfig('admin')}")

        say("3. a simulated TPU host (v5e-4): sysfs tree and real device nodes")
        host = SimHost.preset(self.workdir / "host", "v5e-4")
        print(f"   chips {', '.join(host.chips())} under {host.root}")

        say("4. the node: containerd 2 (built here) + runc and CNI (Debian), kubelet, our image imported with `ctr images import`")
        t0 = time.monotonic()
        self.node = Node(self.workdir / "node", self.tools_bin, self.cp, labels=LABELS,
                         log=lambda m: print(f"   {m}", flush=True), verbosity=self.kubelet_verbosity)
        self.node.start([image])
        print(f"   Node {self.node.name} Ready in {time.monotonic() - t0:.0f}s")

        say("5. kubectl apply -k daemonsets/crds/, then daemonsets/ (an overlay fits it to this loopback node and the simulated host)")
        overlay = self.workdir / "overlay"
        overlay.mkdir()
        base_docs = [d for d in yaml.safe_load_all(subprocess.run(
            [str(self.tools_bin / "kubectl"), "kustomize", str(ROOT / "daemonsets")], capture_output=True, text=True,
            check=True).stdout) if d]
        write_overlay(overlay, ROOT / "daemonsets", self.node, sysfs_root=host.sysfs_root, dev_root=host.dev_root,
                      api_port=self.cp.port, accelerator_type="v5litepod-4", topology="2x2", base_docs=base_docs)
        t0 = time.monotonic()
        applied = self.kubectl("apply", "--server-side", "-k", str(ROOT / "daemonsets" / "crds"))
        applied += self.kubectl("apply", "--server-side", "-k", str(overlay))
        print("   " + "\n   ".join(applied.splitlines()))
        want = {"accelnode-tpu-device-plugin", "accelnode-csi-node", "accelnode-controller"}
        self.wait(lambda: want <= {p["metadata"]["labels"].get("app.kubernetes.io/name")
                                   for p in self.get("pods", "-n", "accelnode-system")["items"] if _ready(p)},
                  "the accelnode pods Ready")
        print(f"   every accelnode pod Ready in {time.monotonic() - t0:.0f}s:")
        print("   " + "\n   ".join(self.kubectl("get", "pods", "-n", "accelnode-system").splitlines()))
        self.timings["suite_ready_s"] = time.monotonic() - t0
        node = self.get("node", self.node.name)
        print(f"   node capacity google.com/tpu={node['status']['capacity'].get('google.com/tpu')}")

    def workload(self) -> None:
        """Steps 6-7: a cache in the registry, a GKMCache, a pod with chips and the cache."""
        from tests.rigs.node import inline, workload

        say("6. a kernel cache: built with `accelnode cache build`, pushed to a local registry, named by a GKMCache")
        reg = self.reg_host = self.reg_host or self.start_registry()
        src = self.workdir / "cache-src"
        (src / "xla").mkdir(parents=True)
        (src / "xla" / "module-1.bin").write_bytes(b"\x7fXLA" * 4096)
        ref = f"{reg}/demo/jax-v5e:v1"
        subprocess.run([sys.executable, "-m", "accelnode", "cache", "build", str(src), ref, "--kind", "jax",
                        "--target", "backend=tpu,arch=v5e", "--plain-http", "--log-format", "text"], check=True,
                       capture_output=True)
        self.kubectl("create", "namespace", NS)
        self.wait(lambda: subprocess.run([str(self.tools_bin / "kubectl"), f"--kubeconfig={self.cp.kubeconfig('admin')}",
                                          "get", "sa", "default", "-n", NS], capture_output=True).returncode == 0,
                  "the namespace's ServiceAccount", 30)
        cache = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": "jax-v5e", "namespace": NS},
                 "spec": {"image": ref}}
        self.kubectl("apply", "-f", "-", stdin=json.dumps(cache))
        digest = self.wait(lambda: self.get("gkmcache", "jax-v5e", "-n", NS).get("status", {}).get("resolvedDigest"),
                           "the controller to pin the cache")
        print(f"   GKMCache {NS}/jax-v5e -> {ref}, pinned by the controller to {digest}")

        say("7. a workload pod: google.com/tpu: 2 and the cache mounted through csi.gkm.io")
        t0 = time.monotonic()
        self.kubectl("apply", "-f", "-", stdin=json.dumps(workload("worker", NS, inline("jax-v5e", NS))))
        phase = self.wait(lambda: self.get("pod", "worker", "-n", NS)["status"].get("phase") in ("Succeeded", "Failed")
                          and self.get("pod", "worker", "-n", NS)["status"]["phase"], "the workload to finish")
        got = json.loads(self.node.pod_log(NS, "worker", "worker").strip().splitlines()[-1])
        print(f"   pod {phase} after {time.monotonic() - t0:.0f}s; from inside it saw:")
        print(f"   devices   {' '.join(got['devices'])}")
        for k, v in sorted(got["tpu_env"].items()):
            print(f"   env       {k}={v}")
        for name in sorted(got["files"]):
            print(f"   cache     /caches/jax/{name}")
        print(f"   read-only {got['read_only']} (a write failed with EROFS)")
        if phase != "Succeeded":
            raise RuntimeError("the workload pod failed")

    def stop(self) -> None:
        if self.node is not None:
            try:
                self.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=60s")
            except Exception:  # noqa: BLE001 - teardown goes on whatever happened
                pass
            self.node.stop()
        if self.registry is not None:
            self.registry.terminate()
            self.registry.wait(10)
        if self.cp is not None:
            self.cp.stop()


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.rigs.nodedemo", description=__doc__.splitlines()[0])
    ap.add_argument("--tools-bin", type=Path, default=Path(os.environ.get("ACCELNODE_TOOLS_BIN", ROOT / ".tools/bin")))
    args = ap.parse_args(argv)
    from tests.rigs.node import prerequisites

    missing = prerequisites(args.tools_bin) + [f"{t} in {args.tools_bin} (make tools)" for t in
                                               ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                                                "kubectl") if not (args.tools_bin / t).exists()]
    if not shutil.which("docker-registry"):
        missing.append("docker-registry (Debian package docker-registry)")
    if missing:
        print("demo: missing: " + "; ".join(missing), file=sys.stderr)
        return exitcodes.PREREQUISITE
    workdir = Path(tempfile.mkdtemp(prefix="accelnode-demo-"))
    demo = Demo(workdir, args.tools_bin)
    try:
        demo.run()
        return exitcodes.OK
    except Exception as e:  # noqa: BLE001 - a demo says what failed and cleans up
        print(f"\ndemo: {e}", file=sys.stderr)
        if demo.node is not None:
            print(demo.node.logs(), file=sys.stderr)
        return exitcodes.FAILURE
    finally:
        say("cleaning up: pods, containers, kubelet, containerd, control plane, registry")
        demo.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"   removed {workdir}; kubelet's sysctls and /var/lib/kubelet/device-plugins put back", flush=True)


if __name__ == "__main__":
    sys.exit(main())
