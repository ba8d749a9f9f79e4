"""The generated protobuf code the CSI driver uses, in one place.

``csi`` holds the CSI v1 messages and ``csi_grpc`` its servicers/stubs; ``agent``/``agent_grpc``
the node agent's API; ``reg``/``reg_grpc`` kubelet's plugin-registration API. Business code
imports these names, never ``*_pb2`` modules directly.
"""

from accelnode.pb import agent_pb2 as agent
from accelnode.pb import agent_pb2_grpc as agent_grpc
from accelnode.pb import csi_pb2 as csi
from accelnode.pb import csi_pb2_grpc as csi_grpc
from accelnode.pb import pluginregistration_pb2 as reg
from accelnode.pb import pluginregistration_pb2_grpc as reg_grpc

__all__ = ["agent", "agent_grpc", "csi", "csi_grpc", "reg", "reg_grpc"]
