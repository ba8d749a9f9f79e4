"""A cache's capture settings (``accelnode.io/capture*`` annotations on a GKMCache) checked
against the operator's rules (docs/capture.md, "Settings").

The cache's author (a namespace admin) chooses: capture on or off, the repository to push to,
the push credentials (a ``kubernetes.io/dockerconfigjson`` Secret of the namespace, lent to the
controller by a Role as pull secrets are), the signing key (a Secret of the namespace, or none)
and promotion (manual or auto, with the fewest contributing pods). The operator chooses which
repositories each namespace may push to (``--capture-repositories``: JSON, namespace or ``"*"``
-> repository prefixes; a namespace's own entry replaces ``"*"``) and whether an unsigned
capture may be promoted automatically (never: auto needs a signing key).

Only a namespaced GKMCache captures: a ClusterGKMCache is mounted by pods of many namespaces,
and what one tenant's pod wrote must never reach another tenant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from accelnode.decode import SMALL, DocumentError, read_file
from accelnode.oci.errors import InvalidReference
from accelnode.oci.reference import Reference

PREFIX = "accelnode.io/capture"
ON = PREFIX
REPOSITORY = f"{PREFIX}-repository"
PUSH_SECRET = f"{PREFIX}-push-secret"
SIGNING_SECRET = f"{PREFIX}-signing-secret"
PROMOTION = f"{PREFIX}-promotion"
MIN_PODS = f"{PREFIX}-min-pods"
KNOWN = (ON, REPOSITORY, PUSH_SECRET, SIGNING_SECRET, PROMOTION, MIN_PODS)
MANUAL, AUTO = "manual", "auto"
MAX_MIN_PODS = 1000
_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_WALKS = re.compile(r"\.\.|[%\\?#@\s]")


class BadSettings(ValueError):
    """Capture settings that are refused; the message names the annotation."""


@dataclass(frozen=True)
class Settings:
    repository: str  # HOST/REPO, no tag or digest
    push_secret: str
    signing_secret: str | None
    promotion: str
    min_pods: int


@dataclass(frozen=True)
class Rules:
    """The operator's ``--capture-repositories``: namespace (or ``*``) -> allowed prefixes."""

    prefixes: dict[str, tuple[str, ...]]

    @classmethod
    def load(cls, path: str) -> Rules:
        doc = read_file(path, SMALL, "--capture-repositories")
        out = {}
        for ns, prefixes in doc.items():
            if not isinstance(prefixes, list) or not all(isinstance(p, str) and p for p in prefixes):
                raise DocumentError("--capture-repositories", f"{ns!r}: expected a list of repository prefixes")
            out[ns] = tuple(prefixes)
        return cls(out)

    def allows(self, namespace: str, repository: str) -> bool:
        """``repository`` equals an entry of the namespace's rule that does not end in ``/``, or
        lies below one that does, with no ``..`` or URL syntax past it (no prefix is walked out of)."""
        for p in self.prefixes.get(namespace, self.prefixes.get("*", ())):
            if repository == p and not p.endswith("/"):
                return True
            if p.endswith("/") and repository.startswith(p) and not _WALKS.search(repository[len(p):]):
                return True
        return False


def parse(cache: dict, rules: Rules) -> Settings | None:
    """The capture settings of a cache object, None when capture is off or not asked;
    :class:`BadSettings` naming the annotation when they are refused."""
    meta = cache.get("metadata") or {}
    notes = meta.get("annotations") or {}
    unknown = [k for k in notes if k.startswith(PREFIX) and k not in KNOWN]
    if unknown:
        raise BadSettings(f"annotation {unknown[0][:80]!r} is not known; capture annotations are {', '.join(KNOWN)}")
    on = notes.get(ON)
    if on in (None, "off", "false"):
        return None
    if on not in ("on", "true"):
        raise BadSettings(f"annotation {ON} is {on[:40]!r}: expected on or off")
    if cache.get("kind") != "GKMCache" or not meta.get("namespace"):
        raise BadSettings(f"{ON}: only a namespaced GKMCache captures (a ClusterGKMCache is shared by tenants)")
    ns = meta["namespace"]
    repo = notes.get(REPOSITORY, "")
    try:
        ref = Reference.parse(repo)
        if ref.tag or ref.digest or f"{ref.host}/{ref.repository}" != repo:
            raise ValueError("no tag or digest")
    except (ValueError, InvalidReference) as e:
        raise BadSettings(f"annotation {REPOSITORY} is {repo[:120]!r}: expected HOST/REPOSITORY "
                          f"with no tag or digest ({str(e)[:80]})") from None
    if not rules.allows(ns, repo):
        raise BadSettings(f"annotation {REPOSITORY}: namespace {ns} may not push to {repo[:120]!r} "
                          "(the operator's --capture-repositories)")
    push = notes.get(PUSH_SECRET, "")
    if not _SECRET_NAME.fullmatch(push):
        raise BadSettings(f"annotation {PUSH_SECRET} must name a Secret of namespace {ns}")
    signing = notes.get(SIGNING_SECRET) or None
    if signing is not None and not _SECRET_NAME.fullmatch(signing):
        raise BadSettings(f"annotation {SIGNING_SECRET} must name a Secret of namespace {ns}")
    promotion = notes.get(PROMOTION, MANUAL)
    if promotion not in (MANUAL, AUTO):
        raise BadSettings(f"annotation {PROMOTION} is {promotion[:40]!r}: expected {MANUAL} or {AUTO}")
    if promotion == AUTO and signing is None:
        raise BadSettings(f"annotation {PROMOTION}: {AUTO} needs {SIGNING_SECRET} (an unsigned capture is "
                          "only offered, never rolled out by itself)")
    raw = notes.get(MIN_PODS, "1")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_MIN_PODS:
        raise BadSettings(f"annotation {MIN_PODS} is {raw[:20]!r}: expected 1 to {MAX_MIN_PODS}")
    return Settings(repo, push, signing, promotion, int(raw))
