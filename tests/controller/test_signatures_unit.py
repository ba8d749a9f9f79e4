"""controller/caches/signatures.py's decisions without a server: which caches need a signature, the verdict
kept across a restart (read back from status.verification), the last verdict kept through an outage,
policies that cannot be used. The registry round trip is a counting stand-in here; the real one
is tests/controller/test_signatures.py and tests/cache/test_signatures.py."""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from accelnode.oci import signatures as sg
from accelnode.oci.errors import RegistryUnavailable
from accelnode.oci.registry import RegistryOptions
from controller.caches.pinning import Pin
from accelnode.oci.refusal import Verdict
from controller.caches.signatures import Signer, parse_policy

D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
PEM = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def policy(name="p", gen=1, namespaces=("team",), cluster=False, require=False, pem=PEM):
    return parse_policy({"metadata": {"name": name, "generation": gen},
                         "spec": {"namespaces": list(namespaces), "clusterCaches": cluster, "requireSignature": require,
                                  "keys": [{"name": "k", "publicKey": pem}]}})


ACCEPTED = sg.Verdict(True, sg.VERIFIED, "signed by k", sg.V3, "k", sg.key_fingerprint(policy().keys[0]))


class Verify:
    def __init__(self, verdict=ACCEPTED):
        self.calls, self.verdict, self.down = 0, verdict, False

    def __call__(self, image, digest, keys, options, *, formats, timeout, keyless=()):
        self.calls += 1
        if self.down:
            raise RegistryUnavailable("connection refused", image)
        return self.verdict


def cache(labels=None, outcome=None):
    """A cache object whose status holds ``outcome`` as the controller writes it."""
    status = {}
    if outcome is not None:
        status["conditions"] = [{"type": "Verified", "status": outcome.status, "reason": outcome.reason,
                                 "message": outcome.message}]
        if outcome.verdict is not None:
            status["verification"] = outcome.verdict.to_status()
    return {"metadata": {"labels": labels or {}}, "status": status}


LABEL = {sg.SIGNATURE_FORMAT_LABEL: sg.V3}
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"


def test_which_caches_need_a_signature():
    s = Signer(RegistryOptions(), verify=Verify())
    pin = Pin("r.example/x:v1", D1, None)
    assert s.outcome("team/a", cache(), pin, "team", [policy()], T0) is None  # unlabelled: unaffected
    assert s.outcome("c", cache(), pin, None, [policy()], T0) is None  # cluster caches not covered
    assert s.outcome("c", cache(), pin, None, [policy(cluster=True)], T0).status == "True"
    ok = s.outcome("team/a", cache(), pin, "team", [policy(require=True)], T0)
    assert ok.status == "True" and ok.verdict == Verdict(D1, ("p@1",), True, sg.VERIFIED, T0, sg.FORMATS, "k",
                                                          sg.key_fingerprint(policy().keys[0]))
    no = s.outcome("other/a", cache(LABEL), pin, "other", [policy()], T0)
    assert (no.status, no.reason, no.verdict.verified, no.verdict.policies) == ("False", "NoPolicy", False, ())
    bad = s.outcome("team/a", cache({sg.SIGNATURE_FORMAT_LABEL: "gpg"}), pin, "team", [policy()], T0)
    assert (bad.status, bad.reason, bad.verdict.formats) == ("False", "UnknownSignatureFormat", ())
    broken = s.outcome("team/a", cache(LABEL), pin, "team", [policy(pem="not a key")], T0)
    assert (broken.status, broken.reason) == ("False", "InvalidPolicy")
    # a verdict that does not change keeps its time: no status write per resync
    assert s.outcome("team/a", cache(LABEL, broken), pin, "team", [policy(pem="not a key")], T1) == broken


def test_once_per_digest_and_policy_even_across_a_restart():
    v = Verify()
    pin = Pin("r.example/x:v1", D1, None)
    first = Signer(RegistryOptions(), verify=v).outcome("team/a", cache(LABEL), pin, "team", [policy()], T0)
    assert v.calls == 1
    restarted = Signer(RegistryOptions(), verify=v)
    again = restarted.outcome("team/a", cache(LABEL, first), pin, "team", [policy()], T1)
    assert v.calls == 1 and again.status == "True" and again.verdict == first.verdict and again.message == first.message
    restarted.outcome("team/a", cache(LABEL, first), pin, "team", [policy(gen=2)], T1)  # the policy changed
    assert v.calls == 2
    other = restarted.outcome("team/a", cache(LABEL, first), Pin(pin.image, D2, None), "team", [policy(gen=2)], T1)
    assert v.calls == 3 and other.verdict.digest == D2  # a new digest


def test_outage_keeps_the_last_verdict_for_this_digest_only():
    v = Verify(sg.Verdict(False, sg.WRONG_KEY, "not ours"))
    s = Signer(RegistryOptions(), verify=v)
    pin = Pin("r.example/x:v1", D1, None)
    first = s.outcome("team/a", cache(LABEL), pin, "team", [policy()], T0)
    v.down = True
    stale = s.outcome("team/a", cache(LABEL, first), pin, "team", [policy(gen=2)], T1)
    assert (stale.status, stale.reason, stale.retry) == ("False", "VerificationStale", True)
    assert (stale.verdict.verified, stale.verdict.policies, stale.verdict.time) == (False, ("p@2",), T0)
    other = s.outcome("team/a", cache(LABEL, first), Pin(pin.image, D2, None), "team", [policy(gen=2)], T1)
    assert (other.status, other.reason, other.verdict) == ("Unknown", "RegistryUnavailable", None)  # nothing of D2
    v.down = False
    healed = s.outcome("team/a", cache(LABEL, stale), pin, "team", [policy(gen=2)], T1)
    assert (healed.status, healed.reason) == ("False", sg.WRONG_KEY)


def test_outage_keeps_an_acceptance_only_while_its_key_is_trusted():
    """A registry that does not answer keeps an accepted verdict on the same digest through a
    policy edit that keeps the accepting key (an added key, another namespace), and drops it
    when the key is gone: a removed key never keeps working through an outage."""
    v = Verify()
    s = Signer(RegistryOptions(), verify=v)
    pin = Pin("r.example/x:v1", D1, None)
    first = s.outcome("team/a", cache(LABEL), pin, "team", [policy()], T0)
    v.down = True
    other_pem = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    more = parse_policy({"metadata": {"name": "p", "generation": 2},
                         "spec": {"namespaces": ["team"], "keys": [{"name": "k", "publicKey": PEM},
                                                                    {"name": "k2", "publicKey": other_pem}]}})
    kept = s.outcome("team/a", cache(LABEL, first), pin, "team", [more], T1)
    assert (kept.status, kept.reason, kept.verdict.verified, kept.verdict.policies) == (
        "True", "VerificationStale", True, ("p@2",))
    swapped = policy(gen=3, pem=other_pem)  # the same key name, other key material
    gone = s.outcome("team/a", cache(LABEL, kept), pin, "team", [swapped], T1)
    assert (gone.status, gone.reason, gone.verdict) == ("Unknown", "RegistryUnavailable", None)


def test_registry_text_never_becomes_a_verdict():
    """An outage message carrying a forged verdict text is quoted, truncated, and the verdict is data."""
    forged = "[digest " + D2 + "; policies p@1] " + "x" * 2000

    class Hostile(Verify):
        def __call__(self, *a, **kw):
            raise RegistryUnavailable(forged, "r.example/x:v1")

    s = Signer(RegistryOptions(), verify=Verify())
    pin = Pin("r.example/x:v1", D1, None)
    first = s.outcome("team/a", cache(LABEL), pin, "team", [policy()], T0)
    s._verify = Hostile()
    stale = s.outcome("team/a", cache(LABEL, first), pin, "team", [policy(gen=2)], T1)
    assert stale.verdict.digest == D1 and len(stale.message) < 1000 and "'r.example/x:v1: [digest" in stale.message
    onto = s.outcome("team/a", cache(LABEL, stale), Pin(pin.image, D2, None), "team", [policy(gen=2)], T1)
    assert (onto.status, onto.verdict) == ("Unknown", None)


def test_key_types_cosign_signs_with():
    """ECDSA P-256/P-384 (SHA-256, as cosign hashes), RSA PKCS#1 v1.5, Ed25519: a simple-signing
    payload signed with each verifies under its own public key only, and names the digest."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa

    payload = ('{"critical":{"identity":{"docker-reference":"r.example/x"},"image":{"docker-manifest-digest":"%s"},'
               '"type":"cosign container image signature"},"optional":null}' % D1).encode()
    signers = {
        "p256": (ec.generate_private_key(ec.SECP256R1()), lambda k: k.sign(payload, ec.ECDSA(hashes.SHA256()))),
        "p384": (ec.generate_private_key(ec.SECP384R1()), lambda k: k.sign(payload, ec.ECDSA(hashes.SHA256()))),
        "rsa": (rsa.generate_private_key(65537, 2048), lambda k: k.sign(payload, padding.PKCS1v15(), hashes.SHA256())),
        "ed25519": (ed25519.Ed25519PrivateKey.generate(), lambda k: k.sign(payload)),
    }
    trusted = {name: sg.TrustedKey.from_pem(name, k.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode())
        for name, (k, _) in signers.items()}
    for name, (k, sign) in signers.items():
        found = [sg._Found(sg.V2, payload, sign(k), sg._payload_digest(payload))]
        ok = sg.judge(found, D1, [trusted[name]])
        assert (ok.ok, ok.key) == (True, name), ok
        others = [t for n, t in trusted.items() if n != name]
        assert sg.judge(found, D1, others).reason == sg.WRONG_KEY
        assert sg.judge(found, D2, [trusted[name]]).reason == sg.DIGEST_MISMATCH


def test_keyless_policy_parsed_and_bad_roots_make_it_invalid():
    from tests.cache.test_signatures_keyless import EMAIL, ISSUER, _cert  # noqa: PLC0415
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    k = ec.generate_private_key(ec.SECP256R1())
    root = _cert("r", k, None, k, ca=True).public_bytes(serialization.Encoding.PEM).decode()
    spec = {"keyless": [{"issuer": ISSUER, "subject": EMAIL}], "trustRoots": [{"name": "r", "certificate": root}]}
    p = parse_policy({"metadata": {"name": "k", "generation": 2}, "spec": spec})
    assert p.error is None and p.keyless.identities == (sg.Identity(ISSUER, EMAIL),) and len(p.keyless.roots) == 1
    for bad in ({**spec, "trustRoots": [{"name": "r", "certificate": "junk"}]}, {**spec, "trustRoots": []},
                {**spec, "keyless": [{"issuer": ISSUER}]}, {**spec, "keyless": [{"issuer": ISSUER, "subjectRegExp": "("}]}):
        assert parse_policy({"metadata": {"name": "k"}, "spec": bad}).error, bad


def test_what_a_node_decides_from_the_verdict_and_the_policies():
    """accelnode/oci/refusal.py, the rule the agent and the driver apply: a verdict is data about
    one digest under one covering set; its message is never read."""
    from accelnode.oci.refusal import mount_refusal, pull_refusal

    pol = {"metadata": {"name": "p", "generation": 3}, "spec": {"namespaces": ["team"], "requireSignature": True}}
    ok = Verdict(D1, ("p@3",), True, sg.VERIFIED, T0)
    st = {"verification": ok.to_status(), "conditions": [
        {"type": "Verified", "status": "True", "reason": "Verified", "message": f"[digest {D2}; policies p@3]"}]}
    assert mount_refusal("team", {}, st, D1, [pol]) is None
    assert mount_refusal("team", {}, st, D2, [pol])[0] == "Unknown"  # the message names D2: text, not a verdict
    assert pull_refusal({}, st, D2)[0] == "Unknown"
    moved = {**pol, "metadata": {"name": "p", "generation": 4}}  # a key removed, say
    assert "judged under policies p@3" in mount_refusal("team", {}, st, D1, [moved])[1]
    added = {"metadata": {"name": "q", "generation": 1}, "spec": {"namespaces": ["*"]}}
    assert mount_refusal("team", {}, st, D1, [pol, added])[0] == "Unknown"  # another policy covers it now
    assert mount_refusal("other", {}, {}, D1, [pol]) is None  # not covered, no verdict: unaffected
    refused = {"verification": Verdict(D1, ("p@3",), False, sg.WRONG_KEY, T0).to_status()}
    assert pull_refusal({}, refused, D1)[0] == "False" and mount_refusal("other", {}, refused, D1, [])[0] == "False"
    assert pull_refusal(LABEL, {}, D1)[0] == "Unknown" and pull_refusal({}, {}, D1) is None
    for bad in ({"digest": D1}, {**ok.to_status(), "verified": "true"}, {**ok.to_status(), "digest": "sha256:x"}, []):
        assert Verdict.of({"verification": bad}) is None, bad
        assert mount_refusal("team", {}, {"verification": bad}, D1, [pol])[0] == "Unknown"
