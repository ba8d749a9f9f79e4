"""controller/caches/signatures.py's decisions without a server: which caches need a signature, the verdict
kept across a restart (read back from the condition), the last verdict kept through an outage,
policies that cannot be used. The registry round trip is a counting stand-in here; the real one
is tests/controller/test_signatures.py and tests/cache/test_signatures.py."""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from accelnode.oci import signatures as sg
from accelnode.oci.errors import RegistryUnavailable
from accelnode.oci.registry import RegistryOptions
from controller.caches.pinning import Pin
from controller.caches.signatures import Signer, parse_policy

D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
PEM = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def policy(name="p", gen=1, namespaces=("team",), cluster=False, require=False, pem=PEM):
    return parse_policy({"metadata": {"name": name, "generation": gen},
                         "spec": {"namespaces": list(namespaces), "clusterCaches": cluster, "requireSignature": require,
                                  "keys": [{"name": "k", "publicKey": pem}]}})


class Verify:
    def __init__(self, verdict=sg.Verdict(True, sg.VERIFIED, "signed by k")):
        self.calls, self.verdict, self.down = 0, verdict, False

    def __call__(self, image, digest, keys, options, *, formats, timeout, keyless=()):
        self.calls += 1
        if self.down:
            raise RegistryUnavailable("connection refused", image)
        return self.verdict


def cache(labels=None, verified=None):
    return {"metadata": {"labels": labels or {}}, "status": {"conditions": [verified] if verified else []}}


LABEL = {sg.SIGNATURE_FORMAT_LABEL: sg.V3}


def test_which_caches_need_a_signature():
    s = Signer(RegistryOptions(), verify=Verify())
    pin = Pin("r.example/x:v1", D1, None)
    assert s.outcome("team/a", cache(), pin, "team", [policy()], None) is None  # unlabelled: unaffected
    assert s.outcome("c", cache(), pin, None, [policy()], None) is None  # cluster caches not covered
    assert s.outcome("c", cache(), pin, None, [policy(cluster=True)], None).status == "True"
    assert s.outcome("team/a", cache(), pin, "team", [policy(require=True)], None).status == "True"
    no = s.outcome("other/a", cache(LABEL), pin, "other", [policy()], None)
    assert (no.status, no.reason) == ("False", "NoPolicy")
    bad = s.outcome("team/a", cache({sg.SIGNATURE_FORMAT_LABEL: "gpg"}), pin, "team", [policy()], None)
    assert (bad.status, bad.reason) == ("False", "UnknownSignatureFormat")
    broken = s.outcome("team/a", cache(LABEL), pin, "team", [policy(pem="not a key")], None)
    assert (broken.status, broken.reason) == ("False", "InvalidPolicy")


def test_once_per_digest_and_policy_even_across_a_restart():
    v = Verify()
    pin = Pin("r.example/x:v1", D1, None)
    first = Signer(RegistryOptions(), verify=v).outcome("team/a", cache(LABEL), pin, "team", [policy()], None)
    assert v.calls == 1
    cond = {"type": "Verified", "status": first.status, "reason": first.reason, "message": first.message}
    restarted = Signer(RegistryOptions(), verify=v)
    again = restarted.outcome("team/a", cache(LABEL, cond), pin, "team", [policy()], cond)
    assert v.calls == 1 and again.status == "True"
    restarted.outcome("team/a", cache(LABEL, cond), pin, "team", [policy(gen=2)], cond)  # the policy changed
    assert v.calls == 2
    restarted.outcome("team/a", cache(LABEL, cond), Pin(pin.image, D2, None), "team", [policy(gen=2)], cond)
    assert v.calls == 3  # a new digest


def test_outage_keeps_the_last_verdict_for_this_digest_only():
    v = Verify(sg.Verdict(False, sg.WRONG_KEY, "not ours"))
    s = Signer(RegistryOptions(), verify=v)
    pin = Pin("r.example/x:v1", D1, None)
    first = s.outcome("team/a", cache(LABEL), pin, "team", [policy()], None)
    cond = {"type": "Verified", "status": first.status, "reason": first.reason, "message": first.message}
    v.down = True
    stale = s.outcome("team/a", cache(LABEL, cond), pin, "team", [policy(gen=2)], cond)
    assert (stale.status, stale.reason, stale.retry) == ("False", "VerificationStale", True)
    assert "WrongKey" not in stale.reason and "not ours" in stale.message
    other = s.outcome("team/a", cache(LABEL, cond), Pin(pin.image, D2, None), "team", [policy(gen=2)], cond)
    assert (other.status, other.reason) == ("Unknown", "RegistryUnavailable")  # no verdict of D2 to keep
    v.down = False
    healed = s.outcome("team/a", cache(LABEL, cond), pin, "team", [policy(gen=2)],
                       {**cond, "reason": stale.reason, "message": stale.message})
    assert (healed.status, healed.reason) == ("False", sg.WRONG_KEY)


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
