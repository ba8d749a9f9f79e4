"""The node side of the join: a metadata server emulator per test, join tokens made by the
controller's code against the real API server, and ``accelnode bootstrap`` as a real process
running the real kubeadm (``--dry-run``: discovery and TLS bootstrap against the API server, no
change to this host)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from accelnode.kube.client import Client, Config
from tests.rigs.metadata import MetadataServer
from controller.nodegroups.jointokens import JoinTokens
from tests.conftest import accelnode_cmd, tool


@pytest.fixture
def metadata():
    with MetadataServer(name=f"tpu-{uuid.uuid4().hex[:6]}", zone="us-east5-b", project="accelnode-test") as srv:
        yield srv


@pytest.fixture
def join_tokens(control_plane) -> JoinTokens:
    admin = Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")))
    return JoinTokens(admin, ca_pem=control_plane.ca_file.read_bytes())


@pytest.fixture
def control_plane_endpoint(control_plane) -> str:
    return f"127.0.0.1:{control_plane.port}"


@pytest.fixture
def kubeadm_wrapper(tmp_path) -> tuple[Path, Path]:
    """(wrapper, record): a kubeadm that records, per call, its argv and the mode of the file
    after --config, then runs the real kubeadm: what `ps` would have shown."""
    real = tool("kubeadm")
    record = tmp_path / "kubeadm-calls.log"
    wrapper = tmp_path / "kubeadm"
    wrapper.write_text(f"""#!/bin/sh
echo "argv: $*" >> {record}
if [ "$2" = "--config" ]; then echo "mode: $(stat -c %a "$3") dir: $(stat -c %a "$(dirname "$3")")" >> {record}; fi
exec {real} "$@"
""")
    wrapper.chmod(0o755)
    return wrapper, record


class Bootstrap:
    """``accelnode bootstrap`` as a process."""

    def __init__(self, metadata: MetadataServer, kubeadm: Path | str, tmp: Path, *extra: str):
        self.dryrun_dir = tmp / "kubeadm-dryrun"
        self.dryrun_dir.mkdir(exist_ok=True)
        env = dict(os.environ, GCE_METADATA_HOST=metadata.host, KUBEADM_JOIN_DRYRUN_DIR=str(self.dryrun_dir))
        self.argv = accelnode_cmd() + ["bootstrap", "--kubeadm", str(kubeadm), "--dry-run",
                                       "--log-format", "json", *extra]
        self.log = tmp / f"bootstrap-{uuid.uuid4().hex[:6]}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"accelnode bootstrap did not end in {timeout}s:\n{self.output()}") from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def bootstrap(tmp_path):
    started: list[Bootstrap] = []

    def start(metadata, kubeadm, *extra) -> Bootstrap:
        b = Bootstrap(metadata, kubeadm, tmp_path, *extra)
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop()
