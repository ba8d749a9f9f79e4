"""``accelnode tpu-selftest`` in a container view of a simulated host (issue 24.9): the chips it
holds are the ones the real plugin allocated, mapped to host indices through sysfs; real JAX runs
(on CPU here, so it must report that it sees no TPU chip and fail); the copy an image without
accelnode runs gives the same report. On real TPUs: examples/tpu/selftest/jobs.yaml."""

import json
import os
import subprocess
import sys

import yaml

from tests.conftest import ROOT, accelnode_cmd
from tests.device_plugin.test_plugin import registered


def container_dev(tmp_path, resp):
    """The /dev a runtime makes for the container: the allocated nodes, same device numbers."""
    dev = tmp_path / "ctr-dev"
    for spec in resp.devices:
        st = os.stat(spec.host_path)
        path = dev / spec.container_path.removeprefix("/dev/")
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, st.st_mode, st.st_rdev)
    return dev


def selftest(argv, env, cmd=None):
    return subprocess.run((cmd or accelnode_cmd() + ["tpu-selftest"]) + argv, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", **env})


def test_selftest_reports_the_held_chips_and_what_jax_sees(tpu_host, kubelet, run_plugin, tmp_path):
    host = tpu_host("v5e-4")
    run_plugin(host, "--topology", "2x2", "--accelerator-type", "v5litepod-4")
    ids = sorted(registered(kubelet))
    resp = kubelet.allocate(ids[2:])  # chips 2 and 3 (IOMMU groups 1 and 0 in the preset)
    dev = container_dev(tmp_path, resp)
    argv = ["--dev-root", str(dev), "--sysfs-root", str(host.sysfs_root), "--try-visible-chips", "--compact"]
    out = selftest(argv, dict(resp.envs))
    assert out.returncode == 1, out.stderr  # JAX on CPU: no TPU chip seen
    report = json.loads(out.stdout)
    assert [c["host_index"] for c in report["held"]] == [2, 3]
    assert [c["nodes"] for c in report["held"]] == [[f"{dev}/vfio/1"], [f"{dev}/vfio/0"]]
    assert report["expect_chips"] == 2 and report["pass"] is False
    assert report["tpu_env"]["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,2,1" and "TPU_VISIBLE_CHIPS" not in report["tpu_env"]
    assert set(report["runs"]) == {"as given", "TPU_VISIBLE_CHIPS=positions", "TPU_VISIBLE_CHIPS=host indices"}
    for run in report["runs"].values():
        assert run["jax"]["platform"] == "cpu" and run["jax"]["sums"] == [8.0]  # real JAX ran
        assert run["problem"] == "JAX sees no TPU devices (platform cpu)"

    # the copy for an image without accelnode: the same report from the file alone
    assert selftest(["--copy-to", str(tmp_path / "copy")], {}).returncode == 0
    standalone = selftest(argv, {**dict(resp.envs), "PYTHONPATH": ""},
                          cmd=[sys.executable, "-I", str(tmp_path / "copy/selftest.py")])
    assert standalone.returncode == 1, standalone.stderr
    assert json.loads(standalone.stdout)["held"] == report["held"]


def test_no_jax_is_its_own_exit_code(tpu_host, tmp_path):
    host = tpu_host("v5e-4")
    fake = tmp_path / "nojax"
    fake.mkdir()
    (fake / "jax.py").write_text("raise ImportError('jax is not installed')\n")
    out = selftest(["--dev-root", str(host.dev_root), "--sysfs-root", str(host.sysfs_root), "--compact"],
                   {"PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert out.returncode == 3, out.stderr
    report = json.loads(out.stdout)
    assert len(report["held"]) == 4  # a privileged-like view: every chip of the host
    assert report["runs"]["as given"]["problem"].startswith("no JAX")


def test_the_job_manifest_runs_every_allocation_size():
    docs = [d for d in yaml.safe_load_all((ROOT / "examples/tpu/selftest/jobs.yaml").read_text()) if d]
    jobs = [d for d in docs if d["kind"] == "Job"]
    sizes = []
    for job in jobs:
        spec = job["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        n = c["resources"]["limits"]["google.com/tpu"]
        sizes.append(n)
        assert f"--expect {n}" in c["args"][0] and "--try-visible-chips" in c["args"][0]
        assert spec["initContainers"][0]["command"][:2] == ["accelnode", "tpu-selftest"]
    assert sizes == [1, 2, 4, 8]


def test_a_v7x_chip_is_held_through_both_of_its_functions(tpu_host, kubelet, run_plugin, tmp_path):
    """TPU7x: 2 chips allocated are 4 VFIO devices; the self-test (which runs without accelnode)
    pairs them into chips as accelnode.hw.tpu does, in a slot and where each function has its own."""
    from device_plugin.selftest import held_chips
    from tests.rigs.simhost import SimHost

    host = tpu_host("v7x-4")
    run_plugin(host)
    ids = sorted(registered(kubelet))
    dev = container_dev(tmp_path, kubelet.allocate(ids[2:]))
    held = held_chips(dev, host.sysfs_root)
    assert [(c["host_index"], c["nodes"]) for c in held] == [(2, [f"{dev}/vfio/3", f"{dev}/vfio/2"]),
                                                             (3, [f"{dev}/vfio/1", f"{dev}/vfio/0"])]
    flat = SimHost(tmp_path / "flat")  # every function in a slot of its own: consecutive ones pair
    fdev = tmp_path / "flat-dev"
    (fdev / "vfio").mkdir(parents=True)
    for i in range(4):
        d = flat.add_pci_device(f"0000:00:{4 + i:02x}.0", vendor=0x1AE0, device=0x0076)
        (d / "iommu_group").symlink_to(f"../../../kernel/iommu_groups/{10 + i}")
        if i >= 2:
            (fdev / "vfio" / str(10 + i)).touch()  # the container holds the second pair's nodes
    assert [(c["host_index"], c["bdf"]) for c in held_chips(fdev, flat.sysfs_root)] == [(1, "0000:00:06.0")]
