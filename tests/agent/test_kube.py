"""The agent's API client: credentials (token files re-read after rotation, inline secrets kept
out of reprs and off the disk), TLS always verified, bad configuration refused with a reason."""

from __future__ import annotations

import base64
import tempfile

import pytest
import yaml

from accelnode.kube.client import Client, Config, KubeError, Unreachable

SA = ("accelnode-system", "accelnode-agent")


def token_for(kube_api, seconds: int = 3600) -> str:
    """A real service-account token of the agent's identity (TokenRequest, as kubelet gets it)."""
    from kubernetes import client

    req = client.CoreV1Api(kube_api("admin")).create_namespaced_service_account_token(
        SA[1], SA[0], body={"spec": {"expirationSeconds": seconds}})
    return req.status.token


def whoami(c: Client) -> str:
    review = c.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                       body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    return review["status"]["userInfo"]["username"]


def test_a_rotated_token_file_is_read_again(tmp_path, control_plane, kube_api, agent_rbac):
    token_file = tmp_path / "token"
    token_file.write_text("not-a-token\n")
    c = Client(Config(control_plane.url, str(control_plane.ca_file), token_file=str(token_file)))
    with pytest.raises(KubeError) as err:
        whoami(c)
    assert err.value.code == 401
    token_file.write_text(token_for(kube_api) + "\n")  # kubelet rotates the projected token
    assert whoami(c) == f"system:serviceaccount:{SA[0]}:{SA[1]}"


def test_inline_credentials_stay_in_memory(tmp_path, control_plane, kube_api, agent_rbac):
    token = token_for(kube_api)
    ca = base64.b64encode(control_plane.ca_file.read_bytes()).decode()
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": control_plane.url, "certificate-authority-data": ca}}],
        "users": [{"name": "u", "user": {"token": token}}]}))
    config = Config.from_kubeconfig(path)
    assert token not in repr(config) and ca not in repr(config)
    assert whoami(Client(config)) == f"system:serviceaccount:{SA[0]}:{SA[1]}"


def test_client_certificate_data_is_not_left_on_disk(tmp_path, monkeypatch, control_plane):
    doc = yaml.safe_load(control_plane.kubeconfig("agent").read_text())
    user = doc["users"][0]["user"]
    for key in ("client-certificate", "client-key"):
        user[key + "-data"] = base64.b64encode(open(user.pop(key), "rb").read()).decode()
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    c = Client(Config.from_kubeconfig(path))
    assert list(tmp.iterdir()) == []
    assert whoami(c) == f"system:serviceaccount:{SA[0]}:{SA[1]}"


def test_the_server_certificate_is_verified(control_plane):
    c = Client(Config(control_plane.url))  # the system trust store does not know the test CA
    with pytest.raises(Unreachable) as err:
        c.request("GET", "/version")
    assert "CERTIFICATE_VERIFY_FAILED" in str(err.value), err.value


@pytest.mark.parametrize("cluster, why", [
    ({"server": "http://127.0.0.1:6443"}, "only https:// is supported"),
    ({"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}, "insecure-skip-tls-verify"),
])
def test_unsafe_kubeconfigs_are_refused(tmp_path, cluster, why):
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": {"tokenFile": "t"}}]}))
    with pytest.raises(ValueError, match=why):
        Config.from_kubeconfig(path)
