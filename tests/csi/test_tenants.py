"""Tenants pull with their own credentials, and content is handed out per (repository, digest)
(docs/security.md). Real API server, real agent and driver with real mounts, real registry with
auth. The agent holds the node's credentials for that registry (``--registry-config``) and reads
pull secrets as the "agent" identity with daemonsets/rbac-agent.yaml applied; a namespace grants
it its pull secrets with a Role naming them (``pullsecrets.lending``).

Each attack here succeeds on a driver that pulls every cache with the node's credentials and
hands installed content out by digest alone."""

from __future__ import annotations

import base64
import json
import uuid

import grpc
import pytest

from tests.csi.test_by_name import (GROUP, VERSION, condition, csi_rbac, digest_of, namespaces,  # noqa: F401
                                    objects, publish_until, readyz, repo_of, start_by_name, write_status)

from .conftest import error_of, eventually, make_cache

Code = grpc.StatusCode
V5E = [{"backend": "tpu", "arch": "v5e"}]


@pytest.fixture(scope="session")
def agent_rbac(kubectl, crds):
    out = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-agent.yaml")
    assert out.returncode == 0, out.stderr


@pytest.fixture
def core(kube_api):
    from kubernetes import client

    return client.CoreV1Api(kube_api("admin"))


@pytest.fixture
def tenant_node(node, control_plane, auth_registry, csi_rbac, agent_rbac):  # noqa: F811
    """Agent with the node's credentials and the API server; driver resolving caches by name."""
    node.set_agent_flags("--registry-config", auth_registry.config_file,
                         "--kubeconfig", str(control_plane.kubeconfig("agent")))
    start_by_name(node, control_plane)
    assert eventually(lambda: readyz(node)[0] == 200), readyz(node)
    return node


def private_image(auth_registry, tmp_path, repo: str) -> str:
    tag = uuid.uuid4().hex[:12]
    src = make_cache(tmp_path / tag, {"xla/module.bin": tag.encode() * 512})
    return auth_registry.push(src, f"{repo}-{tag}", kind="jax", targets=V5E)


def give_pull_secret(core, namespace: str, registry, *, grant: bool = True) -> None:
    """A dockerconfigjson Secret for ``registry`` on the namespace's default ServiceAccount and,
    with ``grant``, the RoleBinding that lets the agent read it."""
    from kubernetes.client.exceptions import ApiException

    auth = base64.b64encode(f"{registry.username}:{registry.password}".encode()).decode()
    config = json.dumps({"auths": {registry.host: {"auth": auth}}})
    core.create_namespaced_secret(namespace, {
        "metadata": {"name": "regcred"}, "type": "kubernetes.io/dockerconfigjson",
        "data": {".dockerconfigjson": base64.b64encode(config.encode()).decode()}})

    def patched() -> bool:
        try:
            core.patch_namespaced_service_account("default", namespace, {"imagePullSecrets": [{"name": "regcred"}]})
            return True
        except ApiException as e:
            if e.status != 404:  # the ServiceAccount controller has not made it yet
                raise
            return False

    assert eventually(patched)
    if grant:
        from kubernetes import client

        from accelnode.kube.pullsecrets import AGENT, lending

        rbac = client.RbacAuthorizationV1Api(core.api_client)
        role, binding = lending(namespace, ["regcred"], (AGENT,))
        rbac.create_namespaced_role(namespace, role)
        rbac.create_namespaced_role_binding(namespace, binding)


def digest_cache(objects, name: str, image: str, namespace: str) -> None:  # noqa: F811
    """A GKMCache whose spec.image carries its digest (mountable before any controller pins it)."""
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GKMCache", "metadata": {"name": name},
            "spec": {"image": image}}
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, "gkmcaches", body)


def refused(node, vol, want=Code.UNAUTHENTICATED) -> str:
    """Publish ``vol`` until refused with ``want``; the message. Nothing is mounted, nothing held."""
    assert publish_until(node, vol, want) == want
    err = error_of(node.node_stub().NodePublishVolume, vol.publish_request())
    assert err.code() == want, err.details()
    assert not vol.target.exists() and vol.volume_id not in node.references()
    return err.details()


def test_tenants_pull_with_their_own_pull_secrets(tenant_node, objects, namespaces, core, auth_registry,  # noqa: F811
                                                 tmp_path):
    a, b = namespaces
    image = private_image(auth_registry, tmp_path, "team-a/kernels")
    give_pull_secret(core, a, auth_registry)
    digest_cache(objects, "kernels", image, a)
    mine = tenant_node.volume("", pod_namespace=a, cache="kernels", cache_namespace=a)
    assert publish_until(tenant_node, mine) == Code.OK
    assert (mine.target / "io.jax.cache").is_dir()
    # B has no pull secret: the node's credentials do not stand in, and the bytes installed for
    # A are not handed out, though B names the very same image
    digest_cache(objects, "kernels", image, b)
    theirs = tenant_node.volume("", pod_namespace=b, cache="kernels", cache_namespace=b)
    message = refused(tenant_node, theirs)
    assert f"namespace {b} lends the accelnode agent no pull secrets" in message
    assert "does not serve" in message or "requires credentials" in message or "refused" in message


def test_a_pull_secret_the_agent_may_not_read_is_a_clear_refusal(tenant_node, objects, namespaces, core,  # noqa: F811
                                                                 auth_registry, tmp_path):
    _, b = namespaces
    image = private_image(auth_registry, tmp_path, "team-b/kernels")
    give_pull_secret(core, b, auth_registry, grant=False)
    digest_cache(objects, "kernels", image, b)
    vol = tenant_node.volume("", pod_namespace=b, cache="kernels", cache_namespace=b)
    message = refused(tenant_node, vol)
    assert f"may not read ServiceAccount {b}/default" in message and "Role accelnode-pull-secrets" in message
    assert auth_registry.password not in message


def test_naming_a_digest_under_another_repository_gets_nothing(tenant_node, objects, namespaces, core,  # noqa: F811
                                                              auth_registry, tmp_path):
    """B has valid credentials of its own and names A's private digest under a repository of its
    own that does not hold it: the repository is asked, with B's credentials, and says no."""
    a, b = namespaces
    image = private_image(auth_registry, tmp_path, "team-a/private")
    give_pull_secret(core, a, auth_registry)
    digest_cache(objects, "kernels", image, a)
    mine = tenant_node.volume("", pod_namespace=a, cache="kernels", cache_namespace=a)
    assert publish_until(tenant_node, mine) == Code.OK  # A's bytes are on the node now
    give_pull_secret(core, b, auth_registry)
    # a repository B can write to, holding something else
    private_image(auth_registry, tmp_path, "team-b/anything")
    stolen = f"{auth_registry.host}/team-b/anything@{digest_of(image)}"
    digest_cache(objects, "stolen", stolen, b)
    vol = tenant_node.volume("", pod_namespace=b, cache="stolen", cache_namespace=b)
    message = refused(tenant_node, vol)
    assert f"team-b/anything does not serve {digest_of(image)} to this pull" in message


def test_cluster_caches_get_the_nodes_credentials_only_when_the_flag_says_so(tenant_node, objects, auth_registry,  # noqa: F811
                                                                            tmp_path):
    image = private_image(auth_registry, tmp_path, "shared/kernels")
    name = f"shared-{uuid.uuid4().hex[:8]}"
    objects.create_cluster_custom_object(GROUP, VERSION, "clustergkmcaches", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterGKMCache", "metadata": {"name": name},
        "spec": {"image": image}})
    try:
        vol = tenant_node.volume("", pod_namespace="default", cache=name, cache_namespace=None)
        assert "--node-credentials-for-cluster-caches" in refused(tenant_node, vol)
        tenant_node.agent.stop()
        tenant_node.set_agent_flags("--node-credentials-for-cluster-caches")
        tenant_node.agent.start()
        assert publish_until(tenant_node, vol) == Code.OK
        tenant_node.node_stub().NodeUnpublishVolume(vol.unpublish_request(), timeout=30)
    finally:  # cluster-scoped: other tests' reconcilers would give it claims in their namespaces
        objects.delete_cluster_custom_object(GROUP, VERSION, "clustergkmcaches", name)
