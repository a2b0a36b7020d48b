"""The steps of preparing and unpreparing one claim on this node, which both the prepare
transaction (state.py) and start-up recovery (recovery.py) take.

`ClaimSteps` knows where this driver's files are (checkpoint, lock, CDI dir) and what this
node has (devices, driver files, sharing): `plan` turns a claim into what preparing it
means here (pure), `set_up` starts its sharing and writes its CDI spec, `roll_back` undoes
both, `load` and `save` read and write the checkpoint. It must not take the lock or decide
when a step runs: its callers hold the lock around every step that touches a file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from dra_driver.cdi.builders import build_claim_spec, common_edits
from dra_driver.cdi.files import remove_claim_spec, write_spec
from dra_driver.cdi.spec import CdiSpec, ContainerEdits, claim_device_id
from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claims import AllocatedDevice, ClaimRef, ClaimRejected, allocated_devices, describe
from dra_driver.plugin.prepared import PreparedDevice
from dra_driver.sharing.policy import ConfigError, Sharing, SharingError, SharingPlan

log = structlog.get_logger(__name__)

LOCK_FILE: Final = "serialize.lock"
FAULT_ENV: Final = "DRA_DRIVER_FAULT"
_FAULT_POINT: Final = os.environ.get(FAULT_ENV)

JSON = dict[str, Any]


def fault(point: str) -> None:
    """Die as kill -9 would at a named point, if `DRA_DRIVER_FAULT` names it (the
    crash-safety tests): prepare-after-started, prepare-after-cdi, prepare-after-completed,
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
        try:
            sharing = self.sharing.plan(ref.uid, claim, hardware)
        except ConfigError as e:
            raise ClaimRejected(f"claim {ref}: invalid configuration for driver {self.driver}: {e}") from e
        return ClaimPlan(ref, tuple(self._prepared(ref, a) for a in allocated), hardware, sharing)

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

    def set_up(self, plan: ClaimPlan) -> str | None:
        """Sharing, then the CDI spec, for a claim whose entry the caller holds; the error
        text for the kubelet if that failed (the caller rolls back)."""
        ref = plan.ref
        try:
            self.sharing.apply(plan.sharing)
        except SharingError as e:
            return f"claim {ref}: GPU sharing could not be set up on this node: {e}"
        try:
            self.write_spec(ref.uid, plan.hardware, plan.sharing)
        except OSError as e:
            log.exception("writing the CDI spec failed", **ref.log_fields())
            return f"internal error preparing claim {ref}: writing its CDI spec failed: {describe(e)}"
        return None

    def roll_back(self, ref: ClaimRef, why: str) -> None:
        """Remove the claim's CDI spec, then its sharing; the caller then drops its entry.
        Each step is idempotent and the entry goes last, so a crash repeats them."""
        remove_claim_spec(self.cdi_dir, self.driver, ref.uid)
        fault("unprepare-after-cdi-removed")
        self.sharing.release(ref.uid)
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


__all__ = ["FAULT_ENV", "LOCK_FILE", "ClaimPlan", "ClaimSteps", "fault"]
