"""The pure parts of the self-managed webhook certificates: controller/webhooks/certs.py's plan (what the
Secret should hold at a given time), the policy's limits, controller/webhooks/cabundle.py's choice of
webhooks, and the CLI's durations. The certificates are checked with cryptography's own
verification (chain to a CA of the bundle, names, key usage)."""

from __future__ import annotations

import argparse
import base64
import datetime as dt

import pytest
from cryptography import x509
from cryptography.x509.verification import DNSName, PolicyBuilder, Store
from cryptography.x509.oid import ExtendedKeyUsageOID

from controller.webhooks.cabundle import set_ca_bundle
from controller.webhooks.certs import (BACKDATE, RENEW_AT, Policy, expires_at, issued_at, parse_bundle, plan, renew_at,
                              service_names)
from controller.cli import parse_duration

NAMES = service_names("accelnode-controller", "accelnode-system")
POLICY = Policy(ca_lifetime=3000.0, cert_lifetime=900.0)
T0 = 1_900_000_000.0


def leaf(data) -> x509.Certificate:
    return x509.load_pem_x509_certificate(data["tls.crt"])


def bundle(data) -> list[x509.Certificate]:
    return parse_bundle(data["ca.crt"])


def verify(data, name: str = NAMES[0], at: float | None = None) -> x509.Certificate:
    """The serving certificate verifies for ``name`` against the bundle, as a TLS client would."""
    cert = leaf(data)
    at = at if at is not None else issued_at(cert) + 1
    verifier = (PolicyBuilder().store(Store(bundle(data))).time(dt.datetime.fromtimestamp(at, dt.timezone.utc))
                .build_server_verifier(DNSName(name)))
    chain = verifier.verify(cert, [])
    return chain[-1]  # the CA it chains to


def test_no_secret_makes_a_ca_and_a_serving_certificate_for_the_service_names():
    p = plan(None, NAMES, POLICY, T0)
    assert p.changed and p.reasons == ("no Secret", "no serving certificate matching its key")
    assert set(p.data) == {"tls.crt", "tls.key", "ca.crt", "ca.key"}
    assert NAMES == ["accelnode-controller.accelnode-system.svc",
                     "accelnode-controller.accelnode-system.svc.cluster.local",
                     "accelnode-controller.accelnode-system", "accelnode-controller"]
    for name in NAMES:
        ca = verify(p.data, name)
    assert ca == bundle(p.data)[0]
    cert = leaf(p.data)
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH])
    assert cert.not_valid_before_utc.timestamp() == T0 - BACKDATE  # an API server whose clock lags still trusts it
    assert expires_at(cert) == T0 + POLICY.cert_lifetime and expires_at(ca) == T0 + POLICY.ca_lifetime
    assert p.wake_at == T0 + RENEW_AT * POLICY.cert_lifetime
    assert b"PRIVATE KEY" in p.data["tls.key"] and b"PRIVATE KEY" in p.data["ca.key"]


def test_a_secret_as_it_should_be_is_left_byte_for_byte_until_the_renewal_point():
    first = plan(None, NAMES, POLICY, T0).data
    for t in (T0, T0 + 100, renew_at(leaf(first)) - 1):
        p = plan(first, NAMES, POLICY, t)
        assert not p.changed and p.data == first and p.wake_at == renew_at(leaf(first))


def test_the_serving_certificate_is_renewed_at_two_thirds_of_its_life_by_the_same_ca():
    first = plan(None, NAMES, POLICY, T0).data
    t = renew_at(leaf(first))
    p = plan(first, NAMES, POLICY, t)
    assert p.reasons == ("the serving certificate is due for renewal",)
    assert leaf(p.data).serial_number != leaf(first).serial_number
    assert p.data["ca.crt"] == first["ca.crt"] and p.data["ca.key"] == first["ca.key"]
    verify(p.data, at=t)


def test_a_renewed_ca_is_trusted_first_and_signs_only_after_the_grace():
    first = plan(None, NAMES, POLICY, T0).data
    old_ca = bundle(first)[0]
    t = renew_at(old_ca)  # 2000 s in
    mid = plan(first, NAMES, POLICY, t - 700).data  # the serving certificate's renewal, due again at t - 100
    assert leaf(mid).serial_number != leaf(first).serial_number
    p = plan(mid, NAMES, POLICY, t)
    assert "the CA is due for renewal" in p.reasons
    new_ca, kept = bundle(p.data)
    assert kept == old_ca and issued_at(new_ca) == t  # newest first; the old CA stays until it expires
    # the serving certificate is due too, but the new CA is too young to sign it: it waits
    assert t >= renew_at(leaf(mid)) and p.data["tls.crt"] == mid["tls.crt"]
    assert p.wake_at == t + POLICY.grace and POLICY.grace == pytest.approx(900.0 / 6)
    assert plan(p.data, NAMES, POLICY, t + POLICY.grace - 1).changed is False
    after = plan(p.data, NAMES, POLICY, t + POLICY.grace)
    assert after.reasons == ("the serving certificate is due for renewal",)
    assert verify(after.data, at=t + POLICY.grace) == new_ca
    assert bundle(after.data) == [new_ca, old_ca]
    # the old CA leaves the bundle when it expires, not before
    gone = plan(after.data, NAMES, POLICY, expires_at(old_ca))
    assert "an expired CA left the bundle" in gone.reasons and bundle(gone.data) == [new_ca]


def test_an_unusable_serving_certificate_is_replaced_at_once_even_by_a_young_ca():
    first = plan(None, NAMES, POLICY, T0).data
    other = plan(None, NAMES, POLICY, T0).data
    cases = {
        "no serving certificate matching its key": {**first, "tls.key": other["tls.key"]},
        "the serving certificate's names are not the Service's": plan(None, service_names("x", "y"), POLICY, T0).data,
        "the serving certificate is not issued by a CA of the bundle": {**first, "tls.crt": other["tls.crt"],
                                                                        "tls.key": other["tls.key"]},
    }
    for reason, data in cases.items():
        p = plan(data, NAMES, POLICY, T0 + 1)
        assert reason in p.reasons, (reason, p.reasons)
        verify(p.data, at=T0 + 1)
    expired = plan(first, NAMES, POLICY, expires_at(leaf(first)))
    assert expired.reasons == ("the serving certificate has expired",)


def test_a_broken_ca_is_replaced_and_a_bad_bundle_never_survives():
    first = plan(None, NAMES, POLICY, T0).data
    other = plan(None, NAMES, POLICY, T0).data
    p = plan({**first, "ca.key": other["ca.key"]}, NAMES, POLICY, T0 + 1)
    assert "no usable CA (ca.key does not match the newest CA of ca.crt)" in p.reasons
    assert len(bundle(p.data)) == 2 and p.data["tls.crt"] == first["tls.crt"]  # still issued by a trusted CA
    p = plan({**first, "ca.crt": b"garbage"}, NAMES, POLICY, T0 + 1)
    assert "ca.crt is not a bundle of CA certificates" in p.reasons
    assert len(bundle(p.data)) == 1
    verify(p.data, at=T0 + 1)
    with pytest.raises(ValueError, match="not a CA"):
        parse_bundle(first["tls.crt"])


def test_policy_limits_and_durations():
    Policy().check()
    with pytest.raises(ValueError, match="at most a third"):
        Policy(ca_lifetime=100.0, cert_lifetime=50.0).check()
    with pytest.raises(ValueError, match="at least 30s"):
        Policy(ca_lifetime=100.0, cert_lifetime=10.0).check()
    assert Policy().grace == 600.0
    assert parse_duration("87600h") == 10 * 365 * 86400 and parse_duration("30s") == 30
    assert parse_duration("1.5m") == 90 and parse_duration("2d") == 172800
    for bad in ("", "10", "0s", "-1h", "1y", "h"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(bad)


def test_ca_bundle_goes_only_to_webhooks_calling_our_service():
    def hook(name, cc):
        return {"name": name, "clientConfig": cc}

    config = {"webhooks": [
        hook("ours", {"service": {"namespace": "ns", "name": "svc", "port": 443}}),
        hook("other-service", {"service": {"namespace": "ns", "name": "other"}, "caBundle": "b2xk"}),
        hook("other-namespace", {"service": {"namespace": "elsewhere", "name": "svc"}}),
        hook("url", {"url": "https://example.invalid/x"}),
    ]}
    b64 = base64.b64encode(b"pem").decode()
    set_ca_bundle(config, b64, "svc", "ns")
    got = {h["name"]: h["clientConfig"].get("caBundle") for h in config["webhooks"]}
    assert got == {"ours": b64, "other-service": "b2xk", "other-namespace": None, "url": None}
    set_ca_bundle({}, b64, "svc", "ns")  # a configuration without webhooks is no error


def test_a_key_half_written_by_a_killed_replica_is_swept_at_start(tmp_path):
    """The serving key is written through accelnode.atomic; a temporary file a killed process
    left (a private key among them) is gone when the next one starts, and nothing else is."""
    from controller.webhooks.certs import ServingCerts

    stale = [tmp_path / ".tls.key.12.34.tmp", tmp_path / ".tls.crt.12.34.tmp"]
    other = tmp_path / ".operator-notes.tmp"
    for p in stale + [other]:
        p.write_text("-----BEGIN EC PRIVATE KEY-----")
    ServingCerts(None, "ns", "secret", ["svc.ns.svc"], directory=str(tmp_path))
    assert [p.exists() for p in stale] == [False, False] and other.exists()
