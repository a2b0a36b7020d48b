"""One published device entry, authored from the inventory: its name, attributes and capacity
(`controller.attributes`) and, for a GPU carved by dynamic MIG, the counters it consumes
(`controller.partitions`).

`device_json` is the entry of any device; `dynamic_mig_entries` the entries of one MIG-mode GPU
under dynamic MIG (the whole GPU, its static instances, every placement). `controller.slices`
puts the entries in slices; memory shares and consumable shares (`controller.capacity`,
`controller.consumable`) add to the whole GPUs' entries. Pure: no I/O.
"""

from __future__ import annotations

from controller.attributes import UUID, DeviceAttributes, NvlinkFacts, device_attributes
from controller.partitions import consumes, counter_set, placement_counters, placements
from dra_driver.devices import NodeDevice, gpu_device_name, mig_device_name
from dra_driver.gpu.model import GpuInfo, Inventory, MigDevice
from dra_driver.gpu.placements import MIB, Placement
from dra_driver.jsontypes import JSON


def device_json(name: str, described: DeviceAttributes, consumed: list[JSON] | None = None) -> JSON:
    """One `Device` entry; empty maps are left out as the API server leaves them out."""
    device: JSON = {"name": name}
    if described.attributes:
        device["attributes"] = described.attributes
    if described.capacity:
        device["capacity"] = described.capacity
    if consumed is not None:
        device["consumesCounters"] = consumed
    return device


def _as_mig(p: Placement) -> MigDevice:
    """The MIG device a placement would be once created (no ids, no UUID yet)."""
    g = p.profile
    return MigDevice(
        parent_index=p.gpu.index, profile=g.name, gpu_instance_id=0, compute_instance_id=0,
        placement_start=p.start, placement_size=g.memory_slices, uuid="", memory_bytes=g.memory_mib * MIB,
        multiprocessors=g.multiprocessors, copy_engines=g.copy_engines, decoders=g.decoders,
        encoders=g.encoders, jpeg_engines=g.jpeg_engines, ofa_engines=g.ofa_engines,
        gpu_instance_profile_id=g.id,
    )


def dynamic_mig_entries(
    gpu: GpuInfo, inventory: Inventory, nvlink: NvlinkFacts | None, list_attributes: bool
) -> list[JSON]:
    """Every device of one MIG-mode GPU, each consuming its counters: the whole GPU first,
    then the static instances, then every placement of every profile (small to large)."""
    out: list[JSON] = []
    if not gpu.mig_devices:
        name = gpu_device_name(gpu)
        whole = device_attributes(NodeDevice(name, gpu), inventory, nvlink, list_attributes=list_attributes)
        out.append(device_json(name, whole, consumes(gpu, counter_set(gpu)["counters"])))
    for mig in gpu.mig_devices:
        name = mig_device_name(mig)
        static = device_attributes(NodeDevice(name, gpu, mig), inventory, None,
                                   list_attributes=list_attributes)
        out.append(device_json(name, static))
    for p in placements(gpu):
        d = device_attributes(NodeDevice(p.name, gpu, _as_mig(p)), inventory, None,
                              list_attributes=list_attributes)
        # the UUID exists once the instance is created
        placed = DeviceAttributes({k: v for k, v in d.attributes.items() if k != UUID}, d.capacity)
        out.append(device_json(p.name, placed, consumes(gpu, placement_counters(p))))
    return out
