"""Capability: TPU node groups on GCE (docs/tpu-node-groups.md), run with ``--tpu-node-groups``.

* :mod:`.reconciler` — the reconcilers, and the map of the modules below by responsibility:
  :mod:`.policy` (the operator's rules), :mod:`.children` (workload policy, instance template,
  MIG), :mod:`.group` (``TPUNodeGroup``), :mod:`.nodes` (membership, join, labels, drain),
  :mod:`.devplugin`, :mod:`.common`.
* :mod:`.compute` — the GCE Compute API as those reconcilers use it.
* :mod:`.generations` — TPU generations: machine types, topologies, chips per host.
* :mod:`.jointokens` — the kubeadm bootstrap tokens written into the VMs' metadata (docs/bootstrap.md).
"""
