"""The real ``accelnode controller`` under a JSON bomb at admission (issue 33): a GKMCache whose
``spec.image`` is an image index of eight 4 MiB manifests of ``{}`` (:mod:`tests.fuzz.bombs`,
served on 127.0.0.1). The cache webhook resolves the image while the API server waits; it used to
take the controller from about 50 MB to over 1 GB resident in under two seconds (its pod's limit
is 256 Mi: every TPU workload create in the cluster was then refused by its fail-closed
webhooks). Now the first child is refused before it is parsed (the warning says the answer was
refused, the log names the document) and the process stays under RSS_BOUND_KIB, however often
it is asked."""

from __future__ import annotations

import re
import ssl
import time

from controller.caches.webhooks import MUTATE_GKMCACHE, VALIDATE_GKMCACHE
from tests.controller.test_cache_webhooks import gkmcache, post_review
from tests.controller.test_webhook_server import CA
from tests.csi.conftest import free_ports
from tests.fuzz import bombs
from tests.fuzz.test_memory_bound import REFUSAL
from tests.fuzz.test_registry_answers import HostileRegistry


def test_a_bomb_index_at_admission_is_refused_within_the_memory_bound(controllers, fresh_lease, tmp_path):
    reg = HostileRegistry()
    reg.world = bombs.world()
    ca = CA()
    cert, key, _ = ca.serving(tmp_path, "accelnode-controller")
    (port,) = free_ports(1)
    proc = controllers("budget", "--webhook-address", f"127.0.0.1:{port}", "--tls-cert-file", cert,
                       "--tls-key-file", key, "--plain-http", "--registry-timeout", "30")
    ctx = ssl.create_default_context(cadata=ca.pem.decode())

    def post(path: str, obj: dict) -> dict:
        return post_review(port, ctx, path, "tenant", obj, timeout=60)

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                post(VALIDATE_GKMCACHE, gkmcache("warm", "example.com/warm:v1"))
                break
            except (ConnectionError, OSError):
                assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
                time.sleep(0.1)
        before = bombs.vm_hwm(proc.proc.pid)
        for image in (f"{reg.host}/{bombs.REPO}:index", bombs.pinned_index(reg.host), f"{reg.host}/{bombs.REPO}:manifest"):
            answer = post(MUTATE_GKMCACHE, gkmcache("bomb", image))
            assert answer["allowed"], answer  # unpinned, with a warning: the controller pins it when it can
            assert any("the registry's answer was refused (HostileContent)" in w
                       for w in answer.get("warnings", [])), answer
        peak = bombs.vm_hwm(proc.proc.pid)
        print(f"controller peak RSS: {before} KiB before the bombs, {peak} KiB after")
        assert proc.proc.poll() is None, proc.log()
        assert re.search(REFUSAL, proc.log()), proc.log()[-3000:]  # the log names the document
    finally:
        reg.stop()
    assert peak < bombs.RSS_BOUND_KIB, f"the controller's peak RSS {peak} KiB ({before} KiB before the bombs)"
