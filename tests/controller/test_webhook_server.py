"""The admission server (controller/webhooks/server.py) with a real TLS client on loopback: uid echo,
JSON Patch encoding, bad input, failing handlers, TLS floor and certificate reload."""

from __future__ import annotations

import base64
import datetime as dt
import http.client
import ipaddress
import json
import os
import socket
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from controller.webhooks.server import AdmissionServer, allow, deny


class CA:
    def __init__(self):
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "webhook-test-ca")])
        self.cert = self._build(self.name, self.key.public_key(), ca=True)
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def _build(self, subject, public_key, *, ca: bool, extensions=()):
        now = dt.datetime.now(dt.timezone.utc)
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.name).public_key(public_key)
             .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
             .not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        for ext in extensions:
            b = b.add_extension(ext, critical=False)
        return b.sign(self.key, hashes.SHA256())

    def serving(self, directory, cn: str) -> tuple[str, str, bytes]:
        """A serving pair for 127.0.0.1 written as ``cert.pem``/``key.pem``; the cert's DER."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._build(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]), key.public_key(), ca=False,
                           extensions=[x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])])
        crt, keyf = directory / "cert.pem", directory / "key.pem"
        # write-then-rename, as a Secret volume update does: a reader never sees half a file
        for path, data in ((crt, cert.public_bytes(serialization.Encoding.PEM)),
                           (keyf, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))):
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return str(crt), str(keyf), cert.public_bytes(serialization.Encoding.DER)


def review(uid="7d9c2a8e-1b3f-4c5d-9e0f-a1b2c3d4e5f6", obj=None) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
                        "namespace": "default", "object": obj or {"metadata": {"name": "p"}}}}


def add_label(request):
    if request["object"]["metadata"].get("labels", {}).get("deny"):
        return deny("labelled deny", code=403)
    return allow([{"op": "add", "path": "/metadata/labels", "value": {"mutated": "yes"}}], warnings=["be careful"])


def boom(request):
    raise RuntimeError("handler bug")


@pytest.fixture
def tls(tmp_path):
    ca = CA()
    cert, key, der = ca.serving(tmp_path, "webhook-1")
    return ca, cert, key, der


@pytest.fixture
def server(tls):
    ca, cert, key, _ = tls
    s = AdmissionServer("127.0.0.1:0", cert, key, {"/mutate": add_label, "/boom": boom, "/wrong": lambda r: {}},
                        max_body=64 * 1024).start()
    yield s
    s.stop()


def client_ctx(ca: CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=ca.pem.decode())
    return ctx


def post(server, ca, path, body: bytes, headers=None):
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=client_ctx(ca), timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_uid_is_echoed_and_the_patch_is_base64_json_patch(server, tls):
    ca = tls[0]
    status, body = post(server, ca, "/mutate?timeout=10s", json.dumps(review()).encode())
    assert status == 200
    doc = json.loads(body)
    assert (doc["apiVersion"], doc["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    resp = doc["response"]
    assert resp["uid"] == "7d9c2a8e-1b3f-4c5d-9e0f-a1b2c3d4e5f6" and resp["allowed"] is True
    assert resp["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(resp["patch"])) == [
        {"op": "add", "path": "/metadata/labels", "value": {"mutated": "yes"}}]
    assert resp["warnings"] == ["be careful"]


def test_a_denial_carries_code_and_message(server, tls):
    status, body = post(server, tls[0], "/mutate",
                        json.dumps(review(uid="u-2", obj={"metadata": {"labels": {"deny": "1"}}})).encode())
    resp = json.loads(body)["response"]
    assert status == 200
    assert resp == {"uid": "u-2", "allowed": False, "status": {"code": 403, "message": "labelled deny"}}


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "body is not valid JSON"),
    (b"[1, 2]", "body is not a JSON object"),
    (json.dumps({**review(), "apiVersion": "admission.k8s.io/v1beta1"}).encode(), "admission.k8s.io/v1"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(), "no request"),
    (json.dumps({**review(), "request": {"operation": "CREATE"}}).encode(), "no uid"),
    (b"\xff\xfe\x00garbage", "body is not valid JSON"),
    # issue 33: decoded under accelnode.decode.ADMISSION_REVIEW, checked before anything is parsed
    (json.dumps({**review(), "pad": [0]}).encode().replace(b"[0]", b"[" * 600 + b"0" + b"]" * 600),
     "nests arrays and objects 601 deep, over the budget of 500"),
])
def test_malformed_reviews_are_400_with_a_message(server, tls, body, fragment):
    status, out = post(server, tls[0], "/mutate", body)
    assert status == 400
    assert b"malformed AdmissionReview" in out and fragment.encode() in out, out


def test_the_server_survives_bad_input_and_still_answers(server, tls):
    ca = tls[0]
    assert post(server, ca, "/mutate", b"x" * (64 * 1024 + 1))[0] == 413
    assert post(server, ca, "/nowhere", json.dumps(review()).encode())[0] == 404
    # a client that connects and says nothing, and one that does not speak TLS
    idle = socket.create_connection(("127.0.0.1", server.port))
    plain = socket.create_connection(("127.0.0.1", server.port))
    plain.sendall(b"POST /mutate HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
    try:
        status, _ = post(server, ca, "/mutate", json.dumps(review()).encode())
        assert status == 200
    finally:
        idle.close()
        plain.close()


def test_a_failing_handler_answers_allowed_false_500(server, tls):
    for path in ("/boom", "/wrong"):
        status, body = post(server, tls[0], path, json.dumps(review(uid="u-3")).encode())
        assert status == 200
        resp = json.loads(body)["response"]
        assert resp["uid"] == "u-3" and resp["allowed"] is False
        assert resp["status"]["code"] == 500 and f"internal error in webhook {path}" in resp["status"]["message"]


def test_tls_1_2_is_the_floor(server, tls):
    assert server.certs.context().minimum_version == ssl.TLSVersion.TLSv1_2
    ctx = client_ctx(tls[0])
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2  # the oldest version a client may use
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            assert s.version() == "TLSv1.2"


def peer_cert(server, ca) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        with client_ctx(ca).wrap_socket(raw, server_hostname="127.0.0.1") as s:
            return s.getpeercert(binary_form=True)


def test_a_new_certificate_is_served_to_new_handshakes_without_restart(server, tls, tmp_path):
    ca, _, _, first = tls
    assert peer_cert(server, ca) == first
    _, _, second = ca.serving(tmp_path, "webhook-2")
    assert second != first
    assert peer_cert(server, ca) == second
    assert post(server, ca, "/mutate", json.dumps(review()).encode())[0] == 200
    # a broken replacement keeps the working pair
    (tmp_path / "key.pem").write_text("not a key")
    assert peer_cert(server, ca) == second
    assert server.certs.reloads == 1


def test_answers_are_counted_by_path_and_kind_and_timed(tls):
    from prometheus_client import CollectorRegistry

    from controller.webhooks.server import AdmissionMetrics

    ca, cert, key, der = tls
    registry = CollectorRegistry()
    s = AdmissionServer("127.0.0.1:0", cert, key, {"/mutate": add_label, "/boom": boom},
                        max_body=1024, metrics=AdmissionMetrics(registry)).start()
    try:
        post(s, ca, "/mutate", json.dumps(review()).encode())
        post(s, ca, "/mutate", json.dumps(review(obj={"metadata": {"labels": {"deny": "1"}}})).encode())
        post(s, ca, "/boom", json.dumps(review()).encode())
        post(s, ca, "/mutate", b"{not json")
        post(s, ca, "/made-up-path", json.dumps(review()).encode())
        post(s, ca, "/mutate", b"x" * 2048)
    finally:
        s.stop()

    def count(path, answer):
        return registry.get_sample_value("accelnode_controller_admission_requests_total",
                                         {"path": path, "answer": answer})
    assert [count("/mutate", a) for a in ("patched", "denied", "malformed", "too_large")] == [1, 1, 1, 1]
    assert count("/boom", "error") == 1 and count("other", "no_route") == 1
    assert registry.get_sample_value("accelnode_controller_admission_seconds_count", {"path": "/mutate"}) == 3
    want = x509.load_der_x509_certificate(der).not_valid_after_utc.timestamp()
    assert s.certs.not_after == want  # what the expiry gauge of certificates from files reads
