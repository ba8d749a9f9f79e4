"""What the product ships: the wheel (and so the image, which installs it: tests/rigs/image.py)
holds the runtime packages only, never the test rigs, tests, benchmarks or build tools."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile

from tests.conftest import ROOT
from tests.rigs import image

RUNTIME = {"accelnode", "agent", "bootstrap", "csi_driver", "device_plugin", "controller"}


def test_pyproject_and_image_ship_the_same_runtime_packages():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {i.rstrip("*") for i in include} == RUNTIME
    assert set(image.SOURCE_DIRS) == RUNTIME
    assert {p.parts[len(ROOT.parts)] for p in image.source_files() if p.suffix == ".py"} == RUNTIME


def test_wheel_holds_runtime_code_only(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path,
                    ROOT], check=True, cwd=tmp_path)
    (whl,) = tmp_path.glob("accelnode-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == RUNTIME
    assert not [n for n in names if "/testing/" in n or n.endswith("protogen.py") or n.startswith(("tests/", "bench/",
                                                                                                  "tools/"))]
    # every runtime module is there, the wiring of each command included
    for mod in ("bootstrap/cli.py", "bootstrap/poller.py", "controller/cli.py", "controller/runtime/runner.py",
                "controller/webhooks/server.py", "controller/caches/reconciler.py", "controller/tpuenv/patches.py",
                "controller/nodegroups/reconciler.py", "accelnode/pb/csi_pb2.py"):
        assert mod in names
