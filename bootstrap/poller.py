"""The node side of the pull-model join (``accelnode bootstrap``, docs/bootstrap.md).

Wait for the join values in the GCE metadata (:func:`wait_for_join_values`, a long poll), verify
the API server as kubeadm's token discovery does (:func:`discover`), then ``kubeadm join``
(:class:`Joiner`). Invariants:

* no credential is sent before the CA is pinned by the metadata's hash and the cluster-info
  signature proves the server knows the token (:class:`CAMismatch`, :class:`TokenNotSigned`);
* the token never appears on a command line or in a log: the JoinConfiguration is a ``0600``
  file in a private directory, kubeadm's output is masked, and :class:`JoinValues` hides it
  from ``repr``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from accelnode.decode import KUBE_OBJECT, SMALL, decode
from accelnode.gce.metadata import Metadata, MetadataError, NotFound, Unreachable
from accelnode.kube.bootstraptoken import ENDPOINT_RE, HASH_RE, METADATA_KEYS, TOKEN_RE, spki_hash
from accelnode.log import kv

log = logging.getLogger("accelnode.bootstrap")

TOKEN_KEY, ENDPOINT_KEY, HASH_KEY = METADATA_KEYS
DEFAULT_PORT = 6443
CLUSTER_INFO = "/api/v1/namespaces/kube-public/configmaps/cluster-info"
JWS_PREFIX = "jws-kubeconfig-"


class BootstrapError(Exception):
    """A step failed; the message says what to do. ``retry``: a later attempt may succeed."""

    retry = False


class BadMetadata(BootstrapError):
    pass


class ServerUnreachable(BootstrapError):
    retry = True


class TokenNotSigned(BootstrapError):
    """cluster-info carries no signature for the token: the API server does not know it."""


class BadSignature(BootstrapError):
    pass


class CAMismatch(BootstrapError):
    pass


# -- the metadata's values -------------------------------------------------------------------


@dataclass(frozen=True)
class JoinValues:
    token: str = field(repr=False)
    endpoint: str  # host:port
    ca_hash: str

    @property
    def token_id(self) -> str:
        return self.token.split(".", 1)[0]

    @property
    def token_secret(self) -> str:
        return self.token.split(".", 1)[1]

    @classmethod
    def from_attributes(cls, attrs: dict[str, str]) -> "JoinValues | None":
        """The values when all three are there (None while one is missing or empty);
        BadMetadata when one is malformed (the message never holds the token)."""
        token, endpoint, ca_hash = (attrs.get(k, "").strip() for k in (TOKEN_KEY, ENDPOINT_KEY, HASH_KEY))
        if not (token and endpoint and ca_hash):
            return None
        if not TOKEN_RE.match(token):
            raise BadMetadata(f"metadata {TOKEN_KEY} is not a kubeadm bootstrap token (<6 chars>.<16 chars>, "
                              f"lower-case letters and digits)")
        if not HASH_RE.match(ca_hash):
            raise BadMetadata(f"metadata {HASH_KEY}={ca_hash!r} is not sha256:<64 hex digits>")
        if not ENDPOINT_RE.match(endpoint):
            raise BadMetadata(f"metadata {ENDPOINT_KEY}={endpoint!r} is not host[:port]")
        if not re.search(r":[0-9]+$", endpoint) or endpoint.endswith("]"):
            endpoint = f"{endpoint}:{DEFAULT_PORT}"
        return cls(token, endpoint, ca_hash)


def read_retrying(md: Metadata, path: str, timeout: float) -> str:
    """One metadata value, retried with backoff while the server is unreachable (a VM's network
    may still be coming up); Unreachable after ``timeout``, NotFound at once."""
    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        try:
            return md.get(path).body.strip()
        except Unreachable as e:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("metadata server unreachable; retrying", extra=kv(error=str(e), retry_in_s=delay))
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def wait_for_join_values(md: Metadata, *, timeout: float | None, poll_s: int = 60,
                         skip_token: str | None = None, clock: Callable[[], float] = time.monotonic,
                         on_wait: Callable[[], None] | None = None) -> JoinValues:
    """Long-poll the attributes until the three values are there (and the token is not
    ``skip_token``, one the API server refused). ``timeout`` None: forever. Unreachable
    metadata is retried with backoff; ServerUnreachable once ``timeout`` passed."""
    deadline = None if timeout is None else clock() + timeout
    etag: str | None = None
    backoff = 0.2
    announced = False
    while True:
        left = None if deadline is None else deadline - clock()
        if left is not None and left <= 0:
            what = "a new" if skip_token else "the"
            raise ServerUnreachable(f"{what} join token did not appear in the instance metadata ({TOKEN_KEY}, "
                                    f"{ENDPOINT_KEY}, {HASH_KEY}) within {timeout:g}s: is the node group's "
                                    f"controller running, and does it see this instance RUNNING?")
        wait_s = max(1, min(poll_s, int(left) if left is not None else poll_s))
        try:
            attrs, etag = md.attributes(last_etag=etag, wait=etag is not None, timeout_sec=wait_s)
        except Unreachable as e:
            log.warning("metadata server unreachable; retrying", extra=kv(error=str(e), retry_in_s=backoff))
            time.sleep(backoff if left is None else min(backoff, max(left, 0)))
            backoff = min(backoff * 2, 5.0)
            continue
        except NotFound:  # no attributes directory (yet): nothing to long-poll on
            attrs, etag = {}, None
        except MetadataError as e:
            raise BadMetadata(str(e)) from None
        backoff = 0.2
        values = JoinValues.from_attributes(attrs)
        if values is not None and values.token != skip_token:
            log.info("join values found in the metadata", extra=kv(bootstrap_id=values.token_id, endpoint=values.endpoint,
                                                                   ca_hash=values.ca_hash))
            return values
        if not announced:
            log.info("waiting for the join token in the instance metadata", extra=kv(keys=[TOKEN_KEY, ENDPOINT_KEY,
                                                                                           HASH_KEY]))
            announced = True
        if on_wait is not None:
            on_wait()
        if etag is None:  # an answer without ETag cannot be long-polled: plain polling, once a second
            time.sleep(1.0 if left is None else min(1.0, max(left, 0)))


# -- token discovery -------------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64url(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def verify_detached_jws(jws: str, payload: str, token_id: str, token_secret: str) -> None:
    """A detached compact JWS (``header..signature``) over ``payload``, HS256 keyed by the token
    secret, as the bootstrap signer writes it; BadSignature otherwise."""
    parts = jws.split(".")
    if len(parts) != 3 or parts[1] != "":
        raise BadSignature(f"cluster-info's {JWS_PREFIX}{token_id} is not a detached JWS")
    try:
        header = decode(_unb64url(parts[0]), SMALL, "the JWS header")
        sig = _unb64url(parts[2])
    except ValueError:
        raise BadSignature(f"cluster-info's {JWS_PREFIX}{token_id} is not a detached JWS") from None
    if header.get("alg") != "HS256" or header.get("kid", token_id) != token_id:
        raise BadSignature(f"cluster-info's {JWS_PREFIX}{token_id} is signed with {header.get('alg')!r} "
                           f"(kid {header.get('kid')!r}), not HS256 by this token")
    signing_input = f"{parts[0]}.{_b64url(payload.encode())}".encode()
    want = hmac.new(token_secret.encode(), signing_input, hashlib.sha256).digest()
    if not hmac.compare_digest(want, sig):
        raise BadSignature(f"cluster-info's signature for token id {token_id} does not verify with this token's "
                           f"secret: the metadata's token is wrong, or something other than the cluster answered")


def _fetch_cluster_info(endpoint: str, ctx: ssl.SSLContext, timeout: float) -> dict:
    req = urllib.request.Request(f"https://{endpoint}{CLUSTER_INFO}", headers={"Accept": "application/json",
                                                                                "User-Agent": "accelnode-bootstrap"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
            return decode(resp.read(KUBE_OBJECT.max_bytes + 1), KUBE_OBJECT, f"https://{endpoint}{CLUSTER_INFO}")
    except urllib.error.HTTPError as e:
        if e.code in (401, 403, 404):
            raise BootstrapError(f"https://{endpoint}{CLUSTER_INFO} answered HTTP {e.code}: the control plane "
                                 f"does not publish cluster-info to anonymous clients (kubeadm init creates it "
                                 f"and its RBAC)") from None
        raise ServerUnreachable(f"https://{endpoint}{CLUSTER_INFO}: HTTP {e.code}") from None
    except ssl.SSLCertVerificationError as e:
        raise CAMismatch(f"the API server at {endpoint} does not present a certificate of the pinned CA: "
                         f"{e.verify_message}") from None
    except (urllib.error.URLError, OSError, socket.timeout) as e:
        reason = getattr(e, "reason", e)
        raise ServerUnreachable(f"API server {endpoint} unreachable: {reason}") from None
    except ValueError:
        raise BootstrapError(f"https://{endpoint}{CLUSTER_INFO}: the answer is not JSON") from None


@dataclass(frozen=True)
class Discovered:
    ca_pem: bytes
    server: str  # the API server cluster-info names


def discover(values: JoinValues, *, timeout: float = 60.0, request_timeout: float = 10.0,
             clock: Callable[[], float] = time.monotonic) -> Discovered:
    """kubeadm's token discovery against ``values.endpoint``. Waits up to ``timeout`` for the
    bootstrap signer to sign cluster-info for the token (it does so moments after the token's
    Secret appears); TokenNotSigned after that."""
    insecure = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # no system CAs to load: nothing is trusted yet,
    insecure.check_hostname = False                      # the signature and the pin decide
    insecure.verify_mode = ssl.CERT_NONE
    insecure.minimum_version = ssl.TLSVersion.TLSv1_2
    deadline = clock() + timeout
    delay = 0.05
    while True:
        try:
            cm = _fetch_cluster_info(values.endpoint, insecure, request_timeout)
        except ServerUnreachable as e:
            if clock() >= deadline:
                raise
            log.warning("API server unreachable; retrying", extra=kv(error=str(e), retry_in_s=delay))
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        data = cm.get("data") or {}
        kubeconfig = data.get("kubeconfig")
        if not kubeconfig:
            raise BootstrapError(f"cluster-info at {values.endpoint} holds no kubeconfig")
        jws = data.get(JWS_PREFIX + values.token_id)
        if jws:
            break
        if clock() >= deadline:
            raise TokenNotSigned(
                f"cluster-info at {values.endpoint} carries no signature for token id {values.token_id} after "
                f"{timeout:g}s: the API server does not know this token (expired, revoked, or its Secret lacks "
                f"usage-bootstrap-signing), or kube-controller-manager's bootstrap signer is not running")
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    verify_detached_jws(jws, kubeconfig, values.token_id, values.token_secret)
    try:
        doc = yaml.safe_load(kubeconfig)
        cluster = doc["clusters"][0]["cluster"]
        ca_pem = base64.b64decode(cluster["certificate-authority-data"])
        cas = x509.load_pem_x509_certificates(ca_pem)
        server = cluster.get("server", "")
    except (yaml.YAMLError, KeyError, IndexError, TypeError, ValueError) as e:
        raise BootstrapError(f"cluster-info's kubeconfig is not usable: {type(e).__name__}: {e}") from None
    hashes = [spki_hash(c) for c in cas]
    if values.ca_hash not in hashes:
        raise CAMismatch(f"REFUSING TO JOIN: the cluster CA's public key hash is {', '.join(hashes)} but the "
                         f"metadata pins {values.ca_hash}. Either {HASH_KEY} is stale or wrong, or the server at "
                         f"{values.endpoint} is not the cluster's API server")
    pinned = [c for c in cas if spki_hash(c) == values.ca_hash]
    verified = ssl.create_default_context(cadata="".join(c.public_bytes(serialization.Encoding.PEM).decode()
                                                         for c in pinned))
    again = _fetch_cluster_info(values.endpoint, verified, request_timeout)
    if (again.get("data") or {}).get("kubeconfig") != kubeconfig:
        raise BootstrapError(f"cluster-info at {values.endpoint} changed between the insecure and the pinned read; "
                             f"try again")
    log.info("discovery verified: cluster-info signed by the token, CA pinned by its hash",
             extra=kv(endpoint=values.endpoint, bootstrap_id=values.token_id, ca_hash=values.ca_hash))
    return Discovered(ca_pem, server)


# -- kubeadm ---------------------------------------------------------------------------------


def provider_id(project: str, zone: str, name: str) -> str:
    return f"gce://{project}/{zone.rsplit('/', 1)[-1]}/{name}"


def join_configuration(values: JoinValues, *, node_name: str, provider: str,
                       ignore_preflight_errors: list[str] = (), cri_socket: str | None = None,
                       patches: str | None = None) -> dict:
    """The ``kubeadm.k8s.io/v1beta4`` JoinConfiguration (kubeletExtraArgs is a list of
    name/value pairs in v1beta4; ``patches``: a directory of kubeadm patches)."""
    registration = {"name": node_name, "kubeletExtraArgs": [{"name": "provider-id", "value": provider}]}
    if ignore_preflight_errors:
        registration["ignorePreflightErrors"] = list(ignore_preflight_errors)
    if cri_socket:
        registration["criSocket"] = cri_socket
    config = {
        "apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "JoinConfiguration",
        "discovery": {"bootstrapToken": {"token": values.token, "apiServerEndpoint": values.endpoint,
                                         "caCertHashes": [values.ca_hash]},
                      "tlsBootstrapToken": values.token},
        "nodeRegistration": registration,
    }
    if patches:
        config["patches"] = {"directory": patches}
    return config


class Joiner:
    """Runs ``kubeadm join`` until it succeeds or ``attempts`` are spent, ``kubeadm reset -f``
    between attempts. ``dry_run``: both with ``--dry-run`` (kubeadm changes nothing on the host)."""

    def __init__(self, kubeadm: str, *, attempts: int = 3, backoff_s: float = 15.0, max_backoff_s: float = 120.0,
                 dry_run: bool = False, out=None, sleep: Callable[[float], None] = time.sleep):
        self.kubeadm = kubeadm
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.dry_run = dry_run
        self.out = out or sys.stderr
        self.sleep = sleep

    def _run(self, argv: list[str], secret: str) -> int:
        """Run, passing its output on line by line with ``secret`` masked."""
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                self.out.write(line.replace(secret, "<redacted>"))
            self.out.flush()
            return proc.wait()
        except BaseException:  # stopped (SIGTERM, Ctrl-C): kubeadm goes too, the config file is removed
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise

    def join(self, values: JoinValues, config: dict) -> None:
        """BootstrapError after the last failed attempt."""
        workdir = Path(tempfile.mkdtemp(prefix="accelnode-bootstrap-"))  # 0700
        try:
            path = workdir / "join.yaml"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(config, f, sort_keys=False)
            argv = [self.kubeadm, "join", "--config", str(path)] + (["--dry-run"] if self.dry_run else [])
            delay = self.backoff_s
            for attempt in range(1, self.attempts + 1):
                log.info("running kubeadm join", extra=kv(attempt=attempt, of=self.attempts, endpoint=values.endpoint,
                                                          bootstrap_id=values.token_id, dry_run=self.dry_run))
                rc = self._run(argv, values.token_secret)
                if rc == 0:
                    log.info("kubeadm join succeeded", extra=kv(attempt=attempt, dry_run=self.dry_run))
                    return
                log.error("kubeadm join failed", extra=kv(attempt=attempt, of=self.attempts, exit_code=rc))
                if attempt == self.attempts:
                    break
                reset = [self.kubeadm, "reset", "-f"] + (["--dry-run"] if self.dry_run else [])
                rrc = self._run(reset, values.token_secret)
                if rrc != 0:
                    log.warning("kubeadm reset failed", extra=kv(exit_code=rrc))
                log.info("retrying kubeadm join", extra=kv(in_s=delay))
                self.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
            raise BootstrapError(f"kubeadm join failed {self.attempts} times (last exit code {rc}); its output is "
                                 f"above. Fix the cause on this node (or the control plane) and restart "
                                 f"accelnode bootstrap")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
