"""TPU node-group benchmark: the real ``accelnode controller --tpu-node-groups`` as a subprocess
(controller identity, daemonsets/rbac-controller*.yaml) against a control plane of its own whose
audit log records every call the controller makes, and the GCE emulator
(tests/rigs/gce.py) in this process. A VM "joins" when the benchmark sees the join token
in its metadata: it registers the Node (with the VM's providerID, Ready) as kubelet would.

1. Provisioning: one BULK group of 64 v6e VMs (ct6e-standard-4t, topology 16x16) from creation
   to ``Ready``: ``provision_cpu_s`` (the controller's CPU seconds), ``api_calls_per_vm`` (its
   API server calls, Lease renewals aside, per VM), ``gce_calls_per_vm``, ``provision_s``.
   The group is then deleted (``teardown_s``).
2. Steady state: 4 groups of 4 VMs each, Ready and settled, then a window of
   ``ACCELNODE_BENCH_STEADY_S`` seconds (default 300; ``--steady-seconds`` when run as a script)
   with the controller's ``--resync`` a third of it: ``steady_gce_writes`` and
   ``steady_api_writes`` (creates/updates/patches/deletes, Lease renewals aside), target 0 each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import psutil

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from bench_controller import CONTROLLER_USER, Audit, resource, wait_established, wait_for  # noqa: E402

from accelnode.kube.client import Client, Config, KubeError, custom_path, is_conflict, is_not_found  # noqa: E402
from tests.rigs import devcluster  # noqa: E402
from tests.rigs.devcluster import ControlPlane  # noqa: E402
from tests.rigs.gce import Server  # noqa: E402
from tests.conftest import ROOT, TOOLS_BIN, accelnode_cmd, tool  # noqa: E402
from tests.csi.conftest import free_ports  # noqa: E402

WRITES = {"create", "update", "patch", "delete", "deletecollection"}
PROJECT, ZONE = "bench-project", "us-east5-b"


def group(name: str, nodes: int, topology: str) -> dict:
    return {"apiVersion": "tpu.google.com/v1alpha1", "kind": "TPUNodeGroup",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"project": PROJECT, "nodeLocation": ZONE, "nodeCount": nodes, "topology": topology,
                     "targetSizePolicyMode": "BULK", "acceleratorConnectionMode": "STATIC",
                     "bootstrapKubernetes": {"version": "1.35", "controlPlaneIP": "10.128.0.2"},
                     "instanceConfig": {"machineType": "ct6e-standard-4t", "provisioningModel": "SPOT"}}}


class Kubelets(threading.Thread):
    """Registers a Node for each emulated VM that has the join token in its metadata."""

    def __init__(self, admin: Client, gce: Server):
        super().__init__(daemon=True, name="kubelets")
        self.admin, self.gce, self.stop = admin, gce, threading.Event()
        self.joined: set[str] = set()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            for inst in self.gce.compute.instances(PROJECT):
                items = {i["key"] for i in inst["metadata"].get("items") or []}
                if inst["name"] in self.joined or "kubeadm-join-token" not in items:
                    continue
                name = inst["name"]
                try:
                    self.admin.request("POST", "/api/v1/nodes", body={
                        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                        "spec": {"providerID": f"gce://{PROJECT}/{ZONE}/{name}"}})
                    node = self.admin.request("GET", f"/api/v1/nodes/{name}")
                    node["status"] = {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                                      "message": "ready", "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                                                      "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
                    self.admin.request("PUT", f"/api/v1/nodes/{name}/status", body=node)
                except KubeError as e:
                    if not is_conflict(e):
                        raise
                self.joined.add(name)


def ready(admin: Client, name: str) -> bool:
    g = admin.request("GET", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", "default", name))
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (g.get("status") or {}).get("conditions") or [])


def gone(admin: Client, name: str) -> bool:
    try:
        admin.request("GET", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", "default", name))
    except KubeError as e:
        return is_not_found(e)
    return False


def controller_calls(audit: Audit, start: int, verbs: set[str] | None = None) -> list[dict]:
    return [e for e in audit.events(start) if e.get("stage") == "ResponseComplete"
            and e["user"]["username"] == CONTROLLER_USER and resource(e) != "leases"
            and (verbs is None or e.get("verb") in verbs)]


def quiet(audit: Audit, gce: Server, still: float = 3.0, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        start, writes = audit.mark(), gce.compute.stats["writes"]
        time.sleep(still)
        if not controller_calls(audit, start, WRITES) and gce.compute.stats["writes"] == writes:
            return
    raise RuntimeError(f"the controller kept writing for {timeout:.0f}s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steady-seconds", type=float, default=float(os.environ.get("ACCELNODE_BENCH_STEADY_S", "300")))
    args = p.parse_args(argv if argv is not None else [])
    with tempfile.TemporaryDirectory(prefix="bench-nodegroup-") as tmp:
        run(Path(tmp), args.steady_seconds)


def run(tmp: Path, steady_s: float) -> None:
    rules = [{"level": "Metadata", "users": [CONTROLLER_USER]}, *devcluster._AUDIT_POLICY["rules"]]
    cp = ControlPlane(tmp / "cp", TOOLS_BIN)
    with mock.patch.dict(devcluster._AUDIT_POLICY, rules=rules):
        cp.start()
    gce = Server().start()
    gce.compute.set_faults(op_delay_s=0.2, boot_s=0.5)
    proc = kubelets = None
    try:
        kubectl = tool("kubectl")
        subprocess.run([kubectl, f"--kubeconfig={cp.kubeconfig('admin')}", "apply", *devcluster.crd_args(),
                        "-f", str(ROOT / "daemonsets/namespace.yaml"),
                        *[a for f in sorted((ROOT / "daemonsets").glob("rbac-controller*.yaml")) for a in ("-f", str(f))]],
                       check=True, capture_output=True)
        admin = Client(Config.from_kubeconfig(cp.kubeconfig("admin")), user_agent="bench")
        audit = Audit(cp.audit_log)
        wait_established(admin)
        (metrics_port,) = free_ports(1)
        log = open(tmp / "controller.log", "ab")
        proc = subprocess.Popen(accelnode_cmd() + [
            "controller", "--kubeconfig", str(cp.kubeconfig("controller")), "--identity", "bench",
            "--namespace", "accelnode-system", "--metrics-address", f"127.0.0.1:{metrics_port}", "--disable-webhooks",
            "--tpu-node-groups", "--gce-endpoint", gce.endpoint, "--gce-project", PROJECT, "--node-group-poll", "1",
            "--resync", str(max(10.0, min(300.0, steady_s / 3)))], cwd=ROOT, stdout=log, stderr=log)
        controller = psutil.Process(proc.pid)
        kubelets = Kubelets(admin, gce)
        kubelets.start()
        time.sleep(3)  # leader election and the first lists

        # 1. provisioning 64 VMs
        start, gce_calls = audit.mark(), gce.compute.stats["requests"]
        cpu0, t0 = sum(controller.cpu_times()[:2]), time.monotonic()
        admin.request("POST", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", "default"),
                      body=group("big", 64, "16x16"))
        wait_for(lambda: ready(admin, "big"), "64 VMs to join", proc, timeout=600)
        provision_s = time.monotonic() - t0
        cpu = sum(controller.cpu_times()[:2]) - cpu0
        calls = controller_calls(audit, start)
        print(f"BENCH nodegroup provision_s={provision_s:.1f} provision_cpu_s={cpu:.2f} "
              f"api_calls_per_vm={len(calls) / 64:.2f} gce_calls_per_vm="
              f"{(gce.compute.stats['requests'] - gce_calls) / 64:.2f}", flush=True)
        t0 = time.monotonic()
        admin.request("DELETE", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", "default", "big"))
        wait_for(lambda: gone(admin, "big"), "the big group to go", proc, timeout=300)
        print(f"BENCH nodegroup teardown_s={time.monotonic() - t0:.1f}", flush=True)

        # 2. steady state: 4 groups x 4 VMs
        for i in range(4):
            admin.request("POST", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", "default"),
                          body=group(f"steady-{i}", 4, "4x4"))
        for i in range(4):
            wait_for(lambda i=i: ready(admin, f"steady-{i}"), f"group steady-{i}", proc, timeout=300)
        quiet(audit, gce)
        start, writes = audit.mark(), gce.compute.stats["writes"]
        time.sleep(steady_s)
        api_writes = controller_calls(audit, start, WRITES)
        print(f"BENCH nodegroup steady_window_s={steady_s:.0f} steady_gce_writes={gce.compute.stats['writes'] - writes} "
              f"steady_api_writes={len(api_writes)} target_steady_gce_writes<=0 target_steady_api_writes<=0", flush=True)
        if api_writes:
            print("# writes: " + ", ".join(sorted({f"{e['verb']} {resource(e)}" for e in api_writes})), flush=True)
    finally:
        if kubelets is not None:
            kubelets.stop.set()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        gce.stop()
        cp.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
