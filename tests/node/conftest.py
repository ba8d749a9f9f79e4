"""The node as users run it: a real kubelet with containerd 2 + runc (tests/rigs/node.py),
its own control plane (Node authorizer, ServiceAccount admission), the accelnode image built here
(tests/rigs/image.py) and ``daemonsets/`` applied with ``kubectl apply -k`` through an
overlay that fits it to the loopback node and a simulated v5e-4 TPU host.

``deployed`` (package scope: one node for every test here) is that node with every accelnode pod
Ready; it is torn down (pods, containers, mounts, kubelet's changes to the host) at the end.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, TOOLS_BIN, require

BASE = ROOT / "daemonsets"
SYSTEM = "accelnode-system"
TPU = "google.com/tpu"
NODE_LABELS = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
               "cloud.google.com/gke-tpu-topology": "2x2", "cloud.google.com/gke-accelerator-count": "4"}


@dataclass
class Deployed:
    cp: object
    node: object
    host: object
    registry: object
    ports: dict
    workdir: Path
    log: list = field(default_factory=list)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([str(TOOLS_BIN / "kubectl"), f"--kubeconfig={self.cp.kubeconfig('admin')}", *args],
                             input=stdin, capture_output=True, text=True, timeout=120)
        if check:
            assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
        return out

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def claim_phase(self, name: str, namespace: str) -> str | None:
        """The PVC's phase; None while the controller has not made it yet."""
        out = self.kubectl("get", "pvc", name, "-n", namespace, "-o", "json", check=False)
        if out.returncode != 0:
            assert "NotFound" in out.stderr, out.stderr
            return None
        return json.loads(out.stdout)["status"].get("phase")

    def apply(self, *docs: dict) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))

    def wait(self, predicate, what: str, timeout: float = 120.0, interval: float = 0.5):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {value!r})\n"
                                     f"{self.diagnose()}")
            time.sleep(interval)

    def pods(self, namespace: str = SYSTEM, selector: str = "") -> list[dict]:
        return self.get("pods", "-n", namespace, *(["-l", selector] if selector else []))["items"]

    def ready(self, pod: dict) -> bool:
        return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))

    def system_ready(self) -> bool:
        pods = self.pods()
        names = {p["metadata"]["labels"].get("app.kubernetes.io/name") for p in pods if self.ready(p)}
        return {"accelnode-tpu-device-plugin", "accelnode-csi-node", "accelnode-controller"} <= names

    def events(self, namespace: str, name: str) -> list[str]:
        items = self.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")["items"]
        return [f"{e.get('reason')}: {e.get('message')}" for e in items]

    def allocatable(self) -> int:
        return int(self.get("node", self.node.name)["status"].get("allocatable", {}).get(TPU, "0"))

    def diagnose(self) -> str:
        from tests.rigs.devcluster import _tail

        out = [self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout,
               self.kubectl("get", "events", "-A", check=False).stdout[-3000:]]
        for name in ("kube-scheduler.log", "kube-controller-manager.log"):
            out.append(f"--- {name}\n" + _tail(self.cp.workdir / name, 15))
        for p in self.pods():
            for c in p["spec"]["containers"]:
                out.append(f"--- {p['metadata']['name']}/{c['name']}\n"
                           + "\n".join(self.node.pod_log(SYSTEM, p["metadata"]["name"], c["name"]).splitlines()[-15:]))
        out.append(self.node.logs())
        return "\n".join(out)


def _build(path: Path) -> list[dict]:
    out = subprocess.run([str(TOOLS_BIN / "kubectl"), "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@contextlib.contextmanager
def lane(workdir: Path, registry):
    """A control plane and the loopback node with our image, nothing of ours applied yet: a
    :class:`Deployed` with empty ports (the installer fills them); stopped at the end."""
    from tests.rigs import image as images
    from tests.rigs.devcluster import ControlPlane
    from tests.rigs.node import Node, prerequisites
    from tests.rigs.simhost import SimHost

    for what in prerequisites(TOOLS_BIN):
        require(False, what)
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"):
        require((TOOLS_BIN / name).exists(), f"{name} in {TOOLS_BIN} (tools/mk/k8s.mk)")
    image = images.build(log=lambda m: None)
    cp = ControlPlane(workdir / "cp", TOOLS_BIN, kubelets=True)
    cp.start()
    node = None
    try:
        host = SimHost.preset(workdir / "host", "v5e-4")
        node = Node(workdir / "n", TOOLS_BIN, cp, labels=NODE_LABELS)
        node.start([image])
        yield Deployed(cp, node, host, registry, {}, workdir)
    finally:
        if node is not None:
            node.stop()
        cp.stop()


def fit(world: Deployed, overlay: Path, base: Path, base_docs: list[dict]) -> None:
    """``overlay``: a kustomization over ``base`` fitting it to the lane (tests/rigs/node.py)."""
    from tests.rigs.node import write_overlay

    overlay.mkdir(exist_ok=True)
    world.ports = write_overlay(overlay, base, world.node, sysfs_root=world.host.sysfs_root,
                                dev_root=world.host.dev_root, api_port=world.cp.port, accelerator_type="v5litepod-4",
                                topology="2x2", base_docs=base_docs,
                                capture_repositories={"*": [f"{world.registry.host}/"]})  # docs/capture.md


@pytest.fixture(scope="package")
def deployed(tmp_path_factory, registry):
    with lane(tmp_path_factory.mktemp("node"), registry) as world:
        overlay = world.workdir / "overlay"
        fit(world, overlay, BASE, _build(BASE))
        world.kubectl("apply", "--server-side", "-k", str(BASE / "crds"))  # as docs/operations.md installs
        world.kubectl("apply", "--server-side", "-k", str(overlay))
        world.wait(world.system_ready, "every accelnode pod Ready on the real kubelet", timeout=180)
        yield world
        _teardown(world)


def _teardown(world: Deployed) -> None:
    """Workloads first, while the CSI driver still runs to unpublish their volumes."""
    nss = [n["metadata"]["name"] for n in world.get("namespaces")["items"] if n["metadata"]["name"].startswith("e2e-")]
    for ns in nss:
        world.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=1", "--wait=false", check=False)
    try:
        world.wait(lambda: not any(world.pods(ns) for ns in nss), "workload pods gone", timeout=60)
    except AssertionError:
        pass
