"""Registry behaviour: credentials, deadlines, retries on 5xx and on a connection cut mid-blob."""

from __future__ import annotations

import base64
import json
import os
import socket

import pytest

from agent.errors import AuthError, ImageNotFound, InvalidReference, RegistryUnavailable
from agent.registry import RegistryOptions
from agent.store import CacheStore
from tests.cache.helpers import FaultProxy
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


def test_unreachable_registry_fails_within_the_deadline(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    store = CacheStore(tmp_path / "store", registry=RegistryOptions(plain_http=True, timeout=2))
    with pytest.raises(RegistryUnavailable, match="Connection refused.*2s deadline"):
        store.ensure(f"127.0.0.1:{closed}/x/y:latest")
    # a peer that accepts TCP but never answers
    with socket.create_server(("127.0.0.1", 0)) as silent:
        with pytest.raises(RegistryUnavailable, match="deadline"):
            store.ensure(f"127.0.0.1:{silent.getsockname()[1]}/x/y:latest")


def test_not_found_and_invalid_reference(registry, tmp_path):
    store = CacheStore(tmp_path / "store", registry=registry.options())
    with pytest.raises(ImageNotFound, match="HTTP 404"):
        store.ensure(f"{registry.host}/nothing/here:v1")
    for bad in ("no-host-repo", f"{registry.host}/UPPER", f"{registry.host}/x@sha256:123", ""):
        with pytest.raises(InvalidReference):
            store.ensure(bad)


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


def test_a_cut_that_never_recovers_fails_within_the_deadline(registry, tmp_path):
    image = registry.push(triton_tree(tmp_path / "src", nbytes=2_000_000), "faults/stall")
    proxy = FaultProxy(registry.host, cut_after=100_000, cut_digest=_layer_digests(registry, image)[0], stall=True)
    try:
        store = CacheStore(tmp_path / "store", registry=registry.options(timeout=3))
        with pytest.raises(RegistryUnavailable, match="deadline"):
            store.ensure(image.replace(registry.host, proxy.host))
    finally:
        proxy.close()
    assert store.list() == [] and os.listdir(tmp_path / "store" / "tmp") == []
