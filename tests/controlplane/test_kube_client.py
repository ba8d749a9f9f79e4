"""What our Kubernetes client does that client-go does, against the real kube-apiserver: lists
in pages (one consistent snapshot; an expired continue token restarts the list), 429 Too Many
Requests from API Priority and Fairness waited out as Retry-After says (bounded), and a reflector
that backs off while 410 Gone follows 410 Gone. Waits are injected and recorded, never timed."""

from __future__ import annotations

import base64
import http.server
import json
import ssl
import threading
import urllib.error
import urllib.request
import uuid

import pytest
import urllib3

from accelnode.kube.client import (Client, Config, KubeError, custom_path, is_conflict, is_forbidden, is_gone,
                                   is_invalid, is_not_found, is_precondition_failed, is_too_many_requests,
                                   is_unauthorized)
from accelnode.kube.reflector import Backoff, Reflector
from tests.agent.conftest import eventually
from tests.agent.test_resilience import run_reflector
from tests.conftest import TOOLS_BIN, require

LABEL = "accelnode.test/paging"


class Recording(Client):
    """A client that keeps what it asked (method, path, query), the JSON answers and the errors
    it got; ``after_answer(doc)`` runs after each answer (a test's move between two pages)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[str, str, dict]] = []
        self.answers: list[dict] = []
        self.errors: list[KubeError] = []
        self.after_answer = lambda doc: None

    def _open(self, method, path, query, *args, **kwargs):
        self.asked.append((method, path, dict(query or {})))
        return super()._open(method, path, query, *args, **kwargs)

    def request(self, *args, **kwargs):
        try:
            doc = super().request(*args, **kwargs)
        except KubeError as e:
            self.errors.append(e)
            raise
        self.answers.append(doc)
        self.after_answer(doc)
        return doc


def config(cp, identity: str = "admin") -> Config:
    return Config.from_kubeconfig(cp.kubeconfig(identity))


def configmap(name: str, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels or {LABEL: "yes"}},
            "data": {"n": name}}


def make_configmaps(admin: Client, ns: str, n: int) -> str:
    path = f"/api/v1/namespaces/{ns}/configmaps"
    for i in range(n):
        admin.request("POST", path, body=configmap(f"cm-{i:02d}"))
    return path


def names(items) -> list[str]:
    return sorted(o["metadata"]["name"] for o in items)


# -- error predicates ------------------------------------------------------------------------------


def test_error_predicates_read_the_status_code_of_kube_errors_only():
    preds = {401: is_unauthorized, 403: is_forbidden, 404: is_not_found, 409: is_conflict, 410: is_gone,
             412: is_precondition_failed, 422: is_invalid, 429: is_too_many_requests}
    for code, pred in preds.items():
        assert [c for c in preds if pred(KubeError(c, "", ""))] == [code], pred.__name__
        assert not pred(ValueError(code))
    http_error = urllib.error.HTTPError("https://x", 404, "Not Found", {}, None)
    assert not is_not_found(http_error)  # another library's 404 is not the API server's


# -- pagination ------------------------------------------------------------------------------------


def test_list_pages_through_a_collection_as_one_snapshot(control_plane, kube_namespace):
    admin = Client(config(control_plane))
    path = make_configmaps(admin, kube_namespace, 23)
    c = Recording(config(control_plane), page_size=5)
    late = {}

    def write_between_pages(doc):  # a write after the first page is not in this list
        if not late:
            late.update(admin.request("POST", path, body=configmap("zz-late")))

    c.after_answer = write_between_pages
    doc = c.list(path, query={"labelSelector": f"{LABEL}=yes"})
    assert names(doc["items"]) == [f"cm-{i:02d}" for i in range(23)]
    assert c.sent == 5 and [(q["limit"], "continue" in q) for _, _, q in c.asked] == [
        ("5", False), ("5", True), ("5", True), ("5", True), ("5", True)]
    assert all(q["labelSelector"] == f"{LABEL}=yes" for _, _, q in c.asked)
    rv = doc["metadata"]["resourceVersion"]
    assert {a["metadata"]["resourceVersion"] for a in c.answers} == {rv}  # every page: the first's snapshot
    assert int(late["metadata"]["resourceVersion"]) > int(rv)
    assert "continue" not in doc["metadata"] and doc["kind"] == "ConfigMapList"
    assert names(admin.list(path, query={"labelSelector": f"{LABEL}=yes"})["items"])[-1] == "zz-late"


def test_a_page_over_its_budget_is_asked_again_with_fewer_items(control_plane, kube_namespace, monkeypatch):
    """Issue 33: every answer is decoded under a budget (accelnode.decode), a list page under
    KUBE_LIST_PAGE. A page over it is asked again (same continue token) with fewer items (what
    would fit of the objects it read), so that what one page makes the process hold is bounded whatever the objects
    weigh, and the list still comes whole. Six 300 KB ConfigMaps, a page budget of 1 MiB: three
    objects a page."""
    from accelnode import decode
    from accelnode.kube import client as kube_client

    admin = Client(config(control_plane))
    path = f"/api/v1/namespaces/{kube_namespace}/configmaps"
    for i in range(6):
        admin.request("POST", path, body={**configmap(f"big-{i}"), "data": {"d": "x" * 300_000}})
    monkeypatch.setattr(kube_client, "KUBE_LIST_PAGE", decode.Budget(1 << 20, 1_000_000, decode.KUBE_DEPTH))
    c = Recording(config(control_plane))
    doc = c.list(path, query={"labelSelector": f"{LABEL}=yes"})
    assert names(doc["items"]) == [f"big-{i}" for i in range(6)]
    asked = [(q["limit"], "continue" in q) for _, _, q in c.asked]
    # the label selector filters after etcd's limit: the namespace's kube-root-ca.crt, once the
    # controller-manager has made it, takes a slot of a page and may cost one more page
    assert asked[:3] == [("500", False), ("3", False), ("3", True)] and set(asked[3:]) <= {("3", True)}, asked


def test_the_default_page_size_is_client_gos_and_bad_sizes_are_refused(control_plane):
    assert Client(config(control_plane)).page_size == 500
    for bad in (0, -1, 2.5, "5", True):
        with pytest.raises(ValueError, match="page_size"):
            Client(config(control_plane), page_size=bad)
    c = Client(config(control_plane))
    with pytest.raises(ValueError, match="page_size"):
        c.list("/api/v1/namespaces", page_size=0)
    with pytest.raises(ValueError, match="'limit' is not a query parameter of list()"):
        c.list("/api/v1/namespaces", query={"limit": "5"})


def test_the_reflector_lists_in_pages_then_watches_from_the_snapshot(control_plane, kube_namespace):
    admin = Client(config(control_plane))
    path = make_configmaps(admin, kube_namespace, 23)
    c = Recording(config(control_plane), page_size=5)
    r = Reflector(c, path, query={"labelSelector": f"{LABEL}=yes"})
    halt = run_reflector(r)
    try:
        assert eventually(r.synced.is_set), "the reflector never listed"
        assert names(r.snapshot()) == [f"cm-{i:02d}" for i in range(23)]
        lists = [q for _, _, q in c.asked if "watch" not in q]
        assert [q["limit"] for q in lists] == ["5"] * 5 and r.relists == 1
        admin.request("POST", path, body=configmap("zz-late"))
        assert eventually(lambda: "zz-late" in names(r.snapshot())), "the watch after the paged list missed a write"
    finally:
        assert halt(), "the reflector did not stop"


def test_a_change_the_trimmed_copy_does_not_keep_is_no_cue(control_plane, kube_namespace):
    """A MODIFIED event that leaves the trimmed copy as it was (here: data the trim drops) calls
    neither on_change nor on_event: every node's agent keeps only what it reads of a cache, and
    the controller's count writes must not make each of them recompute its status."""
    admin = Client(config(control_plane))
    path = make_configmaps(admin, kube_namespace, 1)
    changes, events = [], []
    r = Reflector(Client(config(control_plane)), path, trim=lambda o: {"metadata": {
        "name": o["metadata"]["name"], "namespace": o["metadata"]["namespace"],
        "labels": o["metadata"].get("labels") or {}}}, on_change=lambda: changes.append(1),
        on_event=lambda kind, obj: events.append(kind))
    halt = run_reflector(r)
    try:
        assert eventually(r.synced.is_set), "the reflector never listed"
        listed = len(changes)
        admin.request("PATCH", f"{path}/cm-00", body={"data": {"ignored": "1"}})
        admin.request("PATCH", f"{path}/cm-00", body={"metadata": {"labels": {"seen": "yes"}}})
        assert eventually(lambda: (r.get(kube_namespace, "cm-00") or {})["metadata"]["labels"].get("seen") == "yes")
        assert len(changes) == listed + 1 and events.count("MODIFIED") == 1, (changes, events)
    finally:
        assert halt(), "the reflector did not stop"


def test_watches_of_a_fleet_end_at_spread_times(control_plane, kube_namespace):
    """With ``watch_jitter`` each watch asks the server to end it after ``watch_seconds`` times 1
    to 1 + jitter (drawn per watch), so a fleet's watches opened at once do not re-open at once;
    the heartbeat's promise covers the longest."""
    admin = Client(config(control_plane))
    path = make_configmaps(admin, kube_namespace, 1)
    draws = iter([0.0, 0.5, 0.99] + [0.0] * 100)
    c = Recording(config(control_plane))
    r = Reflector(c, path, watch_seconds=2, watch_jitter=1.0, rand=lambda: next(draws))
    assert r.stall_after >= c.timeout + 4
    halt = run_reflector(r)
    try:
        assert eventually(lambda: len([q for _, _, q in c.asked if "watch" in q]) >= 3, timeout=30)
        assert [q["timeoutSeconds"] for _, _, q in c.asked if "watch" in q][:3] == ["2", "3", "4"]
    finally:
        assert halt(), "the reflector did not stop"
    with pytest.raises(ValueError, match="watch_jitter"):
        Reflector(c, path, watch_jitter=1.5)


@pytest.fixture(scope="module")
def snapshotless_plane(tmp_path_factory):
    """A control plane of its own whose watch cache keeps no list snapshots (a continue token is
    then read from etcd, which forgets what it compacted) and no Nodes (a watch of Nodes is then
    served by etcd, whose window ends where it compacted: a quiet object's revision falls out of
    it at once, where a watch cache's window takes minutes of other objects' churn)."""
    from tests.rigs.devcluster import ControlPlane

    for name in ("etcd", "kube-apiserver", "kube-controller-manager"):
        require((TOOLS_BIN / name).exists(), f"{name} in {TOOLS_BIN} (tools/mk/k8s.mk)")
    cp = ControlPlane(tmp_path_factory.mktemp("snapshotless"), TOOLS_BIN,
                      apiserver_args=("--feature-gates=ListFromCacheSnapshot=false",
                                                     "--watch-cache-sizes=nodes#0"))
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def compact_etcd(cp, revision: int) -> None:
    """etcd forgets every revision before ``revision`` (its JSON gateway; physical: done when it answers)."""
    req = urllib.request.Request(cp.etcd_url + "/v3/kv/compaction", method="POST",
                                 data=json.dumps({"revision": str(revision), "physical": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()


def test_an_expired_continue_token_restarts_the_list_in_one_request(snapshotless_plane):
    cp = snapshotless_plane
    admin = Client(config(cp))
    ns = f"t-{uuid.uuid4().hex[:8]}"
    admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
    path = make_configmaps(admin, ns, 12)
    c = Recording(config(cp), page_size=5)

    def compact_after_the_first_page(doc):
        if len(c.answers) == 1:
            late = admin.request("POST", path, body=configmap("zz-late"))
            compact_etcd(cp, int(late["metadata"]["resourceVersion"]))

    c.after_answer = compact_after_the_first_page
    doc = c.list(path, query={"labelSelector": f"{LABEL}=yes"})
    gone = c.errors
    assert len(gone) == 1 and is_gone(gone[0]) and "continue parameter is too old" in gone[0].message, gone
    assert [(q.get("limit"), "continue" in q) for _, _, q in c.asked] == [("5", False), ("5", True), (None, False)]
    # started over: a whole, newer list (the write made after the first page is in it)
    assert names(doc["items"]) == [f"cm-{i:02d}" for i in range(12)] + ["zz-late"]
    assert "continue" not in doc["metadata"]


def test_a_quiet_objects_watch_outlives_the_churn_of_others_without_reading_it_again(snapshotless_plane):
    """A reflector of one named object (GET, then watch) on an object that has not changed while
    others of its kind did, past the server's window (here: etcd compacted past it): one GET, then
    a watch that works and follows the object, not GET, watch, 410 Gone, GET ... for as long as the
    object stays quiet (every agent's own Node re-read every 15-30 s, docs/scale.md)."""
    from tests.rigs.hollow import node_object

    cp = snapshotless_plane
    admin = Client(config(cp))
    quiet, busy = (f"n-{uuid.uuid4().hex[:8]}" for _ in range(2))
    for name in (quiet, busy):
        admin.request("POST", "/api/v1/nodes", body=node_object(name))
    for i in range(20):
        last = admin.request("PATCH", f"/api/v1/nodes/{busy}", body={"metadata": {"labels": {"i": str(i)}}})
    compact_etcd(cp, int(last["metadata"]["resourceVersion"]))
    c = Recording(config(cp))
    changes = []
    r = Reflector(c, "/api/v1/nodes", name=quiet, watch_seconds=30, on_change=lambda: changes.append(1),
                  expired_backoff=Backoff(0.1, 0.2))
    halt = run_reflector(r)
    try:
        assert eventually(lambda: r.out_of_sync_for() == 0.0), "the watch never opened"
        admin.request("PATCH", f"/api/v1/nodes/{quiet}", body={"metadata": {"labels": {"seen": "yes"}}})
        assert eventually(lambda: (r.get(None, quiet) or {})["metadata"]["labels"].get("seen") == "yes"), \
            "the watch did not follow the object"
        gets = [p for m, p, q in c.asked if "watch" not in q]
        assert gets == [f"/api/v1/nodes/{quiet}"] and r.relists == 1 and r.expired == 0, (gets, r.expired)
        assert "resourceVersion" not in [q for _, _, q in c.asked if "watch" in q][0]  # from the most recent
        assert len(changes) == 2  # the GET, the label (the watch's replay of the object is no change)
    finally:
        assert halt(), "the reflector did not stop"


# -- 429 Too Many Requests -------------------------------------------------------------------------


class HoldingWebhook:
    """A validating admission webhook on 127.0.0.1 that holds each request until released: the
    create it validates keeps its API Priority and Fairness seat all that time."""

    def __init__(self, cert: tuple, ca: bytes):
        self.held = 0
        self.release = threading.Event()
        self._cond = threading.Condition()
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook._cond:
                    hook.held += 1
                    hook._cond.notify_all()
                hook.release.wait(25)
                body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                   "response": {"uid": review["request"]["uid"], "allowed": True}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*map(str, cert))
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}/hold"
        self.ca = ca
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def wait_held(self, n: int, thread: threading.Thread, timeout: float = 30) -> bool:
        """Until ``n`` requests are held (True) or ``thread`` ended without being held (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.held >= n or not thread.is_alive(), timeout) and self.held >= n

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class Throttled:
    """A ServiceAccount whose requests API Priority and Fairness sends to a priority level of
    its own: tiny concurrency, ``limitResponse: Reject`` (a full level answers 429 at once, with
    Retry-After). :meth:`saturate` fills the level with creates a webhook holds."""

    def __init__(self, cp, admin: Client, hook: HoldingWebhook):
        self.cp, self.admin, self.hook = cp, admin, hook
        self.ns = f"t-{uuid.uuid4().hex[:8]}"
        self.name = f"accelnode-test-{self.ns}"
        self.path = f"/api/v1/namespaces/{self.ns}/configmaps"
        self.holders: list[threading.Thread] = []
        admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": self.ns}})
        admin.request("POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts", body={"metadata": {"name": "throttled"}})
        rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{self.ns}"
        admin.request("POST", f"{rbac}/roles", body={"metadata": {"name": "configmaps"}, "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]}]})
        admin.request("POST", f"{rbac}/rolebindings", body={
            "metadata": {"name": "throttled"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmaps"},
            "subjects": [{"kind": "ServiceAccount", "name": "throttled", "namespace": self.ns}]})
        self.token = admin.request("POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts/throttled/token", body={
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600}})["status"]["token"]
        fc = "/apis/flowcontrol.apiserver.k8s.io/v1"
        self.level = admin.request("POST", f"{fc}/prioritylevelconfigurations", body={
            "metadata": {"name": self.name},
            "spec": {"type": "Limited", "limited": {
                "nominalConcurrencyShares": 1, "lendablePercent": 0, "borrowingLimitPercent": 0,
                "limitResponse": {"type": "Reject"}}}})
        admin.request("POST", f"{fc}/flowschemas", body={
            "metadata": {"name": self.name},
            "spec": {"priorityLevelConfiguration": {"name": self.name}, "matchingPrecedence": 90,
                     "distinguisherMethod": {"type": "ByUser"},
                     "rules": [{"subjects": [{"kind": "ServiceAccount",
                                              "serviceAccount": {"namespace": self.ns, "name": "throttled"}}],
                                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                   "namespaces": ["*"], "clusterScope": True}]}]}})
        admin.request("POST", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations", body={
            "metadata": {"name": self.name},
            "webhooks": [{"name": "hold.accelnode.test", "sideEffects": "None", "admissionReviewVersions": ["v1"],
                          "failurePolicy": "Ignore", "timeoutSeconds": 30,
                          "clientConfig": {"url": hook.url, "caBundle": base64.b64encode(hook.ca).decode()},
                          "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.ns}},
                          "objectSelector": {"matchLabels": {"accelnode.test/hold": "yes"}},
                          "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                                     "resources": ["configmaps"]}]}]})
        assert eventually(self._level_applies), "the ServiceAccount may not read, or API Priority and Fairness " \
                                                "never sent it to its level"

    def client(self, **kwargs) -> Client:
        return Client(Config(self.cp.url, str(self.cp.ca_file), token=self.token), **kwargs)

    def _level_applies(self) -> bool:
        """The ServiceAccount may list, and the API server classifies its requests into our
        level (APF names the level of each answer in a response header)."""
        http = urllib3.PoolManager(ssl_context=ssl.create_default_context(cafile=str(self.cp.ca_file)))
        resp = http.request("GET", self.cp.url + self.path, headers={"Authorization": "Bearer " + self.token})
        return resp.status == 200 and resp.headers.get("X-Kubernetes-PF-PriorityLevel-UID") == \
            self.level["metadata"]["uid"]

    def saturate(self) -> None:
        """Creates held by the webhook until the level answers a read with 429."""
        self.hook.release.clear()
        probe = self.client(throttle_retries=0)
        for i in range(40):
            try:
                probe.request("GET", self.path)
            except KubeError as e:
                if is_too_many_requests(e):
                    return
                raise
            before = self.hook.held
            holder = threading.Thread(target=self._hold, args=(f"held-{uuid.uuid4().hex[:8]}",), daemon=True)
            holder.start()
            if self.hook.wait_held(before + 1, holder):
                self.holders.append(holder)
        pytest.fail("40 held creates did not fill the priority level")

    def _hold(self, name: str) -> None:
        try:
            self.client(throttle_retries=0).request("POST", self.path, body=configmap(
                name, {"accelnode.test/hold": "yes"}))
        except KubeError:
            pass  # rejected: the level was full already

    def release(self) -> None:
        """The webhook answers; every held create finishes (their seats are free)."""
        self.hook.release.set()
        for t in self.holders:
            t.join(60)
        self.holders.clear()

    def close(self) -> None:
        self.release()
        fc = "/apis/flowcontrol.apiserver.k8s.io/v1"
        for path in (f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{self.name}",
                     f"{fc}/flowschemas/{self.name}", f"{fc}/prioritylevelconfigurations/{self.name}"):
            self.admin.request("DELETE", path)


@pytest.fixture(scope="module")
def throttled(control_plane):
    hook = HoldingWebhook(control_plane.serving_pair("holding-webhook"), control_plane.ca_file.read_bytes())
    t = None
    try:
        t = Throttled(control_plane, Client(config(control_plane)), hook)
        yield t
    finally:
        if t is not None:
            t.close()
        hook.close()


def test_a_429_with_retry_after_is_waited_out_then_retried(throttled):
    throttled.saturate()
    waits = []

    def sleep(seconds):  # the first wait is when the held creates finish: the retry finds room
        waits.append(seconds)
        throttled.release()
        threading.Event().wait(seconds)

    c = throttled.client(sleep=sleep)
    doc = c.request("GET", throttled.path)
    assert doc["kind"] == "ConfigMapList"
    assert waits and all(0 <= w <= c.retry_after_cap for w in waits)
    assert c.throttled == len(waits) and c.sent == len(waits) + 1


def test_a_429_past_the_retry_bound_or_the_timeout_is_a_clear_error(throttled):
    throttled.saturate()
    try:
        waits = []
        c = throttled.client(throttle_retries=2, retry_after_cap=0.5, sleep=waits.append)
        with pytest.raises(KubeError) as err:
            c.request("GET", throttled.path)
        assert is_too_many_requests(err.value) and "still throttled after 2 retries" in str(err.value), err.value
        assert err.value.reason == "TooManyRequests"  # APF answers plain text: the HTTP reason phrase
        assert waits == [0.5, 0.5] and c.sent == 3  # APF says Retry-After >= 1: each wait capped

        waits.clear()
        c = throttled.client(sleep=waits.append)  # a call bounded to less than the wait asked for
        with pytest.raises(KubeError) as err:
            c.request("GET", throttled.path, timeout=0.5)
        assert "past the call's timeout" in str(err.value) and waits == [] and c.sent == 1, err.value
    finally:
        throttled.release()


def test_a_429_without_retry_after_fails_at_once(control_plane, kube_namespace):
    """An eviction a PodDisruptionBudget forbids: 429, no Retry-After (nothing says when)."""
    admin = Client(config(control_plane))
    ns = kube_namespace
    pod = admin.request("POST", f"/api/v1/namespaces/{ns}/pods", body={
        "metadata": {"name": "kept", "labels": {"app": "kept"}},
        "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}]}})
    pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    admin.request("PUT", f"/api/v1/namespaces/{ns}/pods/kept/status", body=pod)
    admin.request("POST", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", body={
        "metadata": {"name": "kept"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "kept"}}}})

    def budget_settled() -> bool:
        pdb = admin.request("GET", f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/kept")
        st = pdb.get("status") or {}
        return st.get("observedGeneration") == pdb["metadata"]["generation"] and st.get("currentHealthy") == 1

    assert eventually(budget_settled), "the disruption controller never counted the pod"
    waits = []
    c = Client(config(control_plane), sleep=waits.append)
    with pytest.raises(KubeError) as err:
        c.request("POST", f"/api/v1/namespaces/{ns}/pods/kept/eviction", body={
            "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "kept", "namespace": ns}})
    assert is_too_many_requests(err.value) and "no Retry-After" in str(err.value), err.value
    assert "disruption budget" in err.value.message and waits == [] and c.sent == 1


def test_bad_throttle_settings_are_refused(control_plane):
    for kwargs in ({"throttle_retries": -1}, {"throttle_retries": 1.5}, {"retry_after_cap": -1},
                   {"retry_after_cap": "10"}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            Client(config(control_plane), **kwargs)


# -- 410 Gone, again and again ---------------------------------------------------------------------


def test_the_backoff_schedule_doubles_to_its_cap_with_jitter_and_resets():
    b = Backoff(0.8, 30.0, rand=lambda: 0.0)  # no jitter drawn: the bare schedule
    assert [b.next() for _ in range(8)] == [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]
    b.reset()
    assert b.next() == 0.8
    draws = iter([0.0, 0.5, 0.999])
    j = Backoff(1.0, 10.0, jitter=0.5, rand=lambda: next(draws))
    assert [j.next() for _ in range(3)] == [1.0, 1.5, pytest.approx(4 * (1 - 0.4995))]  # shortened, never longer
    many = Backoff(1.0, 5.0)  # real random draws: past the doubling, every delay within [cap/2, cap]
    assert all(2.5 <= d <= 5.0 for d in [many.next() for _ in range(200)][3:])
    for bad in ({"base": 0}, {"base": 2, "cap": 1}, {"factor": 0.5}, {"jitter": 1.0}):
        with pytest.raises(ValueError, match="backoff needs"):
            Backoff(**{"base": 0.8, "cap": 30.0, **bad})


class StaleLists(Reflector):
    """A reflector whose first ``stale`` lists hand the watch a resourceVersion the API server
    has long forgotten (as a list served by a lagging cache would): each watch gets a real 410."""

    def __init__(self, *args, stale: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.stale = stale

    def _list(self):
        super()._list()
        if self.stale:
            self.stale -= 1
            self.resource_version = "1"


@pytest.fixture(scope="module")
def widgets(control_plane):
    """A namespaced kind of our own, created now: its watch cache starts at a recent revision, so
    resourceVersion 1 is too old for it."""
    admin = Client(config(control_plane))
    group = f"g{uuid.uuid4().hex[:8]}.accelnode.test"
    admin.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body={
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {"group": group, "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}})
    def established() -> bool:
        crd = admin.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.{group}")
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (crd.get("status") or {}).get("conditions") or [])

    assert eventually(established), "the widgets CRD never became Established"
    assert eventually(lambda: _served(admin, custom_path(group, "v1", "widgets"))), "widgets never served"
    yield group
    admin.request("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.{group}")


def _served(admin: Client, path: str) -> bool:
    try:
        admin.request("GET", path)
        return True
    except KubeError as e:
        if is_not_found(e):
            return False
        raise


def test_the_reflector_backs_off_while_410s_follow_each_other(control_plane, widgets, kube_namespace):
    admin = Client(config(control_plane))
    waits = []

    def wait(stop, seconds):  # recorded, not waited out
        waits.append(seconds)
        return stop.is_set()

    r = StaleLists(Client(config(control_plane)), custom_path(widgets, "v1", "widgets"), stale=4, watch_seconds=2,
                   expired_backoff=Backoff(0.8, 30.0, rand=lambda: 0.5), wait=wait)
    halt = run_reflector(r)
    try:
        assert eventually(lambda: r.relists >= 5 and r.stale == 0), "the stale lists never ran out"
        # 410 #1 re-lists at once; #2, #3, #4 back off 0.8, 1.6, 3.2 (each shortened a quarter by the jitter)
        assert waits[:5] == [0.0, 0.0, pytest.approx(0.6), pytest.approx(1.2), pytest.approx(2.4)], waits
        assert r.expired == 4
        admin.request("POST", custom_path(widgets, "v1", "widgets", kube_namespace),
                      body={"apiVersion": f"{widgets}/v1", "kind": "Widget", "metadata": {"name": "w"}})
        assert eventually(lambda: "w" in names(r.snapshot())), "the watch from a fresh list saw nothing"
        assert eventually(lambda: r.expired == 0), "a watch that worked did not reset the 410 count"
        assert r.expired_backoff.steps == 0 and r.relists == 5
    finally:
        assert halt(), "the reflector did not stop"
