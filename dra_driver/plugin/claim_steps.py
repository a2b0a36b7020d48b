"""The steps of preparing and unpreparing one claim on this node, which both the prepare
transaction (state.py) and start-up recovery (recovery.py) take.

`ClaimSteps` knows where this driver's files are (checkpoint, lock, CDI dir) and what this
node has (devices, driver files, sharing, dynamic MIG placements): `plan` turns a claim
into what preparing it means here (pure), `free` says whether its MIG placements are still
free, `create_mig` makes its MIG instances, `set_up` starts its sharing and writes its CDI
spec, `roll_back` undoes all three, `load` and `save` read and write the checkpoint. It
must not take the lock or decide when a step runs: its callers hold the lock around every
step that touches a file or a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from dra_driver.cdi.builders import build_claim_spec, common_edits
from dra_driver.cdi.files import remove_claim_spec, write_spec
from dra_driver.cdi.spec import CdiSpec, ContainerEdits, claim_device_id
from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles
from dra_driver.gpu.mig import MigError, MigInstances, PlacementTaken
from dra_driver.gpu.placements import Placement
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin import mig_steps
from dra_driver.plugin.claims import AllocatedDevice, ClaimRef, ClaimRejected, allocated_devices, describe
from dra_driver.plugin.prepared import MigRecord, PreparedDevice
from dra_driver.sharing.policy import ConfigError, Sharing, SharingError, SharingPlan

log = structlog.get_logger(__name__)

LOCK_FILE: Final = "serialize.lock"
FAULT_ENV: Final = "DRA_DRIVER_FAULT"
_FAULT_POINT: Final = os.environ.get(FAULT_ENV)

JSON = dict[str, Any]


def fault(point: str) -> None:
    """Die as kill -9 would at a named point, if `DRA_DRIVER_FAULT` names it (the
    crash-safety tests): prepare-after-started, prepare-after-mig-create (a MIG instance
    made, its ids not yet recorded), prepare-after-cdi, prepare-after-completed,
    unprepare-after-cdi-removed, unprepare-after-entry-removed."""
    if point == _FAULT_POINT:
        log.warning("fault injection: dying", point=point)
        os._exit(137)


class MigLeftBehind(MigError):
    """Creating a claim's MIG instances failed and so did destroying what was made: `left`
    must stay recorded (Unprepare or recovery destroys it)."""

    def __init__(self, message: str, left: tuple[MigRecord, ...]) -> None:
        super().__init__(message)
        self.left = left


@dataclass(frozen=True)
class ClaimPlan:
    """What preparing one claim means on this node, decided before the lock."""

    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]  # in allocation order, as answered
    hardware: tuple[NodeDevice, ...]  # each device once, for the CDI spec
    sharing: SharingPlan | None
    mig: tuple[Placement, ...] = ()  # dynamic MIG instances to create, in allocation order
    # the claim as read, for sharing on dynamic MIG slices: planned again once the instances exist
    claim: JSON | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ClaimSteps:
    driver: str
    pool: str
    devices: dict[str, NodeDevice]
    driver_files: DriverFiles
    cdi_dir: Path
    state_dir: Path
    sharing: Sharing
    boot_id: str
    mig: MigInstances | None = None  # None: no dynamic MIG on this node
    placements: Mapping[str, Placement] = field(default_factory=dict)  # by device name
    # the mounts and device nodes every claim's spec shares, built once from the driver files
    common: ContainerEdits = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "common", common_edits(self.driver_files))

    @property
    def checkpoint_path(self) -> Path:
        return ckpt.checkpoint_path(self.state_dir)

    @property
    def lock_path(self) -> Path:
        return self.state_dir / LOCK_FILE

    def plan(self, ref: ClaimRef, claim: JSON) -> ClaimPlan:
        """Raises ClaimRejected with what the user must fix."""
        allocated = allocated_devices(ref, claim, self.driver, self.pool, self.devices)
        hardware = tuple({a.device.name: a.device for a in allocated}.values())
        mig = tuple(self.placements[d.name] for d in hardware if d.name in self.placements)
        for a in allocated:
            if a.device.name in self.placements and (a.admin_access or a.share_id):
                raise ClaimRejected(
                    f"claim {ref}: {a.device.name} is a dynamic MIG slice, made for one claim: it cannot be "
                    "given with adminAccess or as a share; ask for it without them"
                )
        if mig and self.mig is None:
            raise ClaimRejected(
                f"claim {ref} was allocated dynamic MIG slice {mig[0].name}, but this plugin runs without "
                "--dynamic-mig (Helm dynamicMig.enabled); turn it on or delete the claim"
            )
        slices = frozenset(p.name for p in mig)
        try:
            sharing = self.sharing.plan(ref.uid, claim, hardware, slices)
        except ConfigError as e:
            raise ClaimRejected(f"claim {ref}: invalid configuration for driver {self.driver}: {e}") from e
        prepared = tuple(self._prepared(ref, a) for a in allocated)
        return ClaimPlan(ref, prepared, hardware, sharing, mig, claim if mig and sharing else None)

    def _prepared(self, ref: ClaimRef, a: AllocatedDevice) -> PreparedDevice:
        return PreparedDevice(
            request_names=(a.request,),
            pool=a.pool,
            device=a.device.name,
            cdi_device_ids=(claim_device_id(self.driver, ref.uid, a.device.name),),
            share_id=a.share_id,
            admin_access=a.admin_access,
        )

    def spec(self, uid: str, hardware: Sequence[NodeDevice], sharing: SharingPlan | None) -> CdiSpec:
        extra = self.sharing.edits(sharing, hardware)
        return build_claim_spec(
            self.driver, uid, list(hardware), self.driver_files, extra_edits=extra, common=self.common
        )

    def write_spec(self, uid: str, hardware: Sequence[NodeDevice], sharing: SharingPlan | None) -> None:
        write_spec(self.cdi_dir, self.spec(uid, hardware, sharing))

    def free(self, plan: ClaimPlan) -> str | None:
        """Why the claim's MIG placements cannot be made (an instance made by hand or by
        another tool holds some of their slices), None if they are free. Asked before the
        intent is recorded, so that recovery never takes someone else's instance for ours."""
        if not plan.mig or self.mig is None:
            return None
        for p in plan.mig:
            try:
                held = self.mig.occupants(p.gpu.uuid, p.start, p.profile.memory_slices)
            except MigError as e:
                return f"claim {plan.ref}: reading the MIG instances of GPU {p.gpu.uuid} failed: {e}"
            if held:
                what = ", ".join(
                    f"GPU instance {h.gpu_instance_id} at slices {h.start}-{h.start + h.size - 1}"
                    for h in held
                )
                return (
                    f"claim {plan.ref}: MIG placement {p.name} (memory slices {p.start}-{p.slices[-1]} of "
                    f"GPU {p.gpu.index}, {p.gpu.uuid}) is taken by {what} (made by hand, by another tool or "
                    "for another claim; `nvidia-smi mig -lgi` lists it); nothing was changed. Destroy that "
                    "instance, or restart the plugin so that it publishes the GPU as it is, and delete the "
                    "claim's pod"
                )
        return None

    def create_mig(self, plan: ClaimPlan) -> tuple[MigRecord, ...]:
        """Make the claim's MIG instances, each at its allocated placement. Raises MigError
        with nothing of this claim's left behind (those made already are destroyed again)."""
        if not plan.mig:
            return ()
        assert self.mig is not None  # plan() refuses MIG placements without it
        made: list[MigRecord] = []
        current: Placement | None = None
        try:
            for p in plan.mig:
                current = p
                created = self.mig.create(p.gpu.uuid, p.profile, p.start)
                made.append(mig_steps.made(p, created))
                log.info("MIG instance created", device=p.name, gpu_instance_id=created.gpu_instance_id,
                         mig_uuid=created.uuid, **plan.ref.log_fields())
        except MigError as e:
            left = list(made)
            if current is not None and not isinstance(e, PlacementTaken):
                left.append(mig_steps.intent(current))  # a GPU instance whose compute instance failed
            try:
                self.destroy_mig(plan.ref, left)
            except MigError as cleanup:
                why = f"{e}; destroying what was made failed too: {cleanup}"
                raise MigLeftBehind(why, tuple(left)) from e
            raise
        return tuple(made)

    def destroy_mig(self, ref: ClaimRef, records: Sequence[MigRecord]) -> None:
        """Destroy the instances of `records` (last made first); an intent's instance is
        found at its placement. Gone already is fine; NVML refusing raises MigError."""
        if not records:
            return
        if self.mig is None:
            raise MigError(
                f"claim {ref} holds dynamic MIG instances ({', '.join(r.device for r in records)}) but this "
                "plugin runs without --dynamic-mig; turn it on so that they can be destroyed"
            )
        for r in reversed(records):
            if r.created:
                assert r.gpu_instance_id is not None and r.compute_instance_id is not None
                self.mig.destroy(r.parent_uuid, r.gpu_instance_id, r.compute_instance_id)
            else:
                self.mig.destroy_at(r.parent_uuid, r.profile_id, r.start)
            log.info("MIG instance destroyed", device=r.device, gpu_instance_id=r.gpu_instance_id,
                     **ref.log_fields())

    def hardware(self, plan_hardware: Sequence[NodeDevice], records: Sequence[MigRecord]) -> list[NodeDevice]:
        """The devices for the CDI spec: each dynamic MIG placement as the instance made for it."""
        by_name = {r.device: r for r in records}
        out = []
        for d in plan_hardware:
            placement = self.placements.get(d.name)
            if placement is None:
                out.append(d)
                continue
            record = by_name.get(d.name)
            if record is None or not record.created:
                raise ValueError(f"{d.name}: no MIG instance was made for it")
            out.append(mig_steps.created_device(placement, mig_steps.as_created(record)))
        return out

    def set_up(self, plan: ClaimPlan, made: Sequence[MigRecord] = ()) -> str | None:
        """Sharing, then the CDI spec (with the MIG instances `made` for it), for a claim
        whose entry the caller holds; the error text for the kubelet if that failed (the
        caller rolls back)."""
        ref = plan.ref
        sharing = plan.sharing
        if plan.claim is not None:
            # MPS on a dynamic MIG slice: its daemon serves the instance's MIG UUID, known only now
            try:
                sharing = self.sharing.plan(ref.uid, plan.claim, self.hardware(plan.hardware, made))
            except ConfigError as e:
                return f"claim {ref}: invalid configuration for driver {self.driver}: {e}"
        try:
            self.sharing.apply(sharing)
        except SharingError as e:
            return f"claim {ref}: GPU sharing could not be set up on this node: {e}"
        try:
            self.write_spec(ref.uid, self.hardware(plan.hardware, made), sharing)
        except OSError as e:
            log.exception("writing the CDI spec failed", **ref.log_fields())
            return f"internal error preparing claim {ref}: writing its CDI spec failed: {describe(e)}"
        return None

    def roll_back(self, ref: ClaimRef, why: str, mig: Sequence[MigRecord] = ()) -> None:
        """Remove the claim's CDI spec, then its sharing, then its MIG instances (`mig`, as
        recorded); the caller then drops its entry. Each step is idempotent and the entry
        goes last, so a crash repeats them. SharingError or MigError: the entry must stay."""
        remove_claim_spec(self.cdi_dir, self.driver, ref.uid)
        fault("unprepare-after-cdi-removed")
        self.sharing.release(ref.uid)
        self.destroy_mig(ref, mig)
        # the service already says "unprepared" for the ordinary case
        (log.debug if why == "unprepare" else log.info)("claim state removed", reason=why, **ref.log_fields())

    def load(self) -> ckpt.Checkpoint:
        """The checkpoint of this boot (one of an earlier boot is discarded: its CDI specs
        and daemons died with that boot's tmpfs). Raises CheckpointOfAnotherDriver for
        another driver's: nothing here may change it."""
        result = ckpt.load(self.checkpoint_path, self.boot_id, self.driver)
        if result.discarded is not None:
            log.warning(
                "checkpoint from an earlier boot discarded (its CDI specs died with the tmpfs)",
                claims=len(result.discarded.claims),
            )
        return result.checkpoint

    def save(self, claims: dict[str, ckpt.ClaimEntry]) -> None:
        ckpt.save(self.checkpoint_path, ckpt.Checkpoint(self.boot_id, dict(claims), self.driver))


__all__ = ["FAULT_ENV", "LOCK_FILE", "ClaimPlan", "ClaimSteps", "MigLeftBehind", "fault"]
