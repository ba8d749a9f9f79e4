"""Signature verification of kernel caches against the admin's trust policies (docs/signatures.md).

Invariants: which caches must be signed, and which policies cover one, is
:mod:`accelnode.oci.refusal`'s rule (the nodes apply the same); a cache that must be verified
and that no ``ClusterCacheTrustPolicy`` covers is refused (``NoPolicy``), never "any signer";
:class:`Signer` verifies once per (digest, formats, covering set ``name@generation``) and
records the verdict in memory and as data (``status.verification``, a
:class:`~accelnode.oci.refusal.Verdict`), so status writes, resyncs and restarts never verify
again; a verdict is about one digest and never outlives a change of it; a registry outage keeps
the last verdict on the same digest (``VerificationStale``), an acceptance only while the key
that accepted it is still trusted; with none, nothing is pulled. Text a registry supplied
reaches a message only quoted and truncated (:func:`~accelnode.oci.errors.quoted`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

from accelnode.log import kv
from accelnode.oci import signatures as sg
from accelnode.oci.errors import AuthError, ImageError, RegistryUnavailable, quoted
from accelnode.oci.refusal import (FORMATS, POLICY_GROUP, POLICY_PLURAL, POLICY_VERSION,  # noqa: F401 (re-exported)
                                   SIGNATURE_FORMAT_LABEL, Scope, Verdict, covering, requirement)
from accelnode.oci.registry import RegistryOptions

from controller.caches.pinning import Pin

log = logging.getLogger("accelnode.controller")

VERIFIED = "Verified"
NO_POLICY = "NoPolicy"
INVALID_POLICY = "InvalidPolicy"
UNKNOWN_FORMAT = "UnknownSignatureFormat"
STALE = "VerificationStale"
UNAVAILABLE = "RegistryUnavailable"
MAX_VERDICTS = 4096


@dataclass(frozen=True)
class Policy(Scope):
    """A trust policy as the controller reads it: whom it covers (:class:`Scope`, the rule the
    nodes share) and what it trusts."""

    keys: tuple[sg.TrustedKey, ...] = ()
    error: str | None = None
    keyless: sg.KeylessTrust | None = None  # keyless identities and the trust roots they chain to

    def fingerprints(self) -> set[str]:
        """The signers it trusts, as a verdict records them (:attr:`Verdict.fingerprint`)."""
        out = {sg.key_fingerprint(k) for k in self.keys}
        if self.keyless is not None:
            out |= {sg.keyless_fingerprint(i, self.keyless) for i in self.keyless.identities}
        return out


def parse_policy(obj: dict) -> Policy:
    """A policy object as a :class:`Policy`; a key that does not load makes the policy invalid
    (``error`` set): every cache it covers is then refused, none accepted on the other keys."""
    spec = obj.get("spec") or {}
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
    return Policy(**vars(Scope.of(obj)), keys=tuple(keys), error=error, keyless=keyless)


def trim_policy(obj: dict) -> dict:
    md = obj.get("metadata") or {}
    return {"metadata": {k: md[k] for k in ("name", "generation") if k in md}, "spec": obj.get("spec") or {}}


@dataclass(frozen=True)
class Outcome:
    status: str  # the Verified condition: True / False / Unknown
    reason: str
    message: str
    retry: bool = False  # the registry could not answer: look again later
    verdict: Verdict | None = None  # status.verification (None: no verdict on this digest)


def _same(old: Verdict | None, new: Verdict) -> Verdict:
    """``new``, or ``old`` where they differ only in time (the verdict in status does not move)."""
    return old if old is not None and dataclasses.replace(old, time=new.time) == new else new


class Signer:
    """Verdicts for the caches of one process, remembered per (digest, formats, covering set)."""

    def __init__(self, options: RegistryOptions, *, timeout: float = 30.0, verify=sg.verify):
        self.options, self.timeout, self._verify = options, timeout, verify
        self._lock = threading.Lock()
        self._verdicts: dict[tuple, Outcome] = {}
        self.verifications = 0  # registry round trips made (the benchmark's idle check)

    def outcome(self, key: str, obj: dict, pin: Pin, namespace: str | None, policies: list[Policy], now: str, *,
                options: RegistryOptions | None = None) -> Outcome | None:
        """The verdict on ``pin`` (None: this cache needs no signature); the signatures are read
        with ``options`` (the cache's credentials; None: the signer's own). ``now``: the time a
        new verdict is stamped with."""
        md = obj.get("metadata") or {}
        need = requirement(namespace, md.get("labels") or {}, policies)
        if need is None:
            return None
        cover = covering(policies, namespace)
        tags = tuple(p.tag for p in cover)
        under = f"policies {', '.join(tags) or 'none'}"
        formats = need.formats

        old = Verdict.of(obj.get("status"))

        def judged(ok: bool, reason: str, message: str) -> Outcome:
            known = tuple(f for f in formats if f in FORMATS)
            return Outcome("True" if ok else "False", reason, message,
                           verdict=_same(old, Verdict(pin.digest, tags, ok, reason, now, known)))

        if any(f not in FORMATS for f in formats):
            return judged(False, UNKNOWN_FORMAT, f"label {SIGNATURE_FORMAT_LABEL}={quoted(formats[0], 63)} is not "
                                                 f"one of {', '.join(FORMATS)}")
        if not cover:
            return judged(False, NO_POLICY, f"a signature is required but no ClusterCacheTrustPolicy covers "
                                            f"{'cluster caches' if namespace is None else 'namespace ' + namespace}")
        bad = next((p for p in cover if p.error), None)
        if bad is not None:
            return judged(False, INVALID_POLICY, f"ClusterCacheTrustPolicy {bad.name}: {bad.error}")
        memo = (pin.digest, formats, tags)
        with self._lock:
            hit = self._verdicts.get(memo)
        if hit is not None:
            return hit
        if old is not None and (old.digest, old.formats, old.policies) == memo and old.reason != STALE:
            kept = self._restored(obj, old)  # after a restart: judged already, under these very policies
            self._remember(memo, kept)
            return kept
        keys = [k for p in cover for k in p.keys]
        try:
            with self._lock:
                self.verifications += 1
            verdict = self._verify(pin.image, pin.digest, keys, options or self.options, formats=formats,
                                   timeout=self.timeout, keyless=tuple(p.keyless for p in cover if p.keyless))
        except (RegistryUnavailable, AuthError) as e:
            log.warning("cache signature not verified: registry did not answer",
                        extra=kv(key=key, digest=pin.digest, error=str(e)))
            return self._unanswered(old, pin.digest, tags, cover, quoted(e))
        except ImageError as e:  # garbled signature manifests: a refusal, not an outage
            verdict = sg.Verdict(False, sg.BAD_SIGNATURE, f"unreadable signature data: {quoted(e)}")
        out = Outcome("True" if verdict.ok else "False", verdict.reason, f"{verdict.message} ({under})",
                      verdict=_same(old, Verdict(pin.digest, tags, verdict.ok, verdict.reason, now, formats,
                                                 verdict.key or "", verdict.fingerprint or "")))
        log.info("cache signature verified", extra=kv(key=key, digest=pin.digest, verified=verdict.ok,
                                                      reason=verdict.reason, policies=",".join(tags)))
        self._remember(memo, out)
        return out

    @staticmethod
    def _restored(obj: dict, old: Verdict) -> Outcome:
        """The outcome a verdict in status stands for (the condition's text kept for people when it
        is about that verdict; never read for anything else)."""
        cond = next((c for c in (obj.get("status") or {}).get("conditions") or ()
                     if isinstance(c, dict) and c.get("type") == VERIFIED), None) or {}
        status = "True" if old.verified else "False"
        message = cond.get("message") if (cond.get("status"), cond.get("reason")) == (status, old.reason) else None
        return Outcome(status, old.reason, str(message or f"{old.reason}: verdict of {old.time} on {old.digest}"),
                       verdict=old)

    @staticmethod
    def _unanswered(old: Verdict | None, digest: str, tags: tuple[str, ...], cover: list[Policy],
                    error: str) -> Outcome:
        """The registry did not answer. The last verdict stays usable only for this same digest,
        and an acceptance only while the key (or identity) that accepted it is still trusted by a
        covering policy: it is then carried to the covering set of now, marked stale. Otherwise
        there is no verdict (nodes refuse)."""
        keep = old is not None and old.digest == digest and (
            not old.verified or old.fingerprint in set().union(*(p.fingerprints() for p in cover)))
        if not keep:
            return Outcome("Unknown", UNAVAILABLE, f"signatures of {digest} not read yet: {error}", retry=True)
        status = "True" if old.verified else "False"
        signer = f" by {old.signer}" if old.signer else ""
        return Outcome(status, STALE, f"could not verify {digest} again under policies {', '.join(tags) or 'none'} "
                                      f"(registry: {error}); keeping the verdict of {old.time}"
                                      f"{signer}{'' if old.verified else ' (refused)'}", retry=True,
                       verdict=dataclasses.replace(old, policies=tags, reason=STALE))

    def _remember(self, memo: tuple, out: Outcome) -> None:
        with self._lock:
            self._verdicts[memo] = out
            if len(self._verdicts) > MAX_VERDICTS:
                for k in list(self._verdicts)[:MAX_VERDICTS // 4]:
                    del self._verdicts[k]
