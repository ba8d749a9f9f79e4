"""An image a pod names (``csi.gkm.io/image``, accepted with ``--trust-pod-image-attribute``) is
pulled without the node's registry credentials, and gets nothing that credentials fetched: not a
pull in flight, not an install, not a failure of the other kind. The agent holds credentials for
the auth-only registry (``auth_registry``); the plain registry serves anyone."""

from __future__ import annotations

import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from accelnode.oci.reference import Reference
from accelnode.oci.registry import Deadline, Registry
from csi_driver.api import agent as agent_api

from .conftest import error_of, make_cache

Code = grpc.StatusCode
Ensure = agent_api.EnsureCacheResponse
V5E = [{"backend": "tpu", "arch": "v5e"}]


@pytest.fixture
def credentialed_node(node, auth_registry):
    """Agent with credentials for the auth-only registry; driver trusting the image attribute."""
    node.set_agent_flags("--registry-config", auth_registry.config_file)
    node.agent.start()
    node.csi.start()
    return node


def fresh_image(reg, tmp_path) -> str:
    """A cache image nobody has pulled yet (its own digest)."""
    tag = uuid.uuid4().hex[:12]
    src = make_cache(tmp_path / tag, {"xla/module.bin": tag.encode() * 512})
    return reg.push(src, f"caches/private-{tag}", kind="jax", targets=V5E)


def ensure(node, image: str, *, anonymous: bool, wait: float = 30.0):
    return node.agent_stub().EnsureCache(agent_api.EnsureCacheRequest(image=image, wait_seconds=wait,
                                                                      anonymous=anonymous), timeout=wait + 30)


def test_pod_named_image_is_pulled_without_the_nodes_credentials(credentialed_node, auth_registry, images,
                                                                  tmp_path):
    node = credentialed_node
    private = fresh_image(auth_registry, tmp_path)
    vol = node.volume(private)
    err = error_of(node.node_stub().NodePublishVolume, vol.publish_request())
    assert err.code() == Code.UNAUTHENTICATED, err.details()
    assert "requires credentials and this pull is anonymous" in err.details()
    assert not vol.target.exists()
    # the agent's credentials work: a credentialed ensure installs it ...
    assert ensure(node, private, anonymous=False).state == Ensure.READY
    # ... and the install is still not handed to a pod that names the image
    err = error_of(node.node_stub().NodePublishVolume, vol.publish_request())
    assert err.code() == Code.UNAUTHENTICATED
    assert not vol.target.exists() and vol.volume_id not in node.references()
    # an image anyone may pull mounts
    public = node.volume(images.tpu, pod_name="worker-1")
    node.node_stub().NodePublishVolume(public.publish_request(), timeout=60)
    assert node.references()[public.volume_id] == images.tpu.split("@")[1]


def test_anonymous_never_joins_a_credentialed_pull(credentialed_node, auth_registry, tmp_path):
    node = credentialed_node
    private = fresh_image(auth_registry, tmp_path)
    ensure(node, private, anonymous=False, wait=0)  # a credentialed pull starts (and may be running still)
    answer = ensure(node, private, anonymous=True)
    assert (answer.state, answer.failure) == (Ensure.FAILED, Ensure.DENIED), answer
    assert ensure(node, private, anonymous=False).state == Ensure.READY
    answer = ensure(node, private, anonymous=True)
    assert (answer.state, answer.failure) == (Ensure.FAILED, Ensure.DENIED), answer


def test_a_credentialed_caller_is_not_given_an_anonymous_failure(credentialed_node, auth_registry, tmp_path):
    node = credentialed_node
    private = fresh_image(auth_registry, tmp_path)
    ensure(node, private, anonymous=True, wait=0)  # an anonymous pull starts; it will be refused
    answer = ensure(node, private, anonymous=False)
    assert answer.state == Ensure.READY, answer
    answer = ensure(node, private, anonymous=True)
    assert (answer.state, answer.failure) == (Ensure.FAILED, Ensure.DENIED), answer


def test_public_content_installed_with_credentials_is_served_anonymously(credentialed_node, registry, tmp_path):
    """The registry serves the manifest to an anonymous request: the install is reused."""
    node = credentialed_node
    public = fresh_image(registry, tmp_path)
    first = ensure(node, public, anonymous=False)
    assert first.state == Ensure.READY
    again = ensure(node, public, anonymous=True)
    assert (again.state, again.path, again.digest) == (Ensure.READY, first.path, first.digest)


class ManifestOnlyRegistry:
    """Someone's own registry on 127.0.0.1 that serves a copy of one manifest (never a blob)."""

    def __init__(self, manifest: bytes, media_type: str):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server naming)
                if self.path.rstrip("/") == "/v2":
                    body, ctype, code = b"{}", "application/json", 200
                elif "/manifests/" in self.path:
                    body, ctype, code = manifest, media_type, 200
                else:
                    body, ctype, code = b'{"errors":[{"code":"BLOB_UNKNOWN"}]}', "application/json", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_copied_manifest_elsewhere_does_not_unlock_installed_content(credentialed_node, auth_registry, tmp_path):
    """Installed from the private repository, the content is handed to an anonymous pull only if
    that repository serves it anonymously, whatever repository the pod names."""
    node = credentialed_node
    private = fresh_image(auth_registry, tmp_path)
    assert ensure(node, private, anonymous=False).state == Ensure.READY
    ref = Reference.parse(private)
    body, media_type, digest = Registry(ref.host, auth_registry.options(), Deadline(30)).get_manifest(ref, private)
    copy = ManifestOnlyRegistry(body, media_type)
    try:
        answer = ensure(node, f"{copy.host}/copies/cache@{digest}", anonymous=True)
        assert (answer.state, answer.failure) == (Ensure.FAILED, Ensure.DENIED), answer
        assert f"does not serve {digest} to this pull" in answer.message
        assert ref.repository not in answer.message
    finally:
        copy.close()
