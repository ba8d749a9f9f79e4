"""csi-sanity v5.4.0 (kubernetes-csi/csi-test) against the real driver socket, agent running.

Skipped specs, all of which call controller RPCs this node-only driver does not serve:
"""

from __future__ import annotations

import re
import subprocess
import uuid

from tests.conftest import tool

SKIPPED = [
    "Controller Server",  # every spec of the controller suite calls controller RPCs
    "should remove target path",  # NodeUnpublishVolume spec that calls CreateVolume first
    "should fail when volume does not exist on the specified path",  # NodeGetVolumeStats spec, CreateVolume first
]
__doc__ += "".join(f"\n* {s}" for s in SKIPPED)


def test_csi_sanity(running_node, tmp_path):
    """Sanity's target paths are its mount dir + ``/target``, under the driver's --kubelet-dir;
    kubelet's shape ends in ``/mount``, so a publish of sanity's reaching the target check would
    be refused. None does: each one sanity sends lacks a required field the driver checks first
    (the specs that publish a real volume need CreateVolume and are skipped)."""
    sanity = tool("csi-sanity")
    mountdir = running_node.kubelet_dir / "pods" / str(uuid.uuid4()) / "volumes" / "kubernetes.io~csi" / "sanity"
    mountdir.parent.mkdir(parents=True)  # sanity makes the mount dir itself, not its parents
    proc = subprocess.run(
        [sanity, f"--csi.endpoint=unix://{running_node.csi_socket}",
         f"--csi.mountdir={mountdir}", f"--csi.stagingdir={tmp_path / 'sanity-staging'}",
         "--ginkgo.skip=" + "|".join(SKIPPED), "--ginkgo.no-color", "--ginkgo.v"],
        capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    passed = re.search(r"SUCCESS! -- (\d+) Passed \| 0 Failed", out)
    assert passed and int(passed.group(1)) >= 10, out[-3000:]
