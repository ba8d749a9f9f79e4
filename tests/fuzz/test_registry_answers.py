"""Fuzz: every registry answer the controller and the agent parse. A hostile registry (an HTTP
server in this process that answers whatever hypothesis drew: its /v2/ challenge, its token
answer, manifests, image indexes, config blobs and layers, media types and Content-Types) is
asked by the controller's path (``manifest.inspect``, what pinning a cache runs) and the agent's
(``CacheStore.ensure``, a pull into a fresh store), and the signatures of a digest are fetched
and judged as the controller and the agent do (``signatures.verify``: cosign v2 ``.sig``
manifests, v3 referrers, bundles, payloads, certificates). Each must end with its answer or one of our
refusals (:class:`ImageError`); any other exception is a crash. A refused pull leaves the store
as it was: no cache, no reference, nothing in its staging area."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import tarfile
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelnode.oci import cacheformat as fmt
from accelnode.oci import manifest
from accelnode.oci import signatures as sg
from accelnode.oci.errors import ImageError
from accelnode.oci.registry import INDEX_TYPES, MANIFEST_TYPES, RegistryOptions
from agent.store import CacheStore

from .fuzzing import fuzz_settings, json_values, shaped, text

REPO = "team/cache"
ACCELERATORS = [{"backend": "tpu", "arch": "v5e"}]
SELF = "{self}"  # replaced by the server's host:port when it answers


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _cache_layer() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("io.jax.cache/xla/index.txt", b"m1\n"), ("io.jax.cache/xla/m.bin", b"\x7fXLA")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(out.getvalue(), mtime=0)


GOOD_LAYER = _cache_layer()
GOOD_LABELS = {fmt.label("jax", "summary"): json.dumps({"targets": [{"backend": "tpu", "arch": "v5e"}]})}

# -- what the registry answers ---------------------------------------------------------------------

blob_bytes = st.one_of(st.just(GOOD_LAYER), st.binary(max_size=64), st.binary(max_size=64).map(gzip.compress))
media_types = st.one_of(st.sampled_from([*fmt.LAYER_TYPES, *fmt.CONFIG_TYPES, *MANIFEST_TYPES, *INDEX_TYPES]),
                        text, json_values)


@st.composite
def descriptor(draw, blobs: dict, data: bytes, kind_types) -> dict:
    """A descriptor of ``data`` (served as a blob), its fields right or drawn."""
    blobs[_digest(data)] = data
    return draw(shaped({"mediaType": st.one_of(st.sampled_from(kind_types), media_types),
                        "digest": st.one_of(st.just(_digest(data)), st.just(_digest(b"elsewhere")), text),
                        "size": st.one_of(st.just(len(data)), st.integers(-2, 2**40), st.booleans()),
                        "annotations": st.dictionaries(text, text, max_size=2),
                        "platform": st.one_of(st.just(fmt.host_platform()), json_values)}))


@st.composite
def image_manifest(draw, blobs: dict) -> dict:
    labels = draw(st.one_of(st.just(GOOD_LABELS), st.dictionaries(
        st.one_of(st.sampled_from([fmt.label(k, "summary") for k in fmt.KINDS]), text),
        st.one_of(text, st.just('{"targets": [{"backend": "tpu"}]}'), json_values), max_size=3), json_values))
    config = draw(st.one_of(st.just({"config": {"Labels": labels}}), json_values))
    config_bytes = draw(st.one_of(st.just(json.dumps(config).encode()), st.binary(max_size=32)))
    layers = draw(st.lists(st.builds(lambda b: b, blob_bytes).flatmap(
        lambda b: descriptor(blobs, b, list(fmt.LAYER_TYPES))), max_size=3))
    return draw(shaped({"schemaVersion": st.just(2), "mediaType": st.sampled_from(MANIFEST_TYPES),
                        "config": descriptor(blobs, config_bytes, list(fmt.CONFIG_TYPES)),
                        "layers": st.one_of(st.just(layers), json_values)}))


@st.composite
def world(draw) -> dict:
    """One registry: its challenge, its token server, and the documents and blobs it serves."""
    blobs, manifests = {}, {}
    doc = draw(image_manifest(blobs))
    if draw(st.booleans()):  # an index over one or two manifests
        children = [doc] + ([draw(image_manifest(blobs))] if draw(st.booleans()) else [])
        entries = []
        for child in children:
            body = json.dumps(child).encode()
            manifests[_digest(body)] = body
            entries.append(draw(descriptor({}, body, list(MANIFEST_TYPES))))
        doc = draw(shaped({"schemaVersion": st.just(2), "mediaType": st.sampled_from(INDEX_TYPES),
                           "manifests": st.one_of(st.just(entries), json_values, st.lists(
                               st.one_of(json_values, st.sampled_from(entries)), max_size=3))}))
    top = draw(st.one_of(st.just(json.dumps(doc).encode()), st.binary(max_size=64),
                         json_values.map(lambda v: json.dumps(v).encode())))
    manifests["t"] = top
    challenge = draw(st.one_of(
        st.none(),  # open registry
        st.just(f'Bearer realm="http://{SELF}/token",service="registry",scope="repository:{REPO}:pull"'),
        st.just('Basic realm="registry"'),
        st.builds(lambda realm, rest: f'Bearer realm="{realm}"{rest}',
                  st.one_of(st.just(f"http://{SELF}/token"), st.just(f"{SELF}/token"), text),
                  st.one_of(st.just(""), st.just(',service="s"'), text)),
        text))
    token = draw(st.one_of(st.just(b'{"token": "t0k3n"}'), st.just(b'{"access_token": "a"}'),
                           json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=32)))
    return {"challenge": challenge, "token_status": draw(st.sampled_from([200, 200, 401, 404])), "token": token,
            "manifest_status": draw(st.sampled_from([200, 200, 200, 404, 401, 400])),
            "content_type": draw(st.one_of(st.sampled_from([*MANIFEST_TYPES, *INDEX_TYPES]), text)),
            "manifests": manifests, "blobs": blobs, "anonymous": draw(st.booleans())}


class HostileRegistry:
    """Answers from ``self.world``; a Bearer challenge is lifted by any Bearer token."""

    def __init__(self):
        self.world: dict = {}
        registry = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self):
                self.do_GET(head=True)

            def do_GET(self, head=False):
                status, headers, body = registry.answer(self.path, self.headers.get("Authorization") or "")
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v.replace(SELF, registry.host).replace("\r", " ").replace("\n", " "))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # clients hang up on refusals
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, authorization: str) -> tuple[int, dict, bytes]:
        w = self.world
        if path.startswith("/token"):
            return w["token_status"], {"Content-Type": "application/json"}, w["token"]
        challenge = w["challenge"]
        if challenge is not None and not authorization.startswith("Bearer ") and not (
                challenge.startswith("Basic") and authorization.startswith("Basic ")):
            return 401, {"WWW-Authenticate": challenge.encode("latin-1", "replace").decode("latin-1")}, b"{}"
        if path == "/v2/":
            return 200, {}, b"{}"
        prefix = f"/v2/{REPO}/"
        if path.startswith(prefix + "manifests/"):
            body = w["manifests"].get(path.rsplit("/", 1)[1])
            if body is None:
                return 404, {}, b"{}"
            return w["manifest_status"], {"Content-Type": w["content_type"].encode("latin-1", "replace")
                                          .decode("latin-1")}, body
        if path.startswith(prefix + "referrers/"):
            body = w.get("referrers")
            return (404, {}, b"{}") if body is None else (200, {"Content-Type": sg.INDEX_TYPE}, body)
        if path.startswith(prefix + "blobs/"):
            body = w["blobs"].get(path.rsplit("/", 1)[1])
            return (404, {}, b"{}") if body is None else (200, {"Content-Type": "application/octet-stream"}, body)
        return 404, {}, b"{}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    reg = HostileRegistry()
    config = tmp_path_factory.mktemp("fuzz-creds") / "config.json"
    config.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(b"u:p").decode()}}}))
    reg.config = str(config)
    yield reg
    reg.stop()


def _options(reg: HostileRegistry, w: dict) -> RegistryOptions:
    return RegistryOptions(plain_http=True, config_file=reg.config, anonymous=w["anonymous"], timeout=10.0)


@fuzz_settings(ci_examples=150)
@given(w=world())
def test_controller_inspect_refuses_or_answers(hostile, w):
    hostile.world = w
    try:
        manifest.inspect(f"{hostile.host}/{REPO}:t", _options(hostile, w))
    except ImageError:
        pass


def _store_state(root: Path) -> dict:
    return {sub: sorted(p.name for p in (root / sub).iterdir()) for sub in ("caches", "refs", "tmp")}


def _kept_indexes_accepted(store: CacheStore, image: str) -> None:
    """An image index is kept (for offline pulls) only once accepted: it names an entry to pull."""
    for path in (store.root / "indexes").iterdir():
        store._choose(json.loads(path.read_bytes()), image, ACCELERATORS)


@fuzz_settings(ci_examples=150)
@given(w=world())
def test_agent_pull_refuses_or_installs(hostile, w):
    hostile.world = w
    with tempfile.TemporaryDirectory() as d:
        store = CacheStore(d, registry=_options(hostile, w))
        before = _store_state(Path(d))
        image = f"{hostile.host}/{REPO}:t"
        try:
            store.ensure(image, accelerators=ACCELERATORS)
        except ImageError:
            assert _store_state(Path(d)) == before  # a refusal installs, references and stages nothing
            _kept_indexes_accepted(store, image)


# -- signatures -------------------------------------------------------------------------------------

SIGNED = _digest(b"the cache's manifest")
b64 = st.one_of(st.binary(max_size=80).map(lambda b: base64.b64encode(b).decode()), text)
certificates = st.one_of(st.just("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"), text, json_values)


@st.composite
def signature_world(draw) -> dict:
    """A registry holding cosign v2 and v3 signatures of SIGNED, their fields right or drawn."""
    blobs, manifests = {}, {}
    payload = draw(st.one_of(
        st.just(json.dumps({"critical": {"image": {"docker-manifest-digest": SIGNED}}}).encode()),
        json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=40)))
    ann = draw(shaped({sg.SIG_ANNOTATION: b64, sg.CERT_ANNOTATION: certificates, sg.CHAIN_ANNOTATION: certificates}))
    layer = draw(descriptor(blobs, payload, [sg.SIMPLESIGNING]))
    layer["annotations"] = ann
    v2 = draw(shaped({"layers": st.one_of(st.just([layer]), json_values), "mediaType": media_types}))
    manifests[SIGNED.replace(":", "-") + ".sig"] = json.dumps(v2).encode()
    raw = st.one_of(st.just({"rawBytes": draw(b64)}), json_values)
    bundle = draw(st.one_of(shaped({
        "verificationMaterial": shaped({"certificate": raw, "publicKey": shaped({"hint": text}),
                                        "x509CertificateChain": shaped({"certificates": st.lists(raw, max_size=2)})}),
        "dsseEnvelope": shaped({"payload": b64, "payloadType": text,
                                "signatures": st.lists(shaped({"sig": b64}), max_size=2)}),
        "messageSignature": shaped({"messageDigest": shaped({"digest": b64}), "signature": b64})}), json_values))
    bundle_bytes = draw(st.one_of(st.just(json.dumps(bundle).encode()), st.binary(max_size=40)))
    art = draw(shaped({"subject": shaped({"digest": st.one_of(st.just(SIGNED), text)}),
                       "layers": st.one_of(st.lists(descriptor(blobs, bundle_bytes, list(sg.BUNDLE_TYPES)),
                                                    max_size=1), json_values)}))
    art_bytes = json.dumps(art).encode()
    manifests[_digest(art_bytes)] = art_bytes
    entry = draw(shaped({"artifactType": st.one_of(st.sampled_from(sg.BUNDLE_TYPES), json_values),
                         "digest": st.one_of(st.just(_digest(art_bytes)), text)}))
    index = draw(shaped({"manifests": st.one_of(st.just([entry]), json_values)}))
    referrers = json.dumps(index).encode()
    if draw(st.booleans()):
        manifests[SIGNED.replace(":", "-")] = referrers  # the fallback tag, no referrers API
        referrers = None
    return {"challenge": None, "manifest_status": 200, "content_type": sg.INDEX_TYPE, "manifests": manifests,
            "blobs": blobs, "referrers": referrers, "anonymous": True}


@pytest.fixture(scope="module")
def trust():
    """A key and a keyless trust (a CA) for the verifier: no fuzzed signature verifies under them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import datetime as dt

    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fuzz-ca")])
    now = dt.datetime.now(dt.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
          .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    return [sg.TrustedKey.from_pem("k", pem)], (sg.KeylessTrust((sg.Identity("https://issuer", "a@b"),), (ca,)),)


@fuzz_settings(ci_examples=150)
@given(w=signature_world())
def test_signature_fetch_and_judge_refuse_or_answer(hostile, trust, w):
    hostile.world = w
    keys, keyless = trust
    try:
        verdict = sg.verify(f"{hostile.host}/{REPO}:t", SIGNED, keys, _options(hostile, w), keyless=keyless)
    except ImageError:
        return
    assert not verdict.ok  # nothing here is signed by the trusted key or CA
