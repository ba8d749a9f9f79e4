"""The node-group fault battery (issue 25.4): a real ``accelnode controller`` process against the
real API server and the GCE emulator (tests/rigs/gce.py), killed at every GCE write it makes,
with API errors (429, 500, 503), operations that fail late and quota errors. Each run ends
with every group Ready or failed with a reason, and once the groups are deleted nothing is left
in GCE, no join token and no Node.

A Node is registered for each VM that was offered the join, as kubelet would register it
(tests/e2e/test_nodegroup_join.py runs the real join)."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid

from pathlib import Path

import pytest

from accelnode.kube.client import Client, KubeError, custom_path
from tests.controller.test_nodegroups import (RULES, SINGLE, _register, cond, get, group_secrets, metadata, tng_path,
                                              wait)
from tests.crds.test_crds import example
from tests.rigs.gce import Server

ZONE = "us-central1-c"


@pytest.fixture(scope="module")
def rbac(crds, kubectl, controller_rbac):
    out = kubectl("admin", "apply", *[a for f in ("rbac-controller-caches", "rbac-controller-claims",
                                                  "rbac-controller-tpuenv", "rbac-controller-nodegroups",
                                                  "rbac-controller-jointokens")
                                      for a in ("-f", f"daemonsets/{f}.yaml")])
    assert out.returncode == 0, out.stderr


class Rig:
    """The emulator, one controller process (restarted when killed) and a stand-in kubelet."""

    def __init__(self, control_plane, controllers, admin: Client, ns: str):
        self.admin, self.ns, self.controllers = admin, ns, controllers
        self.project = f"faults-{uuid.uuid4().hex[:8]}"  # a test's own: one's leftovers never fail the next
        self.gce = Server().start()
        self.gce.compute.set_faults(op_delay_s=0.3, boot_s=0.2)
        self.proc = None
        self.kills: list[str] = []
        self.killed: set[tuple[str, str]] = set()
        self.kill_writes = False
        self.stop = threading.Event()
        self.joining = True  # off once the groups are deleted: a VM being deleted registers no Node
        self.registered: list[str] = []
        self.gce.compute.on_write = self._on_write
        self.kubelet = threading.Thread(target=self._kubelet, daemon=True)

    def start(self, rules: Path):
        # the operator's rules: the example's (what the upstream manifests ask for), in our project
        rules.write_text(json.dumps({"*": {**RULES["*"], "projects": [self.project]}}))
        self.proc = self.controllers("faults", "--disable-webhooks", "--lease-duration", "4", "--renew-deadline",
                                     "3", "--retry-period", "1", "--tpu-node-groups", "--gce-endpoint",
                                     self.gce.endpoint, "--node-group-placement", str(rules), "--node-group-poll",
                                     "0.2", "--drain-timeout", "2")
        return self

    def _on_write(self, n: int, method: str, path: str) -> None:
        """Kill the controller after GCE applied its write, before it hears the answer: once per
        distinct write, so every step is interrupted once and the run still ends."""
        step = (method, path.rsplit("/operations/", 1)[0])
        if not self.kill_writes or step in self.killed or self.proc is None or self.proc.proc.poll() is not None:
            return
        self.killed.add(step)
        self.kills.append(f"{method} {path}")
        self.proc.proc.send_signal(signal.SIGKILL)
        self.proc.proc.wait(10)

    def _kubelet(self) -> None:
        while not self.stop.is_set():
            for inst in self.gce.compute.instances(self.project):
                if inst["status"] == "RUNNING" and "kubeadm-join-token" in metadata(inst) and \
                        get(self.admin, f"/api/v1/nodes/{inst['name']}") is None:
                    try:
                        if self.joining:
                            _register(self.admin, inst, self.project, ZONE)
                            self.registered.append(inst["name"])
                    except KubeError:
                        pass
            self.stop.wait(0.2)

    def revive(self) -> None:
        """Restart the controller when the battery killed it (same identity: it leads at once)."""
        if self.proc is not None and self.proc.proc.poll() is not None:
            self.proc.start()

    def until(self, what: str, fn, timeout: float = 120.0):
        def step():
            self.revive()
            return fn()
        return wait(what, step, timeout)

    def close(self) -> None:
        self.stop.set()
        self.gce.stop()

    def leftovers(self) -> list[str]:
        with self.gce.compute.lock:
            self.gce.compute.advance()
            return sorted(p for p in self.gce.compute.resources if p.startswith(f"projects/{self.project}/"))


def new_group(rig: Rig, name: str) -> dict:
    obj = example(*SINGLE)
    obj["metadata"].update(namespace=rig.ns, name=name)
    obj["spec"]["project"] = rig.project
    return rig.admin.request("POST", custom_path("tpu.google.com", "v1alpha1", "tpunodegroups", rig.ns), body=obj)


def settled(admin: Client, ns: str, name: str):
    """The group once it is Ready or failed for a reason that retrying cannot fix."""
    g = get(admin, tng_path(ns, name))
    ready = cond(g, "Ready")
    if ready.get("status") == "True":
        return g
    failed = [c for c in (g or {}).get("status", {}).get("conditions", [])
              if c.get("reason") in ("InstancesCreationFailed", "OperationFailed", "RequestRejected", "NotOwned",
                                     "NotAllowed")]
    return g if failed else None


def teardown_leaves_nothing(rig: Rig, names: list[str]) -> None:
    rig.joining = False
    time.sleep(0.5)  # the stand-in kubelet's last round
    for name in names:
        rig.admin.request("DELETE", tng_path(rig.ns, name))
    rig.until("groups gone", lambda: all(get(rig.admin, tng_path(rig.ns, n)) is None for n in names), 180)
    rig.until("GCE empty", lambda: rig.leftovers() == [], 30)
    assert group_secrets(rig.admin, rig.ns) == []
    nodes = rig.admin.request("GET", "/api/v1/nodes")["items"]
    left = [n["metadata"]["name"] for n in nodes if (n["spec"].get("providerID") or "").startswith(f"gce://{rig.project}/")]
    assert left == [], (left, rig.registered, rig.kills, [ln[:300] for ln in rig.proc.log().splitlines()
                                                          if "group" in ln or "leader" in ln or "error" in ln][-40:])


@pytest.fixture
def rig(control_plane, rbac, fresh_lease, controllers, admin, kube_namespace, tmp_path):
    r = Rig(control_plane, controllers, admin, kube_namespace)
    r.kubelet.start()
    yield r.start(tmp_path / "rules.json")
    r.close()


def test_killed_at_every_gce_write_the_group_still_comes_up_and_goes_without_a_leak(rig):
    rig.kill_writes = True
    new_group(rig, "killed")
    g = rig.until("Ready despite the kills", lambda: settled(rig.admin, rig.ns, "killed"), 180)
    assert cond(g, "Ready")["status"] == "True", g["status"]
    teardown_leaves_nothing(rig, ["killed"])
    # every step was interrupted once: template and MIG inserted, join offered (withdrawn: the same
    # request path, not killed twice), MIG and template deleted
    assert len(rig.kills) >= 5, rig.kills
    for method, what in (("POST", "/instanceTemplates"), ("POST", "/instanceGroupManagers"), ("POST", "/setMetadata"),
                         ("DELETE", "/instanceGroupManagers/"), ("DELETE", "/instanceTemplates/")):
        assert any(k.startswith(method) and what in k for k in rig.kills), (method, what, rig.kills)


def test_deleted_while_its_inserts_are_pending_nothing_leaks(rig):
    rig.gce.compute.set_faults(op_delay_s=3.0)
    new_group(rig, "hasty")
    mig_pending = lambda: any(  # noqa: E731
        (c.get("status") or {}).get("operationType") == "CREATE" for c in rig.admin.request(
            "GET", custom_path("tpu.google.com", "v1alpha1", "managedinstancegroups", rig.ns))["items"])
    rig.until("the MIG insert pending", mig_pending, 60)
    teardown_leaves_nothing(rig, ["hasty"])


def test_api_errors_late_failures_and_quota_end_ready_or_failed_with_a_reason(rig):
    c = rig.gce.compute
    c.set_faults(unavailable=3, errors=[
        {"method": "POST", "path": f"/{rig.project}/global/instanceTemplates$", "code": 429, "reason": "rateLimitExceeded"},
        {"method": "POST", "path": "/instanceGroupManagers$", "code": 500, "reason": "backendError"},
        {"method": "POST", "path": "/setMetadata$", "code": 503, "reason": "backendError"}],
        fail_ops=[{"type": "insert", "path": "/instanceTemplates/transient-", "code": 500},
                  {"type": "insert", "path": "/instanceGroupManagers/transient-", "code": 503},
                  {"type": "insert", "path": "/instanceTemplates/refused-", "code": 403, "reason": "forbidden",
                   "message": "Required 'compute.instanceTemplates.create' permission"}])
    new_group(rig, "transient")
    new_group(rig, "refused")
    g = rig.until("transient faults ride out", lambda: settled(rig.admin, rig.ns, "transient"), 120)
    assert cond(g, "Ready")["status"] == "True", g["status"]
    g = rig.until("late refusal reported", lambda: settled(rig.admin, rig.ns, "refused"), 60)
    assert cond(g, "Ready")["reason"] == "OperationFailed" and "compute.instanceTemplates.create" in \
        cond(g, "Ready")["message"], g["status"]
    c.set_faults(quota_exceeded=True)
    new_group(rig, "quota")
    g = rig.until("quota reported", lambda: settled(rig.admin, rig.ns, "quota"), 60)
    assert cond(g, "Ready")["reason"] == "InstancesCreationFailed" and "QUOTA_EXCEEDED" in cond(g, "Ready")["message"]
    c.set_faults(fail_ops=[{"type": "delete", "path": "/instanceGroupManagers/transient-", "code": 503},
                           {"type": "delete", "path": "/instanceTemplates/quota-", "code": 500}],
                 errors=[{"method": "DELETE", "path": "/instanceGroupManagers/quota-", "code": 429,
                          "reason": "rateLimitExceeded"}])  # and the deletions fail too, once each
    teardown_leaves_nothing(rig, ["transient", "refused", "quota"])
    assert c.faults.fail_ops == [] and c.faults.errors == []  # every fault was met
