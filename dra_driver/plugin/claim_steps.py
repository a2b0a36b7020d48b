"""The steps on one claim that both the prepare transaction (transaction.py) and start-up
recovery (recovery.py) take, and where this driver's files are.

`ClaimSteps` knows where this driver's files are (checkpoint, lock, CDI dir) and what this
node has (devices, driver files, sharing, dynamic MIG placements and their `MigSteps`):
`plan` turns a claim into what preparing it means here (pure), `write_spec` assembles and
writes its CDI spec (the only place that does), `roll_back` removes its spec, sharing and
MIG instances, `load` and `save` read and write the checkpoint. It must not take the lock
or decide when a step runs: its callers hold the lock around every step that touches a
file or a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Final

import structlog

from dra_driver.cdi.builders import build_channel_spec, build_claim_spec, common_edits
from dra_driver.cdi.files import remove_claim_spec, write_spec
from dra_driver.cdi.spec import ContainerEdits, claim_device_id
from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles
from dra_driver.gpu.mig import MigInstances
from dra_driver.gpu.placements import Placement
from dra_driver.imex.channels import (
    ChannelConfigError,
    ChannelRequest,
    channel_nodes,
    channel_request,
    is_channel,
)
from dra_driver.imex.daemons import ImexDaemons, ImexError
from dra_driver.jsontypes import JSON
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claims import (
    AllocatedDevice,
    ClaimRef,
    ClaimRejected,
    ForeignAllocation,
    allocated_devices,
    allocation_results,
)
from dra_driver.plugin.mig_steps import MigSteps
from dra_driver.plugin.own_allocation import GPU, MIG, MIG_SLICE, SHARE, foreign_device
from dra_driver.plugin.prepared import MigRecord, PreparedDevice
from dra_driver.sharing.policy import ConfigError, Sharing, SharingError, SharingPlan
from dra_driver.sharing.shares import is_share_view

log = structlog.get_logger(__name__)

LOCK_FILE: Final = "serialize.lock"
FAULT_ENV: Final = "DRA_DRIVER_FAULT"
_FAULT_POINT: Final = os.environ.get(FAULT_ENV)

def fault(point: str) -> None:
    """Die as kill -9 would at a named point, if `DRA_DRIVER_FAULT` names it (the
    crash-safety tests): prepare-after-started, prepare-after-mig-create (a MIG instance
    made, its ids not yet recorded), prepare-after-cdi, prepare-after-completed,
    unprepare-after-cdi-removed, unprepare-after-entry-removed."""
    if point == _FAULT_POINT:
        log.warning("fault injection: dying", point=point)
        os._exit(137)


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
    channel: ChannelRequest | None = None  # an IMEX channel of a ComputeDomain (dra_driver.imex)


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
    # --compute-domains: the node's IMEX daemons and its channels' char major (None: not served)
    imex: ImexDaemons | None = None
    channel_major: int | None = None
    # the mounts and device nodes every claim's spec shares, built once from the driver files
    common: ContainerEdits = field(init=False)
    mig_steps: MigSteps = field(init=False)  # the claims' dynamic MIG instances

    def __post_init__(self) -> None:
        object.__setattr__(self, "common", common_edits(self.driver_files))
        object.__setattr__(self, "mig_steps", MigSteps(self.mig, self.placements))

    @cached_property
    def checkpoint_path(self) -> Path:
        return ckpt.checkpoint_path(self.state_dir)

    @cached_property
    def lock_path(self) -> Path:
        return self.state_dir / LOCK_FILE

    def plan(self, ref: ClaimRef, claim: JSON) -> ClaimPlan:
        """Raises ClaimRejected with what the user must fix."""
        results = allocation_results(ref, claim, self.driver, self.pool)
        if any(is_channel(str(r.get("device", ""))) for r in results):
            return self._channel_plan(ref, claim, results)
        allocated = allocated_devices(ref, claim, self.driver, self.pool, self.devices, results)
        foreign = foreign_device(claim, self.driver, self.pool, self._kind)
        if foreign:
            raise ForeignAllocation(ref, foreign)
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

    def _channel_plan(self, ref: ClaimRef, claim: JSON, results: list[JSON]) -> ClaimPlan:
        """An IMEX channel claim: the channel alone, as the domain's template asks for it."""
        if self.imex is None or self.channel_major is None:
            raise ClaimRejected(
                f"claim {ref} was allocated an IMEX channel, but this plugin runs without --compute-domains "
                "(Helm computeDomains.enabled) or without the channels' device major; turn it on or delete "
                "the claim"
            )
        if len(results) != 1:
            raise ClaimRejected(
                f"claim {ref} asks for an IMEX channel and {len(results) - 1} other device(s) of this "
                "driver: ask for the channel in a claim of its own (the ComputeDomain's template) and for "
                "GPUs in another"
            )
        try:
            request = channel_request(claim, self.driver)
        except ChannelConfigError as e:
            raise ClaimRejected(f"claim {ref}: {e}") from e
        request_name, name = str(results[0].get("request", "")), str(results[0]["device"])
        device = PreparedDevice(
            request_names=(request_name.split("/", 1)[0],), pool=self.pool, device=name,
            cdi_device_ids=(claim_device_id(self.driver, ref.uid, name),),
        )
        return ClaimPlan(ref, (device,), (), None, channel=request)

    def _kind(self, name: str) -> str | None:
        device = self.devices.get(name)
        if device is None:
            return None
        if is_share_view(name):
            return SHARE
        if name in self.placements:
            return MIG_SLICE
        return GPU if device.mig is None else MIG

    def _prepared(self, ref: ClaimRef, a: AllocatedDevice) -> PreparedDevice:
        return PreparedDevice(
            request_names=(a.request,),
            pool=a.pool,
            device=a.device.name,
            cdi_device_ids=(claim_device_id(self.driver, ref.uid, a.device.name),),
            share_id=a.share_id,
            admin_access=a.admin_access,
        )

    def write_spec(
        self, uid: str, devices: Sequence[NodeDevice], sharing: SharingPlan | None,
        channel: tuple[str, ChannelRequest] | None = None,
    ) -> None:
        """The one place a claim's CDI spec is assembled: its devices (each dynamic MIG
        placement as the instance made for it), the driver's files, and what its sharing
        adds; or, for an IMEX channel claim (`channel`: device name, request), the channel's
        device nodes alone, as NVIDIA's driver gives them. Written atomically."""
        if channel is not None:
            assert self.channel_major is not None  # planned only with one
            nodes = channel_nodes(channel[1], self.channel_major)
            write_spec(self.cdi_dir, build_channel_spec(self.driver, uid, channel[0], nodes))
            return
        extra = self.sharing.edits(sharing, devices)
        spec = build_claim_spec(
            self.driver, uid, list(devices), self.driver_files, extra_edits=extra, common=self.common
        )
        write_spec(self.cdi_dir, spec)

    def roll_back(self, ref: ClaimRef, why: str, mig: Sequence[MigRecord] = ()) -> None:
        """Remove the claim's CDI spec, then its sharing, then its MIG instances (`mig`, as
        recorded); the caller then drops its entry. Each step is idempotent and the entry
        goes last, so a crash repeats them. SharingError or MigError: the entry must stay."""
        remove_claim_spec(self.cdi_dir, self.driver, ref.uid)
        fault("unprepare-after-cdi-removed")
        self.sharing.release(ref.uid)
        self.mig_steps.destroy(ref, mig)
        # the service already says "unprepared" for the ordinary case
        (log.debug if why == "unprepare" else log.info)("claim state removed", reason=why, **ref.log_fields())

    def release_channel(self, ref: ClaimRef) -> None:
        """Forget the claim's IMEX channel, stopping its domain's daemon after the domain's last
        claim here (only when the claim goes: a Prepare that is redone keeps the daemon).
        SharingError if a daemon does not stop: the entry must stay."""
        if self.imex is None:
            return
        try:
            self.imex.release(ref.uid)
        except ImexError as e:
            raise SharingError(str(e)) from e

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


__all__ = ["FAULT_ENV", "LOCK_FILE", "ClaimPlan", "ClaimSteps", "fault"]
