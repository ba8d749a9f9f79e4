"""The metadata server emulator (tests/rigs/metadata.py) speaks the protocol the real one
does, and the client (accelnode/gce/metadata.py) uses it as Google's clients do."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from accelnode.gce.metadata import Metadata, MetadataError, NotFound, metadata_host
from tests.rigs.metadata import MetadataServer


@pytest.fixture
def md():
    with MetadataServer(name="tpu-a-0", zone="us-east5-b", project="p1", project_number=42,
                        attributes={"kube-labels": "a=b"}) as srv:
        yield srv


def raw(srv: MetadataServer, path: str, headers: dict | None = None):
    req = urllib.request.Request(f"http://{srv.host}/computeMetadata/v1/{path}",
                                 headers={"Metadata-Flavor": "Google", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def test_the_flavor_header_is_required_and_forwarded_requests_refused(md):
    req = urllib.request.Request(f"http://{md.host}/computeMetadata/v1/instance/name")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 403 and err.value.headers["Metadata-Flavor"] == "Google"
    code, headers, body = raw(md, "instance/name", {"X-Forwarded-For": "10.0.0.9"})
    assert code == 403 and "X-Forwarded-For" in body
    code, headers, body = raw(md, "instance/name")
    assert (code, body) == (200, "tpu-a-0") and headers["Metadata-Flavor"] == "Google" and headers["ETag"]


def test_the_tree(md):
    assert raw(md, "instance/id")[2] == str(md.instance["id"])
    assert raw(md, "instance/zone")[2] == "projects/42/zones/us-east5-b"
    assert raw(md, "instance/hostname")[2] == "tpu-a-0.us-east5-b.c.p1.internal"
    assert raw(md, "project/project-id")[2] == "p1"
    assert raw(md, "instance/attributes/kube-labels")[2] == "a=b"
    assert raw(md, "instance/attributes/nope")[0] == 404
    assert raw(md, "instance/")[2].splitlines() == ["id", "name", "hostname", "zone", "attributes/"]
    code, headers, body = raw(md, "instance/attributes/?recursive=true")
    assert json.loads(body) == {"kube-labels": "a=b"} and headers["Content-Type"] == "application/json"
    assert raw(md, "instance/attributes/?recursive=true&alt=text")[2] == "kube-labels a=b\n"
    assert json.loads(raw(md, "project/?recursive=true")[2]) == {"projectId": "p1", "numericProjectId": 42,
                                                                 "attributes": {}}
    code, headers, _ = raw(md, "instance/attributes?recursive=true")
    assert code == 200  # urllib followed the 301 to the directory
    assert ("/computeMetadata/v1/instance/attributes?recursive=true", 301) in md.requests
    assert raw(md, "instance/name?alt=xml")[0] == 400
    assert raw(md, "instance/name?wait_for_change=true&timeout_sec=0")[0] == 400


def test_etags_follow_the_content(md):
    first = raw(md, "instance/attributes/?recursive=true")[1]["ETag"]
    assert raw(md, "instance/attributes/?recursive=true")[1]["ETag"] == first
    md.set_attributes({"x": "1"})
    second = raw(md, "instance/attributes/?recursive=true")[1]["ETag"]
    assert second != first
    md.remove_attributes("x")
    assert raw(md, "instance/attributes/?recursive=true")[1]["ETag"] == first
    md.replace_attributes({"y": "2"})
    assert json.loads(raw(md, "instance/attributes/?recursive=true")[2]) == {"y": "2"}
    with pytest.raises(ValueError, match="bad attribute"):
        md.set_attributes({"a/b": "1"})
    assert md.attributes() == {"y": "2"}


def test_a_long_poll_answers_at_once_on_a_stale_etag_and_on_change_otherwise(md):
    c = Metadata(md.host)
    attrs, etag = c.attributes()
    assert c.attributes(last_etag="stale", wait=True, timeout_sec=30) == (attrs, etag)
    got = {}
    t = threading.Thread(target=lambda: got.update(a=c.attributes(last_etag=etag, wait=True, timeout_sec=60)))
    t.start()
    md.wait_for_waiters(1)  # parked on the server, its answer not sent
    assert got == {}
    md.set_attributes({"kubeadm-join-token": "abcdef.0123456789abcdef"})
    t.join(30)
    assert not t.is_alive()
    new, new_etag = got["a"]
    assert new["kubeadm-join-token"] == "abcdef.0123456789abcdef" and new_etag != etag


def test_a_long_poll_ends_unchanged_after_timeout_sec(md):
    c = Metadata(md.host)
    _, etag = c.attributes()
    attrs, again = c.attributes(last_etag=etag, wait=True, timeout_sec=1)
    assert again == etag and attrs == {"kube-labels": "a=b"}
    # without last_etag: the next change, whatever it is (here: none within the timeout)
    a = c.watch("instance/name", last_etag=None, timeout_sec=1)
    assert a.body == "tpu-a-0"


def test_a_missing_key_is_404_at_once_even_when_waiting(md):
    c = Metadata(md.host)
    with pytest.raises(NotFound):
        c.watch("instance/attributes/kubeadm-join-token", last_etag=None, timeout_sec=60)


def test_the_client_finds_the_server_through_gce_metadata_host(md, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", md.host)
    assert metadata_host() == md.host
    assert Metadata().get("instance/name").body == "tpu-a-0"
    monkeypatch.delenv("GCE_METADATA_HOST")
    assert metadata_host() == "169.254.169.254"


def test_the_client_refuses_a_server_that_is_no_metadata_server():
    class Plain(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Plain)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(MetadataError, match="lacks Metadata-Flavor"):
            Metadata(f"127.0.0.1:{srv.server_address[1]}").attributes()
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_emulator_runs_standalone():
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "tests.rigs.metadata", "--name", "vm-x",
                             "--attribute", "kube-labels=a=b"], stdout=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        host = proc.stdout.readline().strip().removeprefix("export GCE_METADATA_HOST=")
        assert "metadata server emulator at http://" in first
        c = Metadata(host)
        assert c.get("instance/name").body == "vm-x"
        assert c.attributes()[0] == {"kube-labels": "a=b"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = subprocess.run([sys.executable, "-m", "tests.rigs.metadata", "--attribute", "novalue"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "is not KEY=VALUE" in bad.stderr
