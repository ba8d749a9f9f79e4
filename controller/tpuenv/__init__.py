"""Capability: the TPU worker environment of StatefulSets, Indexed Jobs and JobSets (docs/tpu-env.md).

* :mod:`.patches` — the environment as JSON Patches; pure.
* :mod:`.webhooks` — the admission routes that apply them.
* :mod:`.scale` — the reconciler that recomputes them when a StatefulSet is scaled through ``/scale``.
"""
