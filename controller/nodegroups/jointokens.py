"""kubeadm bootstrap tokens for node groups: the controller side of the pull-model join
(docs/bootstrap.md).

:class:`JoinTokens` keeps the bootstrap-token Secrets of a group, in the form the API server and
kubeadm expect, each bound to its group (annotation :data:`GROUP_ANNOTATION`) and named from a
fixed pool of ids that the group records in its status: the controller reads and deletes only
those names and lists no Secret (docs/security.md). A token is reused only while enough of its
lifetime is left for a VM that reads it to join; :meth:`JoinTokens.revoke` deletes them once the
group's nodes have joined or the group goes, and the cluster's token cleaner deletes any that
expire. The CA hash is what ``kubeadm join --discovery-token-ca-cert-hash`` checks.

A token's secret half is never logged: :class:`JoinInfo`'s repr leaves it out and log lines
carry the token id only (which is public: it names the Secret).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import logging
import re
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping

from accelnode.kube.bootstraptoken import ENDPOINT_RE, METADATA_KEYS, TOKEN_RE, ca_cert_hash
from accelnode.kube.client import Client, KubeError, is_conflict, is_not_found
from accelnode.log import kv

log = logging.getLogger("accelnode.controller.jointoken")

SECRET_TYPE = "bootstrap.kubernetes.io/token"
NODE_GROUP = "system:bootstrappers:kubeadm:default-node-token"
GROUP_LABEL = "accelnode.io/join-group"  # the group's name, or a hash of it when not a label value
GROUP_ANNOTATION = "accelnode.io/join-group"  # the group's full name
CLUSTER_INFO = "/api/v1/namespaces/kube-public/configmaps/cluster-info"
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
# The token ids the controller uses, and so the only bootstrap-token Secrets it may read and
# delete: daemonsets/rbac-controller-jointokens.yaml names exactly these (a test checks).
POOL = tuple(f"acn{i:03d}" for i in range(64))
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")


@dataclass(frozen=True)
class JoinInfo:
    """What a VM needs to join: its three metadata values."""

    token: str = field(repr=False)  # "<id>.<secret>": never logged
    ca_hash: str  # "sha256:<hex>"
    control_plane: str  # host[:port]
    # when the API server made the token's Secret (seconds since the epoch, its clock; 0: not
    # known): a certificate request made with this token cannot be older (ids are reused)
    created: float = field(default=0.0, compare=False)
    expires: float = field(default=0.0, compare=False)  # seconds since the epoch; 0: not known

    @property
    def token_id(self) -> str:
        return self.token.split(".", 1)[0]

    def metadata_items(self) -> dict[str, str]:
        return dict(zip(METADATA_KEYS, (self.token, self.control_plane, self.ca_hash)))


def new_token() -> str:
    pick = lambda n: "".join(secrets.choice(_ALPHABET) for _ in range(n))  # noqa: E731
    return f"{pick(6)}.{pick(16)}"


def rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(int(t), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(s: str) -> float:
    """Seconds since the epoch; ValueError when ``s`` is not an RFC 3339 time."""
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def created_at(obj: dict) -> float:
    """An object's metadata.creationTimestamp in seconds since the epoch; 0.0 when it has none
    or it does not parse (older than anything)."""
    try:
        return parse_rfc3339((obj.get("metadata") or {}).get("creationTimestamp") or "")
    except ValueError:
        return 0.0


def group_label_value(group: str) -> str:
    if _LABEL_VALUE.match(group):
        return group
    return "h-" + hashlib.sha256(group.encode()).hexdigest()[:40]


def check_control_plane(control_plane: str) -> str:
    if not ENDPOINT_RE.match(control_plane or ""):
        raise ValueError(f"control plane endpoint {control_plane!r} is not host[:port]")
    return control_plane


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _unb64(s: str) -> str:
    return base64.b64decode(s).decode()


@dataclass
class _Token:
    name: str
    token: str
    expires: float
    created: float = 0.0  # the Secret's creationTimestamp


class JoinTokens:
    """Bootstrap-token Secrets of node groups in ``namespace`` (``kube-system``: where the API
    server's bootstrap authenticator looks).

    The controller may create Secrets there but read and delete only the ones named from
    :data:`POOL` (daemonsets/rbac-controller-jointokens.yaml lists exactly those names: RBAC cannot
    narrow ``create`` or ``list`` by name, so the controller lists nothing and draws its token ids
    from a fixed pool). A group records the ids it drew in its status *before* creating the
    Secret (``reserve``), so a crash never leaves a token that no group names."""

    def __init__(self, kube: Client, *, ca_pem: bytes, namespace: str = "kube-system", ttl_s: int = 3600,
                 clock: Callable[[], float] = time.time):
        if ttl_s < 60:
            raise ValueError(f"a join token must live at least 60 s (ttl_s={ttl_s})")
        self.kube = kube
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.min_left_s = ttl_s / 6  # reuse a token only with this much time left
        self.ca_hash = ca_cert_hash(ca_pem)
        self.clock = clock
        self._path = f"/api/v1/namespaces/{namespace}/secrets"
        self._ledger: dict[str, list[str]] = {}  # group -> ids, for callers that keep no status of their own

    # -- public surface ------------------------------------------------------------------------

    def ensure(self, group: str, control_plane: str, recorded: list[str] | None = None,
               taken: Collection[str] = (), reserve: Callable[[list[str]], None] | None = None) -> JoinInfo:
        """The group's join values: a token with comfortable time left (one of ``recorded``
        reused, or a new one), the CA hash and ``control_plane``. ``taken``: the ids other groups
        record; ``reserve(ids)`` writes the group's ids before a new Secret is made (without
        ``recorded``, this object keeps them: one process, tests and benches).
        KubeError/Unreachable from the API pass through."""
        check_control_plane(control_plane)
        if not group:
            raise ValueError("a join token needs a node group name")
        if recorded is None:
            recorded = self._ledger.get(group, [])
            reserve = lambda ids: self._ledger.__setitem__(group, list(ids))  # noqa: E731
        now = self.clock()
        alive: list[str] = []
        usable: list[_Token] = []
        for tid in recorded:
            tok = self._read(tid, group)
            if tok is None:
                continue
            if tok.expires <= now:
                self._delete(tok.name, group, "expired")
                continue
            alive.append(tid)
            if tok.expires - now >= self.min_left_s:
                usable.append(tok)
        if usable:
            best = max(usable, key=lambda t: t.expires)
            return JoinInfo(best.token, self.ca_hash, control_plane, best.created, best.expires)
        return self._new(group, control_plane, alive, list(recorded) + list(taken), reserve, now)

    def issue(self, group: str, control_plane: str, recorded: list[str], taken: Collection[str],
              reserve: Callable[[list[str]], None], requested: Mapping[str, float] | None = None) -> JoinInfo:
        """A new token for one VM of ``group`` (never one already handed out: a token joins one
        VM and is revoked once it has), its id added to ``recorded`` through ``reserve``.
        ``requested``: id -> when the newest certificate request made with a token of that id
        was made (the ids are reused, and such requests outlive their tokens by an hour or
        more); ids no request names are drawn first."""
        check_control_plane(control_plane)
        return self._new(group, control_plane, list(recorded), list(recorded) + list(taken), reserve, self.clock(),
                         requested)

    def get(self, group: str, tid: str, control_plane: str) -> JoinInfo | None:
        """The group's token ``tid`` when its Secret is there, whatever time it has left
        (:meth:`fresh` says whether to offer it); else None."""
        tok = self._read(tid, group)
        if tok is None:
            return None
        return JoinInfo(tok.token, self.ca_hash, check_control_plane(control_plane), tok.created, tok.expires)

    def fresh(self, info: JoinInfo) -> bool:
        """Whether the token has comfortable time left to be offered to a VM."""
        return info.expires - self.clock() >= self.min_left_s

    def _new(self, group: str, control_plane: str, alive: list[str], used: list[str],
             reserve: Callable[[list[str]], None], now: float,
             requested: Mapping[str, float] | None = None) -> JoinInfo:
        requested = requested or {}
        free = [t for t in POOL if t not in used]
        unnamed = [t for t in free if t not in requested]
        # an id some request names last: the oldest such request first (docs/tpu-node-groups.md, "Join")
        named = sorted((t for t in free if t in requested), key=lambda t: requested[t])
        for tid in (random.sample(unnamed, len(unnamed)) + named)[:5]:
            reserve(alive + [tid])  # an id that turns out taken is dropped by the next reservation
            tok = self._create(group, tid, now)
            if tok is not None:
                return JoinInfo(tok.token, self.ca_hash, control_plane, tok.created, tok.expires)
        reserve(alive)
        raise RuntimeError(f"no free join token id: the {len(POOL)} ids accelnode may use are taken "
                           "(by other groups' live tokens or Secrets not ours)")

    def signed(self, info: JoinInfo) -> bool:
        """Whether the bootstrap signer has signed ``kube-public/cluster-info`` for the token yet
        (it does so a few seconds after the Secret appears). A VM given a token before that
        waits for the signature in its discovery; writing the metadata once this is true makes
        the join start the moment the VM sees it."""
        try:
            cm = self.kube.request("GET", CLUSTER_INFO)
        except KubeError as e:
            if is_not_found(e):
                return False
            raise
        return f"jws-kubeconfig-{info.token_id}" in (cm.get("data") or {})

    def revoke(self, group: str, recorded: list[str] | None = None) -> None:
        """Delete the group's token Secrets among ``recorded`` (default: the ids this object
        keeps for it); one that is not the group's is left alone."""
        for tid in self._ledger.pop(group, []) if recorded is None else recorded:
            tok = self._read(tid, group)
            if tok is not None:
                self._delete(tok.name, group, "revoked")

    # -- internals -----------------------------------------------------------------------------

    def _read(self, tid: str, group: str) -> _Token | None:
        """The group's well-formed token Secret with id ``tid``; None when there is none, or it
        is someone else's (another group's, or not made by us), or malformed (the API server
        would not accept it as a token either)."""
        if tid not in POOL:
            return None
        try:
            s = self.kube.request("GET", f"{self._path}/bootstrap-token-{tid}")
        except KubeError as e:
            if is_not_found(e):
                return None
            raise
        meta = s.get("metadata") or {}
        if s.get("type") != SECRET_TYPE or (meta.get("annotations") or {}).get(GROUP_ANNOTATION) != group:
            log.warning("join token secret is not this group's; left alone",
                        extra=kv(secret=meta.get("name"), group=group))
            return None
        data = s.get("data") or {}
        try:
            token = f"{_unb64(data['token-id'])}.{_unb64(data['token-secret'])}"
            expires = parse_rfc3339(_unb64(data["expiration"]))
        except (KeyError, ValueError) as e:
            log.warning("join token secret is malformed; ignored",
                        extra=kv(secret=meta.get("name"), group=group, error=type(e).__name__))
            return None
        if not TOKEN_RE.match(token) or not token.startswith(tid + "."):
            log.warning("join token secret is malformed; ignored", extra=kv(secret=meta.get("name"), group=group))
            return None
        return _Token(meta["name"], token, expires, created_at(s))

    def _create(self, group: str, tid: str, now: float) -> _Token | None:
        """A new token with id ``tid``; None when its Secret exists already (and is not a
        usable one of this group's, made before a crash)."""
        tsecret = new_token().split(".")[1]
        expiration = rfc3339(now + self.ttl_s)
        body = {
            "apiVersion": "v1", "kind": "Secret", "type": SECRET_TYPE,
            "metadata": {"name": f"bootstrap-token-{tid}", "namespace": self.namespace,
                         "labels": {GROUP_LABEL: group_label_value(group),
                                    "app.kubernetes.io/managed-by": "accelnode-controller"},
                         "annotations": {GROUP_ANNOTATION: group}},
            "data": {k: _b64(v) for k, v in {
                "description": f"accelnode: joins the nodes of node group {group}",
                "token-id": tid, "token-secret": tsecret, "expiration": expiration,
                "usage-bootstrap-authentication": "true", "usage-bootstrap-signing": "true",
                "auth-extra-groups": NODE_GROUP}.items()},
        }
        try:
            made = self.kube.request("POST", self._path, body=body)
        except KubeError as e:
            if not is_conflict(e):
                raise
            tok = self._read(tid, group)
            return tok if tok is not None and tok.expires - now >= self.min_left_s else None
        log.info("join token created", extra=kv(group=group, bootstrap_id=tid, expiration=expiration))
        return _Token(body["metadata"]["name"], f"{tid}.{tsecret}", parse_rfc3339(expiration), created_at(made))

    def _delete(self, name: str, group: str, why: str) -> None:
        try:
            self.kube.request("DELETE", f"{self._path}/{name}")
        except KubeError as e:
            if not is_not_found(e):
                raise
            return
        log.info(f"join token {why}", extra=kv(group=group, bootstrap_id=name.removeprefix("bootstrap-token-")))
