"""Capture on a node, through the real CSI driver and agent processes and the real API server: a
capturing GKMCache of the JAX kind gets a copy-on-write view (JAX writes its persistent cache on
a miss), real JAX compiles into it, the driver hands the layer to the agent at unpublish, the
agent pushes the contribution under the push Secret its namespace lent (and only that), and the
node's GKMCacheNode reports it for the controller; a Secret the namespace did not lend is never
read, and nothing is pushed."""

from __future__ import annotations

import base64
import json
import uuid

from kubernetes import client

from accelnode.capture import publish, settings
from accelnode.kube.pullsecrets import AGENT, lending
from tests.agent.conftest import eventually
from tests.capture.test_loop import jax_base, jax_run
from tests.csi.test_by_name import publish_until, readyz, start_by_name


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_a_capturing_jax_cache_is_captured_on_unpublish(node, control_plane, csi_rbac, cluster, registry, tmp_path):
    base, _ = jax_base(registry, tmp_path)
    ns = f"cap-{uuid.uuid4().hex[:8]}"
    cluster.core.create_namespace(body={"metadata": {"name": ns}})
    config = json.dumps({"auths": {registry.host: {"auth": b64("pusher:any")}}})
    for name in ("pusher", "not-lent"):
        cluster.core.create_namespaced_secret(ns, {"metadata": {"name": name}, "type": "kubernetes.io/dockerconfigjson",
                                                   "data": {".dockerconfigjson": b64(config)}})
    role, binding = lending(ns, ["pusher"], (AGENT,))
    rbac = client.RbacAuthorizationV1Api(cluster.core.api_client)
    rbac.create_namespaced_role(ns, role)
    rbac.create_namespaced_role_binding(ns, binding)
    repo = f"{registry.host}/{ns}/captured"
    for cache, secret in (("kernels", "pusher"), ("sneaky", "not-lent")):
        cluster.cache(cache, base, namespace=ns, annotations={settings.ON: "on", settings.REPOSITORY: repo,
                                                              settings.PUSH_SECRET: secret})
    cluster.cache("plain", base, namespace=ns)  # no capture: a JAX cache stays read-only
    node_name = cluster.make_node({})
    node.set_agent_flags("--kubeconfig", str(control_plane.kubeconfig("agent")), "--node-name", node_name)
    start_by_name(node, control_plane)
    assert eventually(lambda: readyz(node)[0] == 200), readyz(node)

    runs = {}
    for cache in ("kernels", "sneaky", "plain"):
        vol = node.volume("", pod_namespace=ns, cache=cache, cache_namespace=ns, name=f"vol-{cache}")
        publish_until(node, vol)
        if cache == "plain":
            assert not _writable(vol.target / "io.jax.cache")  # a read-only bind, as before
        else:
            runs[cache] = jax_run(vol.target / "io.jax.cache", 128)  # compiles its misses into the view
            assert runs[cache]["misses"] >= 1, runs[cache]
        node.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=60)

    def captures(cache):
        return ((cluster.node_status(node_name, ns) or {}).get("captures") or {}).get(cache)

    (done,) = eventually(lambda: captures("kernels"))
    assert done["state"] == "Pushed" and done["podNamespace"] == ns and done["entries"] == runs["kernels"]["misses"]
    contribution = publish.fetch_contribution(done["contribution"], node_name, f"{ns}/{done['podName']}",
                                              done["time"], registry.options())
    merged = publish.merge([contribution], "jax", "/cache/io.jax.cache")
    assert len(merged.sources) == runs["kernels"]["misses"] and not merged.refused
    assert done["contribution"].startswith(repo + "@sha256:")

    (failed,) = eventually(lambda: captures("sneaky"))
    assert failed["state"] == "Failed" and "may not read capture push secret" in failed["message"], failed
    assert "contribution" not in failed
    assert captures("plain") is None


def _writable(path) -> bool:
    try:
        (path / "probe").write_bytes(b"")
    except OSError:
        return False
    return True
