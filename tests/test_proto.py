"""Our .proto files against upstream: stubs are fresh, and every RPC path is upstream's.

The tables below are written from the upstream API definitions (kubelet device plugin v1beta1,
kubelet plugin registration, CSI v1). Every service defined in proto/ must be listed here (or be
one of accelnode's own APIs, package ``accelnode.*``, which have no upstream), and every RPC it
defines must have exactly the upstream full method path — the string a peer (kubelet,
csi-sanity) puts on the wire.
"""

import importlib
import importlib.util
from pathlib import Path

import pytest

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("protogen", ROOT / "tools" / "protogen.py")
protogen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(protogen)

PROTO_DIR = Path(protogen.PROTO_DIR)

UPSTREAM = {
    "v1beta1.Registration": ["Register"],
    "v1beta1.DevicePlugin": ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
                             "PreStartContainer"],
    "pluginregistration.Registration": ["GetInfo", "NotifyRegistrationStatus"],
    **{f"k8s.io.kubelet.pkg.apis.dra.{v}.DRAPlugin": ["NodePrepareResources", "NodeUnprepareResources"]
       for v in ("v1", "v1beta1")},
    **{f"{v}.DRAResourceHealth": ["NodeWatchResources"] for v in ("v1", "v1alpha1")},
    "csi.v1.Identity": ["GetPluginInfo", "GetPluginCapabilities", "Probe"],
    "csi.v1.Controller": ["CreateVolume", "DeleteVolume", "ControllerPublishVolume", "ControllerUnpublishVolume",
                          "ValidateVolumeCapabilities", "ListVolumes", "GetCapacity", "ControllerGetCapabilities",
                          "CreateSnapshot", "DeleteSnapshot", "ListSnapshots", "ControllerExpandVolume",
                          "ControllerGetVolume", "ControllerModifyVolume"],
    "csi.v1.GroupController": ["GroupControllerGetCapabilities", "CreateVolumeGroupSnapshot",
                               "DeleteVolumeGroupSnapshot", "GetVolumeGroupSnapshot"],
    "csi.v1.SnapshotMetadata": ["GetMetadataAllocated", "GetMetadataDelta"],
    "csi.v1.Node": ["NodeStageVolume", "NodeUnstageVolume", "NodePublishVolume", "NodeUnpublishVolume",
                    "NodeGetVolumeStats", "NodeExpandVolume", "NodeGetCapabilities", "NodeGetInfo"],
}
# kubelet's APIs are ours in full: every upstream RPC must be there, with upstream streaming
COMPLETE = {"v1beta1.Registration", "v1beta1.DevicePlugin", "pluginregistration.Registration",
            "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
            "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"}
SERVER_STREAMING = {"/v1beta1.DevicePlugin/ListAndWatch", "/csi.v1.SnapshotMetadata/GetMetadataAllocated",
                    "/csi.v1.SnapshotMetadata/GetMetadataDelta",
                    "/v1.DRAResourceHealth/NodeWatchResources", "/v1alpha1.DRAResourceHealth/NodeWatchResources"}
OWN_PREFIX = "accelnode."

# message -> {field: number} for the kubelet APIs (wire compatibility beyond the paths)
FIELDS = {
    "v1beta1.DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
    "v1beta1.RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
    "v1beta1.ListAndWatchResponse": {"devices": 1},
    "v1beta1.TopologyInfo": {"nodes": 1},
    "v1beta1.NUMANode": {"ID": 1},
    "v1beta1.Device": {"ID": 1, "health": 2, "topology": 3},
    "v1beta1.PreStartContainerRequest": {"devices_ids": 1},
    "v1beta1.PreferredAllocationRequest": {"container_requests": 1},
    "v1beta1.ContainerPreferredAllocationRequest": {"available_deviceIDs": 1, "must_include_deviceIDs": 2,
                                                    "allocation_size": 3},
    "v1beta1.PreferredAllocationResponse": {"container_responses": 1},
    "v1beta1.ContainerPreferredAllocationResponse": {"deviceIDs": 1},
    "v1beta1.AllocateRequest": {"container_requests": 1},
    "v1beta1.ContainerAllocateRequest": {"devices_ids": 1},
    "v1beta1.AllocateResponse": {"container_responses": 1},
    "v1beta1.ContainerAllocateResponse": {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5},
    "v1beta1.Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
    "v1beta1.DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
    "v1beta1.CDIDevice": {"name": 1},
    "pluginregistration.PluginInfo": {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4},
    "pluginregistration.RegistrationStatus": {"plugin_registered": 1, "error": 2},
}
# the DRA plugin API (k8s.io/kubelet/pkg/apis/dra/{v1,v1beta1}/api.proto at v0.35.4): the same
# messages in both versions, but for Device.share_id (v1 only)
for _v in ("v1", "v1beta1"):
    _p = f"k8s.io.kubelet.pkg.apis.dra.{_v}"
    FIELDS.update({
        f"{_p}.NodePrepareResourcesRequest": {"claims": 1},
        f"{_p}.NodePrepareResourcesResponse": {"claims": 1},
        f"{_p}.NodePrepareResourceResponse": {"devices": 1, "error": 2},
        f"{_p}.Device": {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4,
                         **({"share_id": 5} if _v == "v1" else {})},
        f"{_p}.NodeUnprepareResourcesRequest": {"claims": 1},
        f"{_p}.NodeUnprepareResourcesResponse": {"claims": 1},
        f"{_p}.NodeUnprepareResourceResponse": {"error": 1},
        f"{_p}.Claim": {"namespace": 1, "uid": 2, "name": 3},
    })
# the DRA health API (k8s.io/kubelet/pkg/apis/dra-health/{v1,v1alpha1}/api.proto at v0.37.2): the
# same messages in both versions
for _v in ("v1", "v1alpha1"):
    FIELDS.update({
        f"{_v}.NodeWatchResourcesRequest": {},
        f"{_v}.DeviceIdentifier": {"pool_name": 1, "device_name": 2},
        f"{_v}.DeviceHealth": {"device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4,
                               "message": 5},
        f"{_v}.NodeWatchResourcesResponse": {"devices": 1},
    })

PROTOS = sorted(PROTO_DIR.glob("*.proto"))


def modules(proto: Path):
    return (importlib.import_module(f"accelnode.pb.{proto.stem}_pb2"),
            importlib.import_module(f"accelnode.pb.{proto.stem}_pb2_grpc"))


def test_generated_stubs_are_fresh():
    stale = protogen.check()
    assert stale == [], f"stale or missing stubs in accelnode/pb: {stale}; run `make proto`"


def test_kubelet_protos_exist():
    assert {p.name for p in PROTOS} >= {"deviceplugin.proto", "pluginregistration.proto"}


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_every_rpc_has_the_upstream_method_path(proto):
    pb2, grpc_mod = modules(proto)
    source = Path(grpc_mod.__file__).read_text()
    for service in pb2.DESCRIPTOR.services_by_name.values():
        if service.full_name.startswith(OWN_PREFIX):
            continue
        assert service.full_name in UPSTREAM, f"{proto.name}: service {service.full_name} is not an upstream service"
        ours = [m.name for m in service.methods]
        unknown = set(ours) - set(UPSTREAM[service.full_name])
        assert not unknown, f"{service.full_name}: RPCs not in upstream: {sorted(unknown)}"
        if service.full_name in COMPLETE:
            assert sorted(ours) == sorted(UPSTREAM[service.full_name])
        for m in service.methods:
            path = f"/{service.full_name}/{m.name}"
            assert f"'{path}'" in source, f"{path} not in the generated stub {Path(grpc_mod.__file__).name}"
            assert m.server_streaming == (path in SERVER_STREAMING), path
            assert not m.client_streaming, path


def test_kubelet_field_numbers():
    from google.protobuf import descriptor_pool

    for proto in ("deviceplugin", "pluginregistration", "dra_v1", "dra_v1beta1", "dra_health_v1",
                  "dra_health_v1alpha1"):
        importlib.import_module(f"accelnode.pb.{proto}_pb2")  # adds its messages to the pool
    pool = descriptor_pool.Default()
    for message, fields in FIELDS.items():
        desc = pool.FindMessageTypeByName(message)
        assert {f.name: f.number for f in desc.fields} == fields, message
    for v in ("v1", "v1alpha1"):  # kubelet maps these numbers to Unknown, Healthy, Unhealthy
        status = pool.FindEnumTypeByName(f"{v}.HealthStatus")
        assert {e.name: e.number for e in status.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
