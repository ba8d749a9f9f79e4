"""Signature verification of kernel caches against the admin's trust policies (docs/signatures.md).

Invariants: a cache that must be verified and that no ``ClusterCacheTrustPolicy`` covers is
refused (``NoPolicy``), never "any signer"; :class:`Signer` verifies once per (digest, covering
policies and their generations) and records the verdict in memory and in the ``Verified``
condition's message, so status writes, resyncs and restarts never verify again; a registry
outage keeps the last verdict (``VerificationStale``), and with none yet nothing is pulled.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from accelnode.log import kv
from accelnode.oci import signatures as sg
from accelnode.oci.errors import AuthError, ImageError, RegistryUnavailable
from accelnode.oci.refusal import stamp
from accelnode.oci.registry import RegistryOptions

from controller.caches.pinning import SIGNATURE_FORMAT_LABEL, Pin

log = logging.getLogger("accelnode.controller")

POLICY_GROUP, POLICY_VERSION, POLICY_PLURAL = "accelnode.io", "v1alpha1", "clustercachetrustpolicies"
VERIFIED = "Verified"
NO_POLICY = "NoPolicy"
INVALID_POLICY = "InvalidPolicy"
UNKNOWN_FORMAT = "UnknownSignatureFormat"
STALE = "VerificationStale"
UNAVAILABLE = "RegistryUnavailable"
MAX_VERDICTS = 4096


@dataclass(frozen=True)
class Policy:
    name: str
    generation: int
    namespaces: tuple[str, ...]  # "*": every namespace
    cluster_caches: bool
    require: bool
    keys: tuple[sg.TrustedKey, ...]
    error: str | None = None
    keyless: sg.KeylessTrust | None = None  # keyless identities and the trust roots they chain to

    @property
    def tag(self) -> str:
        return f"{self.name}@{self.generation}"

    def covers(self, namespace: str | None) -> bool:
        if namespace is None:
            return self.cluster_caches
        return "*" in self.namespaces or namespace in self.namespaces


def parse_policy(obj: dict) -> Policy:
    """A policy object as a :class:`Policy`; a key that does not load makes the policy invalid
    (``error`` set): every cache it covers is then refused, none accepted on the other keys."""
    md, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    keys, error = [], None
    for i, k in enumerate(spec.get("keys") or ()):
        try:
            keys.append(sg.TrustedKey.from_pem(str(k.get("name") or f"key{i}"), str(k.get("publicKey") or "")))
        except (sg.InvalidKey, AttributeError) as e:
            error = str(e)
    keyless = None
    try:
        idents = tuple(sg.Identity(str(i.get("issuer") or ""), str(i.get("subject") or ""),
                                   str(i.get("subjectRegExp") or "")) for i in spec.get("keyless") or ())
        roots, inter = [], []
        for i, r in enumerate(spec.get("trustRoots") or ()):
            name = str(r.get("name") or f"root{i}")
            roots += sg.load_certs(f"trust root {name!r}", str(r.get("certificate") or ""))
            if r.get("intermediates"):
                inter += sg.load_certs(f"intermediates of {name!r}", str(r["intermediates"]))
        if idents and not roots:
            raise sg.InvalidKey("keyless identities need at least one trust root (spec.trustRoots)")
        if idents:
            keyless = sg.KeylessTrust(idents, tuple(roots), tuple(inter))
    except (sg.InvalidKey, AttributeError) as e:
        error = str(e)
    return Policy(md.get("name", ""), int(md.get("generation") or 0), tuple(spec.get("namespaces") or ()),
                  bool(spec.get("clusterCaches")), bool(spec.get("requireSignature")), tuple(keys), error, keyless)


def trim_policy(obj: dict) -> dict:
    md = obj.get("metadata") or {}
    return {"metadata": {k: md[k] for k in ("name", "generation") if k in md}, "spec": obj.get("spec") or {}}


@dataclass(frozen=True)
class Outcome:
    status: str  # True / False / Unknown
    reason: str
    message: str
    retry: bool = False  # the registry could not answer: look again later


def _stamp(digest: str, policies: list[Policy]) -> str:
    return stamp(digest, [p.tag for p in policies])


class Signer:
    """Verdicts for the caches of one process, remembered per (digest, formats, policies)."""

    def __init__(self, options: RegistryOptions, *, timeout: float = 30.0, verify=sg.verify):
        self.options, self.timeout, self._verify = options, timeout, verify
        self._lock = threading.Lock()
        self._verdicts: dict[tuple, Outcome] = {}
        self.verifications = 0  # registry round trips made (the benchmark's idle check)

    def required(self, obj: dict, namespace: str | None, policies: list[Policy]) -> tuple[bool, tuple[str, ...]]:
        """(must it be verified, the formats to look for)."""
        label = ((obj.get("metadata") or {}).get("labels") or {}).get(SIGNATURE_FORMAT_LABEL)
        if label is not None:
            return True, (label,)
        covering = [p for p in policies if p.covers(namespace)]
        if namespace is None and covering:
            return True, sg.FORMATS
        return any(p.require for p in covering), sg.FORMATS

    def outcome(self, key: str, obj: dict, pin: Pin, namespace: str | None, policies: list[Policy],
                old: dict | None, *, options: RegistryOptions | None = None) -> Outcome | None:
        """The Verified condition for ``pin`` (None: this cache needs no signature); the signatures
        are read with ``options`` (the cache's credentials; None: the signer's own)."""
        needed, formats = self.required(obj, namespace, policies)
        if not needed:
            return None
        covering = sorted((p for p in policies if p.covers(namespace)), key=lambda p: p.name)
        stamp = _stamp(pin.digest, covering)
        if any(f not in sg.FORMATS for f in formats):
            return Outcome("False", UNKNOWN_FORMAT, f"label {SIGNATURE_FORMAT_LABEL}={formats[0]!r} is not one of "
                                                    f"{', '.join(sg.FORMATS)} {stamp}")
        if not covering:
            return Outcome("False", NO_POLICY, f"a signature is required but no ClusterCacheTrustPolicy covers "
                                               f"{'cluster caches' if namespace is None else 'namespace ' + namespace} "
                                               f"{stamp}")
        bad = next((p for p in covering if p.error), None)
        if bad is not None:
            return Outcome("False", INVALID_POLICY, f"ClusterCacheTrustPolicy {bad.name}: {bad.error} {stamp}")
        memo = (pin.digest, formats, stamp)
        with self._lock:
            hit = self._verdicts.get(memo)
        if hit is not None:
            return hit
        if old and old.get("reason") not in (STALE, UNAVAILABLE) and str(old.get("message", "")).endswith(stamp):
            kept = Outcome(old.get("status", "Unknown"), old.get("reason", ""), old["message"])  # after a restart
            self._remember(memo, kept)
            return kept
        keys = [k for p in covering for k in p.keys]
        try:
            with self._lock:
                self.verifications += 1
            verdict = self._verify(pin.image, pin.digest, keys, options or self.options, formats=formats,
                                   timeout=self.timeout,
                                   keyless=tuple(p.keyless for p in covering if p.keyless))
        except (RegistryUnavailable, AuthError) as e:
            log.warning("cache signature not verified: registry did not answer",
                        extra=kv(key=key, digest=pin.digest, error=str(e)))
            last = old if old and pin.digest in str(old.get("message", "")) and old.get("status") in ("True", "False") \
                else None
            if last is not None:
                return Outcome(last["status"], STALE, f"could not verify again ({e}); keeping the last verdict: "
                                                      f"{last['message'].split(' [digest')[0]}", retry=True)
            return Outcome("Unknown", UNAVAILABLE, f"signatures of {pin.digest} not read yet: {e}", retry=True)
        except ImageError as e:  # garbled signature manifests: a refusal, not an outage
            verdict = sg.Verdict(False, sg.BAD_SIGNATURE, f"unreadable signature data: {e}")
        out = Outcome("True" if verdict.ok else "False", verdict.reason, f"{verdict.message} {stamp}")
        log.info("cache signature verified", extra=kv(key=key, digest=pin.digest, verified=verdict.ok,
                                                      reason=verdict.reason, policies=stamp))
        self._remember(memo, out)
        return out

    def _remember(self, memo: tuple, out: Outcome) -> None:
        with self._lock:
            self._verdicts[memo] = out
            if len(self._verdicts) > MAX_VERDICTS:
                for k in list(self._verdicts)[:MAX_VERDICTS // 4]:
                    del self._verdicts[k]
