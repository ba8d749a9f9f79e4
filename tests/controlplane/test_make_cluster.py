"""`make cluster` (python -m tests.rigs.devcluster): starts in the foreground, prints how to use
it, and Ctrl-C stops the servers and removes its temporary directory."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TOOLS_BIN, tool


def test_cluster_command_runs_until_ctrl_c(control_plane):
    proc = subprocess.Popen([sys.executable, "-m", "tests.rigs.devcluster", "--tools-bin", str(TOOLS_BIN)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:  # bounded: the command exits with an error if startup fails
            lines.append(line)
            if line.startswith("Ctrl-C stops it."):
                break
        banner = "".join(lines)
        kubeconfig = re.search(r"export KUBECONFIG=(\S+)", banner)
        port = re.search(r"ready at https://127.0.0.1:(\d+)", banner)
        if not (kubeconfig and port):  # stdout closed early: the command failed, stderr says why
            pytest.fail(f"no usage banner; stdout:\n{banner}\nstderr:\n{proc.stderr.read()}")
        workdir = Path(kubeconfig.group(1)).parent
        ready = subprocess.run([tool("kubectl"), f"--kubeconfig={kubeconfig.group(1)}", "get", "--raw", "/readyz"],
                               capture_output=True, text=True, timeout=60)
        assert ready.stdout == "ok", ready.stderr
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "devcluster: stopped" in proc.stderr.read()
    assert not workdir.exists(), "the temporary work directory must be removed"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(port.group(1)))) != 0, "kube-apiserver still listening"
