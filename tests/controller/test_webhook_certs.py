"""Self-managed webhook certificates against the real kube-apiserver (docs/webhook-certificates.md).

Real peers on loopback: the session's kube-apiserver, real ``accelnode controller`` processes
as the controller identity with daemonsets/rbac-controller*.yaml applied, and
daemonsets/webhooks-gkm.yaml as shipped but for ``clientConfig.service``: its name is this
module's Service and its port the controllers' listening port. The Service is an ExternalName
Service naming 127.0.0.1, which the API server's service resolver dials (there is no
kube-proxy here); the API server verifies our certificate for ``<service>.<namespace>.svc``
against the ``caBundle`` the controller wrote, exactly as in a cluster. A dry-run create of a
digest-pinned GKMCache that comes back pinned proves both webhooks were called over verified
TLS (the mutating one is failurePolicy Ignore: an unverified call would admit it unpinned; the
validating one is Fail).

Tests run top to bottom on one module world (the Secret and the configurations' names are
the ones RBAC names, so they are shared and cleaned up around the module)."""

from __future__ import annotations

import base64
import copy
import os
import socket
import ssl
import stat
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from kubernetes import client
from prometheus_client import CollectorRegistry

from accelnode import exitcodes
from accelnode.kube.client import Client, Config, KubeError, is_not_found
from accelnode.oci.registry import RegistryOptions
from controller.webhooks.server import AdmissionServer
from controller.webhooks.cabundle import CABundleReconciler
from controller.caches.webhooks import ControllerIdentity
from controller.caches.webhooks import routes as cache_routes
from controller.webhooks.certs import Policy, ServingCerts, parse_bundle, plan, service_names
from controller.runtime.runner import Controller, Metrics
from controller.caches.pinning import DIGEST_ANNOTATION, Resolver
from tests.agent.conftest import eventually
from tests.conftest import ROOT, accelnode_cmd, http_get
from tests.controller.conftest import NAMESPACE, ControllerProc, lease_spec
from tests.csi.conftest import free_ports

SECRET = "accelnode-controller-webhook-tls"
SECRET_PATH = f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}"
CONFIG = "accelnode-gkm-caches"  # the name daemonsets/webhooks-gkm.yaml ships and RBAC allows updating
ENV_CONFIG = "accelnode-tpu-env"  # daemonsets/webhooks-tpu-env.yaml's
WAIT = 60  # seconds: a bound on starts, elections and propagation, never a measurement
FAST = ("--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "1", "--resync", "2")


class World:
    def __init__(self, kube_api, control_plane, tmp: Path):
        api = kube_api("admin")
        self.core, self.objs = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.reg = client.AdmissionregistrationV1Api(api)
        self.admin = Client(Config.from_kubeconfig(control_plane.kubeconfig("admin")))
        self.cp, self.tmp = control_plane, tmp
        self.run = uuid.uuid4().hex[:8]
        self.service = f"certs-{self.run}"
        self.ns = f"certs-{self.run}"
        self.ports: list[int] = []
        self.procs: list[ControllerProc] = []
        self.image = ""  # the probe GKMCache's image (set by the fixture: a digest the registry holds)

    # -- objects -------------------------------------------------------------------------------

    def shipped(self, port: int) -> list[dict]:
        """Our webhook configurations as shipped (the caches' two, then the TPU env one)."""
        docs = [d for f in ("webhooks-gkm.yaml", "webhooks-tpu-env.yaml")
                for d in yaml.safe_load_all((ROOT / "daemonsets" / f).read_text())]
        for doc in docs:
            for hook in doc["webhooks"]:
                hook["clientConfig"]["service"].update(name=self.service, namespace=NAMESPACE, port=port)
        return docs

    def create_configs(self, docs: list[dict]) -> None:
        for doc in docs:
            if doc["kind"] == "MutatingWebhookConfiguration":
                self.reg.create_mutating_webhook_configuration(body=doc)
            else:
                self.reg.create_validating_webhook_configuration(body=doc)

    def config(self, kind: str, name: str = CONFIG) -> dict:
        return self.admin.request("GET", f"/apis/admissionregistration.k8s.io/v1/{kind}webhookconfigurations/{name}")

    def bundles(self) -> dict[str, str | None]:
        """caBundle of every webhook of our three configurations, by webhook name."""
        out = {}
        for kind, name in (("mutating", CONFIG), ("validating", CONFIG), ("mutating", ENV_CONFIG)):
            for hook in self.config(kind, name)["webhooks"]:
                out[hook["name"]] = hook["clientConfig"].get("caBundle")
        return out

    def secret(self) -> dict | None:
        try:
            return self.admin.request("GET", SECRET_PATH)
        except KubeError as e:
            if is_not_found(e):
                return None
            raise

    def ca_b64(self) -> str | None:
        s = self.secret()
        return s["data"]["ca.crt"] if s else None

    def filled(self) -> bool:
        """Every webhook calling our Service carries the Secret's CA bundle."""
        want = self.ca_b64()
        ours = {k: v for k, v in self.bundles().items() if k != "foreign.certs.test.accelnode.io"}
        return want is not None and set(ours.values()) == {want}

    def delete_everything(self) -> None:
        for delete in (lambda: self.reg.delete_mutating_webhook_configuration(CONFIG),
                       lambda: self.reg.delete_validating_webhook_configuration(CONFIG),
                       lambda: self.reg.delete_mutating_webhook_configuration(ENV_CONFIG),
                       lambda: self.reg.delete_mutating_webhook_configuration(f"certs-foreign-{self.run}"),
                       lambda: self.core.delete_namespaced_secret(SECRET, NAMESPACE)):
            try:
                delete()
            except client.ApiException as e:
                assert e.status == 404, e

    # -- the webhooks, as the API server calls them ------------------------------------------------

    def webhooks_called(self) -> bool:
        return self.call() == ""

    def env_injected(self) -> str:
        """A dry-run create of an opted-in StatefulSet: its template's TPU_WORKER_HOSTNAMES, as
        the TPU env webhook set it through the API server ("" when it was not called)."""
        label = {"gke-tpu-env-injector.aaronbatilo.dev/inject": "enabled"}
        body = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web", "labels": label},
                "spec": {"replicas": 2, "serviceName": "nginx", "selector": {"matchLabels": {"app": "web"}},
                         "template": {"metadata": {"labels": {"app": "web", **label}},
                                      "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause"}]}}}}
        try:
            out = client.AppsV1Api(self.core.api_client).create_namespaced_stateful_set(self.ns, body, dry_run="All")
        except client.ApiException:
            return ""
        env = out.spec.template.spec.containers[0].env or []
        return next((e.value for e in env if e.name == "TPU_WORKER_HOSTNAMES"), "")

    def call(self) -> str:
        """A dry-run create of a GKMCache: "" when it came back pinned, else what went wrong."""
        body = {"apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {"name": "probe"},
                "spec": {"image": self.image}}
        try:
            out = self.objs.create_namespaced_custom_object("gkm.io", "v1alpha1", self.ns, "gkmcaches", body,
                                                            dry_run="All")
        except client.ApiException as e:
            return f"{e.status}: {e.body}"
        if (out["metadata"].get("annotations") or {}).get(DIGEST_ANNOTATION) != self.image.rsplit("@", 1)[1]:
            return f"admitted unpinned (the mutating webhook was not reached): {out['metadata']}"
        return ""

    # -- controllers -----------------------------------------------------------------------------

    def start(self, identity: str, port: int, *extra: str) -> ControllerProc:
        c = ControllerProc(self.cp, self.tmp, identity, *FAST, "--plain-http", "--webhook-address", f"127.0.0.1:{port}",
                           "--webhook-service", self.service, "--webhook-service-namespace", NAMESPACE,
                           *extra).start()
        self.procs.append(c)
        return c

    def stop_all(self) -> None:
        for c in self.procs:
            c.stop()
        self.procs.clear()


def served(port: int, cafile_pem: bytes, name: str) -> x509.Certificate:
    """The certificate served on ``port``, verified for ``name`` against ``cafile_pem``."""
    ctx = ssl.create_default_context(cadata=cafile_pem.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=name) as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


def secret_data(w: World, key: str) -> bytes:
    return base64.b64decode(w.secret()["data"][key])


@pytest.fixture(scope="module")
def world(kube_api, kubectl, control_plane, crds, registry, tmp_path_factory):
    rbac = [a for f in sorted((ROOT / "daemonsets").glob("rbac-controller*.yaml")) for a in ("-f", str(f))]
    out = kubectl("admin", "apply", "-f", str(ROOT / "daemonsets/namespace.yaml"), *rbac)
    assert out.returncode == 0, out.stderr
    w = World(kube_api, control_plane, tmp_path_factory.mktemp("webhook-certs"))
    w.delete_everything()  # what an earlier run may have left
    w.image = registry.push_raw("certs/probe", "v1")  # the probe's digest: one the registry holds, pinned at admission
    w.core.create_namespace(body={"metadata": {"name": w.ns}})
    # the API server dials an ExternalName Service's name and the webhook's port
    w.core.create_namespaced_service(NAMESPACE, body={
        "metadata": {"name": w.service}, "spec": {"type": "ExternalName", "externalName": "127.0.0.1"}})
    w.ports = free_ports(2)
    docs = w.shipped(w.ports[0])
    # foreign webhooks: one in our labelled configuration calling another Service, and an
    # unlabelled configuration calling ours; neither is the controller's to fill
    foreign = copy.deepcopy(docs[1]["webhooks"][0])
    foreign.update(name="foreign.certs.test.accelnode.io", failurePolicy="Ignore",
                   objectSelector={"matchLabels": {"certs.test.accelnode.io/never": "x"}})
    foreign["clientConfig"] = {"service": {"namespace": NAMESPACE, "name": "someone-else", "port": 443},
                               "caBundle": base64.b64encode(b"not ours").decode()}
    docs[1]["webhooks"].append(foreign)
    w.create_configs(docs)
    unlabelled = copy.deepcopy(docs[0])
    unlabelled["metadata"] = {"name": f"certs-foreign-{w.run}"}
    for hook in unlabelled["webhooks"]:
        hook["objectSelector"] = {"matchLabels": {"certs.test.accelnode.io/never": "x"}}
    w.reg.create_mutating_webhook_configuration(body=unlabelled)
    try:
        yield w
    finally:
        w.stop_all()
        w.delete_everything()
        w.core.delete_namespaced_service(w.service, NAMESPACE)
        w.core.delete_namespace(w.ns)


def test_two_replicas_race_to_one_secret_and_the_api_server_calls_them(world):
    w = world
    a = w.start("certs-a", w.ports[0])
    b = w.start("certs-b", w.ports[1])
    assert eventually(w.secret, timeout=WAIT), f"no Secret:\n{a.log()}\n{b.log()}"
    secret = w.secret()
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt", "ca.key"}
    assert secret["metadata"]["labels"]["app.kubernetes.io/part-of"] == "accelnode"
    created = [r for c in (a, b) for r in c.records() if r.get("msg") == "webhook Secret created"]
    assert len(created) == 1, created  # one replica made it; the other read it after its 409
    # both replicas serve the one serving certificate of the Secret, verified for the Service name
    ca = secret_data(w, "ca.crt")
    want = x509.load_pem_x509_certificate(secret_data(w, "tls.crt")).serial_number
    name = f"{w.service}.{NAMESPACE}.svc"
    for port in w.ports:
        assert eventually(lambda p=port: _serial(p, ca, name) == want, timeout=WAIT), (a.log(), b.log())
    expiry = x509.load_pem_x509_certificate(secret_data(w, "tls.crt")).not_valid_after_utc.timestamp()
    for c in (a, b):
        assert eventually(lambda c=c: http_get(c.metrics_port, "/readyz")[0] == 200, timeout=WAIT), c.log()
        assert metric(c, "accelnode_controller_webhook_cert_expiry_timestamp_seconds") == expiry
    assert eventually(w.filled, timeout=WAIT), f"caBundle not written:\n{a.log()}\n{b.log()}"
    assert eventually(w.webhooks_called, timeout=WAIT), "the API server did not call the webhooks"
    assert eventually(w.env_injected, timeout=WAIT) == "web-0.nginx,web-1.nginx"  # the TPU env webhooks too
    assert w.bundles()["foreign.certs.test.accelnode.io"] == base64.b64encode(b"not ours").decode()
    foreign = w.config("mutating", f"certs-foreign-{w.run}")
    assert all("caBundle" not in h["clientConfig"] for h in foreign["webhooks"])


class Caller:
    """The API server calls our webhooks all along (a dry-run create every 0.1 s); ``failures``
    are the calls that did not come back pinned (time and why)."""

    def __init__(self, w: World):
        self.w, self.calls, self.failures = w, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.calls += 1
            wrong = self.w.call()
            if wrong:
                self.failures.append(f"{time.strftime('%X')} {wrong}")


def metric(c: ControllerProc, name: str) -> float | None:
    for line in http_get(c.metrics_port, "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _serial(port: int, ca: bytes, name: str) -> int | None:
    try:
        return served(port, ca, name).serial_number
    except (OSError, ssl.SSLError):
        return None


def test_steady_state_writes_nothing(world):
    w = world
    assert w.filled() and w.secret() is not None

    def versions():
        return (w.secret()["metadata"]["resourceVersion"], w.config("mutating")["metadata"]["resourceVersion"],
                w.config("validating")["metadata"]["resourceVersion"],
                w.config("mutating", f"certs-foreign-{w.run}")["metadata"]["resourceVersion"])

    before = versions()
    time.sleep(6)  # three resyncs of the leader (--resync 2), a cert check of each replica at start
    assert versions() == before
    assert w.webhooks_called()


def test_a_reverted_ca_bundle_is_written_again_and_a_new_configuration_filled(world):
    w = world
    cfg = w.config("mutating")
    for hook in cfg["webhooks"]:
        hook["clientConfig"]["caBundle"] = base64.b64encode(b"reverted").decode()
    w.admin.request("PUT", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{CONFIG}", body=cfg)
    assert eventually(w.filled, timeout=WAIT)
    # a configuration that appears (here: deleted and made again as shipped, no caBundle)
    foreign_bundle = w.bundles()["foreign.certs.test.accelnode.io"]
    validating = w.config("validating")
    w.reg.delete_validating_webhook_configuration(CONFIG)
    for hook in validating["webhooks"]:
        if hook["name"] != "foreign.certs.test.accelnode.io":
            hook["clientConfig"].pop("caBundle")
    validating["metadata"] = {"name": CONFIG, "labels": validating["metadata"]["labels"]}
    w.reg.create_validating_webhook_configuration(body=validating)
    assert eventually(w.filled, timeout=WAIT)
    assert w.bundles()["foreign.certs.test.accelnode.io"] == foreign_bundle
    assert eventually(w.webhooks_called, timeout=WAIT)


def test_a_configuration_cert_manager_fills_is_left_to_it(world):
    w = world
    path = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{CONFIG}"
    cfg = w.config("mutating")
    cfg["metadata"].setdefault("annotations", {})["cert-manager.io/inject-ca-from"] = f"{NAMESPACE}/some-ca"
    for hook in cfg["webhooks"]:
        hook["clientConfig"]["caBundle"] = base64.b64encode(b"cert-manager's").decode()
    rv = w.admin.request("PUT", path, body=cfg)["metadata"]["resourceVersion"]
    time.sleep(5)  # two resyncs of the leader (--resync 2)
    assert w.config("mutating")["metadata"]["resourceVersion"] == rv
    cfg = w.config("mutating")
    del cfg["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    w.admin.request("PUT", path, body=cfg)
    assert eventually(w.filled, timeout=WAIT)


def test_renewal_and_ca_rotation_are_served_without_a_restart_or_a_failed_call(world):
    """30 s serving certificates (renewed 20 s in), a 90 s CA (renewed 60 s in, signing 5 s
    later): the API server calls the webhooks every 0.1 s all along and not one call fails."""
    w = world
    w.stop_all()
    w.core.delete_namespaced_secret(SECRET, NAMESPACE)
    a = w.start("certs-short-a", w.ports[0], "--cert-lifetime", "30s", "--ca-lifetime", "90s")
    b = w.start("certs-short-b", w.ports[1], "--cert-lifetime", "30s", "--ca-lifetime", "90s")
    assert eventually(lambda: w.secret() is not None and w.filled(), timeout=WAIT), (a.log(), b.log())
    ca, name = secret_data(w, "ca.crt"), f"{w.service}.{NAMESPACE}.svc"
    for port in w.ports:  # both replicas serve the Secret's certificate
        assert eventually(lambda p=port: _serial(p, ca, name) == _current(w), timeout=WAIT), (a.log(), b.log())
    assert eventually(w.webhooks_called, timeout=WAIT)
    caller = Caller(w)
    caller.start()
    try:
        first = _current(w)
        assert eventually(lambda: _current(w) != first, timeout=WAIT), (a.log(), b.log())
        assert secret_data(w, "ca.crt") == ca  # the CA renews only 60 s in
        for port in w.ports:  # a renewed certificate served by the same processes
            assert eventually(lambda p=port: _serial(p, ca, name) not in (None, first), timeout=WAIT)
        # the CA's renewal: the new CA joins the old in caBundle, then signs
        assert eventually(lambda: len(parse_bundle(secret_data(w, "ca.crt"))) == 2, timeout=90), (a.log(), b.log())
        ca2, ca1 = parse_bundle(secret_data(w, "ca.crt"))
        assert ca1.public_bytes(Encoding.PEM) == ca
        assert eventually(w.filled, timeout=WAIT)
        new_ca = ca2.public_bytes(Encoding.PEM)
        for port in w.ports:  # both replicas end up serving a certificate of the new CA
            assert eventually(lambda p=port: _serial(p, new_ca, name) is not None, timeout=WAIT), (a.log(), b.log())
        seen = caller.calls
        assert eventually(lambda: caller.calls >= seen + 10, timeout=WAIT)  # calls answered with the new CA
    finally:
        caller.stop()
    assert caller.failures == [], (caller.failures, a.log(), b.log())
    assert a.proc.poll() is None and b.proc.poll() is None  # the same processes: no restart
    renewals = [r for c in (a, b) for r in c.records() if r.get("msg") == "webhook Secret renewed"]
    assert {"the serving certificate is due for renewal", "the CA is due for renewal"} <= {
        reason for r in renewals for reason in r["reasons"]}
    w.stop_all()


def _hold_lease(w: World, holder: str, seconds: int) -> None:
    """The controllers' Lease as another candidate would hold it (``holder`` "" lets it go)."""
    from accelnode.kube.client import is_conflict
    from tests.controller.conftest import LEASE_PATH

    for _ in range(10):
        lease = w.admin.request("GET", LEASE_PATH)
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        lease["spec"] = {**lease.get("spec", {}), "holderIdentity": holder, "leaseDurationSeconds": seconds,
                         "acquireTime": now, "renewTime": now}
        try:
            w.admin.request("PUT", LEASE_PATH, body=lease)
            return
        except KubeError as e:
            if not is_conflict(e):
                raise


def test_a_replica_is_not_ready_until_the_webhook_configurations_trust_it(world):
    """A reinstall: the configurations come back without caBundle while the old leader's Lease
    has not expired. Every replica serves its certificate, but the API server cannot call it:
    /readyz says so (helm install --wait must not return yet), and turns 200 once the replica
    leads and has written caBundle."""
    w = world
    w.stop_all()
    w.core.delete_namespaced_secret(SECRET, NAMESPACE)  # the short-lived one of the test above
    _hold_lease(w, "the-previous-install", 3600)
    for kind in ("mutating", "validating"):
        cfg = w.config(kind)
        for hook in cfg["webhooks"]:
            if hook["clientConfig"]["service"]["name"] == w.service:
                hook["clientConfig"].pop("caBundle", None)
        w.admin.request("PUT", f"/apis/admissionregistration.k8s.io/v1/{kind}webhookconfigurations/{CONFIG}",
                        body=cfg)
    c = w.start("certs-late", w.ports[0])
    try:
        assert eventually(lambda: w.secret() and _serial(w.ports[0], secret_data(w, "ca.crt"),
                                                         f"{w.service}.{NAMESPACE}.svc"),
                          timeout=WAIT), c.log()  # it serves its certificate...
        assert eventually(lambda: "does not trust" in http_get(c.metrics_port, "/readyz")[1], timeout=WAIT), (
            http_get(c.metrics_port, "/readyz"), lease_spec(w.admin),
            [ln for ln in c.log().splitlines() if "lease" in ln.lower() or "caBundle" in ln])
        status, body = http_get(c.metrics_port, "/readyz")
        assert status == 503 and "does not trust the served certificate yet" in body, (status, body)
        assert f"mutating/{CONFIG}" in body and f"validating/{CONFIG}" in body, body
        assert not w.webhooks_called()  # ... and the API server cannot call it: not Ready is the truth
        _hold_lease(w, "", 1)  # the old Lease expires
        assert eventually(w.filled, timeout=WAIT), c.log()
        assert eventually(lambda: http_get(c.metrics_port, "/readyz")[0] == 200, timeout=WAIT), c.log()
        assert eventually(w.webhooks_called, timeout=WAIT)
    finally:
        w.stop_all()


def _current(w: World) -> int:
    return x509.load_pem_x509_certificate(secret_data(w, "tls.crt")).serial_number


def test_ca_rotation_keeps_the_old_and_new_ca_trusted_and_no_call_fails(world, control_plane, tmp_path):
    """In process, with a clock the test moves (never more than BACKDATE ahead of the real one,
    so every certificate is valid in real time too): the cert loop, the leader's caBundle
    reconciler and the admission server of the controller, the real API server calling it."""
    w = world
    w.stop_all()
    w.core.delete_namespaced_secret(SECRET, NAMESPACE)
    me = Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")))
    t0 = time.time()
    offset = [0.0]
    certs = ServingCerts(me, NAMESPACE, SECRET, service_names(w.service, NAMESPACE),
                         policy=Policy(ca_lifetime=180.0, cert_lifetime=60.0), directory=str(tmp_path),
                         clock=lambda: time.time() + offset[0])
    reconciler = CABundleReconciler(me, secret_namespace=NAMESPACE, secret=SECRET, service=w.service,
                                    service_namespace=NAMESPACE)
    leader = Controller(me, reconciler, Metrics(CollectorRegistry()), workers=1, resync=300)
    certs.sync()
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(certs.key_file).st_mode) == 0o600
    resolver = Resolver(RegistryOptions(anonymous=True, plain_http=True))  # the probe's image is in the registry
    server = AdmissionServer(f"127.0.0.1:{w.ports[0]}", certs.cert_file, certs.key_file,
                             cache_routes(resolver, ControllerIdentity.of(me))).start()
    leader.start()
    caller = Caller(w)
    try:
        assert eventually(w.filled, timeout=WAIT) and eventually(w.webhooks_called, timeout=WAIT)
        caller.start()
        (ca1,) = parse_bundle(secret_data(w, "ca.crt"))

        def at(seconds: float) -> None:
            offset[0] = t0 + seconds - time.time()
            certs.sync()

        first = certs.serial
        at(75)  # a renewal by the same CA (due at 40 s), due again at 115 s
        leaf1 = certs.serial
        assert leaf1 != first and parse_bundle(secret_data(w, "ca.crt")) == [ca1]
        at(121)  # the CA is due (2/3 of 180 s); the serving certificate too, but the new CA is young
        ca2, old = parse_bundle(secret_data(w, "ca.crt"))
        assert old == ca1 and ca2 != ca1 and certs.serial == leaf1
        assert eventually(w.filled, timeout=WAIT)  # caBundle: new and old
        time.sleep(1)  # the grace (10 s of the test clock) stands for the time caBundle takes to spread
        at(126)  # still in the grace: the serving certificate waits
        assert certs.serial == leaf1
        at(132)
        assert certs.serial != leaf1
        name = f"{w.service}.{NAMESPACE}.svc"
        new_ca_pem = ca2.public_bytes(Encoding.PEM)  # the new serving certificate verifies with the new CA alone
        assert eventually(lambda: _serial(w.ports[0], new_ca_pem, name) == certs.serial, timeout=WAIT)
        assert parse_bundle(base64.b64decode(w.bundles()["vgkmcache.accelnode.gkm.io"])) == [ca2, ca1]
        time.sleep(1)
        at(181)  # the old CA expired (test clock): it leaves the bundle
        assert parse_bundle(secret_data(w, "ca.crt")) == [ca2]
        assert eventually(w.filled, timeout=WAIT)
        time.sleep(1)
    finally:
        caller.stop()
        leader.stop(5)
        server.stop()
    assert caller.calls > 10 and caller.failures == []


def test_external_certificates_make_the_controller_write_nothing(world, tmp_path):
    """--tls-cert-file/--tls-key-file (cert-manager's Secret in a cluster): no Secret of ours,
    no caBundle written; caBundle filled as cert-manager's injector would, the API server calls us."""
    w = world
    w.stop_all()
    w.core.delete_namespaced_secret(SECRET, NAMESPACE)
    data = plan(None, service_names(w.service, NAMESPACE), Policy(), time.time()).data
    (tmp_path / "tls.crt").write_bytes(data["tls.crt"])
    (tmp_path / "tls.key").write_bytes(data["tls.key"])
    for kind in ("mutating", "validating"):
        cfg = w.config(kind)
        for hook in cfg["webhooks"]:
            if hook["clientConfig"]["service"]["name"] == w.service:
                hook["clientConfig"]["caBundle"] = base64.b64encode(data["ca.crt"]).decode()
        w.admin.request("PUT", f"/apis/admissionregistration.k8s.io/v1/{kind}webhookconfigurations/{CONFIG}",
                        body=cfg)
    before = {k: w.config(k)["metadata"]["resourceVersion"] for k in ("mutating", "validating")}
    c = w.start("certs-external", w.ports[0], "--tls-cert-file", str(tmp_path / "tls.crt"),
                "--tls-key-file", str(tmp_path / "tls.key"))
    assert eventually(lambda: lease_spec(w.admin).get("holderIdentity") == "certs-external", timeout=WAIT), c.log()
    assert eventually(w.webhooks_called, timeout=WAIT), c.log()
    time.sleep(3)  # a leader's resyncs (--resync 2)
    assert w.secret() is None
    assert {k: w.config(k)["metadata"]["resourceVersion"] for k in ("mutating", "validating")} == before
    w.stop_all()


@pytest.mark.parametrize("args, message", [
    (("--disable-webhooks", "--tls-cert-file", "c", "--tls-key-file", "k"), "--disable-webhooks serves no webhook"),
    (("--tls-cert-file", "c"), "--tls-cert-file and --tls-key-file go together"),
    (("--cert-lifetime", "100d", "--ca-lifetime", "200d"), "must be at most a third of the CA's"),
    (("--cert-lifetime", "1y"), "'1y' is not a duration such as 30s, 15m, 8760h or 3650d"),
])
def test_certificate_flags_that_cannot_work_are_usage_errors(args, message):
    out = subprocess.run(accelnode_cmd() + ["controller", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == exitcodes.USAGE and message in out.stderr, out.stderr


def test_a_webhook_address_that_is_taken_ends_the_controller(controllers, controller_rbac, tmp_path):
    data = plan(None, service_names("accelnode-controller", NAMESPACE), Policy(), time.time()).data
    (tmp_path / "tls.crt").write_bytes(data["tls.crt"])
    (tmp_path / "tls.key").write_bytes(data["tls.key"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        c = controllers("certs-taken", *FAST, "--webhook-address", f"127.0.0.1:{taken.getsockname()[1]}",
                        "--tls-cert-file", str(tmp_path / "tls.crt"), "--tls-key-file", str(tmp_path / "tls.key"))
        assert c.wait(WAIT) == exitcodes.FAILURE
    assert "cannot serve the admission webhooks" in c.log()
