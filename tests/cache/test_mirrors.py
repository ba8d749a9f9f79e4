"""Registry mirrors (docs/registries.md): images named on quay.io served by the local registry.

The images keep their names (``quay.io/gkm/cache-examples:...``, as examples/gkm/ writes them);
``--registry-mirror quay.io=127.0.0.1:PORT`` sends their requests to the local registry. Nothing
here talks to anything but 127.0.0.1, and no test makes quay.io's name be looked up: an
unreachable origin is a closed loopback port.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess

import pytest

from accelnode import exitcodes
from accelnode.oci.errors import AuthError, ImageNotFound, RegistryUnavailable
from accelnode.oci.manifest import resolve
from accelnode.oci.registry import RegistryOptions
from agent.store import CacheStore
from tests.cache.helpers import BlobRedirector, FaultProxy
from tests.cache.test_registry import closed_port
from tests.cache.test_store import triton_tree
from tests.conftest import accelnode_cmd

REPO, TAG = "gkm/cache-examples", "vector-add-cache-rocm-v2"
QUAY = f"quay.io/{REPO}:{TAG}"  # examples/gkm/10-gkmcache.yaml's image


@pytest.fixture(autouse=True)
def no_home_docker_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # only the configs a test writes hold credentials


@pytest.fixture(scope="module")
def pushed(registry, tmp_path_factory):
    """The GKM example image, pushed to the local registry under its own host: the digest."""
    src = triton_tree(tmp_path_factory.mktemp("src"), arch="gfx90a", backend="hip")
    return registry.push(src, REPO, TAG).split("@")[1]


def cache(*args, rc=0, env=None):
    proc = subprocess.run(accelnode_cmd() + ["cache", *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == rc, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def _config(tmp_path, host, user, password) -> str:
    path = tmp_path / f"config-{host.replace(':', '_')}.json"
    path.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}))
    return str(path)


def test_cli_inspects_and_pulls_a_quay_image_from_the_mirror(registry, pushed, tmp_path):
    mirror = ["--registry-mirror", f"quay.io={registry.host}", "--plain-http"]
    info = json.loads(cache("inspect", QUAY, "--json", *mirror).stdout)
    assert info["image"] == QUAY and info["manifests"][0]["digest"] == pushed
    assert info["manifests"][0]["targets"] == [{"backend": "hip", "arch": "gfx90a", "warp_size": 32}]

    store = str(tmp_path / "store")
    pulled = json.loads(cache("pull", QUAY, "--store", store, "--json", *mirror).stdout)
    assert pulled["digest"] == pushed and pulled["image"] == QUAY
    assert registry.host not in json.dumps(pulled)
    listed = CacheStore(store).list()
    assert [(i.digest, i.image) for i in listed] == [(pushed, QUAY)]

    # the pinned reference (what a node pulls: <registry>/<repo>@<status.resolvedDigest>) as well
    again = cache("pull", f"quay.io/{REPO}@{pushed}", "--store", store, *mirror).stdout.split()
    assert again == [pushed, pulled["path"]]


def test_store_and_resolve_in_process_keep_the_quay_name(registry, pushed, tmp_path):
    options = registry.options(mirrors={"quay.io": registry.host})
    assert resolve(QUAY, options)[0] == pushed
    store = CacheStore(tmp_path / "store", registry=options)
    inst = store.ensure(QUAY)
    assert inst.digest == pushed and inst.image == QUAY and inst.kind == "triton"
    assert store.verify() == [] and CacheStore(tmp_path / "store").installed(pushed).image == inst.image


def test_without_a_mirror_an_unreachable_origin_fails(pushed, tmp_path):
    """The origin stands on a closed loopback port (no name lookup, nothing leaves the machine):
    without a mirror for it the image is unreachable, and a mirror for another host changes nothing."""
    origin = f"127.0.0.1:{closed_port()}/gkm/cache-examples:vector-add-cache-rocm-v2"
    with pytest.raises(RegistryUnavailable, match=r"contacting the registry"):
        resolve(origin, RegistryOptions(plain_http=True, timeout=30))
    proc = cache("inspect", origin, "--plain-http", "--timeout", "30", rc=exitcodes.UNAVAILABLE)
    assert proc.stderr.strip().splitlines()[-1].startswith(f"accelnode cache: {origin}: contacting the registry")
    cache("pull", origin, "--store", str(tmp_path / "store"), "--plain-http", "--timeout", "30",
          "--registry-mirror", "quay.io=127.0.0.1:1", rc=exitcodes.UNAVAILABLE)
    assert not (tmp_path / "store").exists() or CacheStore(tmp_path / "store").list() == []


def test_no_fallback_to_the_original_host_when_the_mirror_fails(registry, tmp_path):
    dead = f"127.0.0.1:{closed_port()}"
    options = RegistryOptions(plain_http=True, timeout=30, mirrors={"quay.io": dead})
    with pytest.raises(RegistryUnavailable, match=rf"Connection refused .*\(through mirror {dead}\)$"):
        CacheStore(tmp_path / "s1", registry=options).ensure(QUAY)
    # a mirror that lacks the image answers for it: not found there, and nowhere else is asked
    options = registry.options(mirrors={"quay.io": registry.host})
    with pytest.raises(ImageNotFound, match=rf"HTTP 404\) \(through mirror {registry.host}\)$"):
        CacheStore(tmp_path / "s2", registry=options).ensure(f"quay.io/{REPO}:not-on-the-mirror")


def test_plain_http_is_for_every_endpoint(registry, pushed):
    # without --plain-http the mirror is spoken to in HTTPS, which the plain local registry is not
    with pytest.raises(RegistryUnavailable, match="through mirror"):
        resolve(QUAY, RegistryOptions(timeout=30, mirrors={"quay.io": registry.host}))


def test_retries_log_the_mirror(registry, pushed, tmp_path):
    proxy = FaultProxy(registry.host, fail_first=1)
    try:
        proc = cache("inspect", QUAY, "--registry-mirror", f"quay.io={proxy.host}", "--plain-http",
                     "--log-format", "text")
    finally:
        proxy.close()
    assert proxy.failures == 1
    line = next(x for x in proc.stderr.splitlines() if "retrying" in x)
    assert f"mirror={proxy.host}" in line and f"image={QUAY}" in line


def test_build_through_the_mirror_pushes_there_under_the_quay_name(registry, tmp_path):
    src = triton_tree(tmp_path / "src")
    ref = cache("build", str(src), f"quay.io/{REPO}:built-through-mirror", "--plain-http",
                "--registry-mirror", f"quay.io={registry.host}").stdout.strip()
    digest = ref.split("@")[1]
    assert ref == f"quay.io/{REPO}@{digest}"
    assert resolve(f"{registry.host}/{REPO}:built-through-mirror", registry.options())[0] == digest


def test_credentials_kept_under_the_mirrors_name_go_to_the_mirror(auth_registry, tmp_path):
    digest = auth_registry.push(triton_tree(tmp_path / "src"), REPO, TAG).split("@")[1]
    cfg = _config(tmp_path, auth_registry.host, auth_registry.username, auth_registry.password)
    store = str(tmp_path / "store")
    out = cache("pull", QUAY, "--store", store, "--plain-http", "--registry-config", cfg,
                "--registry-mirror", f"quay.io={auth_registry.host}").stdout.split()
    assert out[0] == digest and CacheStore(store).installed(digest).image == QUAY
    options = auth_registry.options(config_file=cfg, mirrors={"quay.io": auth_registry.host})
    assert resolve(QUAY, options)[0] == digest


def test_the_registrys_credentials_never_go_to_its_mirror(auth_registry, tmp_path):
    """Attack: a mirror (anyone's pull-through cache, a peer) would collect the credentials of
    every registry it fronts if they were sent to it. Credentials kept for quay.io are not: the
    mirror, which checks basic auth, is asked without any and refuses (its own log: nothing but
    401s), and the error says under which name credentials for it would be looked up."""
    auth_registry.push(triton_tree(tmp_path / "src"), REPO, TAG)
    cfg = _config(tmp_path, "quay.io", auth_registry.username, auth_registry.password)
    before = len(auth_registry.access_log())
    proc = cache("pull", QUAY, "--store", str(tmp_path / "store"), "--plain-http", "--registry-config", cfg,
                 "--registry-mirror", f"quay.io={auth_registry.host}", rc=exitcodes.FAILURE)
    assert f"mirror {auth_registry.host} of quay.io requires credentials and none were found under " \
           f"{auth_registry.host}" in proc.stderr
    seen = auth_registry.access_log()[before:]
    assert seen and {status for _, _, status, _ in seen} == {401}, seen


def test_credentials_under_the_mirror_win_and_none_is_a_clear_error(auth_registry, tmp_path):
    auth_registry.push(triton_tree(tmp_path / "src"), REPO, TAG)
    user, password = auth_registry.username, auth_registry.password
    both = tmp_path / "both.json"
    good = base64.b64encode(f"{user}:{password}".encode()).decode()
    bad = base64.b64encode(f"{user}:wrong".encode()).decode()
    mirrors = {"quay.io": auth_registry.host}
    both.write_text(json.dumps({"auths": {"quay.io": {"auth": bad}, auth_registry.host: {"auth": good}}}))
    resolve(QUAY, auth_registry.options(config_file=str(both), mirrors=mirrors))
    both.write_text(json.dumps({"auths": {"quay.io": {"auth": good}, auth_registry.host: {"auth": bad}}}))
    with pytest.raises(AuthError, match=rf"refused our credentials \(HTTP 401\) \(through mirror {auth_registry.host}\)"):
        resolve(QUAY, auth_registry.options(config_file=str(both), mirrors=mirrors))
    with pytest.raises(AuthError, match=rf"mirror {auth_registry.host} of quay.io requires credentials and none "
                                        rf"were found under {auth_registry.host} \(use --registry-config\)"):
        resolve(QUAY, auth_registry.options(config_file=None, mirrors=mirrors))


def test_redirects_from_a_mirror_never_carry_credentials(auth_registry, tmp_path):
    digest = auth_registry.push(triton_tree(tmp_path / "src"), REPO, "redirected").split("@")[1]
    front = BlobRedirector(auth_registry)
    try:
        cfg = _config(tmp_path, front.host, auth_registry.username, auth_registry.password)
        options = auth_registry.options(config_file=cfg, mirrors={"quay.io": front.host})
        inst = CacheStore(tmp_path / "store", registry=options).ensure(f"quay.io/{REPO}:redirected")
    finally:
        front.close()
    assert inst.digest == digest and len(front.seen) == 2
    assert all("Authorization" not in h for h in front.seen), front.seen


@pytest.mark.parametrize("value, fragment", [
    ("quay.io", "expected HOST=ENDPOINT"),
    ("quay.io=", "is not HOST[:PORT]"),
    ("quay.io=https://mirror.local", "without a scheme"),
    ("quay.io=mirror.local/v2/quay", "without a path"),
    ("quay=mirror.local:5000", "'quay' is not a registry host"),
    ("quay.io=mirror.local:99999", "is not HOST[:PORT]"),
])
def test_malformed_mirror_flag_is_a_usage_error(value, fragment):
    proc = cache("inspect", QUAY, "--registry-mirror", value, rc=exitcodes.USAGE)
    assert "argument --registry-mirror:" in proc.stderr and fragment in proc.stderr
    if "=" in value:  # the same check for in-process callers
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[")):
            RegistryOptions(mirrors=dict([value.split("=", 1)]))


def test_mirror_flags_of_every_command_and_the_environment(tmp_path):
    twice = ["--registry-mirror", "quay.io=a.local", "--registry-mirror", "quay.io=b.local"]
    proc = cache("inspect", QUAY, *twice, rc=exitcodes.USAGE)
    assert "argument --registry-mirror: registry host quay.io is given two mirrors" in proc.stderr
    for command in (["agent", "--store", str(tmp_path / "s"), "--socket", str(tmp_path / "a.sock")],
                    ["controller", "--kubeconfig", str(tmp_path / "none")]):
        proc = subprocess.run(accelnode_cmd() + command + ["--registry-mirror", "quay.io"], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == exitcodes.USAGE and "argument --registry-mirror:" in proc.stderr, proc.stderr
    env = dict(os.environ, ACCELNODE_REGISTRY_MIRROR="docker.io=m.local,quay.io=https://m.local")
    proc = cache("inspect", QUAY, rc=exitcodes.USAGE, env=env)
    assert "ACCELNODE_REGISTRY_MIRROR" in proc.stderr and "without a scheme" in proc.stderr
    assert not (tmp_path / "s").exists()


def test_environment_mirrors_and_the_command_line_winning(registry, pushed):
    env = dict(os.environ, ACCELNODE_REGISTRY_MIRROR=f"registry.example.com:5000=127.0.0.1:1,quay.io={registry.host}")
    assert json.loads(cache("inspect", QUAY, "--json", "--plain-http", env=env).stdout)["image"] == QUAY
    # a --registry-mirror on the command line replaces the environment's list
    cache("inspect", QUAY, "--plain-http", "--timeout", "30", "--registry-mirror", "docker.io=127.0.0.1:1",
          env=env, rc=exitcodes.UNAVAILABLE)


def test_mirror_keys_are_registry_hosts_as_images_name_them():
    options = RegistryOptions(mirrors={"Index.Docker.io": "mirror.local:5000", "QUAY.io": "Mirror.Local"})
    assert dict(options.mirrors) == {"docker.io": "mirror.local:5000", "quay.io": "mirror.local"}
    def server(host):
        return options.hosts.hosts(host)[-1].netloc

    assert server("docker.io") == "mirror.local:5000" and server("quay.io") == "mirror.local"
    assert server("registry.example.com:5000") == "registry.example.com:5000"
    with pytest.raises(ValueError, match="two mirrors"):
        RegistryOptions(mirrors={"quay.io": "a.local", "Quay.io": "b.local"})
