"""accelnode: node-level software for Kubernetes accelerator nodes.

This package holds what every component shares: the ``accelnode`` CLI, structured logging,
the metrics/readiness HTTP endpoint, unix-socket gRPC helpers and the generated protobuf
stubs (``accelnode.pb``; business code imports them through each component's own module).
"""

__version__ = "0.1.0"
