"""The pin of a GKMCache asks the registry with its namespace's pull secrets, never the
controller's own credentials (docs/security.md). The cache reconcilers in-process as the
controller's identity, the controller holding credentials for the htpasswd registry; a namespace
lends its pull secret to accelnode-controller with a Role naming it (pullsecrets.lending)."""

from __future__ import annotations

import pytest
from kubernetes import client

from accelnode.kube.pullsecrets import CONTROLLER, PullSecretReader, lending
from controller.caches.pinning import Resolver
from tests.agent.conftest import eventually, make_cache
from tests.controller.test_caches import (caches_rbac, cond, controller_client, run_reconcilers, status,  # noqa: F401
                                          uid, world)
from tests.csi.test_by_name import namespaces  # noqa: F401
from tests.csi.test_tenants import give_pull_secret


@pytest.fixture
def tenant_reconcilers(control_plane, caches_rbac, auth_registry):  # noqa: F811
    me = controller_client(control_plane)
    yield from run_reconcilers(me, Resolver(auth_registry.options(timeout=10),
                                            secrets=PullSecretReader(me, ttl=0.5)))


def lend_to_controller(kube_api, namespace: str) -> None:
    rbac = client.RbacAuthorizationV1Api(kube_api("admin"))
    role, binding = lending(namespace, ["regcred"], (CONTROLLER,))
    rbac.create_namespaced_role(namespace, role)
    rbac.create_namespaced_role_binding(namespace, binding)


def test_a_gkmcache_is_pinned_with_its_namespaces_pull_secrets(world, tenant_reconcilers, namespaces,  # noqa: F811
                                                              kube_api, auth_registry, tmp_path):
    a, b = namespaces
    core = client.CoreV1Api(kube_api("admin"))
    pushed = auth_registry.push(make_cache(tmp_path / "c", {"xla/p.bin": b"\x05" * 100}), f"team-a/p-{uid()}",
                                kind="jax", targets=[{"backend": "tpu", "arch": "v5e"}])
    image, digest = pushed.split("@", 1)[0] + ":latest", pushed.split("@", 1)[1]
    give_pull_secret(core, a, auth_registry, grant=False)
    lend_to_controller(kube_api, a)
    world.cache("kernels", image, a)
    world.cache("kernels", image, b)  # B lends nothing: the controller's credentials do not stand in
    got = eventually(lambda: (o := world.get("kernels", a)) and status(o).get("resolvedDigest") and o)
    assert status(got)["resolvedDigest"] == digest
    theirs = eventually(lambda: (o := world.get("kernels", b)) and cond(o, "Resolved") and o)
    res = cond(theirs, "Resolved")
    assert (res["status"], res["reason"]) == ("False", "AuthFailed"), res
    assert "resolvedDigest" not in status(theirs)
    # the same image as a ClusterGKMCache is the controller's to pin, with its own credentials
    name = f"shared-{uid()}"
    world.cache(name, image)
    assert eventually(lambda: status(world.get(name)).get("resolvedDigest") == digest)
