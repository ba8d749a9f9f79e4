"""Whose registry credentials a pull uses (docs/security.md): a cache's tenant's, never the node's
on a tenant's behalf.

* a ``GKMCache`` (namespaced): the pull secrets of its namespace's ``default`` ServiceAccount
  (:mod:`accelnode.kube.pullsecrets`); none: anonymous; unreadable: refused, never the node's;
* a ``ClusterGKMCache``: the node's credentials where the agent runs with
  ``--node-credentials-for-cluster-caches``, else anonymous;
* an image a pod's author named (``anonymous``): none at all;
* no cache named (an operator's request on the root-only socket, the prefetcher): the node's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from accelnode.kube.pullsecrets import PullSecretError, PullSecretReader
from accelnode.oci.registry import RegistryOptions

NODE_FLAG = "--node-credentials-for-cluster-caches"


@dataclass(frozen=True)
class Credentials:
    key: str  # names them in the agent's caches of pulls and proofs (never their content)
    options: RegistryOptions
    whose: str  # for messages
    prove: bool = True  # False: the node's own request; installed content needs no repository's word


class Chooser:
    def __init__(self, options: RegistryOptions, secrets: PullSecretReader | None, *,
                 node_for_cluster_caches: bool = False):
        self.secrets, self.node_for_cluster_caches = secrets, node_for_cluster_caches
        self.node = Credentials("node", options, "the node's credentials")
        self.own = Credentials("node", options, "the node's credentials", prove=False)
        self.anonymous = Credentials("anonymous", dataclasses.replace(options, config_file=None, anonymous=True,
                                                                      pull_secrets=()), "no credentials")

    def choose(self, cache: tuple[str, str] | None, anonymous: bool = False, *, fresh: bool = True) -> Credentials:
        """The credentials for a request naming ``cache`` ((namespace, name); namespace "" for a
        ClusterGKMCache). :class:`PullSecretError` when a namespace's secrets cannot be read.
        ``fresh=False``: a namespace's secrets as last read, however long ago (read only when
        never read): what the status reporter asks on every pass, so that an idle node reads
        nothing (docs/scale.md); a pull always asks fresh."""
        if anonymous:
            return self.anonymous
        if cache is None:
            return self.own
        namespace, name = cache
        if not namespace:
            if self.node_for_cluster_caches:
                return self.node
            return dataclasses.replace(self.anonymous, whose=f"no credentials (ClusterGKMCache {name}; the agent "
                                                             f"lends the node's only with {NODE_FLAG})")
        if self.secrets is None:
            return dataclasses.replace(self.anonymous, whose=f"no credentials (GKMCache {namespace}/{name}; this "
                                                             "agent has no API server to read pull secrets from)")
        found = self.secrets.of(namespace, fresh=fresh)
        if not found.secrets:
            return dataclasses.replace(self.anonymous, whose=f"no credentials ({found.why})")
        names = ", ".join(n for n, _ in found.secrets)
        return Credentials(found.key, dataclasses.replace(self.anonymous.options, anonymous=False,
                                                          pull_secrets=found.secrets),
                           f"the pull secrets of namespace {namespace} ({names})")

    def push(self, namespace: str, secret: str) -> RegistryOptions:
        """The registry options of a capture's push: the one Secret ``secret`` that ``namespace``
        lent (docs/capture.md), never the node's credentials nor its pull secrets.
        :class:`PullSecretError` when it cannot be read."""
        if self.secrets is None:
            raise PullSecretError("this agent has no API server to read capture push secrets from")
        found = self.secrets.named(namespace, secret, "capture push secret")
        return dataclasses.replace(self.anonymous.options, anonymous=False, pull_secrets=(found,))


__all__ = ["Chooser", "Credentials", "NODE_FLAG", "PullSecretError"]
