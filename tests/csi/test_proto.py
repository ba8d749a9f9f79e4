"""proto/csi.proto is wire-compatible with CSI spec v1.12: names, paths and field numbers that
kubelet and csi-sanity rely on (ecosystem reference §4)."""

from __future__ import annotations

import pytest

from csi_driver.api import csi

FIELDS = {
    "NodePublishVolumeRequest": {"volume_id": 1, "publish_context": 2, "staging_target_path": 3, "target_path": 4,
                                 "volume_capability": 5, "readonly": 6, "secrets": 7, "volume_context": 8},
    "NodeUnpublishVolumeRequest": {"volume_id": 1, "target_path": 2},
    "VolumeCapability": {"block": 1, "mount": 2, "access_mode": 3},
    "VolumeCapability.MountVolume": {"fs_type": 1, "mount_flags": 2, "volume_mount_group": 3},
    "NodeGetInfoResponse": {"node_id": 1, "max_volumes_per_node": 2, "accessible_topology": 3},
    "GetPluginInfoResponse": {"name": 1, "vendor_version": 2, "manifest": 3},
    "ProbeResponse": {"ready": 1},
    "NodeGetVolumeStatsRequest": {"volume_id": 1, "volume_path": 2, "staging_target_path": 3},
    "NodeGetVolumeStatsResponse": {"usage": 1, "volume_condition": 2},
    "VolumeUsage": {"available": 1, "total": 2, "used": 3, "unit": 4},
}
ENUMS = {
    "VolumeCapability.AccessMode.Mode": {"SINGLE_NODE_WRITER": 1, "SINGLE_NODE_READER_ONLY": 2,
                                         "MULTI_NODE_READER_ONLY": 3, "MULTI_NODE_SINGLE_WRITER": 4,
                                         "MULTI_NODE_MULTI_WRITER": 5, "SINGLE_NODE_SINGLE_WRITER": 6,
                                         "SINGLE_NODE_MULTI_WRITER": 7},
    "NodeServiceCapability.RPC.Type": {"STAGE_UNSTAGE_VOLUME": 1, "GET_VOLUME_STATS": 2, "EXPAND_VOLUME": 3,
                                       "VOLUME_CONDITION": 4, "SINGLE_NODE_MULTI_WRITER": 5, "VOLUME_MOUNT_GROUP": 6},
    "PluginCapability.Service.Type": {"CONTROLLER_SERVICE": 1, "VOLUME_ACCESSIBILITY_CONSTRAINTS": 2,
                                      "GROUP_CONTROLLER_SERVICE": 3, "SNAPSHOT_METADATA_SERVICE": 4},
}


def _message(path: str):
    desc = csi.DESCRIPTOR.message_types_by_name[path.split(".")[0]]
    for part in path.split(".")[1:]:
        desc = desc.nested_types_by_name[part]
    return desc


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_field_numbers(name):
    assert {f.name: f.number for f in _message(name).fields} == FIELDS[name]


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_enum_values(name):
    *msg, enum = name.split(".")
    values = {v.name: v.number for v in _message(".".join(msg)).enum_types_by_name[enum].values}
    assert values == dict(ENUMS[name], UNKNOWN=0)


def test_service_paths():
    services = {s.full_name: sorted(m.name for m in s.methods) for s in csi.DESCRIPTOR.services_by_name.values()}
    assert services["csi.v1.Identity"] == ["GetPluginCapabilities", "GetPluginInfo", "Probe"]
    assert services["csi.v1.Node"] == ["NodeGetCapabilities", "NodeGetInfo", "NodeGetVolumeStats",
                                       "NodePublishVolume", "NodeUnpublishVolume"]
    assert services["csi.v1.Controller"] == ["ControllerGetCapabilities"]
