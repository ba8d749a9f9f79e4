"""The real ``accelnode controller`` under padded cache objects (issue 33): a namespace user's
GKMCaches whose ``spec.podTemplate.spec.affinity`` (it preserves unknown fields) holds 1.35 MiB
of ``{}``, 450,000 empty objects each. The controller kept each whole in the watch caches of its
cache and claims reconcilers, about 35 MB an object: a dozen took it past its pod's 256 Mi
limit. It now keeps of a cache only what it reads (controller.caches.reconciler.trim_cache) and
writes caches by merge patches, so its peak RSS stays under RSS_BOUND_KIB while every cache is
pinned, and the tenant's spec is still whole after the controller's writes."""

from __future__ import annotations

import json
import time

import pytest

from accelnode.kube.client import Client, Config, KubeError, custom_path, is_not_found
from tests.agent.conftest import eventually
from tests.controller.test_caches import cache_images  # noqa: F401
from tests.fuzz.bombs import RSS_BOUND_KIB, vm_hwm

CACHES = 12
PAD = 450_000  # {} a cache: 1.35 MB of JSON, under etcd's 1.5 MiB a request
TENANT = "padding-user"


@pytest.fixture
def controller_rbac_all(kubectl, crds, controller_rbac):
    out = kubectl("admin", "apply", *[a for f in ("rbac-controller-caches", "rbac-controller-claims",
                                                  "rbac-controller-tpuenv") for a in ("-f", f"daemonsets/{f}.yaml")])
    assert out.returncode == 0, out.stderr


def tenant_may_write_caches(kubectl, namespace: str) -> None:
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "caches", "namespace": namespace},
            "rules": [{"apiGroups": ["gkm.io"], "resources": ["gkmcaches"], "verbs": ["create", "get", "delete"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "caches", "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "caches"},
               "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": TENANT}]}
    for obj in (role, binding):
        out = kubectl("admin", "create", "-f", "-", stdin=json.dumps(obj))
        assert out.returncode == 0, out.stderr


def test_padded_caches_do_not_grow_the_controller(controllers, fresh_lease, controller_rbac_all, kubectl,
                                                  kube_namespace, cache_images, control_plane):  # noqa: F811
    ns, (image, digest) = kube_namespace, cache_images["v1"]
    tenant_may_write_caches(kubectl, ns)
    admin = Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")), timeout=60)
    path = custom_path("gkm.io", "v1alpha1", "gkmcaches", ns)
    affinity = {"padding": [{} for _ in range(PAD)]}

    def create(i: int) -> None:
        body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": f"padded-{i}"},
                "spec": {"image": image, "podTemplate": {"spec": {"affinity": affinity}}}}
        out = kubectl("admin", "create", "-n", ns, "--as", TENANT, "-f", "-", stdin=json.dumps(body))
        assert out.returncode == 0, out.stderr

    def pinned() -> int:
        got = 0
        for i in range(CACHES):
            try:
                obj = admin.request("GET", f"{path}/padded-{i}")
            except KubeError as e:
                if is_not_found(e):
                    continue
                raise
            got += (obj.get("status") or {}).get("resolvedDigest") == digest
        return got

    for i in range(CACHES // 2):  # listed at start
        create(i)
    proc = controllers("padded", "--plain-http", "--registry-timeout", "30")
    try:
        for i in range(CACHES // 2, CACHES):  # watched
            create(i)
        assert eventually(lambda: pinned() == CACHES or proc.proc.poll() is not None, 240), proc.log()[-3000:]
        assert proc.proc.poll() is None, proc.log()[-3000:]
        time.sleep(2)  # the claims' status writes after the pins
        peak = vm_hwm(proc.proc.pid)
        # the controller's writes (pin, annotations, finalizer, claims' status) left the tenant's spec whole
        kept = admin.request("GET", f"{path}/padded-{CACHES - 1}")
        assert len(kept["spec"]["podTemplate"]["spec"]["affinity"]["padding"]) == PAD
        assert kept["status"]["resolvedDigest"] == digest
    finally:
        for i in range(CACHES):  # 16 MB in the session's etcd: gone, finalizers and all, before the next test
            try:
                admin.request("DELETE", f"{path}/padded-{i}")
            except KubeError as e:
                assert is_not_found(e), e

        def gone() -> bool:
            left = 0
            for i in range(CACHES):
                try:
                    admin.request("PATCH", f"{path}/padded-{i}", body={"metadata": {"finalizers": None}})
                    left += 1
                except KubeError as e:
                    assert is_not_found(e), e
            return left == 0

        eventually(gone, 30)
    print(f"controller peak RSS with {CACHES} padded caches: {peak} KiB")
    assert peak < RSS_BOUND_KIB, f"the controller's peak RSS {peak} KiB"
