"""Join tokens of node groups (controller/nodegroups/jointokens.py) against the real API server: the Secret
the bootstrap-token authenticator accepts (a request with the token is the bootstrapper user in
kubeadm's node group), reuse, renewal, revocation, and the CA hash kubeadm pins."""

from __future__ import annotations

import base64
import subprocess
import time
import uuid

import pytest

from accelnode.kube.client import Client, Config, KubeError
from controller.nodegroups.jointokens import (GROUP_LABEL, METADATA_KEYS, NODE_GROUP, POOL, SECRET_TYPE, TOKEN_RE,
                                              JoinInfo, JoinTokens, ca_cert_hash)

SECRETS = "/api/v1/namespaces/kube-system/secrets"


@pytest.fixture(scope="module")
def jointokens_rbac(kubectl):
    out = kubectl("admin", "apply", "-f", "daemonsets/namespace.yaml", "-f", "daemonsets/rbac-controller-jointokens.yaml")
    assert out.returncode == 0, out.stderr


@pytest.fixture
def me(control_plane, jointokens_rbac) -> Client:
    return Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")), user_agent="accelnode-controller")


@pytest.fixture
def admin(control_plane) -> Client:
    return Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")))


@pytest.fixture
def group() -> str:
    return f"ns-{uuid.uuid4().hex[:8]}-v6e"


class Ledger:
    """A group's token ids as the reconciler keeps them in the group's status."""

    def __init__(self, jt: JoinTokens, group: str):
        self.jt, self.group, self.ids = jt, group, []

    def ensure(self, control_plane: str = "10.0.0.2", jt: JoinTokens | None = None):
        return (jt or self.jt).ensure(self.group, control_plane, self.ids, set(), self.reserve)

    def reserve(self, ids: list[str]) -> None:
        self.ids = list(ids)

    def revoke(self) -> None:
        self.jt.revoke(self.group, self.ids)
        self.ids = []


def tokens(me: JoinTokens, admin: Client, group: str) -> dict:
    out = admin.request("GET", SECRETS, query={"labelSelector": f"{GROUP_LABEL}={group}"})
    return {s["metadata"]["name"]: s for s in out["items"]}


def unused_ids(admin: Client, n: int) -> tuple[str, ...]:
    """``n`` pool ids that no Secret and no certificate request names now (earlier tests' tokens
    may still be there, e.g. one left for the token cleaner): for tests that narrow the pool."""
    named = {((c.get("spec") or {}).get("username") or "").removeprefix("system:bootstrap:")
             for c in admin.request("GET", "/apis/certificates.k8s.io/v1/certificatesigningrequests")["items"]}
    have = {s["metadata"]["name"] for s in admin.request("GET", SECRETS)["items"]}
    ids = tuple(t for t in POOL if t not in named and f"bootstrap-token-{t}" not in have)[-n:]
    assert len(ids) == n, f"fewer than {n} pool ids unused by earlier tests"
    return ids


def whoami(control_plane, token: str) -> dict:
    c = Client(Config(control_plane.url, str(control_plane.ca_file), token=token))
    review = c.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                       body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    return review["status"]["userInfo"]


def test_a_new_token_is_a_kubeadm_node_bootstrap_token(control_plane, me, admin, group):
    jt = JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes())
    ledger = Ledger(jt, group)
    info = ledger.ensure("10.0.0.2")
    assert TOKEN_RE.match(info.token) and info.token_id in POOL
    tid, tsecret = info.token.split(".")
    secret = admin.request("GET", f"{SECRETS}/bootstrap-token-{tid}")
    assert secret["type"] == SECRET_TYPE
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data["token-id"] == tid and data["token-secret"] == tsecret
    assert data["usage-bootstrap-authentication"] == "true" and data["usage-bootstrap-signing"] == "true"
    assert data["auth-extra-groups"] == NODE_GROUP
    left = time.mktime(time.strptime(data["expiration"], "%Y-%m-%dT%H:%M:%SZ")) - time.mktime(time.gmtime())
    assert 3500 < left <= 3600
    # the API server's bootstrap-token authenticator takes it: kubeadm's joining-node identity
    user = whoami(control_plane, info.token)
    assert user["username"] == f"system:bootstrap:{tid}"
    assert {"system:bootstrappers", NODE_GROUP} <= set(user["groups"])
    assert info.metadata_items() == {"kubeadm-join-token": info.token, "kubeadm-control-plane-ip": "10.0.0.2",
                                     "kubeadm-ca-hash": info.ca_hash}
    assert tuple(info.metadata_items()) == METADATA_KEYS
    ledger.revoke()


def test_the_bootstrap_signer_signs_cluster_info_for_a_new_token(control_plane, me, group):
    jt = JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes())
    ledger = Ledger(jt, group)
    info = ledger.ensure("10.0.0.2")
    deadline = time.monotonic() + 60
    while not jt.signed(info) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert jt.signed(info), "kube-controller-manager's bootstrap signer did not sign cluster-info in 60s"
    ledger.revoke()
    deadline = time.monotonic() + 60
    while jt.signed(info) and time.monotonic() < deadline:  # the signer drops a deleted token's signature
        time.sleep(0.2)
    assert not jt.signed(info)


def test_the_token_is_reused_per_group_and_renewed_near_expiry(control_plane, me, admin, group):
    ca = control_plane.ca_file.read_bytes()
    jt = JoinTokens(me, ca_pem=ca)
    ledger, ledger_b = Ledger(jt, group), Ledger(jt, group + "-b")
    first = ledger.ensure("10.0.0.2:6443")
    assert ledger.ensure("10.0.0.2:6443") == first
    assert ledger.ids == [first.token_id]  # recorded (in the group's status) before it was made
    other = ledger_b.ensure("10.0.0.2:6443")
    assert other.token != first.token
    assert len(tokens(jt, admin, group)) == 1
    # 55 minutes later: 5 minutes left is too little for a VM to join with; a new token
    later = JoinTokens(me, ca_pem=ca, clock=lambda: time.time() + 3300)
    second = ledger.ensure("10.0.0.2:6443", later)
    assert second.token != first.token
    assert len(tokens(jt, admin, group)) == 2
    assert ledger.ensure("10.0.0.2:6443", later) == second  # the newer one is reused
    # after the first expired: it is deleted on the way
    much_later = JoinTokens(me, ca_pem=ca, clock=lambda: time.time() + 3700)
    assert ledger.ensure("10.0.0.2:6443", much_later) == second
    assert set(tokens(jt, admin, group)) == {f"bootstrap-token-{second.token_id}"}
    ledger.revoke()
    ledger_b.revoke()


def test_issue_makes_a_token_per_vm_and_get_reads_only_the_groups_live_ones(control_plane, me, admin, group):
    """The node groups' path (issue 33.5): ``issue`` never hands out a token twice, ``get`` gives
    a group's own token back while it has time left, and nothing of another group's."""
    ca = control_plane.ca_file.read_bytes()
    jt = JoinTokens(me, ca_pem=ca)
    ledger = Ledger(jt, group)
    a = jt.issue(group, "10.0.0.2", ledger.ids, set(), ledger.reserve)
    b = jt.issue(group, "10.0.0.2", ledger.ids, set(), ledger.reserve)
    assert a.token_id != b.token_id and sorted(ledger.ids) == sorted([a.token_id, b.token_id])
    assert jt.get(group, a.token_id, "10.0.0.2") == a
    assert jt.get(group + "-other", a.token_id, "10.0.0.2") is None  # not that group's
    late = JoinTokens(me, ca_pem=ca, clock=lambda: time.time() + 3300)  # 5 of its 60 minutes left: not offered
    assert late.get(group, a.token_id, "10.0.0.2") == a and not late.fresh(a) and jt.fresh(a)
    assert a.created and abs(a.created - time.time()) < 120  # the Secret's creationTimestamp (the server's clock)
    jt.revoke(group, [a.token_id])
    assert jt.get(group, a.token_id, "10.0.0.2") is None and jt.get(group, b.token_id, "10.0.0.2") == b
    ledger.revoke()


def test_revoke_deletes_the_groups_tokens_only(control_plane, me, admin, group):
    jt = JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes())
    ledger, ledger_b = Ledger(jt, group), Ledger(jt, group + "-b")
    info = ledger.ensure("cp.example:6443")
    kept = ledger_b.ensure("cp.example:6443")
    jt.revoke(group, ledger.ids + ledger_b.ids)  # the other group's token is not this group's: left alone
    assert tokens(jt, admin, group) == {}
    assert len(tokens(jt, admin, group + "-b")) == 1
    with pytest.raises(KubeError) as err:
        whoami(control_plane, info.token)
    assert err.value.code == 401
    assert whoami(control_plane, kept.token)["username"] == f"system:bootstrap:{kept.token_id}"
    ledger.revoke()  # nothing left: nothing to do
    ledger_b.revoke()
    assert tokens(jt, admin, group + "-b") == {}


def test_a_group_name_that_is_no_label_value_still_works(control_plane, me, admin):
    jt = JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes())
    group = f"team-{uuid.uuid4().hex[:6]}/v6e pool"
    ledger = Ledger(jt, group)
    info = ledger.ensure("10.0.0.2")
    assert ledger.ensure("10.0.0.2") == info
    ledger.revoke()
    with pytest.raises(KubeError):
        admin.request("GET", f"{SECRETS}/bootstrap-token-{info.token_id}")


def test_bad_input_is_refused_and_creates_nothing(control_plane, me, admin, group):
    jt = JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes())
    for bad in ("", "https://10.0.0.2:6443", "10.0.0.2 6443", "10.0.0.2/x"):
        with pytest.raises(ValueError, match="host\\[:port\\]"):
            jt.ensure(group, bad, [], set(), lambda ids: None)
    with pytest.raises(ValueError, match="node group name"):
        jt.ensure("", "10.0.0.2", [], set(), lambda ids: None)
    assert tokens(jt, admin, group) == {}
    with pytest.raises(ValueError, match="not a PEM certificate"):
        JoinTokens(me, ca_pem=b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="at least 60 s"):
        JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes(), ttl_s=10)


def test_the_ca_hash_is_kubeadms(control_plane):
    """kubeadm's documented recipe: the DER public key of the CA certificate, SHA-256."""
    pub = subprocess.run(["openssl", "x509", "-pubkey", "-noout", "-in", str(control_plane.ca_file)],
                         capture_output=True, check=True).stdout
    der = subprocess.run(["openssl", "pkey", "-pubin", "-outform", "der"], input=pub, capture_output=True,
                         check=True).stdout
    digest = subprocess.run(["openssl", "dgst", "-sha256", "-hex"], input=der, capture_output=True,
                            check=True).stdout.decode().split()[-1]
    assert ca_cert_hash(control_plane.ca_file.read_bytes()) == f"sha256:{digest}"


def test_the_token_never_shows_in_repr_or_logs(control_plane, me, group, caplog):
    caplog.set_level("DEBUG")
    ledger = Ledger(JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes()), group)
    info = ledger.ensure("10.0.0.2")
    secret = info.token.split(".")[1]
    assert secret not in repr(info) and secret not in str(info)
    logged = " ".join(str(r.__dict__) for r in caplog.records)  # messages and their kv fields
    assert info.token_id in logged and secret not in logged
    assert isinstance(info, JoinInfo)
    ledger.revoke()


SA = "system:serviceaccount:accelnode-system:accelnode-controller"


def sar(admin: Client, verb: str, namespace: str = "", name: str = "") -> bool:
    """The API server's own answer (SubjectAccessReview) to: may the controller's ServiceAccount
    ``verb`` Secrets (in ``namespace``, named ``name``)?"""
    attrs = {"verb": verb, "resource": "secrets", "version": "v1", "group": ""}
    attrs.update({k: v for k, v in (("namespace", namespace), ("name", name)) if v})
    review = admin.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", body={
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": SA, "groups": ["system:serviceaccounts", "system:serviceaccounts:accelnode-system",
                                        "system:authenticated"], "resourceAttributes": attrs}})
    return review["status"].get("allowed", False)


def test_the_controller_reads_and_deletes_no_secret_it_did_not_create(control_plane, me, admin, kube_namespace):
    """Issue 23.4: create only; get and delete only the pool's names; list and watch nothing;
    no other Secret anywhere. Asked of the API server (SubjectAccessReview) and tried for real."""
    for verb in ("list", "watch", "get", "delete", "update", "patch", "deletecollection"):
        for ns in ("", "kube-system", "default", "accelnode-system", kube_namespace):
            for name in ("", "victim", "bootstrap-token-abcdef"):
                if verb in ("list", "watch", "deletecollection") and name:
                    continue
                if not ns and name:
                    continue
                assert not sar(admin, verb, ns, name), (verb, ns, name)
    assert sar(admin, "create", "kube-system")
    assert not sar(admin, "create", "default") and not sar(admin, "create", kube_namespace)
    for name in ("bootstrap-token-acn000", "bootstrap-token-acn063"):
        assert sar(admin, "get", "kube-system", name) and sar(admin, "delete", "kube-system", name)
    assert not sar(admin, "get", "kube-system", "bootstrap-token-acn064")
    # real requests: someone else's Secrets, a kubeadm token of the admin's among them
    victims = [("kube-system", "victim"), ("kube-system", "bootstrap-token-abcdef"), (kube_namespace, "victim")]
    for ns, name in victims:
        admin.request("POST", f"/api/v1/namespaces/{ns}/secrets", body={
            "metadata": {"name": name}, "type": "Opaque", "stringData": {"k": "v"}})
    try:
        for path in ("/api/v1/secrets", SECRETS, f"/api/v1/namespaces/{kube_namespace}/secrets"):
            with pytest.raises(KubeError) as err:
                me.request("GET", path)
            assert err.value.code == 403, path
        for ns, name in victims:
            for method in ("GET", "DELETE"):
                with pytest.raises(KubeError) as err:
                    me.request(method, f"/api/v1/namespaces/{ns}/secrets/{name}")
                assert err.value.code == 403, (method, ns, name)
            assert admin.request("GET", f"/api/v1/namespaces/{ns}/secrets/{name}")["data"]["k"]
    finally:
        for ns, name in victims:
            admin.request("DELETE", f"/api/v1/namespaces/{ns}/secrets/{name}")


def test_a_pool_name_taken_by_someone_else_is_skipped_and_left_alone(control_plane, me, admin, group):
    """A Secret in the pool that is not the group's (an admin's token, another group's): never
    used, never deleted, even when the group's ledger names it."""
    jt = JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes())
    used = {s["metadata"]["name"] for s in admin.request("GET", SECRETS)["items"]}
    tid = next(t for t in reversed(POOL) if f"bootstrap-token-{t}" not in used)  # the cluster is shared
    body = {"metadata": {"name": f"bootstrap-token-{tid}"}, "type": SECRET_TYPE,
            "stringData": {"token-id": tid, "token-secret": "0123456789abcdef",
                           "usage-bootstrap-authentication": "true"}}
    admin.request("POST", SECRETS, body=body)
    try:
        ledger = Ledger(jt, group)
        ledger.ids = [tid]  # as if the group had recorded it
        info = ledger.ensure()
        assert info.token_id != tid and tid not in ledger.ids
        jt.revoke(group, [tid])
        assert admin.request("GET", f"{SECRETS}/bootstrap-token-{tid}")
        ledger.revoke()
    finally:
        admin.request("DELETE", f"{SECRETS}/bootstrap-token-{tid}")


def test_the_rbac_names_exactly_the_pool():
    import yaml

    docs = list(yaml.safe_load_all(open("daemonsets/rbac-controller-jointokens.yaml")))
    rules = [r for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == "kube-system"
             for r in d["rules"] if "secrets" in r["resources"]]
    assert sorted(r["verbs"] for r in rules) == [["create"], ["get", "delete"]]
    named = next(r for r in rules if "get" in r["verbs"])
    assert named["resourceNames"] == [f"bootstrap-token-{t}" for t in POOL]
    assert "resourceNames" not in next(r for r in rules if r["verbs"] == ["create"])  # RBAC cannot narrow create


def test_an_expired_token_is_refused_and_cleaned_up_by_the_cluster(control_plane, me, admin, group):
    """A token whose expiration passed: the API server's authenticator refuses it and
    kube-controller-manager's token cleaner deletes its Secret."""
    made_long_ago = JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes(), clock=lambda: time.time() - 4000)
    info = Ledger(made_long_ago, group).ensure("10.0.0.2")
    with pytest.raises(KubeError) as err:
        whoami(control_plane, info.token)
    assert err.value.code == 401
    deadline = time.monotonic() + 60
    while tokens(made_long_ago, admin, group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tokens(made_long_ago, admin, group) == {}


def test_an_id_some_certificate_request_names_is_drawn_last(control_plane, me, admin, group, monkeypatch):
    """Ids come from a fixed pool and are reused; requests made with an id's earlier token stay
    for an hour or more. ``issue`` draws the ids no request names first, then the one whose
    newest request is oldest."""
    from controller.nodegroups import jointokens

    ids = unused_ids(admin, 3)
    monkeypatch.setattr(jointokens, "POOL", ids)
    named, old_named, unnamed = ids
    jt = JoinTokens(me, ca_pem=control_plane.ca_file.read_bytes())
    ledger = Ledger(jt, group)
    requested = {named: time.time(), old_named: time.time() - 600}
    try:
        got = [jt.issue(group, "10.0.0.2", ledger.ids, set(), ledger.reserve, requested=requested).token_id
               for _ in range(3)]
    finally:
        ledger.revoke()
    assert got == [unnamed, old_named, named]
