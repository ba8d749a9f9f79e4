"""Capability: TPU node groups on GCE (docs/tpu-node-groups.md), run with ``--tpu-node-groups``.

* :mod:`.reconciler` — ``TPUNodeGroup`` and its children: workload policy, instance template, MIG.
* :mod:`.compute` — the GCE Compute API as those reconcilers use it.
* :mod:`.generations` — TPU generations: machine types, topologies, chips per host.
* :mod:`.jointokens` — the kubeadm bootstrap tokens written into the VMs' metadata (docs/bootstrap.md).
"""
