"""The kubelet DRA plugin API (v1 and v1beta1, the same messages), the device health API
(v1 and v1alpha1, the same messages) and plugin registration: the only module of
``accelnode dra`` that imports generated stubs."""

from accelnode.pb import dra_health_v1_pb2 as health_v1
from accelnode.pb import dra_health_v1_pb2_grpc as health_v1_grpc
from accelnode.pb import dra_health_v1alpha1_pb2 as health_v1alpha1
from accelnode.pb import dra_health_v1alpha1_pb2_grpc as health_v1alpha1_grpc
from accelnode.pb import dra_v1_pb2 as v1
from accelnode.pb import dra_v1_pb2_grpc as v1_grpc
from accelnode.pb import dra_v1beta1_pb2 as v1beta1
from accelnode.pb import dra_v1beta1_pb2_grpc as v1beta1_grpc
from accelnode.pb import pluginregistration_pb2 as reg
from accelnode.pb import pluginregistration_pb2_grpc as reg_grpc

PLUGIN_TYPE = "DRAPlugin"
# gRPC service names, in our order of preference: kubelet takes the first it speaks
SERVICES = {"v1.DRAPlugin": (v1, v1_grpc), "v1beta1.DRAPlugin": (v1beta1, v1beta1_grpc)}
# the optional DRAResourceHealth service: kubelet 1.37 takes the first of its own list (v1, then
# v1alpha1) that the registration names
HEALTH_SERVICES = {"v1.DRAResourceHealth": (health_v1, health_v1_grpc),
                   "v1alpha1.DRAResourceHealth": (health_v1alpha1, health_v1alpha1_grpc)}

InfoRequest = reg.InfoRequest
PluginInfo = reg.PluginInfo
RegistrationStatus = reg.RegistrationStatus
RegistrationStatusResponse = reg.RegistrationStatusResponse
RegistrationServicer = reg_grpc.RegistrationServicer
RegistrationStub = reg_grpc.RegistrationStub
add_RegistrationServicer_to_server = reg_grpc.add_RegistrationServicer_to_server
