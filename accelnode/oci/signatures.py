"""Cosign signatures of an image digest, fetched from the registry and verified against public keys
(docs/signatures.md). Library layer: no component imports.

Both formats cosign writes are read: ``cosign-v2`` (simple signing under the tag
``sha256-<hex>.sig``) and ``cosign-v3`` (Sigstore bundles found through the referrers API, or
its fallback tag where the registry lacks it). :func:`verify` accepts only a signature that
verifies under a trusted key or identity *and* whose signed payload names exactly the digest
asked about; every refusal has its own reason. Keyless signatures are checked offline against
the admin's trust roots, with no transparency-log or SCT check. An unreachable registry raises
:class:`~accelnode.oci.errors.RegistryUnavailable`, so the caller can keep its last verdict.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import json
import re
from dataclasses import dataclass

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from accelnode.decode import MANIFEST, SIGNATURE, DocumentError, decode

from .errors import ImageNotFound, IntegrityError, RegistryUnavailable, quoted
from .refusal import FORMATS, SIGNATURE_FORMAT_LABEL, V2, V3, pull_refusal  # noqa: F401 (here too: the names callers know)
from .cacheformat import OCI_MANIFEST
from .reference import Reference, check_digest
from .registry import Deadline, Registry, RegistryOptions

SIMPLESIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
SIG_ANNOTATION = "dev.cosignproject.cosign/signature"
CERT_ANNOTATION = "dev.sigstore.cosign/certificate"
CHAIN_ANNOTATION = "dev.sigstore.cosign/chain"
# Fulcio's OIDC issuer extensions: v2 (DER UTF8String) and the legacy v1 (raw string)
ISSUER_V2_OID = x509.ObjectIdentifier("1.3.6.1.4.1.57264.1.8")
ISSUER_V1_OID = x509.ObjectIdentifier("1.3.6.1.4.1.57264.1.1")
MAX_CHAIN = 8
BUNDLE_TYPES = ("application/vnd.dev.sigstore.bundle.v0.3+json", "application/vnd.dev.sigstore.bundle+json;version=0.3")
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
MAX_SIG_BYTES = 1 << 20  # a payload or bundle; cosign's are a few KiB
MAX_SIGNATURES = 32  # layers / referrers looked at per digest

# reasons
VERIFIED = "Verified"
UNSIGNED = "Unsigned"
BAD_SIGNATURE = "BadSignature"
WRONG_KEY = "WrongKey"
DIGEST_MISMATCH = "DigestMismatch"
KEYLESS_UNSUPPORTED = "KeylessUnsupported"
UNTRUSTED_CERT = "UntrustedCertificate"
WRONG_IDENTITY = "WrongIdentity"
# most telling first: the refusal reported when several signatures fail differently
_RANK = (DIGEST_MISMATCH, BAD_SIGNATURE, WRONG_IDENTITY, UNTRUSTED_CERT, WRONG_KEY, KEYLESS_UNSUPPORTED, UNSIGNED)


class InvalidKey(ValueError):
    """A trusted key that cannot be loaded (bad PEM, unsupported algorithm)."""


@dataclass(frozen=True)
class TrustedKey:
    name: str
    key: object  # a cryptography public key

    @classmethod
    def from_pem(cls, name: str, pem: str) -> "TrustedKey":
        try:
            key = serialization.load_pem_public_key(pem.encode())
        except (ValueError, UnsupportedAlgorithm, TypeError) as e:
            raise InvalidKey(f"key {name!r}: not a PEM public key: {e}") from None
        if isinstance(key, ec.EllipticCurvePublicKey):
            if not isinstance(key.curve, (ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)):
                raise InvalidKey(f"key {name!r}: curve {key.curve.name} is not one cosign uses")
        elif isinstance(key, rsa.RSAPublicKey):
            if key.key_size < 2048:
                raise InvalidKey(f"key {name!r}: RSA keys under 2048 bits are refused")
        elif not isinstance(key, ed25519.Ed25519PublicKey):
            raise InvalidKey(f"key {name!r}: {type(key).__name__} is not a key type cosign signs with")
        return cls(name, key)

    @property
    def der(self) -> bytes:
        """Its SubjectPublicKeyInfo, DER."""
        return self.key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)

    @property
    def hint(self) -> str:
        """The key hint cosign v3 writes into a bundle: base64(SHA-256(SubjectPublicKeyInfo DER))."""
        return base64.b64encode(hashlib.sha256(self.der).digest()).decode()

    def verifies(self, signature: bytes, message: bytes) -> bool:
        k = self.key
        try:
            if isinstance(k, ed25519.Ed25519PublicKey):
                k.verify(signature, message)
                return True
            if isinstance(k, ec.EllipticCurvePublicKey):
                # cosign hashes with SHA-256 whatever the curve; the curve's own hash is accepted too
                own = {"secp384r1": hashes.SHA384(), "secp521r1": hashes.SHA512()}.get(k.curve.name)
                for h in (hashes.SHA256(), *([own] if own else [])):
                    try:
                        k.verify(signature, message, ec.ECDSA(h))
                        return True
                    except InvalidSignature:
                        continue
                return False
            k.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
            return True
        except InvalidSignature:
            return False


@dataclass(frozen=True)
class Identity:
    """A keyless signer the admin trusts: the OIDC issuer and the subject (SAN email or URI),
    both exact, or the subject as a regular expression matched in full (cosign's
    ``--certificate-identity-regexp``). Never empty: no "any signer"."""

    issuer: str
    subject: str = ""
    subject_regexp: str = ""

    def __post_init__(self):
        if not self.issuer or not (self.subject or self.subject_regexp):
            raise InvalidKey("a keyless identity needs an issuer and a subject (or subjectRegExp)")
        if self.subject_regexp:
            try:
                re.compile(self.subject_regexp)
            except re.error as e:
                raise InvalidKey(f"subjectRegExp {self.subject_regexp!r}: {e}") from None

    def matches(self, issuer: str | None, subjects: list[str]) -> bool:
        if issuer != self.issuer:
            return False
        if self.subject:
            return self.subject in subjects
        return any(re.fullmatch(self.subject_regexp, s) for s in subjects)

    def __str__(self) -> str:
        return f"{self.subject or '/' + self.subject_regexp + '/'} from {self.issuer}"


def load_certs(name: str, pem: str) -> list[x509.Certificate]:
    """The PEM certificates in ``pem`` (a trust root, a chain); at least one."""
    try:
        certs = x509.load_pem_x509_certificates(pem.encode())
    except (ValueError, TypeError) as e:
        raise InvalidKey(f"{name}: not PEM certificates: {e}") from None
    return certs


@dataclass(frozen=True)
class KeylessTrust:
    """The keyless half of a policy: trusted identities and the CA certificates standing in for
    Fulcio's roots (``roots``; ``intermediates`` optional, also taken from the signature)."""

    identities: tuple[Identity, ...]
    roots: tuple[x509.Certificate, ...]
    intermediates: tuple[x509.Certificate, ...] = ()


def _leaf_identity(leaf: x509.Certificate) -> tuple[str | None, list[str]]:
    issuer = None
    for oid, v2 in ((ISSUER_V2_OID, True), (ISSUER_V1_OID, False)):
        try:
            raw = leaf.extensions.get_extension_for_oid(oid).value.value
        except x509.ExtensionNotFound:
            continue
        if v2:  # DER UTF8String: tag 0x0c, short or long length
            if len(raw) >= 2 and raw[0] == 0x0C:
                n, off = raw[1], 2
                if n & 0x80:
                    k = n & 0x7F
                    n, off = int.from_bytes(raw[2:2 + k], "big"), 2 + k
                issuer = raw[off:off + n].decode("utf-8", "replace")
        else:
            issuer = raw.decode("utf-8", "replace")
        break
    subjects: list[str] = []
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        subjects = [*san.get_values_for_type(x509.RFC822Name), *san.get_values_for_type(x509.UniformResourceIdentifier)]
    except x509.ExtensionNotFound:
        pass
    return issuer, subjects


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    if cert.issuer != ca.subject:
        return False
    try:
        bc = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    if not bc.ca:
        return False
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def _valid_now(cert: x509.Certificate, now: datetime.datetime) -> bool:
    return cert.not_valid_before_utc <= now <= cert.not_valid_after_utc


def check_chain(leaf: x509.Certificate, given: list[x509.Certificate], trust: KeylessTrust) -> str | None:
    """None when ``leaf`` chains (through ``given`` / the policy's intermediates) to one of the
    trust roots, every certificate valid now and the leaf for code signing; else why not."""
    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return "the certificate has no extended key usage (code signing needed)"
    if ExtendedKeyUsageOID.CODE_SIGNING not in eku:
        return "the certificate is not for code signing"
    pool = [*given, *trust.intermediates]
    cert, seen = leaf, 0
    while seen <= MAX_CHAIN:
        if not _valid_now(cert, now):
            return f"certificate {cert.subject.rfc4514_string()!r} is not valid now (expired or not yet valid)"
        root = next((r for r in trust.roots if _issued_by(cert, r)), None)
        if root is not None:
            return None if _valid_now(root, now) else "the trust root is not valid now"
        nxt = next((c for c in pool if c != cert and c not in trust.roots and _issued_by(cert, c)), None)
        if nxt is None:
            return "the certificate chains to none of the policy's trust roots"
        cert, seen = nxt, seen + 1
    return "certificate chain too long"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str
    message: str
    format: str | None = None  # the format of the accepted signature
    key: str | None = None  # the name of the key (or the keyless identity) that verified it
    fingerprint: str | None = None  # of that key's material (identity and trust roots): :func:`key_fingerprint`


@dataclass(frozen=True)
class _Found:
    """One signature as fetched: what was signed, the signature, and the digest the payload names."""

    format: str
    message: bytes  # the bytes the signature is over
    signature: bytes
    names: str | None  # the digest the signed payload names (None: unreadable payload)
    keyless: bool = False
    hint: str | None = None  # v3: base64 SHA-256 of the signer's public key (DER), as cosign writes it
    certs: tuple[bytes, ...] = ()  # keyless: the leaf then the chain, each DER


def _b64(text) -> bytes:
    try:
        return base64.b64decode(text or "", validate=True)
    except (binascii.Error, ValueError, TypeError):
        return b""


def _obj(value) -> dict:
    """``value`` when a registry's JSON has an object there, else an empty one (what is not an
    object is no signature: left out, never a crash)."""
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _sig_tag(digest: str) -> str:
    return digest.replace(":", "-")


def _payload_digest(payload: bytes) -> str | None:
    try:
        doc = decode(payload, SIGNATURE, "simple-signing payload")
        return doc["critical"]["image"]["docker-manifest-digest"]
    except (ValueError, KeyError, TypeError):
        return None


def _statement_digest(payload: bytes) -> str | None:
    """The digest an in-toto statement's subject names (the first sha256 subject)."""
    try:
        doc = decode(payload, SIGNATURE, "in-toto statement")
        for s in doc.get("subject") or ():
            hexd = (s.get("digest") or {}).get("sha256")
            if isinstance(hexd, str):
                return f"sha256:{hexd}"
    except (ValueError, TypeError, AttributeError):
        pass
    return None


def _pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE pre-authentication encoding (what a DSSE signature is over)."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def _manifest(reg: Registry, ref: Reference, image: str, tag: str) -> dict | None:
    """A manifest by tag or digest as JSON, or None when there is none (404)."""
    try:
        body, _, _ = reg.get_manifest(Reference(ref.host, ref.repository, tag if not tag.startswith("sha256:") else None,
                                                tag if tag.startswith("sha256:") else None), image)
    except ImageNotFound:
        return None
    try:
        doc = decode(body, MANIFEST, f"signature manifest {tag}", None)
    except DocumentError as e:
        raise IntegrityError(str(e), image) from None
    return doc if isinstance(doc, dict) else None


def _blob(reg: Registry, ref: Reference, desc: dict, image: str) -> bytes:
    if not isinstance(desc, dict) or not isinstance(desc.get("size"), int) or desc["size"] > MAX_SIG_BYTES:
        raise IntegrityError("signature layer missing or over the size limit", image)
    return reg.read_blob(ref.repository, desc, image, limit=MAX_SIG_BYTES)


def fetch_v2(reg: Registry, ref: Reference, digest: str, image: str) -> list[_Found]:
    """The simple-signing signatures under ``sha256-<hex>.sig``."""
    doc = _manifest(reg, ref, image, _sig_tag(digest) + ".sig")
    out = []
    for layer in _list(_obj(doc).get("layers"))[:MAX_SIGNATURES]:
        if not isinstance(layer, dict) or layer.get("mediaType") != SIMPLESIGNING:
            continue
        ann = _obj(layer.get("annotations"))
        payload = _blob(reg, ref, layer, image)
        out.append(_Found(V2, payload, _b64(ann.get(SIG_ANNOTATION)), _payload_digest(payload),
                          keyless=bool(ann.get(CERT_ANNOTATION)),
                          certs=_pem_ders(ann.get(CERT_ANNOTATION), ann.get(CHAIN_ANNOTATION))))
    return out


def _pem_ders(*pems) -> tuple[bytes, ...]:
    """The certificates of PEM texts as DER, in order (unreadable ones left out)."""
    out = []
    for pem in pems:
        if not isinstance(pem, str) or not pem.strip():
            continue
        try:
            out += [c.public_bytes(serialization.Encoding.DER) for c in x509.load_pem_x509_certificates(pem.encode())]
        except ValueError:
            continue
    return tuple(out[:MAX_CHAIN + 1])


def sign_v2(image: str, private_pem: bytes, options: RegistryOptions) -> None:
    """Write a cosign-v2 signature (what :func:`fetch_v2` reads) of ``image`` (digest-pinned) with an unencrypted PEM EC private key."""
    ref = Reference.parse(image)
    if not ref.digest:
        raise ValueError(f"{image}: sign a digest-pinned reference")
    try:
        key = serialization.load_pem_private_key(private_pem, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the signing key is not an unencrypted PEM private key: {str(e)[:120]}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("the signing key must be an ECDSA key (cosign's default, P-256)")
    payload = json.dumps({"critical": {"identity": {"docker-reference": f"{ref.host}/{ref.repository}"},
                                       "image": {"docker-manifest-digest": ref.digest},
                                       "type": "cosign container image signature"},
                          "optional": None}, separators=(",", ":")).encode()
    signature = base64.b64encode(key.sign(payload, ec.ECDSA(hashes.SHA256()))).decode()
    reg = Registry(ref.host, options, Deadline(options.timeout))
    pdigest = "sha256:" + hashlib.sha256(payload).hexdigest()
    reg.upload_blob(ref.repository, pdigest, payload, image)
    config = b"{}"
    cdigest = "sha256:" + hashlib.sha256(config).hexdigest()
    reg.upload_blob(ref.repository, cdigest, config, image)
    body = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                       "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdigest,
                                  "size": len(config)},
                       "layers": [{"mediaType": SIMPLESIGNING, "digest": pdigest, "size": len(payload),
                                   "annotations": {SIG_ANNOTATION: signature}}]},
                      separators=(",", ":")).encode()
    reg.put_manifest(ref.repository, _sig_tag(ref.digest) + ".sig", body, OCI_MANIFEST, image)


def _referrers(reg: Registry, ref: Reference, digest: str, image: str) -> list[dict]:
    """Descriptors of the artifacts referring to ``digest``: the referrers API, else the
    fallback tag ``sha256-<hex>``."""
    try:
        # a listing no digest covers: asked only of hosts trusted to say what a name means
        resp = reg.request("GET", f"{ref.repository}/referrers/{digest}", image, "listing referrers",
                           headers={"Accept": INDEX_TYPE}, ok=(200,), stream=True, caps=("pull", "resolve"))
        with resp:
            if resp.headers.get("Content-Type", "").split(";")[0].strip() == INDEX_TYPE:
                doc = decode(reg.read_capped(resp, MAX_SIG_BYTES, image, "listing referrers", "referrers index"),
                             MANIFEST.bytes(MAX_SIG_BYTES), f"referrers index of {digest}", None)
                return [m for m in _list(_obj(doc).get("manifests")) if isinstance(m, dict)]
    except (ImageNotFound, IntegrityError, ValueError):
        pass  # no referrers API (404): the fallback tag
    except RegistryUnavailable as e:
        if "unexpected HTTP 4" not in str(e):  # 400/405...: no referrers API either; else a real outage
            raise
    doc = _manifest(reg, ref, image, _sig_tag(digest))
    return [m for m in _list(_obj(doc).get("manifests")) if isinstance(m, dict)]


def fetch_v3(reg: Registry, ref: Reference, digest: str, image: str) -> list[_Found]:
    """The Sigstore bundles that refer to ``digest``."""
    out = []
    for desc in _referrers(reg, ref, digest, image)[:MAX_SIGNATURES]:
        if desc.get("artifactType") not in BUNDLE_TYPES:
            continue
        art = _manifest(reg, ref, image, check_digest(desc.get("digest", ""), image))
        if not art or _obj(art.get("subject")).get("digest") != digest:
            continue  # listed under this digest but not about it: not a signature of it
        for layer in _list(art.get("layers"))[:1]:
            try:
                bundle = decode(_blob(reg, ref, layer, image), SIGNATURE, "Sigstore bundle")
            except DocumentError:
                bundle = None
            out.append(_bundle(bundle) if isinstance(bundle, dict) else _Found(V3, b"", b"", None))
    return out


def _bundle(bundle: dict) -> _Found:
    material = _obj(bundle.get("verificationMaterial"))
    keyless = bool(material.get("certificate") or material.get("x509CertificateChain"))
    raws = [material.get("certificate"), *_list(_obj(material.get("x509CertificateChain")).get("certificates"))]
    certs = tuple(d for d in (_b64(r.get("rawBytes")) for r in raws if isinstance(r, dict)) if d)[:MAX_CHAIN + 1]
    hint = (material.get("publicKey") or {}).get("hint") if isinstance(material.get("publicKey"), dict) else None
    env = bundle.get("dsseEnvelope")
    if isinstance(env, dict):
        payload = _b64(env.get("payload"))
        sigs = _list(env.get("signatures")) or [{}]
        return _Found(V3, _pae(str(env.get("payloadType", "")), payload), _b64(_obj(sigs[0]).get("sig")),
                      _statement_digest(payload), keyless, hint, certs)
    ms = _obj(bundle.get("messageSignature"))
    md = _obj(ms.get("messageDigest"))
    hexd = _b64(md.get("digest")).hex()
    # a message signature is over the artifact itself: here, the manifest; cosign signs the
    # simple-signing payload, which we cannot rebuild byte for byte, so only the digest it names counts
    return _Found(V3, b"", _b64(ms.get("signature")), f"sha256:{hexd}" if hexd else None, keyless, certs=certs)


def _judge_keyless(f: _Found, digest: str, trust: KeylessTrust | None) -> tuple[str, str] | Verdict:
    what = f"a {f.format} keyless signature (certificate) of {digest}"
    if trust is None or not trust.identities or not trust.roots:
        return KEYLESS_UNSUPPORTED, f"{what}; the policy names no keyless identities and trust roots"
    try:
        leaf, *given = [x509.load_der_x509_certificate(d) for d in f.certs]
    except ValueError as e:
        return UNTRUSTED_CERT, f"{what} whose certificate does not load: {e}"
    why = check_chain(leaf, given, trust)
    if why:
        return UNTRUSTED_CERT, f"{what}: {why}"
    issuer, subjects = _leaf_identity(leaf)
    ident = next((i for i in trust.identities if i.matches(issuer, subjects)), None)
    if ident is None:
        return WRONG_IDENTITY, (f"{what} by {quoted(', '.join(subjects)) if subjects else 'no subject'} from issuer "
                                f"{quoted(issuer) if issuer else 'none'}; "
                                f"the policy trusts {'; '.join(str(i) for i in trust.identities)}")
    if not (f.message and f.signature and TrustedKey(str(ident), leaf.public_key()).verifies(f.signature, f.message)):
        return BAD_SIGNATURE, f"{what} whose payload does not verify under its certificate (altered)"
    if f.names != digest:
        return DIGEST_MISMATCH, f"{what} by {ident} names {f.names or 'no digest'}, not {digest}"
    return Verdict(True, VERIFIED, f"{digest} signed ({f.format}, keyless) by {ident}", f.format, str(ident),
                   keyless_fingerprint(ident, trust))


def judge(found: list[_Found], digest: str, keys: list[TrustedKey],
          keyless: tuple[KeylessTrust, ...] = ()) -> Verdict:
    """The verdict on the signatures ``found`` for ``digest`` under ``keys`` and the keyless
    identities (pure)."""
    if not found:
        return Verdict(False, UNSIGNED, f"no cosign signature of {digest} in the registry")
    worst = []
    for f in found:
        key = next((k for k in keys if f.message and f.signature and k.verifies(f.signature, f.message)), None)
        if key is None:
            if f.keyless:
                # each policy's identities against its own trust roots only
                res = [_judge_keyless(f, digest, t) for t in (keyless or (None,))]
                ok = next((r for r in res if isinstance(r, Verdict)), None)
                if ok is not None:
                    return ok
                worst.append(min(res, key=lambda w: _RANK.index(w[0])))
            elif f.names == digest and f.signature and not any(f.hint == k.hint for k in keys):
                # v2 names no key: a signature by another key and one whose payload was altered
                # look alike; v3's key hint tells them apart (a trusted key's hint: altered)
                worst.append((WRONG_KEY, f"a {f.format} signature of {digest} that none of the trusted keys "
                                         f"({', '.join(k.name for k in keys) or 'none'}) verifies"
                                         + ("" if f.hint else " (signed by another key, or its payload altered)")))
            else:
                worst.append((BAD_SIGNATURE, f"a {f.format} signature whose payload does not verify under any "
                                             "trusted key (altered payload or signature)"))
            continue
        if f.names != digest:
            worst.append((DIGEST_MISMATCH, f"a {f.format} signature by key {key.name} names "
                                           f"{f.names or 'no digest'}, not {digest}"))
            continue
        return Verdict(True, VERIFIED, f"{digest} signed ({f.format}) by trusted key {key.name}", f.format, key.name,
                       key_fingerprint(key))
    reason, message = min(worst, key=lambda w: _RANK.index(w[0]))
    return Verdict(False, reason, message)


def verify(image: str, digest: str, keys: list[TrustedKey], options: RegistryOptions, *,
           formats: tuple[str, ...] = FORMATS, timeout: float = 30.0,
           keyless: tuple[KeylessTrust, ...] = ()) -> Verdict:
    """Fetch the signatures of ``digest`` (an image of repository ``image``) in ``formats`` and
    judge them. Raises :class:`~accelnode.oci.errors.RegistryUnavailable` / ``AuthError`` when
    the registry cannot answer (the verdict is then unknown, not a refusal)."""
    check_digest(digest, image)
    ref = Reference.parse(image)
    reg = Registry(ref.host, options, Deadline(min(timeout, options.timeout)))
    found: list[_Found] = []
    if V2 in formats:
        found += fetch_v2(reg, ref, digest, image)
    if V3 in formats:
        found += fetch_v3(reg, ref, digest, image)
    return judge(found, digest, keys, keyless)


def fingerprint(keys: list[TrustedKey]) -> str:
    """A short stable name of a key set (for caching verdicts)."""
    h = hashlib.sha256()
    for k in sorted(keys, key=lambda k: k.name):
        h.update(k.name.encode() + b"\0" + k.der)
    return h.hexdigest()[:16]


def key_fingerprint(key: TrustedKey) -> str:
    """A trusted key's material, as a verdict records its signer: SHA-256 of its
    SubjectPublicKeyInfo (hex), whatever name the policy gives it."""
    return "sha256:" + hashlib.sha256(key.der).hexdigest()


def keyless_fingerprint(ident: Identity, trust: KeylessTrust) -> str:
    """A keyless signer as a verdict records it: the identity with the trust roots it chains to."""
    h = hashlib.sha256(str(ident).encode() + b"\0")
    for root in sorted(r.public_bytes(serialization.Encoding.DER) for r in trust.roots):
        h.update(root)
    return "sha256:" + h.hexdigest()
