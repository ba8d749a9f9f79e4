"""DRA on the real kubelet with containerd 2: its own lane, apart from tests/node's package-scoped deployment."""
