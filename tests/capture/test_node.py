"""The capture loop through the real CSI driver and agent processes, the real API server and the
controller's reconcilers: a capturing GKMCache of the JAX kind gets a copy-on-write view (JAX
writes its persistent cache on a miss), real JAX compiles into it, the driver hands the layer to
the agent at unpublish, the agent pushes the contribution under the push Secret its namespace
lent (and only that), the node's GKMCacheNode reports it; the controller merges, publishes, signs
and promotes it (``spec.image`` moves), and a second node mounts the promoted digest by name and
JAX recompiles nothing. A Secret the namespace did not lend is never read, and nothing is pushed."""

from __future__ import annotations

import base64
import contextlib
import json
import uuid

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from kubernetes import client

from accelnode.capture import publish, settings
from accelnode.capture.settings import Rules
from accelnode.kube.pullsecrets import AGENT, CONTROLLER, lending
from controller.caches.capture import SIGNING_KEY
from tests.agent.conftest import GKM, eventually
from tests.csi.conftest import Node as CsiNode
from tests.capture.test_loop import jax_base, jax_run
from tests.csi.test_by_name import publish_until, readyz, start_by_name


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def tenant(cluster, registry, *push_secrets: str) -> tuple[str, str]:
    """A fresh namespace with Docker-config Secrets ``push_secrets`` (the first lent to the agent
    and the controller, the others to no one) and a signing Secret ``signer`` lent to the
    controller alone; (namespace, its capture repository)."""
    ns = f"cap-{uuid.uuid4().hex[:8]}"
    cluster.core.create_namespace(body={"metadata": {"name": ns}})
    config = json.dumps({"auths": {registry.host: {"auth": b64("pusher:any")}}})
    for name in push_secrets:
        cluster.core.create_namespaced_secret(ns, {"metadata": {"name": name}, "type": "kubernetes.io/dockerconfigjson",
                                                   "data": {".dockerconfigjson": b64(config)}})
    key = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    cluster.core.create_namespaced_secret(ns, {"metadata": {"name": "signer"}, "data": {SIGNING_KEY: b64(key)}})
    rbac = client.RbacAuthorizationV1Api(cluster.core.api_client)
    for role, binding in (lending(ns, [push_secrets[0]], (AGENT, CONTROLLER)), signing_lent(ns)):
        rbac.create_namespaced_role(ns, role)
        rbac.create_namespaced_role_binding(ns, binding)
    return ns, f"{registry.host}/{ns}/captured"


def test_the_jax_capture_loop(node, control_plane, csi_rbac, cluster, caches_rbac, registry, tmp_path):
    base, _ = jax_base(registry, tmp_path)
    ns, repo = tenant(cluster, registry, "pusher", "not-lent")
    for cache, secret in (("kernels", "pusher"), ("sneaky", "not-lent")):
        cluster.cache(cache, base, namespace=ns, annotations={
            settings.ON: "on", settings.REPOSITORY: repo, settings.PUSH_SECRET: secret,
            settings.SIGNING_SECRET: "signer", settings.PROMOTION: "auto", settings.MIN_PODS: "1"})
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

    # the controller: publish, sign, promote (in-process reconcilers as the controller identity)
    rules = tmp_path / "capture-repositories.json"
    rules.write_text(json.dumps({ns: [f"{registry.host}/{ns}/"]}))
    with capture_reconcilers(control_plane, registry, Rules.load(str(rules))):
        promoted = eventually(lambda: _promoted(cluster, ns, "kernels", repo), timeout=60)
        assert promoted, cluster.objs.get_namespaced_custom_object(*GKM, ns, "gkmcaches", "kernels").get("status")
        capture = promoted["status"]["capture"]
        assert capture["state"] == "Promoted", capture
        assert capture["signed"] and capture["sources"] == [done["contribution"]]
        assert capture["nodes"] == [node_name] and capture["entries"] == runs["kernels"]["misses"]
        assert promoted["spec"]["image"] == capture["offered"]
        assert eventually(lambda: _cache(cluster, ns, "kernels")["status"].get("resolvedDigest")
                          == capture["offered"].rsplit("@", 1)[1])
        sneaky = _cache(cluster, ns, "sneaky")
        assert sneaky["spec"]["image"] == base and "capture" not in sneaky.get("status", {})  # nothing was pushed

    # a second node mounts the promoted cache by name: JAX hits everything the first pod compiled
    other = CsiNode(tmp_path / "node-b")
    try:
        other.set_agent_flags("--kubeconfig", str(control_plane.kubeconfig("agent")))
        start_by_name(other, control_plane)
        assert eventually(lambda: readyz(other)[0] == 200), readyz(other)
        vol = other.volume("", pod_namespace=ns, cache="kernels", cache_namespace=ns, name="vol-warm")
        publish_until(other, vol)
        warm = jax_run(vol.target / "io.jax.cache", 128)
        other.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=60)
    finally:
        other.close()
    assert warm["misses"] == 0 and warm["hits"] == runs["kernels"]["hits"] + runs["kernels"]["misses"], warm


def signing_lent(ns: str) -> tuple[dict, dict]:
    """The Role with which a namespace lends its capture signing Secret to the controller alone."""
    meta = {"name": "accelnode-capture-signing", "namespace": ns}
    return ({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [
                {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["signer"], "verbs": ["get"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": meta["name"]},
             "subjects": [{"kind": "ServiceAccount", "name": CONTROLLER[1], "namespace": CONTROLLER[0]}]})


@contextlib.contextmanager
def capture_reconcilers(control_plane, registry, rules, wrap=None):
    """The GKMCache and capture reconcilers in-process as the controller identity, until closed;
    ``wrap(client)`` is the client the capture reconciler writes with (default: the client)."""
    from prometheus_client import CollectorRegistry

    from accelnode.kube.pullsecrets import PullSecretReader
    from controller.caches.capture import CaptureReconciler
    from controller.caches.pinning import Resolver
    from controller.caches.reconciler import gkmcache_reconciler
    from controller.runtime.queue import Backoff
    from controller.runtime.runner import Controller, Metrics
    from tests.controller.test_caches import controller_client

    me = controller_client(control_plane)
    resolver = Resolver(registry.options(timeout=30), secrets=PullSecretReader(me, who="the accelnode controller"))
    metrics = Metrics(CollectorRegistry())
    ctls = [Controller(me, r, metrics, workers=2, resync=0.5, backoff=Backoff(0.2, 2.0)).start()
            for r in (gkmcache_reconciler(me, resolver),
                      CaptureReconciler(wrap(me) if wrap else me, resolver, rules))]
    try:
        yield ctls
    finally:
        for c in ctls:
            c.stop(10)


def _cache(cluster, ns: str, name: str) -> dict:
    return cluster.objs.get_namespaced_custom_object(*GKM, ns, "gkmcaches", name)


def _promoted(cluster, ns: str, name: str, repo: str) -> dict | None:
    obj = _cache(cluster, ns, name)
    return obj if obj["spec"]["image"].startswith(repo + "@") else None


def _writable(path) -> bool:
    try:
        (path / "probe").write_bytes(b"")
    except OSError:
        return False
    return True
