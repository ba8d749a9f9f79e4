"""Controller test helpers: its RBAC applied, its Lease, real ``accelnode controller`` processes,
the shipped webhook configurations pointed at one of them."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from accelnode.kube.client import Client, Config, KubeError, is_not_found
from tests.conftest import accelnode_cmd
from tests.csi.conftest import free_ports

NAMESPACE = "accelnode-system"
LEASE = "accelnode-controller"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{LEASE}"


@pytest.fixture(scope="session")
def controller_rbac(kubectl):
    out = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-controller.yaml")
    assert out.returncode == 0, out.stderr


@pytest.fixture
def admin(control_plane) -> Client:
    return Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")))


@pytest.fixture
def fresh_lease(controller_rbac, admin):
    """No controller Lease at the start of the test (tests share the one name RBAC allows)."""
    try:
        admin.request("DELETE", LEASE_PATH)
    except KubeError as e:
        assert is_not_found(e), e
    return LEASE_PATH


def lease_spec(admin: Client) -> dict:
    try:
        return admin.request("GET", LEASE_PATH).get("spec") or {}
    except KubeError as e:
        if is_not_found(e):
            return {}
        raise


class ControllerProc:
    """One ``accelnode controller`` as a real process, as the controller identity."""

    def __init__(self, control_plane, log_dir: Path, identity: str, *extra: str):
        self.identity = identity
        self.metrics_port = free_ports(1)[0]
        self.argv = accelnode_cmd() + [
            "controller", "--kubeconfig", str(control_plane.kubeconfig("controller")), "--identity", identity,
            "--namespace", NAMESPACE, "--lease-name", LEASE, "--metrics-address", f"127.0.0.1:{self.metrics_port}",
            "--log-format", "json", *extra]
        self.log_path = log_dir / f"controller-{identity}.log"
        # its temporary files (the webhook certificates it installs) under the test's own directory:
        # a controller a test kills cannot clean up after itself, and /tmp must not collect them
        self.tmp = log_dir / f"tmp-{identity}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ControllerProc":
        self.tmp.mkdir(exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=log, env=dict(os.environ, TMPDIR=str(self.tmp)))
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.identity} did not exit in {timeout}s:\n{self.log()}") from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        """SIGTERM, as a rollout would (the leader releases its Lease for the next one); SIGKILL
        after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def records(self) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


@pytest.fixture
def controllers(control_plane, tmp_path):
    started: list[ControllerProc] = []

    def start(identity: str, *extra: str) -> ControllerProc:
        c = ControllerProc(control_plane, tmp_path, identity, *extra).start()
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def serve_webhooks(admission, files, port: int, ca_pem: bytes) -> None:
    """Register the shipped webhook configurations (``daemonsets/webhooks-*.yaml``), each
    Service reference replaced by the controller's loopback URL and the test CA's caBundle.
    ``admission`` is a ``kubernetes.client.AdmissionregistrationV1Api`` as the admin."""
    for path in files:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            for hook in doc["webhooks"]:
                svc = hook["clientConfig"]["service"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{svc['path']}",
                                        "caBundle": base64.b64encode(ca_pem).decode()}
            if doc["kind"] == "MutatingWebhookConfiguration":
                admission.create_mutating_webhook_configuration(body=doc)
            else:
                admission.create_validating_webhook_configuration(body=doc)


def remove_webhooks(admission, files) -> None:
    """Delete what :func:`serve_webhooks` registered (absent ones are fine)."""
    from kubernetes import client

    for path in files:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            delete = (admission.delete_mutating_webhook_configuration
                      if doc["kind"] == "MutatingWebhookConfiguration"
                      else admission.delete_validating_webhook_configuration)
            try:
                delete(doc["metadata"]["name"])
            except client.ApiException as e:
                if e.status != 404:
                    raise
