"""A namespace's registry pull secrets, found as kubelet finds a pod's: the ``imagePullSecrets`` of
the namespace's ``default`` ServiceAccount (GKM's cache kinds have no pull-secret field of their
own), each a ``kubernetes.io/dockerconfigjson`` or ``kubernetes.io/dockercfg`` Secret of that
namespace (docs/security.md).

Reading them takes ``get`` on that ServiceAccount and on those Secrets, which no accelnode
identity holds by default: a namespace lends them with a Role of its own that names the
ServiceAccount ``default`` and each pull secret (``resourceNames``: never the namespace's other
Secrets), bound to the agent and the controller (:func:`lending` writes the pair).
A namespace that lends nothing (its ServiceAccount may not be read) has no pull secrets: its
caches are pulled anonymously, and :attr:`PullSecrets.why` says how to lend them; a secret the
ServiceAccount names but that may not be read is an error. Nothing is ever pulled with anyone
else's credentials instead. Answers are kept ``ttl`` seconds per namespace; content never
reaches a log or a message.
"""

from __future__ import annotations

import base64
import binascii
import threading
import time
from dataclasses import dataclass

from accelnode.log import secret_digest
from .client import Client, KubeError, Unreachable, is_forbidden, is_not_found

SECRET_TYPES = {"kubernetes.io/dockerconfigjson": ".dockerconfigjson", "kubernetes.io/dockercfg": ".dockercfg"}
LENDING = "accelnode-pull-secrets"  # the Role and RoleBinding a namespace lends its pull secrets with
AGENT = ("accelnode-system", "accelnode-agent")
CONTROLLER = ("accelnode-system", "accelnode-controller")


def lending(namespace: str, secrets: list[str], subjects=(AGENT, CONTROLLER)) -> list[dict]:
    """The Role and RoleBinding with which ``namespace`` lends the pull secrets named ``secrets``
    (and nothing else of its own) to ``subjects`` ((namespace, ServiceAccount) pairs): what
    docs/security.md shows."""
    if not secrets:
        raise ValueError("lending names at least one pull secret")
    meta = {"name": LENDING, "namespace": namespace}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [
            {"apiGroups": [""], "resources": ["serviceaccounts"], "resourceNames": ["default"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": list(secrets), "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": LENDING},
         "subjects": [{"kind": "ServiceAccount", "name": n, "namespace": ns} for ns, n in subjects]}]


class PullSecretError(Exception):
    """The namespace's pull secrets cannot be read or used; the message says what to do."""


class NotLent(PullSecretError):
    """The API server refused the read: the namespace has not lent its pull secrets to us."""


@dataclass(frozen=True)
class PullSecrets:
    namespace: str
    secrets: tuple[tuple[str, str], ...]  # (namespace/name, Docker config JSON), in the ServiceAccount's order
    why: str = ""  # no secrets: why not, in words

    @property
    def key(self) -> str:
        """Names these credentials in caches of proofs and pulls, without their content."""
        if not self.secrets:
            return "anonymous"
        parts = [p.encode() for name, content in self.secrets for p in (name, content)]
        return f"tenant:{self.namespace}:{secret_digest(*parts)}"  # logged: keyed, never a plain hash


class PullSecretReader:
    """:meth:`of` a namespace through ``client``, remembered for ``ttl`` seconds."""

    def __init__(self, client: Client, *, ttl: float = 30.0, who: str = "accelnode"):
        self.client, self.ttl, self.who = client, ttl, who
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[PullSecrets, float]] = {}

    def of(self, namespace: str, *, fresh: bool = True) -> PullSecrets:
        """The namespace's pull secrets, read at most ``ttl`` seconds ago; ``fresh=False``: the
        last answer read, whatever its age (read only when there is none)."""
        now = time.monotonic()
        with self._lock:
            hit = self._answers.get(namespace)
            if hit is not None and (not fresh or now - hit[1] < self.ttl):
                return hit[0]
        found = self._read(namespace)
        with self._lock:
            self._answers[namespace] = (found, time.monotonic())
            if len(self._answers) > 4096:
                self._answers.clear()
        return found

    def _get(self, path: str, what: str, namespace: str) -> dict | None:
        try:
            return self.client.request("GET", path)
        except KubeError as e:
            if is_not_found(e):
                return None
            if is_forbidden(e):
                raise NotLent(f"{self.who} may not read {what} (namespace {namespace} has not lent it: a Role "
                              f"{LENDING} with get on serviceaccounts [default] and on secrets [the names of "
                              "its pull secrets], bound to it; docs/security.md)") from None
            raise PullSecretError(f"cannot read {what}: {e}") from None
        except Unreachable as e:
            raise PullSecretError(f"cannot read {what}: {e}") from None

    def _read(self, namespace: str) -> PullSecrets:
        try:
            sa = self._get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default",
                           f"ServiceAccount {namespace}/default", namespace) or {}
        except NotLent as e:
            return PullSecrets(namespace, (), f"namespace {namespace} lends {self.who} no pull secrets: {e}")
        secrets = tuple(self._secrets(namespace, sa))
        return PullSecrets(namespace, secrets, "" if secrets else f"the default ServiceAccount of namespace "
                                                                  f"{namespace} names no imagePullSecrets")

    def _secrets(self, namespace: str, sa: dict):
        for ref in sa.get("imagePullSecrets") or ():
            name = ref.get("name") if isinstance(ref, dict) else None
            if not isinstance(name, str) or not name:
                continue
            found = self._docker_config(namespace, name, f"pull secret {namespace}/{name}")
            if found is not None:  # as kubelet: a named secret that does not exist is skipped
                yield found

    def named(self, namespace: str, name: str, what: str) -> tuple[str, str]:
        """(namespace/name, Docker config JSON) of one Secret the namespace lent by name (a
        capture's push secret); :class:`PullSecretError` when it is missing, not lent or not a
        Docker config. Never remembered: a revoked Role takes effect at the next push."""
        found = self._docker_config(namespace, name, f"{what} {namespace}/{name}")
        if found is None:
            raise PullSecretError(f"{what} {namespace}/{name} does not exist")
        return found

    def _docker_config(self, namespace: str, name: str, what: str) -> tuple[str, str] | None:
        secret = self._get(f"/api/v1/namespaces/{namespace}/secrets/{name}", what, namespace)
        if secret is None:
            return None
        key = SECRET_TYPES.get(secret.get("type", ""))
        if key is None:
            raise PullSecretError(f"{what} is of type {secret.get('type')!r}, not one of {', '.join(SECRET_TYPES)}")
        try:
            content = base64.b64decode((secret.get("data") or {}).get(key, ""), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError, TypeError, ValueError):
            raise PullSecretError(f"{what}: data[{key}] is not base64 of a Docker config") from None
        return f"{namespace}/{name}", content
