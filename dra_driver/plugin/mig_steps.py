"""The plugin's side of dynamic MIG: an allocated placement name -> the device to create,
and a created instance -> the `NodeDevice` the CDI builder writes a spec for.

`device_to_create` resolves an allocated device name through the same placement names
the controller publishes (`dra_driver.gpu.placements`); `created_device` turns what
`dra_driver.gpu.mig.MigInstances.create` made into the device the existing CDI builder
knows (the parent's `/dev/nvidiaN`, the instance's `/dev/nvidia-caps` GI and CI access
nodes, the MIG UUID in the device's environment variable). `dynamic_devices` are the
names a dynamic GPU's claims can be allocated (every placement, and the whole GPU), and
`without_own` takes the instances this plugin made (its checkpoint's `MigRecord`s) out of
a fresh discovery, so that after a restart they are not mistaken for static instances made
by hand. Pure: the NVML calls and the checkpoint belong to the prepare transaction, which
records the placement before it creates (two-phase) and destroys on Unprepare.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace

from dra_driver.devices import NodeDevice, gpu_device_name
from dra_driver.gpu.mig import Created
from dra_driver.gpu.model import Inventory, MigDevice
from dra_driver.gpu.placements import MIB, Placement, dynamic, find_placement, placements
from dra_driver.plugin.prepared import MigRecord


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


def dynamic_devices(inventory: Inventory) -> tuple[dict[str, Placement], dict[str, NodeDevice]]:
    """The placements of every dynamic GPU by device name, and the devices a claim may be
    allocated on them: each placement (no MIG device until created: `created_device` gives
    it) and the whole GPU where no static instance holds part of it, as published."""
    found: dict[str, Placement] = {}
    devices: dict[str, NodeDevice] = {}
    for gpu in inventory.gpus:
        if not dynamic(gpu):
            continue
        if not gpu.mig_devices:
            devices[gpu_device_name(gpu)] = NodeDevice(gpu_device_name(gpu), gpu)
        for p in placements(gpu):
            found[p.name] = p
            devices[p.name] = NodeDevice(p.name, gpu)
    return found, devices


def intent(placement: Placement) -> MigRecord:
    """What the checkpoint records before the instance is created."""
    return MigRecord(placement.name, placement.gpu.uuid, placement.profile.id, placement.start)


def made(placement: Placement, created: Created) -> MigRecord:
    """What the checkpoint records once the instance exists."""
    return replace(
        intent(placement),
        gpu_instance_id=created.gpu_instance_id,
        compute_instance_id=created.compute_instance_id,
        uuid=created.uuid,
    )


def as_created(record: MigRecord) -> Created:
    """A recorded instance as `created_device` takes it (adopting after a restart)."""
    if record.gpu_instance_id is None or record.compute_instance_id is None or record.uuid is None:
        raise ValueError(f"{record.device}: the instance was never recorded as made")
    return Created(
        record.parent_uuid,
        record.gpu_instance_id,
        record.compute_instance_id,
        record.uuid,
        record.profile_id,
        record.start,
    )


def without_own(inventory: Inventory, records: Iterable[MigRecord]) -> Inventory:
    """`inventory` as if the instances of `records` did not exist: discovery sees them like
    any other, but they are this plugin's claims' instances, not static ones. An intent
    (no ids) matches the instance of its profile at its start."""
    own = list(records)

    def mine(parent: str, m: MigDevice) -> bool:
        for r in own:
            if r.parent_uuid != parent:
                continue
            if r.gpu_instance_id is not None and r.gpu_instance_id == m.gpu_instance_id:
                return True
            at = (m.gpu_instance_profile_id, m.placement_start)
            if r.gpu_instance_id is None and (r.profile_id, r.start) == at:
                return True
        return False

    if not own:
        return inventory
    gpus = tuple(
        replace(g, mig_devices=tuple(m for m in g.mig_devices if not mine(g.uuid, m))) for g in inventory.gpus
    )
    return replace(inventory, gpus=gpus)


class CreatedDevices(Mapping[str, NodeDevice]):
    """`devices` with each dynamic MIG placement that has an instance now (`records`: what
    the checkpoint holds) as that instance, for those who describe prepared devices (the
    claim's status: the MIG UUID, not the parent's) and the health keeper (an XID naming the
    instance's ids taints that placement only). A placement is made for one claim at a time,
    so its name names one instance. `records` is asked on every lookup of a placement: keep
    it cheap (the plugin's re-reads the checkpoint only when the file changed)."""

    def __init__(
        self,
        devices: Mapping[str, NodeDevice],
        placements: Mapping[str, Placement],
        records: Callable[[], Iterable[MigRecord]],
    ) -> None:
        self.devices = devices
        self.placements = placements
        self.records = records

    def __getitem__(self, name: str) -> NodeDevice:
        placement = self.placements.get(name)
        if placement is not None:
            for r in self.records():
                if r.device == name and r.created:
                    return created_device(placement, as_created(r))
        return self.devices[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.devices)

    def __len__(self) -> int:
        return len(self.devices)
