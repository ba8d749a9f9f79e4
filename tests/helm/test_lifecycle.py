"""The charts' whole life with Helm on the real kubelet lane (tests/node/conftest.py ``lane``: a
control plane, containerd 2 + runc and kubelet on a loopback node of a simulated v5e-4 host, our
image), one cluster for every step:

0. A kustomize install (``kubectl apply -k``) adopted by ``helm install`` of both charts, as
   docs/helm.md says: nothing changes, nothing restarts; then that release is uninstalled.
1. ``helm push`` of the previous chart version (0.1.0: this chart packaged under that version,
   with values the upgrade changes, since no earlier chart was ever released) to the test
   registry; ``helm install`` from ``oci://``: every DaemonSet pod Running, a TPU pod with its
   cache mounted.
2. ``helm upgrade`` to this checkout's chart (0.2.0, default values) with a pod reading its cache
   throughout: the DaemonSets roll, the CSI + agent pod is replaced under the mount, the reads
   never fail.
3. ``helm rollback`` to revision 1: rolled back, still reading.
4. ``helm uninstall`` of both releases: the workloads and their RBAC are gone; the CRDs (``keep``)
   and the users' objects (a GKMCache) stay.

Helm renders; a post-renderer (``--post-renderer``, as users fit a chart to their cluster) runs
the same kustomize overlay that fits ``kubectl apply -k daemonsets/`` to this lane
(tests/rigs/node.py write_overlay). Run it under ``flock /tmp/kubelet.lock``.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import yaml

from tests.helm.chart import CHART, CRDS_CHART, NAMESPACE, HelmLane, diff
from tests.node.conftest import BASE, _build, _teardown, lane
from tests.node.test_kubelet import FILES, V5E, cache_object, check, finished, make_cache, namespace, running
from tests.node.test_upgrade import FILE, READER, keeps_reading, rolled
from tests.rigs.node import inline, workload

PREVIOUS = "0.1.0"
# what the previous release was installed with; the upgrade's defaults differ, so both DaemonSets roll
PREVIOUS_VALUES = ["devicePlugin.resources.limits.memory=128Mi", "csiDriver.resources.limits.memory=160Mi"]


def previous_chart(tmp) -> os.PathLike:
    """This chart packaged as version :data:`PREVIOUS`."""
    src = tmp / "accelnode"
    shutil.copytree(CHART, src)
    meta = yaml.safe_load((src / "Chart.yaml").read_text())
    meta["version"] = PREVIOUS
    (src / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return src


@pytest.fixture(scope="module")
def world(tmp_path_factory, registry):
    with lane(tmp_path_factory.mktemp("helm-node"), registry) as w:
        yield w
        _teardown(w)


def adopt_kustomize_install(world, h) -> None:
    """0. docs/helm.md "From a kustomize install": ``kubectl apply -k`` of the base and its CRDs
    (fitted to the lane by the overlay Helm's post-renderer uses), then the releases adopt every
    object by their annotations and label: no DaemonSet or Deployment changes, no pod restarts.
    Then the accelnode release is uninstalled; accelnode-crds stays for the steps after."""
    (h.base / "all.yaml").write_text(yaml.safe_dump_all(_build(BASE)))
    world.kubectl("apply", "--server-side", "-k", str(BASE / "crds"))
    world.kubectl("apply", "--server-side", "-k", str(h.overlay))
    world.wait(world.system_ready, "every accelnode pod Ready after kubectl apply -k", timeout=180)

    def workloads():
        objs = world.get("daemonsets,deployments", "-n", NAMESPACE)["items"]
        return {(o["kind"], o["metadata"]["name"]): o["spec"] for o in objs}

    before, pods = workloads(), {p["metadata"]["uid"] for p in world.pods()}
    for release, chart in (("accelnode-crds", CRDS_CHART), ("accelnode", CHART)):
        rendered = world.workdir / f"{release}.yaml"
        rendered.write_text(h("template", release, str(chart), "-n", NAMESPACE).stdout)
        world.kubectl("annotate", "-f", str(rendered), "--overwrite", f"meta.helm.sh/release-name={release}",
                      f"meta.helm.sh/release-namespace={NAMESPACE}")
        world.kubectl("label", "-f", str(rendered), "--overwrite", "app.kubernetes.io/managed-by=Helm")
    h("install", "accelnode-crds", str(CRDS_CHART), "-n", NAMESPACE, "--wait")
    h.release("install", str(CHART))
    after = workloads()
    for k in before:
        assert after[k] == before[k], diff(before[k], after[k], ("kubectl apply -k", "adopted"))
    assert {p["metadata"]["uid"] for p in world.pods()} == pods
    ds = world.get("daemonset", "accelnode-csi-node", "-n", NAMESPACE)["metadata"]
    assert ds["labels"]["app.kubernetes.io/instance"] == "accelnode" and ds["annotations"][
        "meta.helm.sh/release-name"] == "accelnode"
    h("uninstall", "accelnode", "-n", NAMESPACE, "--wait", "--timeout", "5m")
    world.wait(lambda: not world.pods(), "the adopted release's pods gone", timeout=180)


def test_install_upgrade_rollback_uninstall_with_helm(world, registry, tmp_path):
    from accelnode import IMAGE

    h = HelmLane(world)
    adopt_kustomize_install(world, h)
    # 1. the previous chart pushed to an OCI registry, then the release from oci://
    pkg = h("package", str(previous_chart(tmp_path)), "-d", str(tmp_path)).stdout
    tgz = tmp_path / f"accelnode-{PREVIOUS}.tgz"
    assert tgz.exists(), pkg
    pushed = h("push", str(tgz), f"oci://{registry.host}/charts", "--plain-http")
    assert f"{registry.host}/charts/accelnode:{PREVIOUS}" in pushed.stdout + pushed.stderr
    t0 = time.monotonic()
    h.release("install", f"oci://{registry.host}/charts/accelnode", "--version", PREVIOUS, "--plain-http",
              "--create-namespace", *sum((["--set", v] for v in PREVIOUS_VALUES), []))
    world.wait(world.system_ready, "every accelnode pod Ready after helm install", timeout=180)
    world.log.append(f"helm install to Ready: {time.monotonic() - t0:.1f}s")
    for p in world.pods():
        assert p["status"]["phase"] == "Running" and world.ready(p), p["metadata"]["name"]
    ns = namespace(world)
    ref = registry.push(make_cache(tmp_path / "cache", FILES), "e2e/jax-v5e", tag="v1", kind="jax", targets=V5E)
    # the controller is Ready only once caBundle trusts it (after a reinstall the old leader's Lease
    # must expire first, up to 15 s, before the new leader writes it); what is left to wait for is
    # the Service's endpoints and the API server's copy of the configurations
    cached = yaml.safe_dump(cache_object("jax-v5e", ns, f"{registry.host}/e2e/jax-v5e:v1"))
    world.wait(lambda: world.kubectl("apply", "-f", "-", stdin=cached, check=False).returncode == 0,
               "the GKMCache admitted by the new controller's webhooks", timeout=15)
    world.wait(lambda: world.get("gkmcache", "jax-v5e", "-n", ns).get("status", {}).get("resolvedDigest")
               == ref.split("@")[1], "the controller to pin the GKMCache")
    world.apply(workload("tpu-pod", ns, inline("jax-v5e", ns)))
    check(finished(world, ns, "tpu-pod"))  # two chips, GKE's TPU env, the cache's files read-only

    # 2. the upgrade under a pod reading its cache
    world.apply(workload("reader", ns, inline("jax-v5e", ns), chips=1, command=["python3", "-c", READER, FILE]))
    running(world, ns, "reader")
    keeps_reading(world, ns, "reader", 0)

    def csi() -> set[str]:
        return {p["metadata"]["uid"] for p in world.pods(selector="app.kubernetes.io/name=accelnode-csi-node")}

    before = csi()
    h.release("upgrade", str(CHART), "--reset-values")  # Helm keeps the old values when given none
    world.wait(lambda: rolled(world, IMAGE), "the DaemonSets rolled to the new chart", timeout=240)
    assert not before & csi()  # the CSI + agent pod was replaced under the mount
    keeps_reading(world, ns, "reader", time.time())
    limits = world.get("daemonset", "accelnode-csi-node", "-n", NAMESPACE)["spec"]["template"]["spec"]["containers"][0]
    assert limits["resources"]["limits"]["memory"] == "128Mi"  # the new chart's default

    # 3. rollback to the previous release
    before = csi()
    h("rollback", "accelnode", "1", "-n", NAMESPACE, "--wait", "--timeout", "5m")
    world.wait(lambda: rolled(world, IMAGE) and not before & csi(), "the DaemonSets rolled back", timeout=240)
    limits = world.get("daemonset", "accelnode-csi-node", "-n", NAMESPACE)["spec"]["template"]["spec"]["containers"][0]
    assert limits["resources"]["limits"]["memory"] == "160Mi"
    keeps_reading(world, ns, "reader", time.time())
    history = yaml.safe_load(h("history", "accelnode", "-n", NAMESPACE, "-o", "yaml").stdout)
    assert [(r["revision"], r["chart"]) for r in history] == [
        (1, f"accelnode-{PREVIOUS}"), (2, "accelnode-0.2.0"), (3, f"accelnode-{PREVIOUS}")]

    # 4. uninstall: workloads first (their volumes need the CSI driver to unpublish), then both releases
    world.kubectl("delete", "pod", "reader", "tpu-pod", "-n", ns, "--wait=true", "--timeout=90s")
    h("uninstall", "accelnode", "-n", NAMESPACE, "--wait", "--timeout", "5m")
    h("uninstall", "accelnode-crds", "-n", NAMESPACE, "--wait")
    world.wait(lambda: not world.pods(), "the release's pods gone (garbage-collected after their owners)", timeout=180)
    assert world.kubectl("get", "clusterrole", "accelnode-controller", check=False).returncode != 0
    assert world.kubectl("get", "csidriver", "csi.gkm.io", check=False).returncode != 0
    crds = {c["metadata"]["name"] for c in world.get("crd")["items"]}
    assert {"gkmcaches.gkm.io", "clustercachetrustpolicies.accelnode.io", "tpunodegroups.tpu.google.com"} <= crds
    assert world.get("gkmcache", "jax-v5e", "-n", ns)["spec"]["image"].endswith("/e2e/jax-v5e:v1")
    print("\n".join(world.log))
