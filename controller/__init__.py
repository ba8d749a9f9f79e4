"""``accelnode controller``: the cluster half (docs/architecture.md, docs/controller.md).

* :mod:`.runtime` — leader election, watches, work queue, reconciler contract, conditional writes.
* :mod:`.webhooks` — the admission server and its certificates.
* Capabilities, each using only the two above: :mod:`.caches`, :mod:`.tpuenv`, :mod:`.nodegroups`.
* :mod:`.cli` — the wiring: flags, which reconcilers and routes run.
"""
