"""Where registry credentials may go (issue 23, 6a). A real registry (distribution) with token
auth names the realm its clients must ask for a token; the realm is the registry's word, so a
registry (or whoever rewrites its answers) could point it at a listener of its choosing. We ask
a realm only over https (any host, as Docker Hub's auth.docker.io), or over http at the very
host:port contacted when the operator chose plain HTTP.

Peers: distribution 2.8 (``docker-registry``) verifying real ES256 JWTs against a private CA's
certificate; a token server over TLS (private CA) on another loopback host, 127.0.0.2; plain-HTTP
listeners that record every byte they receive."""

from __future__ import annotations

import base64
import datetime as dt
import http.server
import ipaddress
import json
import shutil
import socket
import ssl
import threading
import time
import urllib.parse

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from accelnode.oci.errors import AuthError
from accelnode.oci.reference import Reference
from accelnode.oci.registry import Deadline, Registry
from tests.conftest import require
from tests.fixtures.registry import RunningRegistry, _free_port

USER, PASSWORD = "tenant", "pw-that-must-not-leak"
SERVICE = "accelnode-registry"
ISSUER = "accelnode-test-token-server"
OTHER_HOST = "127.0.0.2"  # another host: Linux answers the whole of 127/8 on lo


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class CA:
    """A private CA and the certificates the test's servers use (ECDSA P-256)."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "token-realm-test-ca")])
        self.cert = self._cert(self.name, self.key.public_key(), ca=True)
        self.file = self._write("ca.pem", self.cert.public_bytes(serialization.Encoding.PEM))

    def _cert(self, subject, public_key, *, ca: bool, ips=(), usage=None):
        now = dt.datetime.now(dt.timezone.utc)
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.name).public_key(public_key)
             .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
             .not_valid_after(now + dt.timedelta(hours=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ips:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(i)) for i in ips]),
                                critical=False)
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return b.sign(self.key, hashes.SHA256())

    def _write(self, name: str, data: bytes) -> str:
        (self.workdir / name).write_bytes(data)
        return str(self.workdir / name)

    def server_files(self, name: str, ip: str) -> tuple[str, str]:
        """(certificate file, key file) for a server at ``ip``."""
        return self._leaf(name, ips=[ip])

    def client_files(self, name: str) -> tuple[str, str]:
        """(certificate file, key file) of a TLS client named ``name`` (mutual TLS)."""
        return self._leaf(name, usage=ExtendedKeyUsageOID.CLIENT_AUTH)

    def _leaf(self, name: str, **kw) -> tuple[str, str]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key.public_key(), ca=False, **kw)
        return (self._write(f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM)),
                self._write(f"{name}-key.pem", key.private_bytes(serialization.Encoding.PEM,
                                                                 serialization.PrivateFormat.PKCS8,
                                                                 serialization.NoEncryption())))

    def jwt(self, claims: dict) -> str:
        """A token distribution accepts: ES256, signed by the CA's key, the CA in ``x5c``."""
        header = {"alg": "ES256", "typ": "JWT",
                  "x5c": [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]}
        signing = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing}.{_b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


class Listener:
    """An HTTP(S) server on (ip, free port) in a thread; keeps every request's line and headers."""

    def __init__(self, ip: str, answer, tls: tuple[str, str] | None = None):
        self.requests: list[tuple[str, dict]] = []
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                status, body = answer(self.path, self.headers)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((ip, 0), Handler)
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.address = f"{ip}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def recorder(ip: str) -> Listener:
    """A plain-HTTP listener that records and answers what a token server would (it never gets to)."""
    return Listener(ip, lambda path, headers: (200, json.dumps({"token": "stolen"}).encode()))


def token_server(ca: CA) -> Listener:
    """A token server over TLS on OTHER_HOST: Basic USER:PASSWORD gets the scope asked for."""
    cert, key = ca.server_files("token-server", OTHER_HOST)
    good = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    def answer(path, headers):
        if headers.get("Authorization") != good:
            return 401, b"{}"
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        access = []
        for scope in query.get("scope", []):
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        token = ca.jwt({"iss": ISSUER, "sub": USER, "aud": SERVICE, "iat": now, "nbf": now - 60,
                        "exp": now + 300, "jti": str(now), "access": access})
        return 200, json.dumps({"token": token}).encode()
    return Listener(OTHER_HOST, answer, tls=(cert, key))


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return CA(tmp_path_factory.mktemp("token-ca"))


@pytest.fixture
def trust_ca(ca, monkeypatch):
    """Our client trusts the private CA (requests reads REQUESTS_CA_BUNDLE), as an operator's
    node would through its system bundle."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", ca.file)


def start_registry(tmp_path_factory, ca: CA, realm, *, tls: bool) -> RunningRegistry:
    """distribution with token auth whose challenge names ``realm`` (or ``realm(host)``)."""
    require(shutil.which("docker-registry") is not None, "docker-registry (Debian package docker-registry)")
    workdir = tmp_path_factory.mktemp("token-registry")
    reg = RunningRegistry(workdir, tls=(*ca.server_files("registry", "127.0.0.1"), ca.file) if tls else None,
                          auth=lambda host: {"token": {"realm": realm(host) if callable(realm) else realm,
                                                       "service": SERVICE, "issuer": ISSUER,
                                                       "rootcertbundle": ca.file}})
    reg.config_file = str(workdir / "docker-config.json")
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    (workdir / "docker-config.json").write_text(json.dumps({"auths": {reg.host: {"auth": auth}}}))
    return reg


def fetch(reg: RunningRegistry, repo: str = "team/cache", tag: str = "v1"):
    image = f"{reg.host}/{repo}:{tag}"
    return Registry(reg.host, reg.options(), Deadline(20)).get_manifest(Reference.parse(image), image)


def _other_port_on(ip: str) -> Listener:
    rec = recorder(ip)
    with socket.create_connection(tuple(rec.address.rsplit(":", 1))):  # it listens
        pass
    return rec


@pytest.mark.parametrize("tls", [True, False], ids=["https-registry", "plain-http-registry"])
@pytest.mark.parametrize("where", [OTHER_HOST, "127.0.0.1"], ids=["other-host", "same-host-other-port"])
def test_http_realm_gets_no_credentials(tmp_path_factory, ca, trust_ca, tls, where):
    """The attack: the registry's challenge names http://<listener>/token. Nothing reaches the
    listener (neither the Basic credentials nor even a request) and the pull fails clearly.
    On main the listener received ``Authorization: Basic <tenant:password>``."""
    rec = _other_port_on(where)
    reg = start_registry(tmp_path_factory, ca, f"http://{rec.address}/token", tls=tls)
    try:
        with pytest.raises(AuthError, match=r"token realm 'http://.*' refused: a token is asked for only over https"):
            fetch(reg)
        assert rec.requests == []
    finally:
        reg.stop()
        rec.stop()


@pytest.mark.parametrize("tls", [True, False], ids=["https-registry", "plain-http-registry"])
def test_https_realm_on_another_host_works(tmp_path_factory, ca, trust_ca, tls):
    """As with Docker Hub (registry-1.docker.io, realm https://auth.docker.io/token): the token
    server is another host, over https with a private CA; credentials go there, the token works."""
    tokens = token_server(ca)
    reg = start_registry(tmp_path_factory, ca, f"https://{tokens.address}/token", tls=tls)
    try:
        pinned = reg.push_raw("team/cache", "v1", layers=[("application/vnd.oci.image.layer.v1.tar", b"x")])
        body, _, digest = fetch(reg)
        assert pinned.endswith(digest) and json.loads(body)["schemaVersion"] == 2
        basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        assert tokens.requests and all(h.get("authorization") == basic for _, h in tokens.requests)
    finally:
        reg.stop()
        tokens.stop()


def test_http_realm_at_the_plain_http_registry_itself_is_allowed(tmp_path_factory, ca):
    """An operator who chose --plain-http for a registry that serves its own tokens (Harbor's
    realm is http://<registry>/service/token) keeps working: the realm is the very host:port.
    The realm here is the registry's own address, which serves no token: the request is made
    (the registry answers 404) and the pull fails for that reason, not a refused realm."""
    reg = start_registry(tmp_path_factory, ca, lambda host: f"http://{host}/token", tls=False)
    try:
        with pytest.raises(AuthError) as err:
            fetch(reg)
        assert "refused: a token is asked for" not in str(err.value)
        assert "GET /token" in (reg.workdir / "registry.log").read_text(errors="replace")
    finally:
        reg.stop()
