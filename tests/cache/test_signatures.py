"""accelnode.oci.signatures against signatures the real cosign wrote into Debian's docker-registry,
in both formats, with cosign's own ``verify`` as the reference: where cosign accepts, we accept;
where it refuses, we refuse (docs/signatures.md)."""

from __future__ import annotations

import base64
import json

import pytest

from accelnode.oci import signatures as sg
from accelnode.oci.errors import RegistryUnavailable
from accelnode.oci.registry import RegistryOptions
from tests.cache.cosign import Cosign, get_blob, get_manifest, put_blob, put_manifest

FORMATS = (sg.V2, sg.V3)


@pytest.fixture(scope="module")
def cosign(tmp_path_factory):
    return Cosign(tmp_path_factory.mktemp("cosign"))


def _image(registry, repo: str, marker: str) -> tuple[str, str]:
    pinned = registry.push_raw(repo, "v1", layers=[("application/vnd.oci.image.layer.v1.tar", marker.encode())])
    return pinned, pinned.rsplit("@", 1)[1]


def _ours(registry, image: str, digest: str, pub: str, fmt: str) -> sg.Verdict:
    return sg.verify(image, digest, [sg.TrustedKey.from_pem("k", pub)], registry.options(), formats=(fmt,))


@pytest.mark.parametrize("fmt", FORMATS)
def test_good_signature_accepted_like_cosign(registry, cosign, fmt):
    key, pub = cosign.keypair("good")
    image, digest = _image(registry, f"sig/good-{fmt}", f"good {fmt}")
    cosign.sign(image, key, fmt)
    assert cosign.verify(image, pub, fmt)
    verdict = _ours(registry, image, digest, pub, fmt)
    assert verdict.ok, verdict
    assert (verdict.reason, verdict.format, verdict.key) == (sg.VERIFIED, fmt, "k")
    # a ClusterGKMCache looks for both formats: found as well
    both = sg.verify(image, digest, [sg.TrustedKey.from_pem("k", pub)], registry.options())
    assert both.ok and both.format == fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_unsigned_refused_like_cosign(registry, cosign, fmt):
    _, pub = cosign.keypair("good")
    image, digest = _image(registry, f"sig/unsigned-{fmt}", "unsigned")
    assert not cosign.verify(image, pub, fmt)
    verdict = _ours(registry, image, digest, pub, fmt)
    assert (verdict.ok, verdict.reason) == (False, sg.UNSIGNED)
    assert digest in verdict.message


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_key_refused_like_cosign(registry, cosign, fmt):
    key, _ = cosign.keypair("good")
    _, other = cosign.keypair("other")
    image, digest = _image(registry, f"sig/wrongkey-{fmt}", f"wrong key {fmt}")
    cosign.sign(image, key, fmt)
    assert not cosign.verify(image, other, fmt)
    verdict = _ours(registry, image, digest, other, fmt)
    assert (verdict.ok, verdict.reason) == (False, sg.WRONG_KEY), verdict


def _tamper(registry, repo: str, digest: str, fmt: str, edit) -> None:
    """Rewrite the signed payload of ``digest``'s signature in place (signature kept)."""
    tag = digest.replace(":", "-")
    if fmt == sg.V2:
        man = get_manifest(registry, repo, tag + ".sig")
        layer = man["layers"][0]
        payload = edit(get_blob(registry, repo, layer))
        layer.update(put_blob(registry, repo, payload))
        put_manifest(registry, repo, tag + ".sig", man, man["mediaType"])
        return
    index = get_manifest(registry, repo, tag)
    art_desc = index["manifests"][0]
    art = get_manifest(registry, repo, art_desc["digest"])
    bundle = json.loads(get_blob(registry, repo, art["layers"][0]))
    env = bundle["dsseEnvelope"]
    env["payload"] = base64.b64encode(edit(base64.b64decode(env["payload"]))).decode()
    art["layers"][0].update(put_blob(registry, repo, json.dumps(bundle).encode()))
    new = put_manifest(registry, repo, "tampered", art, art["mediaType"])
    art_desc["digest"], art_desc["size"] = new, len(json.dumps(art).encode())
    put_manifest(registry, repo, tag, index, index["mediaType"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_tampered_payload_refused_like_cosign(registry, cosign, fmt):
    key, pub = cosign.keypair("good")
    repo = f"sig/tampered-{fmt}"
    image, digest = _image(registry, repo, f"tampered {fmt}")
    cosign.sign(image, key, fmt)
    assert cosign.verify(image, pub, fmt)
    _tamper(registry, repo, digest, fmt, lambda b: b.replace(b'"', b' "', 1))  # same meaning, other bytes
    assert not cosign.verify(image, pub, fmt)
    verdict = _ours(registry, image, digest, pub, fmt)
    # v2 names no signer: an altered payload looks like another key's signature; v3's key hint tells
    assert (verdict.ok, verdict.reason) == (False, sg.WRONG_KEY if fmt == sg.V2 else sg.BAD_SIGNATURE), verdict
    if fmt == sg.V2:
        assert "payload altered" in verdict.message


@pytest.mark.parametrize("fmt", FORMATS)
def test_signature_of_another_digest_refused_like_cosign(registry, cosign, fmt):
    """A valid signature (same trusted key) of image B, placed where A's signature belongs."""
    key, pub = cosign.keypair("good")
    repo = f"sig/swap-{fmt}"
    a, da = _image(registry, repo, f"image a {fmt}")
    b, db = _image(registry, repo + "-b", f"image b {fmt}")
    cosign.sign(b, key, fmt)
    tb, ta = db.replace(":", "-"), da.replace(":", "-")
    if fmt == sg.V2:
        man = get_manifest(registry, repo + "-b", tb + ".sig")
        for d in [man["config"], *man["layers"]]:
            put_blob(registry, repo, get_blob(registry, repo + "-b", d))
        put_manifest(registry, repo, ta + ".sig", man, man["mediaType"])
    else:
        index = get_manifest(registry, repo + "-b", tb)
        art = get_manifest(registry, repo + "-b", index["manifests"][0]["digest"])
        for d in [art["config"], *art["layers"]]:
            put_blob(registry, repo, get_blob(registry, repo + "-b", d))
        a_manifest = get_manifest(registry, repo, da)
        art["subject"] = {"mediaType": a_manifest["mediaType"], "digest": da,
                          "size": len(json.dumps(a_manifest).encode())}
        body = json.dumps(art).encode()
        index["manifests"][0].update(digest=put_manifest(registry, repo, "moved", art, art["mediaType"]), size=len(body))
        put_manifest(registry, repo, ta, index, index["mediaType"])
    assert not cosign.verify(a, pub, fmt)
    verdict = _ours(registry, a, da, pub, fmt)
    assert (verdict.ok, verdict.reason) == (False, sg.DIGEST_MISMATCH), verdict
    assert db in verdict.message


def test_registry_down_is_an_outage_not_a_verdict(cosign):
    _, pub = cosign.keypair("good")
    image = "127.0.0.1:1/sig/gone"
    with pytest.raises(RegistryUnavailable):
        sg.verify(image, "sha256:" + "0" * 64, [sg.TrustedKey.from_pem("k", pub)],
                  RegistryOptions(plain_http=True, timeout=3))


def test_bad_keys_refused_on_load():
    with pytest.raises(sg.InvalidKey):
        sg.TrustedKey.from_pem("junk", "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")


def test_pull_refusal_rule():
    """The agent's rule reads the verdict as data (status.verification), about one digest."""
    from accelnode.oci.refusal import Verdict

    d1, d2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    assert sg.pull_refusal({}, {}, d1) is None
    ok = {"verification": Verdict(d1, (), True, sg.VERIFIED, "2026-01-01T00:00:00Z").to_status()}
    assert sg.pull_refusal({}, ok, d1) is None
    assert sg.pull_refusal({}, ok, d2)[0] == "Unknown"  # a verdict on another digest is none on this one
    no = {"verification": Verdict(d1, (), False, sg.WRONG_KEY, "2026-01-01T00:00:00Z").to_status()}
    assert sg.pull_refusal({}, no, d1) == ("False", f"WrongKey (verdict of 2026-01-01T00:00:00Z on {d1})")
    cond = {"conditions": [{"type": "Verified", "status": "True", "reason": "Verified", "message": f"[digest {d1};"}]}
    assert sg.pull_refusal({}, cond, d1)[0] == "Unknown"  # a condition is for people: no verdict without the data
    assert sg.pull_refusal({sg.SIGNATURE_FORMAT_LABEL: "cosign-v3"}, {}, d1)[0] == "Unknown"
