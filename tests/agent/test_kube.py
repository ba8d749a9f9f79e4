"""The agent's API client: credentials (token files re-read after rotation, inline secrets kept
out of reprs and off the disk), TLS always verified, bad configuration refused with a reason."""

from __future__ import annotations

import base64
import json
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


HTTPS = {"server": "https://127.0.0.1:6443"}
EXEC_USER = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "gke-gcloud-auth-plugin"}}


def kubeconfig(path, cluster: dict, user: dict):
    path.write_text(yaml.safe_dump({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": cluster}], "users": [{"name": "u", "user": user}]}))
    return path


@pytest.mark.parametrize("cluster, user, why", [
    ({"server": "http://127.0.0.1:6443"}, {"tokenFile": "t"}, "only https:// is supported"),
    (dict(HTTPS, **{"insecure-skip-tls-verify": True}), {"tokenFile": "t"}, "insecure-skip-tls-verify"),
    # credential plugins are not run: refused instead of going out anonymous
    (HTTPS, EXEC_USER, "authenticates with 'exec', which this client does not run"),
    (HTTPS, {"auth-provider": {"name": "gcp", "config": {"access-token": "secret-token"}}},
     "authenticates with 'auth-provider', which this client does not run"),
    (HTTPS, {"username": "admin", "password": "secret-password"}, "basic auth"),
])
def test_unsafe_kubeconfigs_are_refused(tmp_path, cluster, user, why):
    with pytest.raises(ValueError, match=why) as err:
        Config.from_kubeconfig(kubeconfig(tmp_path / "kubeconfig", cluster, user))
    assert "secret" not in str(err.value)


class HostileAPI:
    """An HTTPS API server on 127.0.0.1 that answers lists and watches of one collection with
    what the test sets: ``lists`` (documents, served in turn, the last one repeated) and
    ``watches`` (event lists, one per watch, in turn; a watch past the last one stays open,
    quiet, until the test ends). A real apiserver never omits a resourceVersion, so a
    misbehaving one (or something between) is stood up here."""

    def __init__(self, tmp_path, lists: list[dict], watches: list[list[dict]]):
        import http.server
        import ssl
        import threading
        from urllib.parse import parse_qs, urlparse

        from tests.controller.test_webhook_server import CA

        ca = CA()
        self.ca_file = tmp_path / "ca.pem"
        self.ca_file.write_bytes(ca.pem)
        cert, key, _ = ca.serving(tmp_path, "hostile-api")
        api, self.done, self.lists_served = self, threading.Event(), 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                watch = "watch" in parse_qs(urlparse(self.path).query)
                if not watch:
                    doc = lists[min(api.lists_served, len(lists) - 1)]
                    api.lists_served += 1
                    body = json.dumps(doc).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                if watches:
                    for event in watches.pop(0):
                        self.wfile.write(json.dumps(event).encode() + b"\n")
                    self.wfile.flush()
                else:
                    api.done.wait(30)
                self.close_connection = True

            def log_message(self, *a):
                pass

        self._srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self._srv.socket = ctx.wrap_socket(self._srv.socket, server_side=True)
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()
        self.url = f"https://127.0.0.1:{self._srv.server_address[1]}"

    def client(self) -> Client:
        return Client(Config(self.url, str(self.ca_file), token="t"))

    def close(self) -> None:
        self.done.set()
        self._srv.shutdown()
        self._srv.server_close()


def widget(name: str, rv: str | None) -> dict:
    md = {"name": name, "namespace": "ns"}
    if rv is not None:
        md["resourceVersion"] = rv
    return {"metadata": md}


def names(r) -> set:
    return {o["metadata"]["name"] for o in r.snapshot()}


@pytest.fixture
def hostile_api(tmp_path):
    servers = []

    def make(lists, watches):
        servers.append(HostileAPI(tmp_path, lists, watches))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_a_watch_event_without_a_resource_version_is_skipped_and_the_copy_relisted(hostile_api):
    from accelnode.kube.reflector import Reflector
    from tests.agent.conftest import eventually
    from tests.agent.test_resilience import run_reflector

    api = hostile_api(
        lists=[{"metadata": {"resourceVersion": "10"}, "items": [widget("a", "10")]},
               {"metadata": {"resourceVersion": "12"}, "items": [widget("a", "10"), widget("c", "12")]}],
        watches=[[{"type": "BOOKMARK", "object": {"metadata": {}}},  # carries nothing: ignored
                  {"type": "ADDED", "object": widget("b", None)},
                  {"type": "ADDED", "object": widget("never-applied", "11")}]])
    events = []
    r = Reflector(api.client(), "/apis/x.io/v1/widgets", on_event=lambda t, o: events.append((t, o["metadata"]["name"])),
                  max_backoff=1)
    halt = run_reflector(r)
    try:
        assert eventually(lambda: r.relists == 2), "the malformed event did not lead to a re-list"
        assert names(r) == {"a", "c"}  # the second list's copy, nothing of the malformed watch
        assert r.resource_version == "12"
        assert ("ADDED", "b") not in events and ("ADDED", "never-applied") not in events
        assert ("ADDED", "c") in events
    finally:
        assert halt(), "the reflector did not stop (or its thread died)"


def test_a_list_without_a_resource_version_is_retried_not_fatal(hostile_api):
    from accelnode.kube.reflector import Reflector
    from tests.agent.conftest import eventually
    from tests.agent.test_resilience import run_reflector

    api = hostile_api(lists=[{"metadata": {}, "items": [widget("a", "1")]}, {"items": []},
                             {"metadata": {"resourceVersion": "5"}, "items": [widget("a", "5")]}], watches=[])
    r = Reflector(api.client(), "/apis/x.io/v1/widgets", max_backoff=1)
    halt = run_reflector(r)
    try:
        assert eventually(lambda: r.synced.is_set()), "never synced once the list was whole"
        assert api.lists_served >= 3 and names(r) == {"a"} and r.resource_version == "5"
    finally:
        assert halt(), "the reflector did not stop (or its thread died)"
