"""``accelnode dra``: the TPU chips of this node through Dynamic Resource Allocation (docs/dra.md).

A mode of the device-plugin component (it shares the chip inventory, health and TPU env table
with the device plugin): a kubelet DRA plugin that publishes one ResourceSlice device per healthy
chip and, per claim, writes the CDI spec that puts the claim's chips and TPU env into containers.
"""
