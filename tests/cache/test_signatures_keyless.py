"""Keyless (certificate) signatures: the real cosign signs test images with a leaf certificate
issued by a CA made here (standing in for Fulcio), offline (no transparency log, no SCT); cosign's
own ``verify --certificate-identity --certificate-oidc-issuer --insecure-ignore-tlog
--insecure-ignore-sct`` is the reference: where cosign accepts, we accept; where it refuses, we
refuse (docs/signatures.md)."""

from __future__ import annotations

import base64
import datetime
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from accelnode.oci import signatures as sg
from tests.cache.cosign import REGISTRY_FLAGS, Cosign

FORMATS = (sg.V2, sg.V3)
ISSUER = "https://issuer.example.test"
EMAIL = "builder@example.test"
_PEM = serialization.Encoding.PEM


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn), x509.NameAttribute(NameOID.ORGANIZATION_NAME, "t")])


def _cert(subject: str, key, issuer_name: x509.Name | None, issuer_key, *, ca: bool, email: str = "",
          oidc: str = "") -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject) if ca else x509.Name([]))
         .issuer_name(issuer_name or _name(subject)).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
         .not_valid_after(now + datetime.timedelta(days=1)))
    if ca:
        b = (b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True))
    else:
        b = (b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
             .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(email)]), critical=True)
             .add_extension(x509.UnrecognizedExtension(sg.ISSUER_V1_OID, oidc.encode()), critical=False)
             .add_extension(x509.UnrecognizedExtension(sg.ISSUER_V2_OID,
                                                       b"\x0c" + bytes([len(oidc)]) + oidc.encode()), critical=False))
    return b.sign(issuer_key, hashes.SHA256())


class CA:
    """A root and an intermediate; leaves for identities, files cosign reads."""

    def __init__(self, d: Path, name: str):
        self.dir = d
        self.root_key, self.mid_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        self.root = _cert(f"{name} root", self.root_key, None, self.root_key, ca=True)
        self.mid = _cert(f"{name} intermediate", self.mid_key, self.root.subject, self.root_key, ca=True)
        self.root_pem = self.root.public_bytes(_PEM).decode()
        self.mid_pem = self.mid.public_bytes(_PEM).decode()
        (d / f"{name}-chain.pem").write_text(self.mid_pem + self.root_pem)
        (d / f"{name}-root.pem").write_text(self.root_pem)
        self.chain_path, self.root_path = d / f"{name}-chain.pem", d / f"{name}-root.pem"

    def leaf(self, cosign: Cosign, name: str, email: str = EMAIL, oidc: str = ISSUER) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert("", key, self.mid.subject, self.mid_key, ca=False, email=email, oidc=oidc)
        raw = self.dir / f"{name}.raw.key"
        raw.write_bytes(key.private_bytes(_PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        cosign.run("import-key-pair", "--key", str(raw), "--output-key-prefix", str(self.dir / name))
        (self.dir / f"{name}.crt").write_bytes(cert.public_bytes(_PEM))
        return self.dir / f"{name}.key", self.dir / f"{name}.crt"

    def trust(self, *identities: sg.Identity) -> sg.KeylessTrust:
        return sg.KeylessTrust(identities, (self.root,))


def _sign(cosign: Cosign, ca: CA, image: str, key: Path, crt: Path, fmt: str) -> None:
    cosign.run("sign", "--key", str(key), "--certificate", str(crt), "--certificate-chain", str(ca.chain_path),
               "--tlog-upload=false", "--use-signing-config=false", *REGISTRY_FLAGS,
               "--new-bundle-format=" + ("true" if fmt == sg.V3 else "false"), image)


def _trusted_root(ca: CA) -> Path:
    """The CA as a Sigstore trusted root (what cosign v3 verifies bundles against)."""
    path = ca.dir / f"{ca.root_path.stem}-trusted-root.json"
    chain = [{"rawBytes": base64.b64encode(c.public_bytes(serialization.Encoding.DER)).decode()} for c in (ca.mid, ca.root)]
    path.write_text(json.dumps({
        "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
        "certificateAuthorities": [{"subject": {"organization": "t", "commonName": "ca"}, "uri": "https://ca.example.test",
                                    "certChain": {"certificates": chain},
                                    "validFor": {"start": "2000-01-01T00:00:00Z"}}]}))
    return path


def _cosign_accepts(cosign: Cosign, ca: CA, image: str, fmt: str, subject: str = EMAIL, issuer: str = ISSUER) -> bool:
    roots = (["--trusted-root", str(_trusted_root(ca))] if fmt == sg.V3
             else ["--certificate-chain", str(ca.chain_path)])
    out = cosign.run("verify", "--certificate-identity", subject, "--certificate-oidc-issuer", issuer,
                     *roots, "--insecure-ignore-tlog", "--insecure-ignore-sct",
                     *REGISTRY_FLAGS, "--new-bundle-format=" + ("true" if fmt == sg.V3 else "false"), image,
                     check=False)
    return out.returncode == 0


# cosign 3.1.3 verifies a keyless v3 bundle only with a transparency-log entry or a signed
# timestamp: offline (--insecure-ignore-tlog, our mode) it answers "no signatures found" even for a
# good one. Its refusals still hold as the reference; its acceptance is checked for v2 only.
COSIGN_ACCEPTS_OFFLINE = {sg.V2: True, sg.V3: False}


@pytest.fixture(scope="module")
def cosign(tmp_path_factory):
    return Cosign(tmp_path_factory.mktemp("cosign-keyless"))


@pytest.fixture(scope="module")
def ca(cosign):
    return CA(cosign.workdir, "good")


def _ours(registry, image: str, digest: str, trust: sg.KeylessTrust, fmt: str) -> sg.Verdict:
    return sg.verify(image, digest, [], registry.options(), formats=(fmt,), keyless=(trust,))


def _signed(registry, cosign, ca, fmt: str, tag: str, signer: CA | None = None) -> tuple[str, str]:
    pinned = registry.push_raw(f"keyless/{tag}-{fmt}", "v1",
                               layers=[("application/vnd.oci.image.layer.v1.tar", f"{tag} {fmt}".encode())])
    key, crt = (signer or ca).leaf(cosign, f"leaf-{tag}-{fmt}")
    _sign(cosign, signer or ca, pinned, key, crt, fmt)
    return pinned, pinned.rsplit("@", 1)[1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_good_identity_accepted_like_cosign(registry, cosign, ca, fmt):
    image, digest = _signed(registry, cosign, ca, fmt, "good")
    assert _cosign_accepts(cosign, ca, image, fmt) == COSIGN_ACCEPTS_OFFLINE[fmt]
    verdict = _ours(registry, image, digest, ca.trust(sg.Identity(ISSUER, EMAIL)), fmt)
    assert (verdict.ok, verdict.reason, verdict.format) == (True, sg.VERIFIED, fmt), verdict
    assert EMAIL in verdict.message
    rx = _ours(registry, image, digest, ca.trust(sg.Identity(ISSUER, subject_regexp=r".*@example\.test")), fmt)
    assert rx.ok, rx


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_subject_and_issuer_refused_like_cosign(registry, cosign, ca, fmt):
    image, digest = _signed(registry, cosign, ca, fmt, "ident")
    assert not _cosign_accepts(cosign, ca, image, fmt, subject="other@example.test")
    assert not _cosign_accepts(cosign, ca, image, fmt, issuer="https://other.example.test")
    for ident in (sg.Identity(ISSUER, "other@example.test"), sg.Identity("https://other.example.test", EMAIL),
                  sg.Identity(ISSUER, subject_regexp="builder")):  # a regexp matches the whole subject
        verdict = _ours(registry, image, digest, ca.trust(ident), fmt)
        assert (verdict.ok, verdict.reason) == (False, sg.WRONG_IDENTITY), verdict
        assert EMAIL in verdict.message


@pytest.mark.parametrize("fmt", FORMATS)
def test_certificate_of_another_ca_refused_like_cosign(registry, cosign, ca, fmt):
    other = CA(cosign.workdir, f"other-{fmt}")
    image, digest = _signed(registry, cosign, ca, fmt, "otherca", signer=other)
    assert _cosign_accepts(cosign, other, image, fmt) == COSIGN_ACCEPTS_OFFLINE[fmt]  # valid under its own CA
    assert not _cosign_accepts(cosign, ca, image, fmt)
    verdict = _ours(registry, image, digest, ca.trust(sg.Identity(ISSUER, EMAIL)), fmt)
    assert (verdict.ok, verdict.reason) == (False, sg.UNTRUSTED_CERT), verdict


@pytest.mark.parametrize("fmt", FORMATS)
def test_keyless_without_identities_refused(registry, cosign, ca, fmt):
    image, digest = _signed(registry, cosign, ca, fmt, "nopolicy")
    verdict = sg.verify(image, digest, [], registry.options(), formats=(fmt,))
    assert (verdict.ok, verdict.reason) == (False, sg.KEYLESS_UNSUPPORTED), verdict


def test_identity_never_any():
    with pytest.raises(sg.InvalidKey):
        sg.Identity(ISSUER, "")
    with pytest.raises(sg.InvalidKey):
        sg.Identity("", EMAIL)
