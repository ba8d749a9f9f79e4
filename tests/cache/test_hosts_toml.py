"""Pulls through containerd's mirrors (issue 28): ``certs.d/<host>/hosts.toml`` read as containerd
reads it, against real servers.

The images stand on the test registry (distribution, ``docker-registry``) and are named by its
host, ``127.0.0.1:PORT/...``: the hosts directory is keyed ``127.0.0.1_PORT_`` (or
``127.0.0.1:PORT``, or ``_default``). The mirrors are distribution in proxy mode (a pull-through
cache, as Debian packages it: plain, with htpasswd, with TLS and client certificates) and, only
where a mirror must misbehave, small Python fronts (:class:`~tests.cache.helpers.Forwarder`).
Each test shows where the bytes came from by what the servers themselves logged: a mirror's
requests carry ``?ns=<registry>``, the pull-through cache fetches from the registry as
``Go-http-client``, our client is ``python-requests``. No test asserts a duration.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
import uuid

import pytest
import requests

from accelnode import exitcodes
from accelnode.oci.errors import RegistryUnavailable
from accelnode.oci.hosts import HostsConfig, HostsConfigError
from accelnode.oci.limits import Limits
from accelnode.oci.manifest import resolve
from accelnode.oci.registry import RegistryOptions
from agent.store import CacheStore
from tests.cache.helpers import BlobRedirector, Forwarder
from tests.cache.test_registry import closed_port
from tests.cache.test_store import triton_tree
from tests.cache.test_token_realm import CA, SERVICE, start_registry, token_server
from tests.conftest import accelnode_cmd, eventually
from tests.fixtures.registry import RunningRegistry, _start

PROXY_AGENT = "Go-http-client/"  # distribution fetching for its pull-through cache
OUR_AGENT = "python-requests/"  # our client
MIRROR_FAILED = "mirror failed, trying the next host"
MIRROR_USER, MIRROR_PASSWORD = "mirror-user", "mirror-pw"


@pytest.fixture(autouse=True)
def no_home_docker_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # only the configs a test writes hold credentials


# -- servers --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxy(registry, tmp_path_factory):
    """A pull-through cache of the test registry: distribution in proxy mode."""
    reg = _start(tmp_path_factory, proxy=f"http://{registry.host}")
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return CA(tmp_path_factory.mktemp("mirror-ca"))


@pytest.fixture(scope="module")
def tls_proxy(registry, ca, tmp_path_factory):
    """A pull-through cache over TLS (a certificate of the private CA) that requires a client
    certificate of that CA."""
    reg = _start(tmp_path_factory, proxy=f"http://{registry.host}",
                 tls=(*ca.server_files("mirror", "127.0.0.1"), ca.file), client_ca=ca.file)
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def auth_proxy(registry, tmp_path_factory):
    """A pull-through cache of the test registry that checks basic auth (its own user).
    (distribution 2.8's proxy can use upstream credentials only with token auth, so its
    upstream is the registry without auth; images pushed there too have the same digests.)"""
    reg = _start(tmp_path_factory, proxy=f"http://{registry.host}", username=MIRROR_USER, password=MIRROR_PASSWORD)
    yield reg
    reg.stop()


@pytest.fixture
def blackhole():
    """A port where connections hang: a listening socket (backlog 0) whose accept queue is full,
    so that the kernel drops further SYNs (counted as ListenOverflows)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    queued = []
    for _ in range(3):  # more than the queue holds; never accepted
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(srv.getsockname())
        queued.append(s)
    with pytest.raises(TimeoutError):  # what the mirror is: SYNs go unanswered
        socket.create_connection(srv.getsockname(), timeout=0.2).close()
    yield "127.0.0.1:%d" % srv.getsockname()[1]
    for s in (*queued, srv):
        s.close()


# -- helpers --------------------------------------------------------------------------------

def push(registry, tmp_path, repo: str, layers: int = 1, also=(), **build_kw) -> str:
    """A small Triton cache pushed under ``repo`` (to the ``also`` registries too, where it has
    the same digest): the digest-pinned reference on ``registry``."""
    src = triton_tree(tmp_path / f"src-{repo.replace('/', '-')}", nbytes=20_000)
    for other in also:
        other.push(src, repo, layers=layers, **build_kw)
    return registry.push(src, repo, layers=layers, **build_kw)


def tagged(pinned: str) -> str:
    return pinned.split("@")[0] + ":latest"


def manifest_of(registry, pinned: str) -> dict:
    """The image's manifest, as the registry's own storage holds it."""
    return json.loads(registry.blob_file(pinned.split("@")[1]).read_bytes())


def blobs(registry, pinned: str) -> list[str]:
    """The config's digest, then each layer's."""
    manifest = manifest_of(registry, pinned)
    return [manifest["config"]["digest"], *(d["digest"] for d in manifest["layers"])]


def key(host: str) -> str:
    """The directory containerd looks up first for ``host:port``."""
    return host.replace(":", "_") + "_"


def certs_d(root, files: dict[str, str]) -> str:
    """A hosts directory holding ``{directory name: hosts.toml text}``."""
    for name, text in files.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "hosts.toml").write_text(text)
    return str(root)


def mirror(url: str, caps=("pull", "resolve"), extra: str = "") -> str:
    return f'[host."{url}"]\ncapabilities = {json.dumps(list(caps))}\n{extra}\n'


def options(registry, hosts_dir: str, **kw) -> RegistryOptions:
    return registry.options(hosts_dir=hosts_dir, **kw)


def settled(reg: RunningRegistry) -> list[tuple]:
    """The access log once every request answered before now is in it: a marker request is
    sent and waited for (the registry writes a line after answering)."""
    marker = f"/v2/?settled={uuid.uuid4().hex}"
    try:
        urllib.request.urlopen(f"http://{reg.host}{marker}", timeout=10).close()
    except urllib.error.HTTPError:
        pass  # 401 from a registry with auth: logged all the same
    return eventually(lambda: (log := reg.access_log()) and any(p == marker for _, p, _, _ in log) and log,
                      f"{marker} in the access log")


def requests_for(reg: RunningRegistry, repo: str, since: int = 0) -> list[tuple[str, str, int, str]]:
    """(method, path, status, user agent) of the requests for ``repo`` logged after entry ``since``."""
    log = settled(reg)
    agents = reg.user_agents()
    return [(m, p, status, agents[i]) for i, (m, p, status, _) in enumerate(log)
            if i >= since and f"/v2/{repo}/" in p]


def ns(path: str) -> list[str]:
    """The ns= values of a request path."""
    return urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).get("ns", [])


def failures(caplog) -> list[str]:
    """The hosts that failed a request of a pull and were passed over (the client's log)."""
    return [r.fields["mirror"] for r in caplog.records if r.getMessage() == MIRROR_FAILED]


def cache(*args, rc=0):
    proc = subprocess.run(accelnode_cmd() + ["cache", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == rc, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def basic(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


def docker_config(path, host: str, user: str, password: str) -> str:
    path.write_text(json.dumps({"auths": {host: {"auth": basic(user, password)}}}))
    return str(path)


# -- a pull-through cache -------------------------------------------------------------------

def test_pull_through_cache_names_the_registry_and_fetches_each_blob_once(registry, proxy, tmp_path):
    """The mirror is distribution's pull-through cache: our requests reach it with
    ``?ns=<registry>``, it fetches from the registry (the registry's log: the proxy's user agent,
    never ours), and a second node pulling through it costs the registry no blob download."""
    repo = "hosts/through"
    pinned = push(registry, tmp_path, repo, layers=2)
    digests = blobs(registry, pinned)
    d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{proxy.host}")})
    origin_mark = len(settled(registry))

    store = CacheStore(tmp_path / "s1", registry=options(registry, d))
    inst = store.ensure(tagged(pinned))
    assert inst.digest == pinned.split("@")[1] and store.verify() == []

    at_proxy = requests_for(proxy, repo)
    assert at_proxy and all(ns(p) == [registry.host] and status == 200 and agent.startswith(OUR_AGENT)
                            for _, p, status, agent in at_proxy), at_proxy
    assert {p.split("?")[0].rsplit("/", 1)[1] for m, p, _, _ in at_proxy if "/blobs/" in p} == set(digests)
    at_origin = requests_for(registry, repo, origin_mark)
    assert at_origin and all(agent.startswith(PROXY_AGENT) and not ns(p) for _, p, _, agent in at_origin), at_origin
    assert {p.rsplit("/", 1)[1] for m, p, _, _ in at_origin if m == "GET" and "/blobs/" in p} == set(digests)

    # the cache keeps what it fetched (it commits in the background): a second node's pull is
    # served from it, the registry sending no blob again
    eventually(lambda: all(proxy.blob_file(x).exists() for x in digests), "the proxy's copy of every blob")
    origin_mark, proxy_mark = len(settled(registry)), len(settled(proxy))
    again = CacheStore(tmp_path / "s2", registry=options(registry, d)).ensure(pinned)
    assert again.digest == inst.digest
    assert [r for r in requests_for(registry, repo, origin_mark) if "/blobs/" in r[1]] == []
    served = [p.split("?")[0].rsplit("/", 1)[1] for m, p, s, _ in requests_for(proxy, repo, proxy_mark)
              if m == "GET" and "/blobs/" in p and s == 200]
    assert sorted(served) == sorted(digests)


def test_resolve_and_pull_only_mirror(registry, proxy, tmp_path):
    """``capabilities = ["pull"]``: the mirror serves blobs but is never asked what a tag names;
    the tag is resolved at the registry (by us: no ``ns=``, our user agent)."""
    repo = "hosts/pull-only"
    pinned = push(registry, tmp_path, repo)
    d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{proxy.host}", caps=["pull"])})
    origin_mark = len(settled(registry))
    assert resolve(tagged(pinned), options(registry, d))[0] == pinned.split("@")[1]
    inst = CacheStore(tmp_path / "store", registry=options(registry, d)).ensure(tagged(pinned))
    assert inst.digest == pinned.split("@")[1]

    at_proxy = requests_for(proxy, repo)
    assert not [p for _, p, _, _ in at_proxy if "/manifests/" in p], at_proxy
    assert {p.split("?")[0].rsplit("/", 1)[1] for m, p, s, _ in at_proxy if m == "GET" and s == 200} \
        == set(blobs(registry, pinned))
    ours = [(m, p) for m, p, _, agent in requests_for(registry, repo, origin_mark) if agent.startswith(OUR_AGENT)]
    assert ours and all("/manifests/latest" in p and not ns(p) for _, p in ours), ours


# -- mirrors that are down or misbehave -----------------------------------------------------

def test_a_closed_mirror_is_tried_once_then_skipped(registry, proxy, tmp_path, caplog):
    """A mirror on a closed port, then the pull-through cache: the pull succeeds through the
    cache; the dead mirror failed once and later requests (and the next pull with the same
    options) passed it over without trying it again."""
    caplog.set_level(logging.INFO, "accelnode.oci.registry")
    dead = f"127.0.0.1:{closed_port()}"
    repo = "hosts/closed-first"
    first, second = push(registry, tmp_path, repo), push(registry, tmp_path, repo + "-2")
    d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{dead}") + mirror(f"http://{proxy.host}")})
    opts = options(registry, d)
    assert CacheStore(tmp_path / "store", registry=opts).ensure(first).digest == first.split("@")[1]
    assert failures(caplog) == [f"http://{dead}"]
    assert {s for _, p, s, _ in requests_for(proxy, repo)} == {200}
    CacheStore(tmp_path / "store", registry=opts).ensure(second)
    assert failures(caplog) == [f"http://{dead}"]  # remembered down: not tried again
    assert opts.hosts.down(opts.hosts.hosts(registry.host)[0]) > 0


def test_a_blackholed_mirror_is_passed_within_its_dial_timeout(registry, proxy, blackhole, tmp_path, caplog):
    """A mirror whose SYNs go unanswered with ``dial_timeout = "300ms"`` (far below the pull's
    30 s deadline): the connection attempt times out once, and the pull goes on through the next
    mirror; the kernel counted the dropped SYN."""
    caplog.set_level(logging.INFO, "accelnode.oci.registry")
    repo = "hosts/blackhole"
    pinned = push(registry, tmp_path, repo, layers=2)
    d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{blackhole}", extra='dial_timeout = "300ms"')
                                       + mirror(f"http://{proxy.host}")})
    dropped = _listen_overflows()
    inst = CacheStore(tmp_path / "store", registry=options(registry, d)).ensure(pinned)
    assert inst.digest == pinned.split("@")[1]
    assert _listen_overflows() > dropped
    assert failures(caplog) == [f"http://{blackhole}"]
    problem = next(r.fields["problem"] for r in caplog.records if r.getMessage() == MIRROR_FAILED)
    assert "timed out" in problem, problem
    served = {p.split("?")[0].rsplit("/", 1)[1] for m, p, s, _ in requests_for(proxy, repo) if "/blobs/" in p}
    assert served == set(blobs(registry, pinned))


def _listen_overflows() -> int:
    """SYNs the kernel dropped because a listener's queue was full (TcpExt ListenOverflows)."""
    with open("/proc/net/netstat") as f:
        lines = [line.split() for line in f if line.startswith("TcpExt:")]
    return int(dict(zip(lines[0], lines[1]))["ListenOverflows"])


def _flip(digest: str):
    """A ``mangle`` that flips bytes in the middle of blob ``digest`` (same length)."""
    def mangle(path, body):
        if f"/blobs/{digest}" not in path:
            return body
        mid = len(body) // 2
        return body[:mid] + bytes(b ^ 0xFF for b in body[mid:mid + 16]) + body[mid + 16:]
    return mangle


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
def test_a_corrupted_layer_from_a_mirror_is_fetched_from_the_next_host(registry, tmp_path, caplog, compression):
    """A mirror flips bytes of one layer: its digest fails, that layer alone is redone from the
    registry (the registry's log: a GET without ns= for it, by us), the others come from the
    mirror, and what is installed verifies. The image's size limit is its exact content: the
    files the bad copy unpacked before its digest failed are not counted twice."""
    caplog.set_level(logging.INFO)
    repo = f"hosts/corrupt-layer-{compression}"
    pinned = push(registry, tmp_path, repo, layers=2, compression=compression)
    config, *layers = blobs(registry, pinned)
    bad = max(manifest_of(registry, pinned)["layers"], key=lambda d: d["size"])["digest"]  # the kernel's
    content = sum(p.stat().st_size for p in (tmp_path / f"src-{repo.replace('/', '-')}").rglob("*") if p.is_file())
    front = Forwarder(registry.host, mangle=_flip(bad))
    try:
        d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{front.host}")})
        origin_mark = len(settled(registry))
        store = CacheStore(tmp_path / "store", registry=options(registry, d), limits=Limits(max_bytes=content))
        assert store.ensure(pinned).digest == pinned.split("@")[1]
    finally:
        front.close()
    assert store.verify() == []
    direct = [p for m, p, s, _ in requests_for(registry, repo, origin_mark) if m == "GET" and not ns(p) and s == 200]
    assert [p for p in direct if "/blobs/" in p] == [f"/v2/{repo}/blobs/{bad}"], direct
    via_front = [p.split("?")[0] for p in front.paths() if "/blobs/" in p]
    assert sorted(via_front) == sorted(f"/v2/{repo}/blobs/{x}" for x in (config, *layers))
    assert any("failed verification" in r.getMessage() and r.fields["mirror"] == f"http://{front.host}"
               for r in caplog.records)
    installed = next(r for r in caplog.records if r.getMessage() == "cache installed")
    assert set(installed.fields["blob_bytes_from"]) == {f"http://{front.host}", f"http://{registry.host}"}


def test_a_wrong_manifest_for_a_digest_is_fetched_from_the_next_host(registry, tmp_path):
    """A mirror answers a digest's manifest with other bytes: refused by digest, the registry
    serves the manifest (its log: by digest, without ns=); blobs still come from the mirror."""
    repo = "hosts/wrong-manifest"
    pinned = push(registry, tmp_path, repo)
    digest = pinned.split("@")[1]
    front = Forwarder(registry.host, mangle=lambda path, body: body + b"\n" if f"/manifests/{digest}" in path else body)
    try:
        d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{front.host}")})
        origin_mark = len(settled(registry))
        store = CacheStore(tmp_path / "store", registry=options(registry, d))
        assert store.ensure(pinned).digest == digest and store.verify() == []
    finally:
        front.close()
    direct = [p for m, p, _, _ in requests_for(registry, repo, origin_mark) if m == "GET" and not ns(p)]
    assert direct == [f"/v2/{repo}/manifests/{digest}"], direct
    assert [p.split("?")[0] for p in front.paths() if "/manifests/" in p] == [f"/v2/{repo}/manifests/{digest}"]
    assert {p.split("?")[0].rsplit("/", 1)[1] for p in front.paths() if "/blobs/" in p} == set(blobs(registry, pinned))


def test_a_mirror_answering_errors_is_left_at_its_first(registry, tmp_path, caplog):
    """A mirror that answers blob requests with 500: its first 500 (the config) sends the pull to
    the registry, and the mirror is asked nothing more."""
    caplog.set_level(logging.INFO, "accelnode.oci.registry")
    repo = "hosts/errors"
    pinned = push(registry, tmp_path, repo, layers=2)
    front = Forwarder(registry.host, answer=lambda m, path, h: (500, {}, b"boom") if "/blobs/" in path else None)
    try:
        d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{front.host}")})
        origin_mark = len(settled(registry))
        assert CacheStore(tmp_path / "store", registry=options(registry, d)).ensure(tagged(pinned))
    finally:
        front.close()
    config, *layers = blobs(registry, pinned)
    assert [p.split("?")[0] for p in front.paths()] == ["/v2/", f"/v2/{repo}/manifests/latest",
                                                       f"/v2/{repo}/blobs/{config}"]
    direct = {p.rsplit("/", 1)[1] for m, p, s, _ in requests_for(registry, repo, origin_mark)
              if m == "GET" and "/blobs/" in p and not ns(p) and s == 200}
    assert direct == {config, *layers}
    assert failures(caplog) == [f"http://{front.host}"]


def test_a_mirror_that_sends_bad_bytes_then_fails_is_the_one_blamed(registry, tmp_path, caplog):
    """A mirror sends three quarters of a layer, corrupted, drops the connection and answers the resumed
    (ranged) request with 500: the rest comes from the registry, the digest fails, and the
    blame falls on the mirror, not on the registry that sent the good last quarter: the layer
    is fetched again from the registry alone (its log: a whole GET, after the ranged one)."""
    caplog.set_level(logging.INFO, "accelnode.oci.registry")
    repo = "hosts/bad-then-gone"
    pinned = push(registry, tmp_path, repo)
    bad = max(manifest_of(registry, pinned)["layers"], key=lambda d: d["size"])["digest"]
    data = registry.blob_file(bad).read_bytes()
    corrupt = _flip(bad)(f"/blobs/{bad}", data)

    def answer(method, path, headers):
        if f"/blobs/{bad}" not in path:
            return None
        if headers.get("Range"):
            return 500, {}, b"gone"
        return 200, {"Content-Length": str(len(data))}, corrupt[:len(data) * 3 // 4]

    front = Forwarder(registry.host, answer=answer)
    try:
        d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{front.host}")})
        origin_mark = len(settled(registry))
        store = CacheStore(tmp_path / "store", registry=options(registry, d))
        assert store.ensure(pinned).digest == pinned.split("@")[1]
    finally:
        front.close()
    assert store.verify() == []
    direct = [(p, s) for m, p, s, _ in requests_for(registry, repo, origin_mark) if m == "GET" and not ns(p)]
    assert direct == [(f"/v2/{repo}/blobs/{bad}", 206), (f"/v2/{repo}/blobs/{bad}", 200)], direct


def test_when_every_host_fails_the_error_names_each(registry, tmp_path):
    """A dead mirror, then a ``server`` on a dead port: the error names both."""
    dead, dead_server = closed_port(), closed_port()
    d = certs_d(tmp_path / "certs.d", {key(registry.host): f'server = "http://127.0.0.1:{dead_server}"\n'
                                                           + mirror(f"http://127.0.0.1:{dead}")})
    with pytest.raises(RegistryUnavailable, match=rf"through mirror 127.0.0.1:{dead_server}\); tried first: "
                                                   rf"http://127.0.0.1:{dead}: contacting the registry"):
        resolve(f"{registry.host}/hosts/none:latest", options(registry, d, timeout=1))


# -- what a mirror is sent: headers, credentials --------------------------------------------

def test_a_header_authenticated_mirror(registry, auth_proxy, tmp_path):
    """``[host."...".header] Authorization = "Basic ..."``: the mirror (checking basic auth)
    serves everything (its log: 200s, ns=); without the header it refuses (401s), and the pull
    goes to the registry."""
    repo = "hosts/header-auth"
    pinned = push(registry, tmp_path, repo)
    header = (f'[host."http://{auth_proxy.host}".header]\n'
              f'Authorization = "Basic {basic(MIRROR_USER, MIRROR_PASSWORD)}"\n')
    d = certs_d(tmp_path / "with", {key(registry.host): mirror(f"http://{auth_proxy.host}") + header})
    origin_mark = len(settled(registry))
    inst = CacheStore(tmp_path / "s1", registry=options(registry, d)).ensure(tagged(pinned))
    assert inst.digest == pinned.split("@")[1]
    at_mirror = requests_for(auth_proxy, repo)
    assert at_mirror and {(s, *ns(p)) for _, p, s, _ in at_mirror} == {(200, registry.host)}, at_mirror
    assert not [a for *_, a in requests_for(registry, repo, origin_mark) if a.startswith(OUR_AGENT)]

    d = certs_d(tmp_path / "without", {key(registry.host): mirror(f"http://{auth_proxy.host}")})
    mark = len(settled(auth_proxy))
    inst = CacheStore(tmp_path / "s2", registry=options(registry, d)).ensure(tagged(pinned))
    assert inst.digest == pinned.split("@")[1]
    assert {s for _, _, s, _ in settled(auth_proxy)[mark:]} == {401}
    assert [p for _, p, _, a in requests_for(registry, repo, origin_mark) if a.startswith(OUR_AGENT)]


def test_the_registrys_credentials_go_to_no_mirror_not_configured_for_them(registry, auth_registry, auth_proxy,
                                                                          tmp_path):
    """The registry checks basic auth, its credentials are kept for it only: the mirror (which
    checks basic auth too) is asked without any (its own log: nothing but 401s) and the registry
    serves. Credentials kept under the mirror's own name go to the mirror, which serves."""
    repo = "hosts/creds"
    pinned = push(auth_registry, tmp_path, repo, also=[registry])
    d = certs_d(tmp_path / "certs.d", {key(auth_registry.host): mirror(f"http://{auth_proxy.host}")})
    mark = len(settled(auth_proxy))
    cfg = docker_config(tmp_path / "registry.json", auth_registry.host, auth_registry.username,
                        auth_registry.password)
    inst = CacheStore(tmp_path / "s1", registry=options(auth_registry, d, config_file=cfg)).ensure(tagged(pinned))
    assert inst.digest == pinned.split("@")[1]
    seen = settled(auth_proxy)[mark:]
    assert seen and {s for _, _, s, _ in seen} == {401}, seen
    ours = [(p, s) for _, p, s, a in requests_for(auth_registry, repo) if a.startswith(OUR_AGENT) and not ns(p)]
    assert (f"/v2/{repo}/manifests/latest", 200) in ours

    mirror_cfg = docker_config(tmp_path / "mirror.json", auth_proxy.host, MIRROR_USER, MIRROR_PASSWORD)
    mark = len(settled(auth_proxy))
    CacheStore(tmp_path / "s2", registry=options(auth_registry, d, config_file=mirror_cfg)).ensure(pinned)
    at_mirror = requests_for(auth_proxy, repo, mark)
    assert at_mirror and {(s, *ns(p)) for _, p, s, _ in at_mirror} == {(200, auth_registry.host)}, at_mirror


def test_the_registrys_credentials_go_to_its_token_realm_not_to_a_mirror(tmp_path_factory, tmp_path, ca,
                                                                         monkeypatch):
    """The registry uses token auth (realm over TLS on another host); a mirror answers with a
    challenge naming that same realm. The registry's credentials go to the realm for the
    registry's scope only: the mirror's own token request is anonymous, and the mirror never
    sees an Authorization header."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", ca.file)  # the realm's certificate is the private CA's
    tokens = token_server(ca)
    origin = start_registry(tmp_path_factory, ca, f"https://{tokens.address}/token", tls=False)
    challenge = f'Bearer realm="https://{tokens.address}/token",service="{SERVICE}"'
    front = Forwarder(origin.host, answer=lambda m, p, h: (401, {"WWW-Authenticate": challenge}, b"{}"))
    try:
        pinned = origin.push_raw("team/cache", "v1", layers=[("application/vnd.oci.image.layer.v1.tar", b"x")])
        d = certs_d(tmp_path / "certs.d", {key(origin.host): mirror(f"http://{front.host}")})
        tokens.requests.clear()
        assert resolve(pinned.split("@")[0] + ":v1", options(origin, d))[0] == pinned.split("@")[1]
    finally:
        front.close()
        origin.stop()
        tokens.stop()
    assert front.seen and all("Authorization" not in h for *_, h in front.seen), front.seen
    creds = "Basic " + basic("tenant", "pw-that-must-not-leak")
    sent = [h.get("authorization") for _, h in tokens.requests]
    assert None in sent and creds in sent and set(sent) == {None, creds}, sent


def test_a_configured_header_never_follows_a_redirect_to_another_host(registry, tmp_path):
    """A mirror redirects blob downloads to another host (object storage, a CDN): the header a
    hosts.toml configures for the mirror stays with the mirror."""
    repo = "hosts/redirected"
    pinned = push(registry, tmp_path, repo)
    front = BlobRedirector(registry)
    try:
        header = f'[host."http://{front.host}".header]\nX-Mirror-Token = ["t0ken", "second"]\n'
        d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{front.host}") + header})
        assert CacheStore(tmp_path / "store", registry=options(registry, d)).ensure(pinned)
    finally:
        front.close()
    assert front.front_seen and all(h.get("X-Mirror-Token") == "t0ken, second" for *_, h in front.front_seen)
    assert len(front.seen) == len(blobs(registry, pinned))  # every blob went by the redirect
    assert all("X-Mirror-Token" not in h for h in front.seen), front.seen


# -- TLS ------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")  # skip_verify, as asked
@pytest.mark.parametrize("fields, served", [
    ('ca = "ca.pem"\nclient = [["client.pem", "client-key.pem"]]', True),
    ('skip_verify = true\nclient = "client-both.pem"', True),
    ('ca = ["ca.pem"]', False),  # no client certificate: the mirror refuses the handshake
    ('client = [["client.pem", "client-key.pem"]]', False),  # the private CA is not trusted
], ids=["ca-and-client", "skip-verify", "no-client-certificate", "untrusted"])
def test_a_tls_mirror_with_a_private_ca_and_a_client_certificate(registry, tls_proxy, ca, tmp_path, monkeypatch,
                                                                fields, served):
    """The mirror serves HTTPS with a certificate of a private CA and requires a client
    certificate of it; hosts.toml names the files relative to its own directory. Without what
    it takes, the mirror is passed over and the registry serves (its log: our requests). The
    environment names a CA bundle, as many hosts' do: ``skip_verify`` holds all the same (requests
    would let REQUESTS_CA_BUNDLE turn verification back on)."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", requests.certs.where())
    repo = "hosts/tls"
    pinned = push(registry, tmp_path, repo)
    d = tmp_path / "certs.d"
    host_dir = d / key(registry.host)
    host_dir.mkdir(parents=True)
    cert, key_file = ca.client_files(f"client-{uuid.uuid4().hex[:8]}")
    shutil.copy(ca.file, host_dir / "ca.pem")
    shutil.copy(cert, host_dir / "client.pem")
    shutil.copy(key_file, host_dir / "client-key.pem")
    (host_dir / "client-both.pem").write_bytes(open(cert, "rb").read() + open(key_file, "rb").read())
    certs_d(d, {key(registry.host): mirror(f"https://{tls_proxy.host}", extra=fields)})
    origin_mark, mirror_mark = len(settled(registry)), len(tls_proxy.access_log())
    handshakes = _handshake_errors(tls_proxy)

    inst = CacheStore(tmp_path / "store", registry=options(registry, str(d))).ensure(pinned)
    assert inst.digest == pinned.split("@")[1]
    ours = [p for m, p, _, a in requests_for(registry, repo, origin_mark) if a.startswith(OUR_AGENT)]
    if served:
        at_mirror = eventually(lambda: [x for x in tls_proxy.access_log()[mirror_mark:] if "/blobs/" in x[1]],
                               "the mirror's blob answers")
        assert {s for _, _, s, _ in at_mirror} == {200} and all(ns(p) == [registry.host] for _, p, _, _ in at_mirror)
        assert ours == []
    else:
        assert ours and f"/v2/{repo}/manifests/{inst.digest}" in ours
        assert [x for x in tls_proxy.access_log()[mirror_mark:] if repo in x[1]] == []
        if "client" not in fields:
            eventually(lambda: _handshake_errors(tls_proxy) > handshakes, "the mirror's handshake refusal")


def _handshake_errors(reg: RunningRegistry) -> int:
    return (reg.workdir / "registry.log").read_text(errors="replace").count("didn't provide a certificate")


def test_a_mirror_whose_tls_files_are_missing_refuses_the_pull_naming_them(registry, tmp_path):
    """``ca = "missing.pem"``: the file cannot be used as written, like a file that does not
    parse (containerd fails the host's configuration too): the pull is refused naming the file
    and the host, and no host is asked anything."""
    repo = "hosts/tls-missing"
    pinned = push(registry, tmp_path, repo)
    d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror("https://127.0.0.1:1", extra='ca = "missing.pem"')})
    origin_mark = len(settled(registry))
    store = CacheStore(tmp_path / "store", registry=options(registry, d))
    with pytest.raises(HostsConfigError) as err:
        store.ensure(pinned)
    assert f"{d}/{key(registry.host)}/hosts.toml: TLS files for https://127.0.0.1:1 are not usable" in str(err.value)
    assert store.list() == [] and requests_for(registry, repo, origin_mark) == []
    problems = HostsConfig(str(d)).check()  # what the agent logs at start
    assert len(problems) == 1 and "TLS files for https://127.0.0.1:1 are not usable" in problems[0], problems


# -- where the API root is, and which file applies ------------------------------------------

def test_override_path_keeps_the_urls_api_root(registry, tmp_path):
    """A mirror whose API root is ``/api/registry`` (not ``.../v2``): with ``override_path`` the
    URL is used as it is; without it ``/v2`` is added, the mirror has nothing there, and the
    registry serves."""
    repo = "hosts/override"
    pinned = push(registry, tmp_path, repo)
    front = Forwarder(registry.host, prefix="/api/registry")
    try:
        url = f"http://{front.host}/api/registry"
        d = certs_d(tmp_path / "on", {key(registry.host): mirror(url, extra="override_path = true")})
        origin_mark = len(settled(registry))
        assert CacheStore(tmp_path / "s1", registry=options(registry, d)).ensure(tagged(pinned))
        assert front.paths() and all(p.startswith("/api/registry/") and ns(p) == [registry.host]
                                     for p in front.paths())
        assert {p.split("?")[0].rsplit("/", 1)[1] for p in front.paths() if "/blobs/" in p} \
            == set(blobs(registry, pinned))
        assert not [p for _, p, _, _ in requests_for(registry, repo, origin_mark) if not ns(p)]

        front.seen.clear()
        d = certs_d(tmp_path / "off", {key(registry.host): mirror(url)})
        assert CacheStore(tmp_path / "s2", registry=options(registry, d)).ensure(tagged(pinned))
        assert front.paths() and all(p.startswith("/api/registry/v2/") for p in front.paths())
    finally:
        front.close()
    assert [p for _, p, _, _ in requests_for(registry, repo, origin_mark) if not ns(p) and "/manifests/" in p]


def test_lookup_order_and_file_order(registry, tmp_path):
    """``host_port_``, then ``host:port``, then ``_default``: the first directory that exists
    applies (files are read at each pull); in a file, the ``[host]`` tables in their order."""
    repo = "hosts/lookup"
    pinned = push(registry, tmp_path, repo)
    fronts = {n: Forwarder(registry.host) for n in ("port_", "colon", "default", "other")}
    d = tmp_path / "certs.d"
    certs_d(d, {key(registry.host): mirror(f"http://{fronts['port_'].host}"),
                registry.host: mirror(f"http://{fronts['colon'].host}"),
                "_default": mirror(f"http://{fronts['default'].host}") + mirror(f"http://{fronts['other'].host}")})
    opts = options(registry, str(d))

    def asked() -> list[str]:
        assert resolve(tagged(pinned), opts)[0] == pinned.split("@")[1]
        used = sorted(n for n, f in fronts.items() if f.seen)
        for f in fronts.values():
            f.seen.clear()
        return used

    try:
        assert asked() == ["port_"]
        shutil.rmtree(d / key(registry.host))
        assert asked() == ["colon"]
        shutil.rmtree(d / registry.host)
        assert asked() == ["default"]
        certs_d(d, {"_default": mirror(f"http://{fronts['other'].host}") + mirror(f"http://{fronts['default'].host}")})
        assert asked() == ["other"]
        (d / registry.host).mkdir()  # a directory without hosts.toml: the registry alone
        assert asked() == []
    finally:
        for f in fronts.values():
            f.close()


# -- a hosts.toml that cannot be used -------------------------------------------------------

@pytest.mark.parametrize("text, fragment", [
    ('[host."http://127.0.0.1:1"\ncapabilities = ["pull"]\n', "is not valid TOML"),
    ('[host."http://127.0.0.1:1"]\ncapabilities = ["pull", "fetch"]\n', "unknown capability 'fetch'"),
    ('[host."http://127.0.0.1:1"]\ndial_timeout = "3 seconds"\n', "is not a duration"),
], ids=["bad-toml", "unknown-capability", "bad-dial-timeout"])
def test_a_malformed_hosts_toml_is_refused_naming_the_file(registry, tmp_path, text, fragment):
    repo = "hosts/malformed"
    pinned = push(registry, tmp_path, repo)
    d = certs_d(tmp_path / "certs.d", {key(registry.host): text})
    path = f"{d}/{key(registry.host)}/hosts.toml"
    origin_mark = len(settled(registry))
    store = CacheStore(tmp_path / "store", registry=options(registry, d))
    with pytest.raises(HostsConfigError, match="mirror configuration") as err:
        store.ensure(pinned)
    assert path in str(err.value) and fragment in str(err.value)
    assert store.list() == [] and list((tmp_path / "store" / "tmp").iterdir()) == []
    assert requests_for(registry, repo, origin_mark) == []  # nothing was asked of anyone


# -- through the CLI and the agent ----------------------------------------------------------

def test_cli_pull_passes_a_dead_mirror_and_refuses_a_malformed_file(registry, proxy, tmp_path):
    repo = "hosts/cli"
    pinned = push(registry, tmp_path, repo)
    dead = f"127.0.0.1:{closed_port()}"
    d = certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{dead}") + mirror(f"http://{proxy.host}")})
    store = str(tmp_path / "store")
    proc = cache("pull", tagged(pinned), "--store", store, "--hosts-dir", d, "--plain-http", "--json",
                 "--log-format", "text")
    assert json.loads(proc.stdout)["digest"] == pinned.split("@")[1]
    failed = [line for line in proc.stderr.splitlines() if MIRROR_FAILED in line]
    assert len(failed) == 1 and f"mirror=http://{dead}" in failed[0], proc.stderr
    assert {p.split("?")[0].rsplit("/", 1)[1] for _, p, s, _ in requests_for(proxy, repo) if "/blobs/" in p} \
        == set(blobs(registry, pinned))

    bad = certs_d(tmp_path / "bad", {key(registry.host): "server = 5000\n"})
    proc = cache("pull", pinned, "--store", str(tmp_path / "s2"), "--hosts-dir", bad, "--plain-http",
                 rc=exitcodes.USAGE)
    assert proc.stderr.strip() == (f"accelnode cache: {pinned}: mirror configuration "
                                   f"{bad}/{key(registry.host)}/hosts.toml: \"server\" must be a string")
    assert CacheStore(tmp_path / "s2").list() == []


def test_cli_inspect_through_a_pull_only_mirror_and_default(registry, proxy, tmp_path):
    """``cache inspect`` resolves through ``_default``; a pull-only mirror is not asked."""
    repo = "hosts/cli-inspect"
    pinned = push(registry, tmp_path, repo)
    d = certs_d(tmp_path / "certs.d", {"_default": f'server = "http://{registry.host}"\n'
                                                   + mirror(f"http://{proxy.host}", caps=["pull"])})
    info = json.loads(cache("inspect", tagged(pinned), "--json", "--hosts-dir", d).stdout)
    assert info["manifests"][0]["digest"] == pinned.split("@")[1]
    assert [p for _, p, _, _ in requests_for(proxy, repo) if "/manifests/" in p] == []


def test_agent_pulls_through_a_mirror_written_after_it_started(registry, proxy, tmp_path):
    """The real ``accelnode agent``: the hosts directory gets its file after the agent started
    (as Spegel writes its own at its start) and the next pull uses it; a malformed file of
    another registry is reported at start and does not get in the way."""
    from accelnode import grpcutil
    from agent.api import agent as api
    from agent.api import agent_grpc
    from tests.csi.conftest import Daemon

    repo = "hosts/agent"
    pinned = push(registry, tmp_path, repo)
    d = certs_d(tmp_path / "certs.d", {"registry.example.com": "capabilities = 'pull'\n["})
    sock = tmp_path / "agent.sock"
    daemon = Daemon("agent", ["agent", "--store", str(tmp_path / "store"), "--socket", str(sock), "--plain-http",
                              "--registry-timeout", "30", "--hosts-dir", d, "--metrics-address", "127.0.0.1:0",
                              "--log-format", "text"], sock, tmp_path).start()
    channel = grpcutil.unix_channel(sock)
    try:
        eventually(lambda: "unusable mirror configuration" in (log := daemon.log())
                   and "registry.example.com/hosts.toml" in log, "the agent's warning about the malformed file")
        certs_d(tmp_path / "certs.d", {key(registry.host): mirror(f"http://{proxy.host}")})
        answer = agent_grpc.AgentStub(channel).EnsureCache(api.EnsureCacheRequest(image=pinned, wait_seconds=60),
                                                           timeout=90)
        assert answer.state == api.EnsureCacheResponse.INCOMPATIBLE, answer  # installed; no accelerator here
    finally:
        channel.close()
        assert daemon.stop() == 0, daemon.log()
    served = {p.split("?")[0].rsplit("/", 1)[1] for _, p, s, _ in requests_for(proxy, repo) if s == 200 and ns(p)}
    assert set(blobs(registry, pinned)) <= served
    assert CacheStore(tmp_path / "store").installed(pinned.split("@")[1]) is not None
