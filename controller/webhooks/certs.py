"""Self-managed certificates of the admission webhooks: a CA and a serving certificate kept in
one Secret, renewed before expiry, installed as files the admission server reloads
(docs/webhook-certificates.md).

:func:`plan` is the pure decision (Secret data and the time in, new data or nothing out).
Invariant: no API server ever sees a serving certificate from a CA it does not trust yet, so
a CA younger than :attr:`Policy.grace` signs only a certificate that is needed at once, and an
old CA stays in ``ca.crt`` until it expires. :class:`ServingCerts` runs on every replica (every
replica serves the webhooks): every write carries the read ``resourceVersion`` (409: someone
else won, read again), a Secret that is as it should be is never written, and the key file is
``0600`` in a private directory.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client import Gauge

from accelnode import atomic
from accelnode.kube.client import Client, KubeError, Unreachable, is_conflict, is_not_found
from accelnode.log import kv

log = logging.getLogger("accelnode.controller.certs")

RENEW_AT = 2 / 3  # a certificate is renewed once this fraction of its lifetime has passed
BACKDATE = 300.0  # seconds notBefore lies in the past: an API server whose clock lags a little still trusts us
YEAR = 365 * 86400.0
MAX_GRACE = 600.0  # at most this long a new CA is trusted before it signs (see Policy.grace)
SECRET_TYPE = "kubernetes.io/tls"
LABELS = {"app.kubernetes.io/name": "accelnode-controller", "app.kubernetes.io/part-of": "accelnode"}


@dataclass(frozen=True)
class Policy:
    """Lifetimes in seconds. A serving certificate must end before the CA that signed it: the
    CA is renewed with a third of its life left, so a serving certificate may live at most that."""

    ca_lifetime: float = 10 * YEAR
    cert_lifetime: float = YEAR

    def check(self) -> "Policy":
        if self.cert_lifetime < 30:
            raise ValueError("the serving certificate's lifetime must be at least 30s")
        if self.cert_lifetime > self.ca_lifetime * (1 - RENEW_AT):
            raise ValueError(f"the serving certificate's lifetime ({self.cert_lifetime:g}s) must be at most a third "
                             f"of the CA's ({self.ca_lifetime:g}s): the CA is renewed with a third of its life left")
        return self

    @property
    def grace(self) -> float:
        """How long a new CA is only trusted (in ``caBundle``) before it signs a renewal: ten
        minutes, or half the time a serving certificate has left when it is due if that is
        shorter (short lifetimes in tests)."""
        return min(MAX_GRACE, self.cert_lifetime * (1 - RENEW_AT) / 2)


def service_names(service: str, namespace: str) -> list[str]:
    """The DNS names the API server may use for a webhook behind ``service`` (it verifies
    ``<svc>.<ns>.svc``)."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", f"{service}.{namespace}", service]


# -- certificates -------------------------------------------------------------------------------


def _utc(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc)


def issued_at(cert: x509.Certificate) -> float:
    return cert.not_valid_before_utc.timestamp() + BACKDATE


def expires_at(cert: x509.Certificate) -> float:
    return cert.not_valid_after_utc.timestamp()


def renew_at(cert: x509.Certificate) -> float:
    start = issued_at(cert)
    return start + RENEW_AT * (expires_at(cert) - start)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _builder(subject: x509.Name, issuer: x509.Name, public_key, now: float,
             not_after: float) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(_utc(now - BACKDATE)).not_valid_after(_utc(not_after))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def new_ca(now: float, lifetime: float) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"accelnode-controller-webhook-ca@{int(now)}")])
    cert = (_builder(name, name, key.public_key(), now, now + lifetime)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def new_serving(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, names: list[str], now: float,
                lifetime: float) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A serving certificate for ``names`` (the first is the subject's CN), ending at the latest
    when ``ca`` does."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (_builder(subject, ca.subject, key.public_key(), now, min(now + lifetime, expires_at(ca)))
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def parse_bundle(pem: bytes) -> list[x509.Certificate]:
    """The CA certificates of a PEM bundle; :class:`ValueError` if there is none or one is bad."""
    certs = x509.load_pem_x509_certificates(pem)  # ValueError on garbage or an empty bundle
    for c in certs:
        try:
            if not c.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
                raise ValueError(f"{c.subject.rfc4514_string()} is not a CA certificate")
        except x509.ExtensionNotFound:
            raise ValueError(f"{c.subject.rfc4514_string()} has no basic constraints") from None
    return certs


def _key_matches(cert: x509.Certificate, key) -> bool:
    return key.public_key().public_numbers() == cert.public_key().public_numbers()


def _load_key(pem: bytes | None):
    if not pem:
        return None
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        return None
    return key if isinstance(key, ec.EllipticCurvePrivateKey) else None


def _load_cert(pem: bytes | None) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(pem) if pem else None
    except ValueError:
        return None


def issuer_of(cert: x509.Certificate, cas: list[x509.Certificate]) -> x509.Certificate | None:
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return ca
        except (ValueError, TypeError, InvalidSignature):
            continue
    return None


def _dns_names(cert: x509.Certificate) -> list[str]:
    try:
        return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        return []


# -- the decision -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    data: dict[str, bytes]  # the Secret's data as it should be
    reasons: tuple[str, ...]  # why it differs from what was read (empty: nothing to write)
    wake_at: float  # when the next change falls due (unix time)

    @property
    def changed(self) -> bool:
        return bool(self.reasons)


def plan(data: dict[str, bytes] | None, names: list[str], policy: Policy, now: float) -> Plan:
    """What the Secret's data should be at ``now`` (``data`` None: there is no Secret)."""
    data = dict(data or {})
    reasons: list[str] = []
    try:
        cas = parse_bundle(data.get("ca.crt") or b"")
    except ValueError:
        cas = []
        if data:
            reasons.append("ca.crt is not a bundle of CA certificates")
    live = sorted((c for c in cas if expires_at(c) > now), key=issued_at, reverse=True)
    if len(live) < len(cas) and not reasons:
        reasons.append("an expired CA left the bundle")
    ca_key = _load_key(data.get("ca.key"))
    why_new_ca = None
    if not data:
        why_new_ca = "no Secret"
    elif not live or ca_key is None or not _key_matches(live[0], ca_key):
        why_new_ca = "no usable CA (ca.key does not match the newest CA of ca.crt)"
    elif now >= renew_at(live[0]):
        why_new_ca = "the CA is due for renewal"
    if why_new_ca:
        reasons.append(why_new_ca)
        ca, ca_key = new_ca(now, policy.ca_lifetime)
        live.insert(0, ca)  # the older CAs stay trusted until they expire
    signer = live[0]
    wake = [renew_at(signer)] + [expires_at(c) for c in live[1:]]

    leaf, leaf_key = _load_cert(data.get("tls.crt")), _load_key(data.get("tls.key"))
    need, waiting = None, None
    if leaf is None or leaf_key is None or not _key_matches(leaf, leaf_key):
        need = "no serving certificate matching its key"
    elif sorted(_dns_names(leaf)) != sorted(names):
        need = "the serving certificate's names are not the Service's"
    elif issuer_of(leaf, live) is None:
        need = "the serving certificate is not issued by a CA of the bundle"
    elif now >= expires_at(leaf):
        need = "the serving certificate has expired"
    elif now >= renew_at(leaf):
        trusted_at = issued_at(signer) + policy.grace
        if now >= trusted_at:
            reasons.append("the serving certificate is due for renewal")
            leaf = None
        else:
            waiting = trusted_at  # the new CA signs once every caBundle had time to carry it
    if need:
        reasons.append(need)
        leaf = None
    if leaf is None:
        leaf, leaf_key = new_serving(signer, ca_key, names, now, policy.cert_lifetime)
    wake.append(waiting or renew_at(leaf))
    out = {**data, "tls.crt": _pem(leaf), "tls.key": _key_pem(leaf_key),
           "ca.crt": b"".join(_pem(c) for c in live), "ca.key": _key_pem(ca_key)}
    if not reasons:
        out = data  # byte for byte what was read: nothing to write
    return Plan(out, tuple(reasons), min(wake))


# -- every replica --------------------------------------------------------------------------------


class NotOurs(Exception):
    """The Secret of that name is not one this controller made (another type): never overwritten."""


def decode(secret: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def encode(data: dict[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in sorted(data.items())}


class ServingCerts:
    """The cert loop of one replica (see the module docstring). ``cert_file``/``key_file`` exist
    once :attr:`installed` is set."""

    MAX_TRIES = 5  # conflicts in a row before a pass gives up (and the loop retries later)

    def __init__(self, client: Client, namespace: str, secret: str, names: list[str], *,
                 policy: Policy = Policy(), check_interval: float = 60.0, directory: str | None = None,
                 clock=time.time, registry=None):
        self.client, self.namespace, self.secret, self.names = client, namespace, secret, list(names)
        self.policy, self.check_interval, self.clock = policy.check(), check_interval, clock
        self.path = f"/api/v1/namespaces/{namespace}/secrets/{secret}"
        self._own_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="accelnode-webhook-tls-"))
        self.dir.chmod(0o700)
        self.cert_file, self.key_file = str(self.dir / "tls.crt"), str(self.dir / "tls.key")
        for name in ("tls.crt", "tls.key"):  # a write killed half-way (a key among them) goes
            atomic.sweep(self.dir, prefix=name)
        self.installed = threading.Event()
        self.serial: int | None = None  # of the serving certificate installed
        self.writes = 0  # creates and updates this replica made
        self.last_error = ""
        self._expiry: float | None = None
        self._installed_pair: tuple[bytes, bytes] | None = None
        self.certificate: x509.Certificate | None = None  # the serving certificate installed
        if registry is not None:
            Gauge("accelnode_controller_webhook_cert_expiry_timestamp_seconds",
                  "Unix time the installed webhook serving certificate expires (0 before one is installed)",
                  registry=registry).set_function(lambda: self._expiry or 0)

    def sync(self) -> float:
        """One pass; the unix time the next one is due. Raises KubeError, Unreachable, NotOurs."""
        for _ in range(self.MAX_TRIES):
            secret = self._read()
            p = plan(decode(secret) if secret else None, self.names, self.policy, self.clock())
            if p.changed:
                try:
                    secret = self._write(secret, p)
                except KubeError as e:
                    if is_conflict(e):  # another replica created or renewed it meanwhile: read it again
                        log.info("the webhook Secret changed under us; reading it again",
                                 extra=kv(secret=f"{self.namespace}/{self.secret}", reason=e.reason))
                        continue
                    raise
            self._install(p.data)
            return min(p.wake_at, self.clock() + self.check_interval)
        raise KubeError(409, "Conflict", f"{self.MAX_TRIES} conflicting writes of the webhook Secret in a row")

    def run(self, stop: threading.Event, *, on_first_install=None, max_backoff: float = 30.0) -> None:
        """Sync until ``stop``; ``on_first_install(cert_file, key_file)`` runs once, after the
        first pair is installed. Failures are logged and retried with capped backoff."""
        delay = 0.0
        while not stop.wait(delay):
            try:
                due = self.sync()
            except (KubeError, Unreachable, NotOurs, OSError, ValueError) as e:
                delay = min(max_backoff, max(1.0, delay * 2))
                self.last_error = str(e)
                log.warning("webhook certificate check failed, retrying",
                            extra=kv(secret=f"{self.namespace}/{self.secret}", error=str(e), retry_in=delay))
                continue
            self.last_error = ""
            delay = max(0.5, due - self.clock())
            if on_first_install is not None:
                on_first_install(self.cert_file, self.key_file)
                on_first_install = None

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- internals -----------------------------------------------------------------------------

    def _read(self) -> dict | None:
        try:
            return self.client.request("GET", self.path)
        except KubeError as e:
            if is_not_found(e):
                return None
            raise

    def _write(self, secret: dict | None, p: Plan) -> dict:
        where = f"{self.namespace}/{self.secret}"
        if secret is None:
            body = {"apiVersion": "v1", "kind": "Secret", "type": SECRET_TYPE,
                    "metadata": {"name": self.secret, "namespace": self.namespace, "labels": dict(LABELS)},
                    "data": encode(p.data)}
            out = self.client.request("POST", f"/api/v1/namespaces/{self.namespace}/secrets", body=body)
            log.info("webhook Secret created", extra=kv(secret=where))
        else:
            if secret.get("type") != SECRET_TYPE:
                raise NotOurs(f"Secret {where} has type {secret.get('type')!r}, not {SECRET_TYPE}: it is not ours to "
                              "overwrite; delete it or name another --webhook-secret")
            out = self.client.request("PUT", self.path, body={**secret, "data": encode(p.data)})
            log.info("webhook Secret renewed", extra=kv(secret=where, reasons=list(p.reasons)))
        self.writes += 1
        return out

    def _install(self, data: dict[str, bytes]) -> None:
        pair = (data["tls.crt"], data["tls.key"])
        if pair == self._installed_pair:
            return
        # key first: a connection between the two renames fails to load the pair and the server
        # keeps the previous one until the certificate lands (controller/webhooks/server.py)
        atomic.write(self.key_file, pair[1], mode=0o600, durable=False)
        atomic.write(self.cert_file, pair[0], mode=0o600, durable=False)
        cert = x509.load_pem_x509_certificate(pair[0])
        self._installed_pair, self.serial, self._expiry = pair, cert.serial_number, expires_at(cert)
        self.certificate = cert
        self.installed.set()
        log.info("webhook serving certificate installed",
                 extra=kv(serial=format(cert.serial_number, "x"), expires=cert.not_valid_after_utc.isoformat()))


