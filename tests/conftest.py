"""Shared test setup.

Fixture modules live in ``tests/fixtures/`` (registry, control plane, simulated hosts) and are
loaded for every test. A test that needs a prerequisite (root, mounts, a built tool) calls
:func:`require`: a missing prerequisite FAILS the test, loudly, so CI can never pass by
skipping. A developer may set ACCELNODE_ALLOW_SKIP=1 to turn those failures into skips locally.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS_BIN = Path(os.environ.get("ACCELNODE_TOOLS_BIN", ROOT / ".tools" / "bin"))
# The commands tests run read only the mirror configuration a test gives them, never the
# machine's containerd hosts directory (--hosts-dir defaults to /etc/containerd/certs.d)
os.environ.setdefault("ACCELNODE_HOSTS_DIR", "")

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "fixtures").glob("*.py") if p.stem != "__init__"
)


def pytest_configure(config):
    """Give each session its own short temporary base (``/tmp/accelnode-test-XXXX``).

    Unix socket paths are limited to 107 bytes and the default base
    (``/tmp/pytest-of-root/pytest-N/<test name>/...``) leaves too little room for kubelet-shaped
    paths; a per-session directory also keeps concurrent sessions from pruning each other's.
    """
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="accelnode-test-")
        config._accelnode_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    base = getattr(config, "_accelnode_basetemp", None)
    if not base:
        return
    with open("/proc/self/mountinfo") as f:  # never delete through a mount a test left behind
        if any(line.split()[4].startswith(base + "/") for line in f):
            print(f"\nmounts left under {base}; not removing it", file=sys.stderr)
            return
    shutil.rmtree(base, ignore_errors=True)


def require(condition: bool, what: str) -> None:
    """Fail (or, with ACCELNODE_ALLOW_SKIP=1, skip) when a prerequisite is missing."""
    if condition:
        return
    msg = f"prerequisite missing: {what}"
    if os.environ.get("ACCELNODE_ALLOW_SKIP") == "1":
        pytest.skip(msg)
    pytest.fail(msg + " (install it with `make tools` / .ci/run; ACCELNODE_ALLOW_SKIP=1 skips locally)")


def require_root() -> None:
    require(os.geteuid() == 0, "root (mknod, mounts)")


def tool(name: str) -> str:
    """Path of an external tool from .tools/bin (or PATH); fails loudly when absent."""
    p = TOOLS_BIN / name
    if p.exists():
        return str(p)
    found = shutil.which(name)
    require(found is not None, f"tool {name!r} (expected in {TOOLS_BIN})")
    return found


def accelnode_cmd() -> list[str]:
    """argv prefix that runs the real `accelnode` CLI of this checkout."""
    return [sys.executable, "-m", "accelnode"]


def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of a plain GET to a daemon's loopback endpoint (/healthz, /readyz,
    /metrics); status 0 and the error when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def eventually(predicate, what: str, timeout: float = 20.0, interval: float = 0.05):
    """The first truthy value of ``predicate()``, checked every ``interval`` seconds; fails the test
    naming ``what`` (and the last value seen) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what} (last: {value!r})"
        time.sleep(interval)
    return value


def refused(call) -> str:
    """'' when ``call()`` succeeds, else the API server's status code and message (a KubeError)."""
    from accelnode.kube.client import KubeError

    try:
        call()
    except KubeError as e:
        return f"{e.code} {e}"
    return ""


def health_turned(port: int, what: str, timeout: float = 20.0) -> str:
    """The daemon's ``/healthz`` 503 body once it names ``what``; ``/readyz`` must be 503 and
    name it too (a daemon that is not alive is not ready)."""
    body = eventually(lambda: (r := http_get(port, "/healthz"))[0] == 503 and what in r[1] and r[1],
                      f"/healthz naming {what}", timeout)
    code, ready = http_get(port, "/readyz")
    assert code == 503 and what in ready, ready
    return body


@pytest.fixture
def tmpfs(tmp_path):
    """A 16 MiB tmpfs: a file system that really fills up."""
    require_root()
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def fill(directory) -> None:
    """Write ``directory``/filler until its file system is full, to its last page."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 4096):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)
