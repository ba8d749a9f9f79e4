"""CSI Identity service, plus the one Controller RPC a node-only driver must answer.

csi-sanity v5.4.0's node suite calls ControllerGetCapabilities before every node spec even when
CONTROLLER_SERVICE is not advertised (kubernetes-csi/csi-test#595); an empty list fails its
not-nil check, so it gets a single UNKNOWN capability, which promises nothing.
"""

from __future__ import annotations

import grpc
from google.protobuf import wrappers_pb2

from accelnode import __version__, volumeattrs

from .api import agent, csi, csi_grpc

DRIVER_NAME = volumeattrs.DRIVER
PROBE_TIMEOUT = 2.0


class IdentityServer(csi_grpc.IdentityServicer):
    def __init__(self, agent_stub, agent_socket: str):
        self.agent = agent_stub
        self.agent_socket = agent_socket

    def GetPluginInfo(self, request, context):  # noqa: N802 (gRPC naming)
        return csi.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    def GetPluginCapabilities(self, request, context):  # noqa: N802
        # Node service only: no controller, no topology constraints, no expansion.
        return csi.GetPluginCapabilitiesResponse()

    def Probe(self, request, context):  # noqa: N802
        """Ready only while the node agent answers: without it nothing can be published."""
        try:
            self.agent.GetTarget(agent.GetTargetRequest(), timeout=PROBE_TIMEOUT)  # the cheapest call
        except grpc.RpcError:
            return csi.ProbeResponse(ready=wrappers_pb2.BoolValue(value=False))
        return csi.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))


class ControllerCapabilities(csi_grpc.ControllerServicer):
    def ControllerGetCapabilities(self, request, context):  # noqa: N802
        unknown = csi.ControllerServiceCapability.RPC(type=csi.ControllerServiceCapability.RPC.UNKNOWN)
        return csi.ControllerGetCapabilitiesResponse(capabilities=[csi.ControllerServiceCapability(rpc=unknown)])
