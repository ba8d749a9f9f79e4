"""The capture loop on the real kubelet lane (docs/capture.md): a pod mounts a capturing JAX
cache by name through csi.gkm.io and gets a writable view; real JAX (on the host, on the pod's
volume as kubelet published it: the accelnode image carries no JAX) compiles its misses into it;
the pod goes, kubelet unpublishes, the agent captures and pushes under the namespace's lent push
Secret; the deployed controller publishes, signs and promotes; the next pod's volume holds the
promoted digest and JAX compiles nothing - counted by JAX's own persistent-cache events. The same
for Triton, in pods on a simulated H100 (tests/node/test_triton.py's rig: the host's Triton
mounted into our image), judged by Triton's own compilation listener and cache-manager writes."""

from __future__ import annotations

import base64
import json
import subprocess

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from accelnode.capture import settings
from accelnode.kube.pullsecrets import lending
from controller.caches.capture import SIGNING_KEY
from tests.capture.test_loop import jax_run
from tests.capture.test_node import signing_lent
from tests.conftest import accelnode_cmd
from tests.node.test_kubelet import inline, namespace, running, workload


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def holder(name: str, ns: str, cache: str) -> dict:
    """A pod that holds a writable volume of ``cache`` (the pod's own writes go to its view)."""
    volume = inline(cache, ns)
    volume["csi"]["readOnly"] = False
    pod = workload(name, ns, volume, chips=1, command=["python3", "-c", "import time, signal, sys; signal.signal("
                                                        "signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(3600)"])
    pod["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] = False
    return pod


def capturing(deployed, ns: str, name: str, base: str) -> str:
    """A GKMCache ``name`` of ``base`` that captures into ``<registry>/<ns>/captured`` with a push
    Secret and a signing key the namespace lends, promotion auto; pinned. Returns the repository."""
    host = deployed.registry.host
    repo = f"{host}/{ns}/captured"
    config = json.dumps({"auths": {host: {"auth": b64(b"pusher:any")}}}).encode()
    key = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    deployed.apply(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pusher", "namespace": ns},
         "type": "kubernetes.io/dockerconfigjson", "data": {".dockerconfigjson": b64(config)}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "signer", "namespace": ns},
         "data": {SIGNING_KEY: b64(key)}},
        *lending(ns, ["pusher"]), *signing_lent(ns),
        {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {
            "name": name, "namespace": ns, "annotations": {
                settings.ON: "on", settings.REPOSITORY: repo, settings.PUSH_SECRET: "pusher",
                settings.SIGNING_SECRET: "signer", settings.PROMOTION: "auto"}}, "spec": {"image": base}})
    deployed.wait(lambda: deployed.get("gkmcache", name, "-n", ns).get("status", {}).get("resolvedDigest"),
                  "the controller to pin the cache")
    return repo


def promoted(deployed, ns: str, name: str, repo: str) -> dict:
    """After the capturing pod went: the node's capture pushed, the controller's publication signed
    and promoted through the shipped guards, and the new digest pinned. Returns status.capture."""
    def captured():
        nodes = deployed.get("gkmcachenode", "-n", ns).get("items") or []
        return [r for n in nodes for r in ((n.get("status") or {}).get("captures") or {}).get(name) or ()]

    (result,) = deployed.wait(captured, "the node to report the capture")
    assert result["state"] == "Pushed" and result["contribution"].startswith(repo + "@"), result

    def published():
        cache = deployed.get("gkmcache", name, "-n", ns)
        return (cache.get("status", {}).get("capture") or {}).get("offered") and cache

    try:
        cache = deployed.wait(published, "the capture to be published and signed", timeout=180)
    except AssertionError:
        (ctl,) = deployed.pods(selector="app.kubernetes.io/name=accelnode-controller")
        log = deployed.node.pod_log("accelnode-system", ctl["metadata"]["name"], "controller")
        raise AssertionError(f"cache: {deployed.get('gkmcache', name, '-n', ns)}\ncontroller log (capture):\n"
                             + "\n".join(ln for ln in log.splitlines() if "captur" in ln.lower())[-6000:]) from None
    capture = cache["status"]["capture"]
    # promotion: auto, through the shipped guard (ValidatingAdmissionPolicy accelnode-controller-caches),
    # which lets the controller move spec.image to a digest of the capture repository and nothing else
    assert capture["signed"] and capture["state"] == "Promoted", capture
    deployed.wait(lambda: deployed.get("gkmcache", name, "-n", ns).get("status", {}).get("resolvedDigest")
                  == capture["offered"].rsplit("@", 1)[1], "the promoted digest to be pinned")
    return capture


def test_a_pod_compiles_and_the_next_pod_starts_warm(deployed, tmp_path):
    seed = tmp_path / "seed"
    jax_run(seed, 64)  # the base cache: the same program at another shape
    host = deployed.registry.host
    built = subprocess.run([*accelnode_cmd(), "cache", "build", str(seed), f"{host}/e2e/jax-capture:base", "--kind",
                            "jax", "--plain-http", "--target", "backend=tpu,arch=v5e"],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    base = built.stdout.strip()
    ns = namespace(deployed)
    repo = capturing(deployed, ns, "jax", base)

    def mounted(pod: str):
        uid = deployed.get("pod", pod, "-n", ns)["metadata"]["uid"]
        return deployed.node.root_dir / "pods" / uid / "volumes/kubernetes.io~csi/kernel-cache/mount/io.jax.cache"

    deployed.apply(holder("first", ns, "jax"))
    running(deployed, ns, "first")
    first = jax_run(mounted("first"), 128)  # compiles its misses into the pod's view
    assert first["misses"] >= 1, first
    deployed.kubectl("delete", "pod", "first", "-n", ns, "--wait=true", "--timeout=90s")

    capture = promoted(deployed, ns, "jax", repo)
    assert capture["entries"] == first["misses"] and capture["pods"] == [f"{ns}/first"]

    deployed.apply(holder("second", ns, "jax"))
    running(deployed, ns, "second")
    second = jax_run(mounted("second"), 128)
    assert second["misses"] == 0 and second["hits"] == first["hits"] + first["misses"], second
    deployed.kubectl("delete", "pod", "second", "-n", ns, "--wait=true", "--timeout=90s")


def test_a_triton_pod_compiles_and_the_next_pod_starts_warm(deployed, tmp_path):
    """The same loop judged by Triton itself, in pods on a simulated H100 (tests/node/test_triton.py):
    the first pod hits the base's kernels and compiles one the base lacks into its view; after the
    capture is promoted, the next pod hits every kernel, that one included, and Triton's cache
    manager writes nothing."""
    from tests.node.test_triton import (H100, KERNELS, MISSING, POD_PATH, RUN, compile_here, compiled_and_written,
                                        gpu_on_node, hit, require_triton_here, triton_pod, wait_reports)

    require_triton_here()
    src = tmp_path / "cache"
    compile_here(src, KERNELS)
    image = f"{deployed.registry.host}/e2e/triton-capture:base"
    built = subprocess.run([*accelnode_cmd(), "cache", "build", str(src), image, "--plain-http", "--pod-path", POD_PATH],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    ns = namespace(deployed)
    repo = capturing(deployed, ns, "triton", built.stdout.strip())
    everything = ",".join([*KERNELS, MISSING])
    with gpu_on_node(deployed, H100, "sm_90"):
        deployed.apply(triton_pod("first", ns, "triton", f"{RUN} {everything}"))
        (first,) = wait_reports(deployed, ns, "first", 1)
        assert all(hit(first["kernels"][k]) for k in KERNELS), first
        assert compiled_and_written(first["kernels"][MISSING]), first
        deployed.kubectl("delete", "pod", "first", "-n", ns, "--wait=true", "--timeout=90s")

        capture = promoted(deployed, ns, "triton", repo)
        assert capture["entries"] == 1 and capture["pods"] == [f"{ns}/first"], capture

        deployed.apply(triton_pod("second", ns, "triton", f"{RUN} {everything}"))
        (second,) = wait_reports(deployed, ns, "second", 1)
        for kernel, k in second["kernels"].items():
            assert hit(k), f"the second pod compiled {kernel}: {k}"
        deployed.kubectl("delete", "pod", "second", "-n", ns, "--wait=true", "--timeout=90s")
