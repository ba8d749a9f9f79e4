"""``accelnode bootstrap``: joins a fresh node-group VM to the cluster (docs/bootstrap.md).

Runs before kubelet exists and shares nothing with the node daemons: :mod:`.poller` waits for the
join token in the GCE metadata and runs ``kubeadm join``; :mod:`.cli` is its command.
"""
