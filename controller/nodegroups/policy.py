"""What the node groups of a namespace may ask of GCE: the operator's rules, never the group's
author's (docs/tpu-node-groups.md, "Operator rules"; docs/security.md).

A namespace admin writes a ``TPUNodeGroup``; the VMs it makes run with the cluster's join token
and become nodes. Everything that decides what runs on those VMs, where, and as whom is therefore
the operator's: the project and zone, the boot image, the service account and its scopes, the
subnetwork and network tags (firewall rules select VMs by tag), every metadata key
(``startup-script``, ``startup-script-url``, ``user-data``, ``ssh-keys``, the ``accelnode-*-url``
install sources ... are code or access), an existing instance template, ``deletionPolicy:
Orphan`` and how many join tokens the namespace may hold.

The rules come from one JSON file (``--node-group-placement``), a rule per namespace or ``"*"``
for every namespace not named; a namespace's own rule replaces ``"*"``, it does not add to it.
Each list holds *patterns*: a value is allowed when it equals one, when the pattern is ``*``
(any value), or when the pattern ends in ``*`` and the value starts with what precedes it and,
past that prefix, holds no ``..``, ``%``, ``\\``, ``?``, ``#``, ``@`` nor white space (a URL
prefix cannot be walked out of). A field the
rule does not mention allows nothing but its default. :func:`Policy.group` returns one
:class:`Refusal` per field that is not allowed, each naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from accelnode.kube.bootstraptoken import METADATA_KEYS

# Metadata the controller or GCE writes: never the group author's, whatever a rule says.
RESERVED_METADATA = frozenset({"kube-labels", "created-by", *METADATA_KEYS})
DEFAULT_SUBNETWORKS = ("default",)  # the CRD's default: a group that names none
DEFAULT_JOIN_TOKENS = 16  # live join tokens per namespace (a token per waiting VM)
_WALKS = re.compile(r"\.\.|[%\\?#@\s]")
_KEYS = {"projects", "zones", "images", "serviceAccounts", "subnetworks", "networkTags", "metadata",
         "instanceTemplates", "deletionPolicies", "maxJoinTokens"}


def matches(patterns: tuple[str, ...], value: str) -> bool:
    """Whether ``value`` is allowed by one of ``patterns`` (exact, ``*``, or ``prefix*``)."""
    for p in patterns:
        if p == value or p == "*":
            return True
        if p.endswith("*") and value.startswith(p[:-1]) and not _WALKS.search(value[len(p) - 1:]):
            return True
    return False


@dataclass(frozen=True)
class ServiceAccount:
    email: str
    scopes: tuple[str, ...]


@dataclass(frozen=True)
class Refusal:
    """One field of a group that its namespace may not use."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class Rule:
    projects: tuple[str, ...]
    zones: tuple[str, ...] | None = None  # None: any zone
    images: tuple[str, ...] = ()
    service_accounts: tuple[ServiceAccount, ...] = ()
    subnetworks: tuple[str, ...] = DEFAULT_SUBNETWORKS
    network_tags: tuple[str, ...] = ()  # firewall rules select VMs by tag
    metadata: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> value patterns
    instance_templates: tuple[str, ...] = ()
    deletion_policies: tuple[str, ...] = ("Delete",)
    max_join_tokens: int = DEFAULT_JOIN_TOKENS

    @classmethod
    def parse(cls, name: str, raw) -> "Rule":
        """A rule from its JSON; ValueError naming the namespace and field when malformed."""
        def strings(key: str, default=()):
            v = raw.get(key, default)
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
                raise ValueError(f"{name}.{key}: expected a list of non-empty strings")
            return tuple(v)

        if not isinstance(raw, dict) or not set(raw) <= _KEYS:
            raise ValueError(f"{name}: expected an object with keys among {sorted(_KEYS)}")
        if "projects" not in raw:
            raise ValueError(f"{name}.projects: required")
        accounts = raw.get("serviceAccounts", [])
        if not isinstance(accounts, list) or not all(
                isinstance(a, dict) and set(a) == {"email", "scopes"} and isinstance(a["email"], str)
                and isinstance(a["scopes"], list) and all(isinstance(s, str) for s in a["scopes"]) for a in accounts):
            raise ValueError(f'{name}.serviceAccounts: expected [{{"email": "...", "scopes": ["..."]}}]')
        md = raw.get("metadata", {})
        if not isinstance(md, dict) or not all(
                isinstance(v, list) and all(isinstance(x, str) and x for x in v) for v in md.values()):
            raise ValueError(f'{name}.metadata: expected {{"<key>": ["<value pattern>", ...]}}')
        reserved = sorted(RESERVED_METADATA & set(md))
        if reserved:
            raise ValueError(f"{name}.metadata: {reserved} are written by the controller or GCE, never by a group")
        policies = strings("deletionPolicies", ("Delete",))
        if not set(policies) <= {"Delete", "Orphan"}:
            raise ValueError(f"{name}.deletionPolicies: Delete and/or Orphan")
        tokens = raw.get("maxJoinTokens", DEFAULT_JOIN_TOKENS)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= 64:
            raise ValueError(f"{name}.maxJoinTokens: an integer from 0 to 64 (the pool's size)")
        return cls(projects=strings("projects"), zones=strings("zones") if "zones" in raw else None,
                   images=strings("images"), service_accounts=tuple(
                       ServiceAccount(a["email"], tuple(a["scopes"])) for a in accounts),
                   subnetworks=strings("subnetworks", DEFAULT_SUBNETWORKS), network_tags=strings("networkTags"),
                   metadata={k: tuple(v) for k, v in md.items()},
                   instance_templates=strings("instanceTemplates"), deletion_policies=policies,
                   max_join_tokens=tokens)


class Policy:
    """The operator's rules, per namespace (``"*"``: every namespace without its own)."""

    def __init__(self, rules: dict[str, Rule]):
        self.rules = rules

    @classmethod
    def parse(cls, raw) -> "Policy":
        if not isinstance(raw, dict):
            raise ValueError('expected {"<namespace>" or "*": {"projects": ["..."], ...}}')
        return cls({ns: Rule.parse(ns, r) for ns, r in raw.items()})

    @classmethod
    def own_project(cls, project: str | None) -> "Policy":
        """Without a file: the controller's own project, any zone, nothing else."""
        return cls({"*": Rule(projects=(project,))} if project else {})

    def rule(self, namespace: str) -> Rule | None:
        return self.rules.get(namespace) or self.rules.get("*")

    def placement(self, namespace: str, project: str, zone: str | None = None,
                  region: str | None = None) -> Refusal | None:
        """Why a group in ``namespace`` may not use ``project`` (and ``zone`` or ``region``)."""
        rule = self.rule(namespace)
        if rule is None:
            return Refusal("spec.project", f"namespace {namespace} may not create node groups in any GCE project: "
                                           "the operator allows projects per namespace (--node-group-placement, "
                                           "--gce-project; docs/security.md)")
        if project not in rule.projects:
            return Refusal("spec.project", f"GCE project {project!r} is not allowed for namespace {namespace} "
                                           f"(allowed: {list(rule.projects)})")
        if rule.zones is not None and zone is not None and zone not in rule.zones:
            return Refusal("spec.nodeLocation", f"zone {zone!r} is not allowed for namespace {namespace} "
                                                f"(allowed: {list(rule.zones)})")
        if rule.zones is not None and region is not None and not any(z.rsplit("-", 1)[0] == region
                                                                     for z in rule.zones):
            return Refusal("spec.region", f"region {region!r} is not allowed for namespace {namespace} "
                                          f"(allowed zones: {list(rule.zones)})")
        return None

    def group(self, namespace: str, spec: dict) -> list[Refusal]:
        """Every field of a TPUNodeGroup's ``spec`` that its namespace may not use (placement
        first: without a rule nothing else is looked at)."""
        where = self.placement(namespace, spec.get("project", ""), spec.get("nodeLocation"))
        if where is not None:
            return [where]
        rule = self.rule(namespace)
        out = []
        if spec.get("instanceTemplateURI") is not None and not matches(rule.instance_templates,
                                                                       spec["instanceTemplateURI"]):
            out.append(Refusal("spec.instanceTemplateURI", _not_allowed(namespace, spec["instanceTemplateURI"],
                                                                        rule.instance_templates)))
        out += self.instance(namespace, spec.get("instanceConfig") or {}, "spec.instanceConfig")
        if spec.get("deletionPolicy", "Delete") not in rule.deletion_policies:
            out.append(Refusal("spec.deletionPolicy", _not_allowed(namespace, spec["deletionPolicy"],
                                                                   rule.deletion_policies)))
        return out

    def instance(self, namespace: str, ic: dict, at: str, controller_keys: tuple[str, ...] = ()) -> list[Refusal]:
        """What runs on the VMs (``instanceConfig``, or an InstanceTemplate child's spec at
        ``at``): boot image, service accounts and scopes, subnetwork, metadata. A
        ``controller_keys`` metadata key is left to the caller (the controller wrote it)."""
        rule = self.rule(namespace)
        if rule is None:
            return [Refusal(at, f"namespace {namespace} may not create node groups (no rule)")]
        out = []
        if ic.get("image") is not None and not matches(rule.images, ic["image"]):
            out.append(Refusal(f"{at}.image", _not_allowed(namespace, ic["image"], rule.images)))
        subnet = ic.get("subnetwork") or "default"
        if not matches(rule.subnetworks, subnet):
            out.append(Refusal(f"{at}.subnetwork", _not_allowed(namespace, subnet, rule.subnetworks)))
        tags = [t for t in ic.get("networkTags") or [] if not matches(rule.network_tags, t)]
        if tags:
            out.append(Refusal(f"{at}.networkTags", _not_allowed(namespace, tags, rule.network_tags)))
        for i, sa in enumerate(ic.get("serviceAccounts") or []):
            allowed = next((a for a in rule.service_accounts if a.email == sa.get("email")), None)
            if allowed is None:
                out.append(Refusal(f"{at}.serviceAccounts[{i}].email", _not_allowed(
                    namespace, sa.get("email"), tuple(a.email for a in rule.service_accounts))))
                continue
            extra = [s for s in sa.get("scopes") or [] if s not in allowed.scopes]
            if extra:
                out.append(Refusal(f"{at}.serviceAccounts[{i}].scopes", f"{extra} not allowed for {allowed.email} "
                                   f"in namespace {namespace} (allowed: {list(allowed.scopes)})"))
        for key, value in sorted((ic.get("metadata") or {}).items()):
            if key in controller_keys:
                continue
            if key in RESERVED_METADATA:
                out.append(Refusal(f"{at}.metadata.{key}", "written by the controller or GCE, never by a group"))
            elif key not in rule.metadata:
                out.append(Refusal(f"{at}.metadata.{key}", f"key not allowed in namespace {namespace} "
                                   f"(allowed keys: {sorted(rule.metadata)})"))
            elif not matches(rule.metadata[key], value):
                out.append(Refusal(f"{at}.metadata.{key}", _not_allowed(namespace, value, rule.metadata[key])))
        return out

    def orphan_allowed(self, namespace: str) -> bool:
        rule = self.rule(namespace)
        return rule is not None and "Orphan" in rule.deletion_policies

    def max_join_tokens(self, namespace: str) -> int:
        rule = self.rule(namespace)
        return rule.max_join_tokens if rule is not None else 0


def _not_allowed(namespace: str, value, allowed: tuple) -> str:
    shown = value if not isinstance(value, str) or len(value) <= 200 else value[:200] + "..."
    return f"{shown!r} is not allowed in namespace {namespace} (allowed: {list(allowed)})"
