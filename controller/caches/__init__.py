"""Capability: kernel caches (GKMCache, ClusterGKMCache) in the cluster (docs/cache-controller.md).

* :mod:`.pinning` — ``spec.image`` to a digest; the names the pin is recorded under.
* :mod:`.reconciler` — pins each cache and sums the nodes' reports into its status (:mod:`.status`).
* :mod:`.signatures` — cosign verification against ``ClusterCacheTrustPolicy`` (docs/signatures.md).
* :mod:`.claims` — the PV/PVC pair per workload namespace (objects in :mod:`.volumes`; docs/cache-claims.md).
* :mod:`.webhooks` — the caches' admission webhooks (docs/cache-webhooks.md).
"""
