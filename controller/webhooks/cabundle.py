"""The ``caBundle`` of our webhook configurations, kept equal to the trust bundle (``ca.crt``) of
the self-managed webhook Secret (:mod:`controller.webhooks.certs`; docs/webhook-certificates.md).

A reconciler, so it runs on the leader only: one writer, and a replica whose copy of the Secret
lags never writes an older bundle over a newer one. It touches only webhooks whose
``clientConfig.service`` is our Service, leaves cert-manager's configurations alone, never
copies a ``ca.crt`` that is not a bundle of CA certificates, and writes only when a value
differs. Keys are ``mutating/<name>`` and ``validating/<name>`` (both kinds may use one name).
"""

from __future__ import annotations

import base64
import logging
import time

from accelnode.kube.client import Client, KubeError, Unreachable
from accelnode.log import kv

from controller.webhooks.certs import issuer_of, parse_bundle
from controller.runtime.reconciler import Reconciler, Result, Watch
from controller.runtime.writes import ReadYourWrites, update_if_changed

log = logging.getLogger("accelnode.controller.cabundle")

PART_OF = "app.kubernetes.io/part-of=accelnode"
CERT_MANAGER_ANNOTATION = "cert-manager.io/inject-ca-from"
KINDS = {
    "mutating": "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
    "validating": "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations",
}


def ours(hook: dict, service: str, namespace: str) -> bool:
    svc = (hook.get("clientConfig") or {}).get("service") or {}
    return svc.get("name") == service and svc.get("namespace") == namespace


def set_ca_bundle(config: dict, bundle_b64: str, service: str, namespace: str) -> None:
    """Set ``caBundle`` on every webhook of ``config`` (in place) that calls our Service."""
    for hook in config.get("webhooks") or []:
        if ours(hook, service, namespace):
            hook["clientConfig"]["caBundle"] = bundle_b64


class CABundleReconciler(Reconciler):
    name = "webhook-cabundle"

    def __init__(self, client: Client, *, secret_namespace: str, secret: str, service: str, service_namespace: str):
        self.client = client
        self.secret, self.service, self.service_namespace = secret, service, service_namespace
        self.secrets_path = f"/api/v1/namespaces/{secret_namespace}/secrets"
        self.secret_key = f"{secret_namespace}/{secret}"
        self.written = ReadYourWrites()
        self.watches = tuple(
            Watch(path, {"labelSelector": PART_OF}, keys=lambda obj, kind=kind: (f"{kind}/{obj['metadata']['name']}",))
            for kind, path in KINDS.items()) + (
            Watch(self.secrets_path, {"fieldSelector": f"metadata.name={secret}"}, keys=self._every_config,
                  trim=_ca_only),)

    def _every_config(self, _secret: dict) -> list[str]:
        return [f"{kind}/{obj['metadata']['name']}" for kind, path in KINDS.items() for obj in self.cache.list(path)]

    def bundle(self) -> str | None:
        """``ca.crt`` of the Secret, base64 as ``caBundle`` carries it; None while there is no
        Secret or its bundle is not one."""
        secret = self.cache.get(self.secrets_path, self.secret_key)
        encoded = ((secret or {}).get("data") or {}).get("ca.crt")
        if not encoded:
            return None
        try:
            parse_bundle(base64.b64decode(encoded))
        except ValueError as e:
            log.warning("the webhook Secret's ca.crt is not a CA bundle; not copying it",
                        extra=kv(secret=self.secret_key, error=str(e)))
            return None
        return encoded

    def reconcile(self, key: str) -> Result | None:
        kind, _, name = key.partition("/")
        path = KINDS[kind]
        obj = self.written.current(key, self.cache.get(path, name))
        if obj is None:
            self.written.forget(key)
            return None
        if CERT_MANAGER_ANNOTATION in ((obj.get("metadata") or {}).get("annotations") or {}):
            return None
        bundle = self.bundle()
        if bundle is None:
            return None  # the Secret's arrival re-queues every configuration
        written = update_if_changed(self.client, f"{path}/{name}", obj,
                                    lambda o: set_ca_bundle(o, bundle, self.service, self.service_namespace))
        if written is not None:
            self.written.remember(key, obj, written)
            log.info("caBundle written",
                     extra=kv(configuration=key, service=f"{self.service_namespace}/{self.service}"))
        return None


def _ca_only(secret: dict) -> dict:
    """What the reconciler keeps of the Secret: its name and the public bundle, never the keys."""
    md = secret.get("metadata") or {}
    return {"metadata": {k: md.get(k) for k in ("name", "namespace", "resourceVersion")},
            "data": {"ca.crt": (secret.get("data") or {}).get("ca.crt")}}


class TrustGate:
    """Readiness of a replica until the webhook configurations trust the certificate it serves.

    Every webhook of ours (labelled ``part-of=accelnode``, calling our Service, not left to
    cert-manager) must carry a ``caBundle`` holding the CA that signed ``served()``. Without this a
    fresh install is Ready (and ``helm install --wait`` returns) while every admission call still
    fails TLS: the leader writes ``caBundle`` only once it holds the Lease, which after a reinstall
    means after the previous leader's Lease expired. Once a serving certificate is trusted the
    answer is kept for it (readiness probes then read nothing); a new certificate is checked again.
    No configuration of ours at all is no reason to wait (and is not kept: checked again at most
    every ``recheck`` seconds)."""

    def __init__(self, client: Client, served, *, service: str, service_namespace: str, recheck: float = 30.0,
                 clock=time.monotonic):
        self.client, self.served = client, served  # served(): the x509 certificate served now, or None
        self.service, self.service_namespace, self.recheck = service, service_namespace, recheck
        self.clock = clock
        self._trusted_serial: int | None = None
        self._vacuous_until = 0.0

    def check(self) -> str:
        """"" when ready, else why not."""
        cert = self.served()
        if cert is None:
            return ""  # the certificate check of readiness says so
        if cert.serial_number == self._trusted_serial or self.clock() < self._vacuous_until:
            return ""
        try:
            configs = [(kind, obj) for kind, path in KINDS.items()
                       for obj in self.client.list(path, query={"labelSelector": PART_OF}, timeout=3.0)["items"]]
        except (KubeError, Unreachable, OSError) as e:
            return f"cannot read the webhook configurations: {e}"
        untrusted, seen = [], 0
        for kind, obj in configs:
            if CERT_MANAGER_ANNOTATION in ((obj.get("metadata") or {}).get("annotations") or {}):
                continue
            for hook in obj.get("webhooks") or []:
                if not ours(hook, self.service, self.service_namespace):
                    continue
                seen += 1
                if not _bundle_trusts((hook.get("clientConfig") or {}).get("caBundle"), cert):
                    untrusted.append(f"{kind}/{obj['metadata']['name']}")
        if untrusted:
            return (f"the caBundle of {', '.join(sorted(set(untrusted)))} does not trust the served certificate yet "
                    "(the leader writes it)")
        if seen:
            self._trusted_serial = cert.serial_number
        else:
            self._vacuous_until = self.clock() + self.recheck
        return ""


def _bundle_trusts(bundle_b64, cert) -> bool:
    if not isinstance(bundle_b64, str) or not bundle_b64:
        return False
    try:
        cas = parse_bundle(base64.b64decode(bundle_b64, validate=True))
    except ValueError:
        return False
    return issuer_of(cert, cas) is not None
