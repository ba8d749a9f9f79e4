"""Registry behaviour: credentials, deadlines, retries on 5xx and on a connection cut mid-blob."""

from __future__ import annotations

import base64
import json
import logging
import os
import socket

import pytest

from accelnode.oci.errors import AuthError, ImageNotFound, IntegrityError, InvalidReference, RegistryUnavailable
from accelnode.oci.registry import RegistryOptions
from agent.store import CacheStore
from tests.cache.helpers import BlobRedirector, FaultProxy
from tests.cache.test_store import _layer_digests, triton_tree


@pytest.fixture(autouse=True)
def no_home_docker_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # oras-py also reads ~/.docker/config.json


def _config(tmp_path, host, entry) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"auths": {host: entry}}))
    return str(path)


def test_basic_auth_with_docker_config_credentials(auth_registry, tmp_path):
    image = auth_registry.push(triton_tree(tmp_path / "src"), "auth/basic")
    inst = CacheStore(tmp_path / "store", registry=auth_registry.options()).ensure(image)
    assert inst.kind == "triton"


def test_dockerconfigjson_with_username_and_password(auth_registry, tmp_path):
    image = auth_registry.push(triton_tree(tmp_path / "src"), "auth/userpass")
    cfg = _config(tmp_path, auth_registry.host, {"username": auth_registry.username, "password": auth_registry.password})
    assert CacheStore(tmp_path / "store", registry=auth_registry.options(config_file=cfg)).ensure(image).kind == "triton"


def test_missing_and_wrong_credentials_are_auth_errors(auth_registry, tmp_path):
    image = auth_registry.push(triton_tree(tmp_path / "src"), "auth/denied")
    with pytest.raises(AuthError, match="requires credentials and none were found"):
        CacheStore(tmp_path / "s1", registry=auth_registry.options(config_file=None)).ensure(image)
    bad = base64.b64encode(f"{auth_registry.username}:wrong".encode()).decode()
    cfg = _config(tmp_path, auth_registry.host, {"auth": bad})
    with pytest.raises(AuthError, match="refused our credentials") as info:
        CacheStore(tmp_path / "s2", registry=auth_registry.options(config_file=cfg)).ensure(image)
    assert "wrong" not in str(info.value) and bad not in str(info.value)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_registry_fails_within_the_deadline(tmp_path):
    closed = closed_port()
    store = CacheStore(tmp_path / "store", registry=RegistryOptions(plain_http=True, timeout=2))
    with pytest.raises(RegistryUnavailable, match="Connection refused.*2s deadline"):
        store.ensure(f"127.0.0.1:{closed}/x/y:latest")
    # a peer that accepts TCP but never answers
    with socket.create_server(("127.0.0.1", 0)) as silent:
        with pytest.raises(RegistryUnavailable, match="deadline"):
            store.ensure(f"127.0.0.1:{silent.getsockname()[1]}/x/y:latest")


def test_unreachable_registry_fails_after_a_few_attempts_whatever_the_deadline(tmp_path):
    closed = closed_port()
    store = CacheStore(tmp_path / "store", registry=RegistryOptions(plain_http=True, timeout=3600))
    with pytest.raises(RegistryUnavailable, match="Connection refused.*gave up after 5 attempts"):
        store.ensure(f"127.0.0.1:{closed}/x/y:latest")


def test_not_found_and_invalid_reference(registry, tmp_path):
    store = CacheStore(tmp_path / "store", registry=registry.options())
    with pytest.raises(ImageNotFound, match="HTTP 404"):
        store.ensure(f"{registry.host}/nothing/here:v1")
    for bad in ("no-host-repo", f"{registry.host}/UPPER", f"{registry.host}/x@sha256:123", ""):
        with pytest.raises(InvalidReference):
            store.ensure(bad)
    # a name (HOST/REPOSITORY) beyond distribution's 255 characters never reaches a registry
    longest = f"{registry.host}/{'n' * (254 - len(registry.host))}"
    with pytest.raises(ImageNotFound):
        store.ensure(longest + ":v1")
    with pytest.raises(InvalidReference, match="longer than 255 characters"):
        store.ensure(longest + "n:v1")


def test_retries_503_with_backoff(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src"), "faults/503")
    proxy = FaultProxy(registry.host, fail_first=3)
    try:
        inst = CacheStore(tmp_path / "store", registry=registry.options()).ensure(image.replace(registry.host, proxy.host))
    finally:
        proxy.close()
    assert proxy.failures == 3 and inst.kind == "triton"


def test_resumes_a_blob_cut_mid_transfer(registry, tmp_path):
    src = triton_tree(tmp_path / "src", nbytes=3_000_000)
    image = registry.push(src, "faults/cut")
    proxy = FaultProxy(registry.host, cut_after=700_000, cut_digest=_layer_digests(registry, image)[0])
    try:
        store = CacheStore(tmp_path / "store", registry=registry.options())
        inst = store.ensure(image.replace(registry.host, proxy.host))
    finally:
        proxy.close()
    assert proxy.cuts == 1
    kernel = "io.triton.cache/ksm_90/kernel.bin"
    assert (inst.path / kernel).read_bytes() == (src / kernel).read_bytes()
    assert store.verify() == []


def test_a_blob_server_that_never_resumes_fails_after_a_few_attempts(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src", nbytes=2_000_000), "faults/cut-forever")
    proxy = BlobRedirector(registry, mode="cut-forever")
    try:
        store = CacheStore(tmp_path / "store", registry=registry.options(timeout=3600))
        with pytest.raises(RegistryUnavailable, match="at byte 100000 .gave up after 5 attempts without progress"):
            store.ensure(image.replace(registry.host, proxy.host))
    finally:
        proxy.close()
    assert proxy.cuts == 5  # the first cut is the first failed attempt, then four resumes bring nothing
    assert store.list() == [] and os.listdir(tmp_path / "store" / "tmp") == []


@pytest.mark.parametrize("fault", ["stall", "drip"])
def test_a_blob_server_that_stalls_or_drips_fails_within_the_deadline(registry, tmp_path, fault):
    image = registry.push(triton_tree(tmp_path / "src", nbytes=2_000_000), f"faults/{fault}")
    if fault == "stall":  # cut mid-blob and held open
        proxy = FaultProxy(registry.host, cut_after=100_000, cut_digest=_layer_digests(registry, image)[0], stall=True)
    else:  # one byte every 0.2 s: every socket read succeeds, the whole would take days
        proxy = BlobRedirector(registry, mode="drip")
    try:
        store = CacheStore(tmp_path / "store", registry=registry.options(timeout=3))
        with pytest.raises(RegistryUnavailable, match="3s deadline"):
            store.ensure(image.replace(registry.host, proxy.host))
    finally:
        proxy.close()
    assert store.list() == [] and os.listdir(tmp_path / "store" / "tmp") == []


def _userpass(reg) -> str:
    return base64.b64encode(f"{reg.username}:{reg.password}".encode()).decode()


def test_blob_redirect_to_another_host_never_carries_our_credentials(auth_registry, tmp_path):
    src = triton_tree(tmp_path / "src")
    image = auth_registry.push(src, "redirect/auth")
    front = BlobRedirector(auth_registry)
    try:
        cfg = _config(tmp_path, front.host, {"auth": _userpass(auth_registry)})
        store = CacheStore(tmp_path / "store", registry=auth_registry.options(config_file=cfg))
        inst = store.ensure(image.replace(auth_registry.host, front.host))
    finally:
        front.close()
    assert inst.kind == "triton" and store.verify() == []
    assert len(front.seen) == 2  # the config and the layer, each fetched from the blob host
    assert all("Authorization" not in h for h in front.seen), front.seen
    assert all(h.get("Accept-Encoding") == "identity" for h in front.seen)


@pytest.mark.parametrize("mode", ["cut", "ignore-range"])
def test_resume_from_a_blob_host_with_or_without_range_support(registry, tmp_path, mode):
    src = triton_tree(tmp_path / "src", nbytes=600_000)
    image = registry.push(src, f"redirect/{mode}")
    front = BlobRedirector(registry, mode=mode, cut_after=200_000)
    try:
        store = CacheStore(tmp_path / "store", registry=registry.options())
        inst = store.ensure(image.replace(registry.host, front.host))
    finally:
        front.close()
    ranged = [h["Range"] for h in front.seen if "Range" in h]
    assert ranged == ["bytes=200000-"], front.seen
    assert (inst.path / "io.triton.cache/ksm_90/kernel.bin").read_bytes() == (src / "io.triton.cache/ksm_90/kernel.bin").read_bytes()


def test_a_resumed_range_that_starts_elsewhere_is_refused(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src", nbytes=600_000), "redirect/wrong-range")
    front = BlobRedirector(registry, mode="wrong-range", cut_after=200_000)
    try:
        store = CacheStore(tmp_path / "store", registry=registry.options())
        with pytest.raises(IntegrityError, match=r"asked for bytes 200000- .*the registry sent the range 'bytes 0-"):
            store.ensure(image.replace(registry.host, front.host))
    finally:
        front.close()
    assert store.list() == [] and os.listdir(tmp_path / "store" / "tmp") == []


def test_docker_config_keys_with_scheme_and_path(auth_registry, tmp_path):
    image = auth_registry.push(triton_tree(tmp_path / "src"), "auth/scheme")
    for i, key in enumerate([f"http://{auth_registry.host}/v2/", f"https://{auth_registry.host}",
                             auth_registry.host.replace("127.0.0.1", "localhost")]):
        cfg = _config(tmp_path, key, {"auth": _userpass(auth_registry)})
        store = CacheStore(tmp_path / f"store{i}", registry=auth_registry.options(config_file=cfg))
        assert store.ensure(image).kind == "triton", key


def test_given_config_wins_and_credential_helpers_are_never_run(auth_registry, tmp_path, monkeypatch):
    image = auth_registry.push(triton_tree(tmp_path / "src"), "auth/precedence")
    home = tmp_path / "home" / ".docker"
    home.mkdir(parents=True)
    wrong = base64.b64encode(f"{auth_registry.username}:wrong".encode()).decode()
    (home / "config.json").write_text(json.dumps({"auths": {auth_registry.host: {"auth": wrong}}}))
    helper_dir = tmp_path / "bin"
    helper_dir.mkdir()
    marker = tmp_path / "helper-ran"
    helper = helper_dir / "docker-credential-evil"
    helper.write_text(f"#!/bin/sh\ntouch {marker}\necho '{{\"Username\":\"x\",\"Secret\":\"y\"}}'\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{helper_dir}:{os.environ['PATH']}")
    path = tmp_path / "given.json"
    path.write_text(json.dumps({"credsStore": "evil", "credHelpers": {auth_registry.host: "evil"},
                                "auths": {auth_registry.host: {"auth": _userpass(auth_registry)}}}))
    store = CacheStore(tmp_path / "store", registry=auth_registry.options(config_file=str(path)))
    assert store.ensure(image).kind == "triton"
    # a helper and nothing else: never run, so no credentials at all
    (home / "config.json").write_text("{}")
    path.write_text(json.dumps({"credsStore": "evil", "credHelpers": {auth_registry.host: "evil"}}))
    with pytest.raises(AuthError, match="requires credentials and none were found"):
        CacheStore(tmp_path / "s2", registry=auth_registry.options(config_file=str(path))).ensure(image)
    assert not marker.exists()


@pytest.mark.parametrize("entry, fragment", [
    ({"auth": "%%%not-base64"}, "is not base64 of USER:PASSWORD"),
    ({"auth": base64.b64encode(b"no-colon-here").decode()}, "is not base64 of USER:PASSWORD"),
    ({"identitytoken": "refresh-me-secret"}, "only an identitytoken"),
])
def test_malformed_docker_config_entries(auth_registry, tmp_path, entry, fragment):
    image = auth_registry.push(triton_tree(tmp_path / "src"), "auth/malformed")
    cfg = _config(tmp_path, auth_registry.host, entry)
    with pytest.raises(AuthError, match=fragment) as info:
        CacheStore(tmp_path / "store", registry=auth_registry.options(config_file=cfg)).ensure(image)
    assert str(info.value).startswith(image)
    assert all(str(v) not in str(info.value) for v in entry.values())
    with pytest.raises(AuthError, match="does not exist"):
        CacheStore(tmp_path / "s2", registry=auth_registry.options(config_file=str(tmp_path / "nope.json"))).ensure(image)


def test_a_pull_secret_bomb_is_refused_before_it_is_parsed(auth_registry, tmp_path):
    """Issue 33: a tenant's dockerconfigjson pull secret (1.5 MiB in etcd) padded with {} holds
    half a million empty objects (about 35 MB parsed, per pull); it is decoded under
    accelnode.decode.DOCKER_CONFIG and refused by its count, naming the secret, never its content
    (it used to be parsed, and its credentials used)."""
    image = auth_registry.push(triton_tree(tmp_path / "src"), "auth/bomb")
    auth = base64.b64encode(f"{auth_registry.username}:{auth_registry.password}".encode()).decode()
    bomb = json.dumps({"auths": {auth_registry.host: {"auth": auth}}})[:-1] + ',"pad":[' + "{}," * 500_000 + "{}]}"
    options = auth_registry.options(pull_secrets=(("team/regcred", bomb),))
    with pytest.raises(AuthError, match=r"registry config team/regcred holds 500010 JSON values in \d+ bytes, over "
                                        r"the budget of 50000") as info:
        CacheStore(tmp_path / "store", registry=options).ensure(image)
    assert auth not in str(info.value)


def test_credentials_never_reach_logs_or_errors(auth_registry, tmp_path, caplog, capfd):
    image = auth_registry.push(triton_tree(tmp_path / "src"), "auth/logs")
    caplog.set_level(logging.DEBUG)
    secrets = [auth_registry.password, _userpass(auth_registry)]
    CacheStore(tmp_path / "s1", registry=auth_registry.options()).ensure(image)
    wrong = base64.b64encode(f"{auth_registry.username}:{auth_registry.password}x".encode()).decode()
    cfg = _config(tmp_path, auth_registry.host, {"auth": wrong})
    with pytest.raises(AuthError) as info:
        CacheStore(tmp_path / "s2", registry=auth_registry.options(config_file=cfg)).ensure(image)
    out, err = capfd.readouterr()
    for text in (caplog.text, out, err, str(info.value)):
        assert not any(s in text for s in secrets + [wrong])
