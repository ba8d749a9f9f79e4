"""The pure parts of the node-side join: the metadata's values, the detached JWS check, the
JoinConfiguration."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest

from bootstrap.poller import (BadMetadata, BadSignature, JoinValues, join_configuration, provider_id,
                             verify_detached_jws)

HASH = "sha256:" + "ab" * 32


def b64url(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def sign(payload: str, tid: str, secret: str, alg: str = "HS256") -> str:
    """A detached compact JWS as RFC 7515 appendix F describes it (written here from the RFC)."""
    header = b64url(json.dumps({"alg": alg, "kid": tid}).encode())
    sig = hmac.new(secret.encode(), f"{header}.{b64url(payload.encode())}".encode(), hashlib.sha256).digest()
    return f"{header}..{b64url(sig)}"


def attrs(**over) -> dict:
    base = {"kubeadm-join-token": "abcdef.0123456789abcdef", "kubeadm-control-plane-ip": "10.0.0.2",
            "kubeadm-ca-hash": HASH}
    return {**base, **over}


def test_values_need_all_three_keys():
    assert JoinValues.from_attributes({}) is None
    assert JoinValues.from_attributes(attrs(**{"kubeadm-ca-hash": ""})) is None
    v = JoinValues.from_attributes(attrs())
    assert (v.endpoint, v.ca_hash, v.token_id, v.token_secret) == ("10.0.0.2:6443", HASH, "abcdef", "0123456789abcdef")
    assert "0123456789abcdef" not in repr(v)


@pytest.mark.parametrize("endpoint,want", [("10.0.0.2:443", "10.0.0.2:443"), ("cp.example", "cp.example:6443"),
                                           ("[fd00::1]", "[fd00::1]:6443"), ("[fd00::1]:7443", "[fd00::1]:7443")])
def test_the_endpoint_gets_the_default_port(endpoint, want):
    assert JoinValues.from_attributes(attrs(**{"kubeadm-control-plane-ip": endpoint})).endpoint == want


@pytest.mark.parametrize("key,value,match", [
    ("kubeadm-join-token", "ABCDEF.0123456789abcdef", "not a kubeadm bootstrap token"),
    ("kubeadm-join-token", "abcdef0123456789abcdef", "not a kubeadm bootstrap token"),
    ("kubeadm-ca-hash", "md5:abc", "not sha256"),
    ("kubeadm-ca-hash", "sha256:" + "AB" * 32, "not sha256"),
    ("kubeadm-control-plane-ip", "https://10.0.0.2", "not host"),
])
def test_malformed_values_are_refused_without_the_token(key, value, match):
    with pytest.raises(BadMetadata, match=match) as err:
        JoinValues.from_attributes(attrs(**{key: value}))
    assert "0123456789abcdef" not in str(err.value)


def test_a_detached_jws_verifies_only_with_the_right_secret_and_payload():
    payload = "apiVersion: v1\nkind: Config\n"
    jws = sign(payload, "abcdef", "0123456789abcdef")
    verify_detached_jws(jws, payload, "abcdef", "0123456789abcdef")
    with pytest.raises(BadSignature, match="does not verify"):
        verify_detached_jws(jws, payload, "abcdef", "0123456789abcdeg")
    with pytest.raises(BadSignature, match="does not verify"):
        verify_detached_jws(jws, payload + "# tampered\n", "abcdef", "0123456789abcdef")
    with pytest.raises(BadSignature, match="not HS256"):
        verify_detached_jws(sign(payload, "abcdef", "0123456789abcdef", alg="none"), payload, "abcdef",
                            "0123456789abcdef")
    header, _, sig = jws.split(".")
    with pytest.raises(BadSignature, match="not a detached JWS"):
        verify_detached_jws(f"{header}.{b64url(payload.encode())}.{sig}", payload, "abcdef", "0123456789abcdef")


def test_the_join_configuration_carries_the_provider_id_as_v1beta4_wants():
    v = JoinValues.from_attributes(attrs())
    cfg = join_configuration(v, node_name="tpu-0", provider=provider_id("p", "projects/1/zones/us-east5-b", "tpu-0"))
    assert cfg["apiVersion"] == "kubeadm.k8s.io/v1beta4" and cfg["kind"] == "JoinConfiguration"
    assert cfg["discovery"]["bootstrapToken"] == {"token": v.token, "apiServerEndpoint": "10.0.0.2:6443",
                                                  "caCertHashes": [HASH]}
    assert cfg["nodeRegistration"]["kubeletExtraArgs"] == [{"name": "provider-id",
                                                            "value": "gce://p/us-east5-b/tpu-0"}]
    assert cfg["nodeRegistration"]["name"] == "tpu-0"
    assert "patches" not in cfg
    assert join_configuration(v, node_name="tpu-0", provider="gce://p/z/tpu-0",
                              patches="/etc/accelnode/kubeadm-patches")["patches"] == {
        "directory": "/etc/accelnode/kubeadm-patches"}


def test_patches_must_be_a_directory(tmp_path):
    import subprocess

    from tests.conftest import accelnode_cmd

    out = subprocess.run(accelnode_cmd() + ["bootstrap", "--patches", str(tmp_path / "missing"), "--metadata-host",
                                            "127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"--patches {tmp_path / 'missing'}: not a directory" in out.stderr, out.stderr


def test_the_shipped_kubelet_units_give_kubelet_what_kubeadm_wrote(tmp_path):
    """The unit + drop-in, read as systemd reads them (tests/rigs/unitctl.py), with the
    environment file kubeadm writes: kubelet's argv."""
    from tests.conftest import ROOT
    from tests.rigs.unitctl import command, environment, read_unit

    flags = tmp_path / "kubeadm-flags.env"
    flags.write_text('KUBELET_KUBEADM_ARGS="--hostname-override=tpu-0 --provider-id=gce://p/z/tpu-0"\n')
    settings = read_unit(ROOT / "daemonsets/systemd", "kubelet.service")
    settings["EnvironmentFile"] = [f"-{flags}" if v.endswith("kubeadm-flags.env") else v
                                   for v in settings["EnvironmentFile"]]
    assert command(settings, environment(settings), None) == [
        "/usr/local/bin/kubelet", "--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf",
        "--kubeconfig=/etc/kubernetes/kubelet.conf", "--config=/var/lib/kubelet/config.yaml",
        "--hostname-override=tpu-0", "--provider-id=gce://p/z/tpu-0"]


def test_the_systemd_unit_is_valid(tmp_path):
    """systemd-analyze accepts the shipped unit (with a stand-in for the installed binary)."""
    import shutil
    import subprocess

    from tests.conftest import ROOT, require

    exe = shutil.which("systemd-analyze")
    require(exe is not None, "systemd-analyze (Debian package systemd, tools/apt/bootstrap.txt)")
    unit = (ROOT / "daemonsets/systemd/accelnode-bootstrap.service").read_text()
    assert "ExecStart=/usr/local/bin/accelnode bootstrap" in unit
    path = tmp_path / "accelnode-bootstrap.service"
    path.write_text(unit.replace("/usr/local/bin/accelnode", shutil.which("true")))
    out = subprocess.run([exe, "verify", str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    # kubelet's unit with its kubeadm drop-in
    kubelet = tmp_path / "kubelet.service"
    kubelet.write_text((ROOT / "daemonsets/systemd/kubelet.service").read_text().replace(
        "/usr/local/bin/kubelet", shutil.which("true")))
    (tmp_path / "kubelet.service.d").mkdir()
    (tmp_path / "kubelet.service.d/10-kubeadm.conf").write_text(
        (ROOT / "daemonsets/systemd/kubelet.service.d/10-kubeadm.conf").read_text().replace(
            "/usr/local/bin/kubelet", shutil.which("true")))
    out = subprocess.run([exe, "verify", str(kubelet)], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


def test_waiting_survives_a_metadata_server_that_is_not_up_yet():
    import threading
    import time

    from accelnode.gce.metadata import Metadata
    from tests.rigs.devcluster import free_port
    from tests.rigs.metadata import MetadataServer
    from bootstrap.poller import wait_for_join_values

    port = free_port()
    servers = []

    def later():
        time.sleep(0.5)  # ordering only: the poller has met a refused connection first
        servers.append(MetadataServer(port=port, attributes=attrs()).start())

    t = threading.Thread(target=later)
    t.start()
    try:
        v = wait_for_join_values(Metadata(f"127.0.0.1:{port}"), timeout=60)
        assert v.token_id == "abcdef"
    finally:
        t.join()
        for s in servers:
            s.stop()


def test_waiting_ends_with_a_clear_error_after_the_timeout():
    from accelnode.gce.metadata import Metadata
    from tests.rigs.metadata import MetadataServer
    from bootstrap.poller import ServerUnreachable, wait_for_join_values

    with MetadataServer(attributes={"kubeadm-join-token": "abcdef.0123456789abcdef"}) as md:
        with pytest.raises(ServerUnreachable, match="did not appear in the instance metadata"):
            wait_for_join_values(Metadata(md.host), timeout=1)
