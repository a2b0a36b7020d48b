"""The plugin's side of dynamic MIG: an allocated placement name -> the device to create,
and a created instance -> the `NodeDevice` the CDI builder writes a spec for.

`device_to_create` resolves an allocated device name through the same placement names
the controller publishes (`dra_driver.gpu.placements`); `created_device` turns what
`dra_driver.gpu.mig.MigInstances.create` made into the device the existing CDI builder
knows (the parent's `/dev/nvidiaN`, the instance's `/dev/nvidia-caps` GI and CI access
nodes, the MIG UUID in the device's environment variable). Pure: the NVML calls and the
checkpoint belong to the prepare transaction, which records the placement before it
creates (two-phase) and destroys on Unprepare.
"""

from __future__ import annotations

from dra_driver.devices import NodeDevice
from dra_driver.gpu.mig import Created
from dra_driver.gpu.model import Inventory, MigDevice
from dra_driver.gpu.placements import MIB, Placement, find_placement


def device_to_create(inventory: Inventory, device_name: str) -> Placement | None:
    """The placement an allocated device stands for; None for a device that is not one."""
    return find_placement(inventory, device_name)


def created_device(placement: Placement, made: Created) -> NodeDevice:
    """The device of a claim once its instance exists, under the allocated name."""
    if made.parent_uuid != placement.gpu.uuid or (made.profile_id, made.start) != (
        placement.profile.id,
        placement.start,
    ):
        raise ValueError(f"{made} is not the instance of placement {placement.name}")
    p = placement.profile
    mig = MigDevice(
        parent_index=placement.gpu.index,
        profile=p.name,
        gpu_instance_id=made.gpu_instance_id,
        compute_instance_id=made.compute_instance_id,
        placement_start=placement.start,
        placement_size=p.memory_slices,
        uuid=made.uuid,
        memory_bytes=p.memory_mib * MIB,
        multiprocessors=p.multiprocessors,
        copy_engines=p.copy_engines,
        decoders=p.decoders,
        encoders=p.encoders,
        jpeg_engines=p.jpeg_engines,
        ofa_engines=p.ofa_engines,
        gpu_instance_profile_id=p.id,
    )
    return NodeDevice(placement.name, placement.gpu, mig)
