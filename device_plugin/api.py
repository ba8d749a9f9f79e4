"""The kubelet device-plugin API (package ``v1beta1``): the only module of this component that
imports generated stubs; everything else uses the names re-exported here."""

import re

from accelnode.pb import deviceplugin_pb2 as _dp
from accelnode.pb import deviceplugin_pb2_grpc as _dp_grpc

VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
KUBELET_CHECKPOINT = "kubelet_internal_checkpoint"
_QUALIFIED = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def is_extended_resource_name(name: str) -> bool:
    """kubelet's rule: a qualified <domain>/<name>, not in the kubernetes.io namespaces, no "requests." prefix."""
    m = _QUALIFIED.match(name)
    if not m or name.startswith("requests."):
        return False
    domain = m.group(1)
    return not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io"))


AllocateRequest = _dp.AllocateRequest
AllocateResponse = _dp.AllocateResponse
ContainerAllocateRequest = _dp.ContainerAllocateRequest
ContainerAllocateResponse = _dp.ContainerAllocateResponse
ContainerPreferredAllocationRequest = _dp.ContainerPreferredAllocationRequest
ContainerPreferredAllocationResponse = _dp.ContainerPreferredAllocationResponse
Device = _dp.Device
DevicePluginOptions = _dp.DevicePluginOptions
DeviceSpec = _dp.DeviceSpec
Empty = _dp.Empty
ListAndWatchResponse = _dp.ListAndWatchResponse
NUMANode = _dp.NUMANode
PreferredAllocationRequest = _dp.PreferredAllocationRequest
PreferredAllocationResponse = _dp.PreferredAllocationResponse
PreStartContainerResponse = _dp.PreStartContainerResponse
RegisterRequest = _dp.RegisterRequest
TopologyInfo = _dp.TopologyInfo

DevicePluginServicer = _dp_grpc.DevicePluginServicer
DevicePluginStub = _dp_grpc.DevicePluginStub
RegistrationServicer = _dp_grpc.RegistrationServicer
RegistrationStub = _dp_grpc.RegistrationStub
add_DevicePluginServicer_to_server = _dp_grpc.add_DevicePluginServicer_to_server
add_RegistrationServicer_to_server = _dp_grpc.add_RegistrationServicer_to_server

