"""Signature verification in the cache reconciler (controller/caches/signatures.py, docs/signatures.md),
in-process as the controller identity with its RBAC, against the real kube-apiserver, Debian's
docker-registry and images signed by the real cosign: the Verified condition and its reasons,
once per (digest, policy), policy changes, a registry outage keeping the last verdict, and the
agent's and the CSI driver's rule refusing what failed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry

from accelnode.kube.client import Client, Config
from accelnode.oci import signatures as sg
from agent.nodestatus import Cache
from controller.caches.reconciler import CacheReconciler
from controller.runtime.runner import Controller, Metrics
from controller.caches.pinning import Resolver
from controller.runtime.queue import Backoff
from controller.caches.signatures import POLICY_GROUP, POLICY_PLURAL, POLICY_VERSION, Signer
from csi_driver.resolve import CacheRef, ResolveError, check_verified
from tests.agent.conftest import eventually
from tests.cache.cosign import Cosign
from tests.cache.test_signatures_keyless import CA, EMAIL, ISSUER
from tests.cache.test_signatures_keyless import _sign as keyless_sign
from tests.controller.test_caches import World, caches_rbac, cond, uid  # noqa: F401 (fixture)
from tests.fixtures.cluster import load_manifests
from tests.fixtures.registry import RunningRegistry


@pytest.fixture(scope="module")
def cosign(tmp_path_factory):
    return Cosign(tmp_path_factory.mktemp("cosign-ctl"))


@pytest.fixture(scope="module")
def own_registry(tmp_path_factory):
    """A registry of this module's own: one test stops it."""
    reg = RunningRegistry(tmp_path_factory.mktemp("sig-registry"))
    yield reg
    reg.stop()


@pytest.fixture
def world(kube_api, control_plane, caches_rbac):  # noqa: F811
    w = World(kube_api, control_plane)
    yield w
    w.cleanup()


class Policies:
    def __init__(self, kube_api):
        self.objs = client.CustomObjectsApi(kube_api("admin"))
        self.names: list[str] = []

    def put(self, name: str, keys: dict[str, str], *, namespaces=(), cluster=False, extra: dict | None = None) -> None:
        body = {"apiVersion": f"{POLICY_GROUP}/{POLICY_VERSION}", "kind": "ClusterCacheTrustPolicy",
                "metadata": {"name": name},
                "spec": {"namespaces": list(namespaces), "clusterCaches": cluster, **(extra or {})}}
        if keys:
            body["spec"]["keys"] = [{"name": k, "publicKey": v} for k, v in keys.items()]
        if name in self.names:
            cur = self.objs.get_cluster_custom_object(POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL, name)
            body["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
            self.objs.replace_cluster_custom_object(POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL, name, body)
        else:
            self.objs.create_cluster_custom_object(POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL, body)
            self.names.append(name)

    def cleanup(self) -> None:
        for name in self.names:
            self.objs.delete_cluster_custom_object(POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL, name)


@pytest.fixture
def policies(kube_api, caches_rbac):  # noqa: F811
    p = Policies(kube_api)
    yield p
    p.cleanup()


@pytest.fixture
def signed(control_plane, caches_rbac, own_registry):  # noqa: F811
    """Both cache reconcilers in-process with one Signer each (their verification counters)."""
    me = Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")), user_agent="accelnode-controller")
    resolver = Resolver(own_registry.options(timeout=5))
    signers = {False: Signer(resolver.options, timeout=5), True: Signer(resolver.options, timeout=5)}
    ctls = [Controller(me, CacheReconciler(me, resolver, cluster=c, signer=signers[c]), Metrics(CollectorRegistry()),
                       workers=2, resync=0.5, backoff=Backoff(0.2, 1.0)).start() for c in (False, True)]
    yield signers
    for c in ctls:
        c.stop(10)


def labelled(world, name, image, namespace, fmt):
    body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache",
            "metadata": {"name": name, "labels": {sg.SIGNATURE_FORMAT_LABEL: fmt}}, "spec": {"image": image}}
    world.objs.create_namespaced_custom_object("gkm.io", "v1alpha1", namespace, "gkmcaches", body=body)


def verified(world, name, namespace=None, *, not_reason=None) -> dict:
    def check():
        c = cond(world.get(name, namespace), "Verified")
        return c if c and c.get("reason") != not_reason else None
    return eventually(check, timeout=30)


def _push(reg, repo, marker):
    pinned = reg.push_raw(repo, "v1", layers=[("application/vnd.oci.image.layer.v1.tar", marker.encode())])
    return f"{reg.host}/{repo}:v1", pinned


@pytest.mark.parametrize("fmt", (sg.V2, sg.V3))
def test_labelled_cache_verified_once_and_refused_when_wrong(world, policies, signed, own_registry, cosign,
                                                             kube_namespace, fmt):
    key, pub = cosign.keypair("trusted")
    bad_key, _ = cosign.keypair("untrusted")
    good_tag, good = _push(own_registry, f"ctl/good-{fmt}-{uid()}", f"good {fmt}")
    bad_tag, bad = _push(own_registry, f"ctl/bad-{fmt}-{uid()}", f"bad {fmt}")
    cosign.sign(good, key, fmt)
    cosign.sign(bad, bad_key, fmt)
    policies.put(f"p-{fmt}", {"trusted": pub}, namespaces=[kube_namespace])
    labelled(world, "good", good_tag, kube_namespace, fmt)
    labelled(world, "bad", bad_tag, kube_namespace, fmt)
    ok = verified(world, "good", kube_namespace)
    assert (ok["status"], ok["reason"]) == ("True", sg.VERIFIED), ok
    no = verified(world, "bad", kube_namespace)
    assert (no["status"], no["reason"]) == ("False", sg.WRONG_KEY), no
    obj = world.get("bad", kube_namespace)
    assert obj["status"]["conditions"][0]["reason"] == "Unverified"
    # cosign agrees with both verdicts
    assert cosign.verify(good, pub, fmt) and not cosign.verify(bad, pub, fmt)
    # the node side: never pulled, never mounted, the reason named
    assert Cache.from_object(obj).refused and Cache.from_object(world.get("good", kube_namespace)).refused is None
    trust = world.objs.list_cluster_custom_object("accelnode.io", "v1alpha1", "clustercachetrustpolicies")["items"]
    with pytest.raises(ResolveError) as e:
        check_verified(CacheRef("bad", kube_namespace), obj["metadata"].get("labels") or {},
                       obj["status"], obj["status"]["resolvedDigest"], trust)
    assert e.value.code == "FAILED_PRECONDITION" and sg.WRONG_KEY in str(e.value)
    # the controller's verdict names the digest it judged: the driver mounts that one, no other
    good_obj = world.get("good", kube_namespace)
    assert good_obj["status"]["verification"]["digest"] == good_obj["status"]["resolvedDigest"]
    assert good_obj["status"]["verification"]["policies"] == [f"p-{fmt}@1"]
    args = (CacheRef("good", kube_namespace), good_obj["metadata"]["labels"], good_obj["status"])
    check_verified(*args, good_obj["status"]["resolvedDigest"], trust)
    with pytest.raises(ResolveError) as e:
        check_verified(*args, obj["status"]["resolvedDigest"], trust)
    assert e.value.code == "UNAVAILABLE"
    # steady state: resyncs and our own status writes verify nothing again
    n = signed[False].verifications
    assert n == 2
    world.objs.patch_namespaced_custom_object("gkm.io", "v1alpha1", kube_namespace, "gkmcaches", "good",
                                              body={"metadata": {"finalizers": ["example.com/keep"]}})
    eventually(lambda: world.get("good", kube_namespace)["metadata"].get("finalizers"), timeout=10)
    world.objs.patch_namespaced_custom_object("gkm.io", "v1alpha1", kube_namespace, "gkmcaches", "good",
                                              body={"metadata": {"finalizers": None}})

    time.sleep(2)  # several resyncs (0.5 s)
    assert signed[False].verifications == n
    # policy change: trust the other key too -> "bad" verifies now; "good" is verified again once
    _, other_pub = cosign.keypair("untrusted")
    policies.put(f"p-{fmt}", {"trusted": pub, "untrusted": other_pub}, namespaces=[kube_namespace])
    now_ok = verified(world, "bad", kube_namespace, not_reason=sg.WRONG_KEY)
    assert (now_ok["status"], now_ok["reason"]) == ("True", sg.VERIFIED), now_ok
    eventually(lambda: signed[False].verifications == n + 2, timeout=20)
    time.sleep(1.5)
    assert signed[False].verifications == n + 2


def test_no_policy_unsigned_and_cluster_caches(world, policies, signed, own_registry, cosign, kube_namespace):
    key, pub = cosign.keypair("trusted")
    tag, pinned = _push(own_registry, f"ctl/nopolicy-{uid()}", "no policy")
    labelled(world, "lonely", tag, kube_namespace, sg.V3)
    no = verified(world, "lonely", kube_namespace)
    assert (no["status"], no["reason"]) == ("False", "NoPolicy"), no
    # an unlabelled GKMCache is unaffected
    world.cache("plain", tag, kube_namespace)
    eventually(lambda: world.get("plain", kube_namespace).get("status", {}).get("resolvedDigest"), timeout=30)
    assert cond(world.get("plain", kube_namespace), "Verified") == {}
    # a ClusterGKMCache covered by a policy: both formats looked for without the label
    policies.put("cluster", {"trusted": pub}, cluster=True)
    name = f"c-{uid()}"
    world.cache(name, tag)
    c = verified(world, name)
    assert (c["status"], c["reason"]) == ("False", sg.UNSIGNED), c
    cosign.sign(pinned, key, sg.V2)
    policies.put("cluster", {"trusted": pub, "again": pub}, cluster=True)  # a policy change re-evaluates
    c = verified(world, name, not_reason=sg.UNSIGNED)
    assert (c["status"], c["reason"]) == ("True", sg.VERIFIED), c


@pytest.mark.parametrize("fmt", (sg.V2, sg.V3))
def test_keyless_identity_verified_and_wrong_identity_refused(world, policies, signed, own_registry, cosign,
                                                              kube_namespace, fmt):
    ca = CA(cosign.workdir, f"ctl-{fmt}")
    tag, pinned = _push(own_registry, f"ctl/keyless-{fmt}-{uid()}", f"keyless {fmt}")
    key, crt = ca.leaf(cosign, f"ctl-leaf-{fmt}")
    keyless_sign(cosign, ca, pinned, key, crt, fmt)
    roots = [{"name": "ca", "certificate": ca.root_pem, "intermediates": ca.mid_pem}]
    policies.put(f"k-{fmt}", {}, namespaces=[kube_namespace],
                 extra={"keyless": [{"issuer": ISSUER, "subject": EMAIL}], "trustRoots": roots})
    labelled(world, "kl", tag, kube_namespace, fmt)
    ok = verified(world, "kl", kube_namespace)
    assert (ok["status"], ok["reason"]) == ("True", sg.VERIFIED), ok
    # the same image under a policy trusting another subject: refused, the signer named
    policies.put(f"k-{fmt}", {}, namespaces=[kube_namespace],
                 extra={"keyless": [{"issuer": ISSUER, "subject": "someone@else.test"}], "trustRoots": roots})
    no = verified(world, "kl", kube_namespace, not_reason=sg.VERIFIED)
    assert (no["status"], no["reason"]) == ("False", sg.WRONG_IDENTITY), no
    assert EMAIL in no["message"]


def test_registry_down_keeps_the_last_verdict(world, policies, signed, own_registry, cosign, kube_namespace,
                                              ):
    key, pub = cosign.keypair("trusted")
    tag, pinned = _push(own_registry, f"ctl/outage-{uid()}", "outage")
    cosign.sign(pinned, key, sg.V3)
    policies.put("outage", {"trusted": pub}, namespaces=[kube_namespace])
    labelled(world, "kept", tag, kube_namespace, sg.V3)
    ok = verified(world, "kept", kube_namespace)
    assert ok["status"] == "True", ok
    own_registry.stop()  # the module's last use of it
    policies.put("outage", {"trusted": pub, "second": pub}, namespaces=[kube_namespace])
    stale = verified(world, "kept", kube_namespace, not_reason=sg.VERIFIED)
    assert (stale["status"], stale["reason"]) == ("True", "VerificationStale"), stale
    assert "keeping the verdict of" in stale["message"]
    obj = world.get("kept", kube_namespace)
    assert Cache.from_object(obj).refused is None  # still usable, not flapping
    # the node's rule too: the same digest, under the policy as it is now, with its key still trusted
    assert obj["status"]["verification"]["policies"] == ["outage@2"]
    trust = world.objs.list_cluster_custom_object("accelnode.io", "v1alpha1", "clustercachetrustpolicies")["items"]
    check_verified(CacheRef("kept", kube_namespace), obj["metadata"]["labels"], obj["status"],
                   obj["status"]["resolvedDigest"], trust)


def test_rbac_the_controller_reads_policies_and_never_writes_them(control_plane, policies, cosign):
    """daemonsets/rbac-controller-caches.yaml: list and watch the trust policies, nothing more."""
    from tests.controller.test_rbac import forbidden

    _, pub = cosign.keypair("trusted")
    policies.put("rbac", {"trusted": pub}, namespaces=["default"])
    me = Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")))
    path = f"/apis/{POLICY_GROUP}/{POLICY_VERSION}/{POLICY_PLURAL}"
    assert any(p["metadata"]["name"] == "rbac" for p in me.request("GET", path)["items"])
    body = {"apiVersion": f"{POLICY_GROUP}/{POLICY_VERSION}", "kind": "ClusterCacheTrustPolicy",
            "metadata": {"name": "mine"}, "spec": {"keys": [{"name": "k", "publicKey": pub}]}}
    forbidden(me, "POST", path, body)
    forbidden(me, "PUT", f"{path}/rbac", body={**body, "metadata": {"name": "rbac"}})
    forbidden(me, "DELETE", f"{path}/rbac")
    forbidden(me, "GET", f"{path}/rbac")  # reads come from its watch only


def test_the_crd_refuses_a_policy_without_keys(kube_api, caches_rbac):  # noqa: F811
    objs = client.CustomObjectsApi(kube_api("admin"))
    for spec in ({"keys": []}, {"namespaces": ["Not_A_Namespace"], "keys": [{"name": "k", "publicKey": "x"}]},
                 {"keys": [{"name": "k"}]}):
        with pytest.raises(client.ApiException) as e:
            objs.create_cluster_custom_object(POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL, body={
                "apiVersion": f"{POLICY_GROUP}/{POLICY_VERSION}", "kind": "ClusterCacheTrustPolicy",
                "metadata": {"name": "invalid"}, "spec": spec})
        assert e.value.status == 422, spec


def test_keyless_identity_without_subject_refused_by_the_api_server(policies):
    bad = [({"keyless": [{"issuer": ISSUER}], "trustRoots": [{"name": "r", "certificate": "x"}]}, "subject"),
           ({"keyless": [{"subject": EMAIL}], "trustRoots": [{"name": "r", "certificate": "x"}]}, "issuer"),
           ({"keyless": [{"issuer": ISSUER, "subject": EMAIL}]}, "trustRoots"),
           ({}, "keys")]
    for i, (spec, field) in enumerate(bad):
        with pytest.raises(client.ApiException) as e:
            policies.put(f"bad-{i}", {}, extra=spec)
        assert e.value.status == 422 and field in e.value.body, e.value.body
    # the example is valid as written
    (example,) = load_manifests(Path(__file__).parents[2] / "examples/signatures/policy-keyless.yaml")
    policies.put(example["metadata"]["name"], {}, extra=example["spec"])
