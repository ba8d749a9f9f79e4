"""accelnode: node-level software for Kubernetes accelerator nodes.

This package holds what every component shares: the ``accelnode`` CLI, structured logging,
the metrics/readiness HTTP endpoint, unix-socket gRPC helpers and the generated protobuf
stubs (``accelnode.pb``; business code imports them through each component's own module).
"""

__version__ = "0.1.0"  # semantic versioning: CHANGELOG.md; pyproject.toml and the image tag follow it

# The image every manifest names (daemonsets/, docs/deploy.md); kustomize `images:` swaps it for
# an operator's own registry.
IMAGE_REPOSITORY = "ghcr.io/accelnode/accelnode"
IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
