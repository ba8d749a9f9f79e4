"""The controller runtime: what runs reconcilers, kept apart from any capability (docs/architecture.md).

* :mod:`.reconciler` — the contract: ``Reconciler``, ``Watch``, ``Result``, the watch cache.
* :mod:`.runner` — one reconciler's watches feeding a work queue (:mod:`.queue`) and its workers.
* :mod:`.manager` — every runner of the process, started only while it leads (:mod:`.leader`).
* :mod:`.writes` — conditional writes: nothing is written unless something changed.
* :mod:`.conditions` — ``accelnode_controller_conditions``, read from the runners' caches.

Capabilities import from here and from :mod:`controller.webhooks`, never from each other
(tests/test_layers.py).
"""
