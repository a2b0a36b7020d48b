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
by hand.

`MigSteps` holds every step the prepare transaction and recovery take on a claim's dynamic
MIG instances, in one object: `free` (are its placements still free?), `create` (make
them, or leave nothing behind), `destroy` (last made first) and `devices` (each placement
as the instance made for it, for the CDI spec). It makes the NVML calls (through
`dra_driver.gpu.mig.MigInstances`) but must NOT take the lock, read or write the
checkpoint, or decide when a step runs: the transaction records each placement before it
creates (two-phase) and holds the lock around every step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import structlog

from dra_driver.devices import NodeDevice, gpu_device_name
from dra_driver.gpu.mig import Created, MigError, MigInstances, PlacementTaken
from dra_driver.gpu.model import Inventory, MigDevice
from dra_driver.gpu.placements import MIB, Placement, dynamic, find_placement, placements
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.prepared import MigRecord

log = structlog.get_logger(__name__)


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


def made_record(placement: Placement, created: Created) -> MigRecord:
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


class MigLeftBehind(MigError):
    """Creating a claim's MIG instances failed and so did destroying what was made: `left`
    must stay recorded (Unprepare or recovery destroys it)."""

    def __init__(self, message: str, left: tuple[MigRecord, ...]) -> None:
        super().__init__(message)
        self.left = left


@dataclass(frozen=True)
class MigSteps:
    """A claim's dynamic MIG instances: checked free, made, destroyed, described."""

    instances: MigInstances | None  # None: no dynamic MIG on this node
    placements: Mapping[str, Placement]  # by device name

    def free(self, ref: ClaimRef, wanted: Sequence[Placement]) -> str | None:
        """Why the claim's MIG placements cannot be made (an instance made by hand or by
        another tool holds some of their slices), None if they are free. Asked before the
        intent is recorded, so that recovery never takes someone else's instance for ours."""
        if not wanted or self.instances is None:
            return None
        for p in wanted:
            try:
                held = self.instances.occupants(p.gpu.uuid, p.start, p.profile.memory_slices)
            except MigError as e:
                return f"claim {ref}: reading the MIG instances of GPU {p.gpu.uuid} failed: {e}"
            if held:
                what = ", ".join(
                    f"GPU instance {h.gpu_instance_id} at slices {h.start}-{h.start + h.size - 1}"
                    for h in held
                )
                return (
                    f"claim {ref}: MIG placement {p.name} (memory slices {p.start}-{p.slices[-1]} of "
                    f"GPU {p.gpu.index}, {p.gpu.uuid}) is taken by {what} (made by hand, by another tool or "
                    "for another claim; `nvidia-smi mig -lgi` lists it); nothing was changed. Destroy that "
                    "instance, or restart the plugin so that it publishes the GPU as it is, and delete the "
                    "claim's pod"
                )
        return None

    def create(self, ref: ClaimRef, wanted: Sequence[Placement]) -> tuple[MigRecord, ...]:
        """Make the claim's MIG instances, each at its allocated placement. Raises MigError
        with nothing of this claim's left behind (those made already are destroyed again),
        or MigLeftBehind if destroying them failed too."""
        if not wanted:
            return ()
        assert self.instances is not None  # ClaimSteps.plan refuses MIG placements without it
        made: list[MigRecord] = []
        current: Placement | None = None
        try:
            for p in wanted:
                current = p
                created = self.instances.create(p.gpu.uuid, p.profile, p.start)
                made.append(made_record(p, created))
                log.info("MIG instance created", device=p.name, gpu_instance_id=created.gpu_instance_id,
                         mig_uuid=created.uuid, **ref.log_fields())
        except MigError as e:
            left = list(made)
            if current is not None and not isinstance(e, PlacementTaken):
                left.append(intent(current))  # a GPU instance whose compute instance failed
            try:
                self.destroy(ref, left)
            except MigError as cleanup:
                why = f"{e}; destroying what was made failed too: {cleanup}"
                raise MigLeftBehind(why, tuple(left)) from e
            raise
        return tuple(made)

    def destroy(self, ref: ClaimRef, records: Sequence[MigRecord]) -> None:
        """Destroy the instances of `records` (last made first); an intent's instance is
        found at its placement. Gone already is fine; NVML refusing raises MigError."""
        if not records:
            return
        if self.instances is None:
            raise MigError(
                f"claim {ref} holds dynamic MIG instances ({', '.join(r.device for r in records)}) but this "
                "plugin runs without --dynamic-mig; turn it on so that they can be destroyed"
            )
        for r in reversed(records):
            if r.created:
                assert r.gpu_instance_id is not None and r.compute_instance_id is not None
                self.instances.destroy(r.parent_uuid, r.gpu_instance_id, r.compute_instance_id)
            else:
                self.instances.destroy_at(r.parent_uuid, r.profile_id, r.start)
            log.info("MIG instance destroyed", device=r.device, gpu_instance_id=r.gpu_instance_id,
                     **ref.log_fields())

    def devices(self, hardware: Sequence[NodeDevice], records: Sequence[MigRecord]) -> list[NodeDevice]:
        """The devices for the CDI spec: each dynamic MIG placement as the instance made for it."""
        by_name = {r.device: r for r in records}
        out = []
        for d in hardware:
            placement = self.placements.get(d.name)
            if placement is None:
                out.append(d)
                continue
            record = by_name.get(d.name)
            if record is None or not record.created:
                raise ValueError(f"{d.name}: no MIG instance was made for it")
            out.append(created_device(placement, as_created(record)))
        return out
