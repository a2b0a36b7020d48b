"""Prepare and unprepare claims on this node, crash-safely.

The checkpoint is the source of truth. Prepare runs in two phases, each made durable
before the next step: `started` (the devices we are about to hand out) -> CDI spec
written -> `completed`. A crash anywhere leaves a state that `recover()` (at start)
or the next call repairs: a `started` entry is rolled back and redone, a spec without
an entry is removed, an entry whose spec vanished gets it rewritten. All changes to
the checkpoint happen under one asyncio lock; the API read of a claim happens before
it, so a slow API server never blocks other claims' bookkeeping.

`DRA_DRIVER_FAULT=<point>` makes the process die (as kill -9 would) at a named point,
for the crash-safety tests: prepare-after-started, prepare-after-cdi,
prepare-after-completed, unprepare-after-cdi-removed, unprepare-after-entry-removed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from dra_driver import cdi
from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claims import AllocatedDevice, ClaimRef, ClaimRejected, allocated_devices, check_ref
from dra_driver.plugin.prepared import PreparedDevice

log = structlog.get_logger(__name__)

FAULT_ENV = "DRA_DRIVER_FAULT"


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        log.warning("fault injection: dying", point=point)
        os._exit(137)


@dataclass
class NodePreparer:
    driver: str
    pool: str
    devices: dict[str, NodeDevice]
    fetch_claim: Callable[[ClaimRef], Awaitable[dict[str, Any]]]
    driver_files: DriverFiles
    cdi_dir: Path
    data_dir: Path
    boot_id: str | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _checkpoint: ckpt.Checkpoint | None = None

    @property
    def checkpoint_path(self) -> Path:
        return self.data_dir / "checkpoint.json"

    @property
    def checkpoint(self) -> ckpt.Checkpoint:
        assert self._checkpoint is not None, "call recover() first"
        return self._checkpoint

    async def _save(self, new: ckpt.Checkpoint) -> None:
        await asyncio.to_thread(ckpt.save, self.checkpoint_path, new)
        self._checkpoint = new

    # -- start-up --------------------------------------------------------------------

    async def recover(self) -> None:
        """Load the checkpoint and make CDI specs and entries agree again."""
        boot_id = self.boot_id or ckpt.read_boot_id()
        try:
            result = await asyncio.to_thread(ckpt.load, self.checkpoint_path, boot_id)
            loaded = result.checkpoint
            if result.discarded:
                log.warning("checkpoint from an earlier boot discarded (its CDI specs are gone with the tmpfs)",
                            claims=len(result.discarded.claims))
        except ckpt.CheckpointCorrupt as e:
            moved = await asyncio.to_thread(ckpt.quarantine, self.checkpoint_path)
            log.error("checkpoint is corrupt; moved aside, starting empty; claims are re-prepared on demand",
                      error=str(e), moved_to=str(moved))
            loaded = ckpt.Checkpoint.empty(boot_id)
        self._checkpoint = loaded
        async with self._lock:
            for entry in list(self.checkpoint.claims.values()):
                ref = ClaimRef(entry.namespace, entry.name, entry.uid)
                if entry.phase != ckpt.COMPLETED:
                    await self._roll_back(ref, "interrupted prepare found at start")
                elif not cdi.claim_spec_path(self.cdi_dir, self.driver, entry.uid).exists():
                    await self._rewrite_spec(entry)
            known = set(self.checkpoint.claims)
            for uid in cdi.claim_uids_in(self.cdi_dir, self.driver) - known:
                log.warning("removing CDI spec of a claim that is not in the checkpoint", claim_uid=uid)
                await asyncio.to_thread(cdi.remove_claim_spec, self.cdi_dir, self.driver, uid)
        log.info("prepared-claim state recovered", claims=len(self.checkpoint.claims))

    async def _rewrite_spec(self, entry: ckpt.ClaimEntry) -> None:
        missing = [d.device for d in entry.devices if d.device not in self.devices]
        ref = ClaimRef(entry.namespace, entry.name, entry.uid)
        if missing:
            log.error("prepared claim refers to devices this node no longer has; dropping it",
                      claim_namespace=ref.namespace, claim_name=ref.name, claim_uid=ref.uid, devices=missing)
            await self._roll_back(ref, "devices gone")
            return
        spec = self._spec(entry.uid, [self.devices[d.device] for d in entry.devices])
        await asyncio.to_thread(cdi.write_spec, self.cdi_dir, spec)
        log.warning("rewrote a missing CDI spec", claim_namespace=ref.namespace, claim_name=ref.name,
                    claim_uid=ref.uid)

    # -- prepare ---------------------------------------------------------------------

    def _spec(self, uid: str, devices: list[NodeDevice]) -> cdi.CdiSpec:
        return cdi.build_claim_spec(self.driver, uid, devices, self.driver_files)

    async def prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        check_ref(ref)
        done = self.checkpoint.claims.get(ref.uid)
        if done is not None and done.phase == ckpt.COMPLETED:
            return tuple(d.to_prepared() for d in done.devices)
        claim = await self.fetch_claim(ref)
        allocated = allocated_devices(ref, claim, self.driver, self.pool, self.devices)
        async with self._lock:
            entry = self.checkpoint.claims.get(ref.uid)
            if entry is not None and entry.phase == ckpt.COMPLETED:  # a concurrent call finished it
                return tuple(d.to_prepared() for d in entry.devices)
            if entry is not None:
                await self._roll_back(ref, "redoing an interrupted prepare")
            self._refuse_conflicts(ref, allocated)
            prepared = tuple(self._prepared(ref, a) for a in allocated)
            await self._save(ckpt.with_started(self.checkpoint, ref.namespace, ref.name, ref.uid,
                                               [ckpt.PreparedRecord.of(p, a.admin_access) for p, a in
                                                zip(prepared, allocated, strict=True)]))
            _fault("prepare-after-started")
            unique = list({a.device.name: a.device for a in allocated}.values())
            await asyncio.to_thread(cdi.write_spec, self.cdi_dir, self._spec(ref.uid, unique))
            _fault("prepare-after-cdi")
            await self._save(ckpt.with_completed(self.checkpoint, ref.uid))
            _fault("prepare-after-completed")
            return prepared

    def _prepared(self, ref: ClaimRef, a: AllocatedDevice) -> PreparedDevice:
        return PreparedDevice(
            request_names=(a.request,),
            pool=a.pool,
            device=a.device.name,
            cdi_device_ids=(cdi.claim_device_id(self.driver, ref.uid, a.device.name),),
            share_id=a.share_id,
        )

    def _refuse_conflicts(self, ref: ClaimRef, allocated: tuple[AllocatedDevice, ...]) -> None:
        """The last line of defence against a double allocation (a stale or edited claim)."""
        for a in allocated:
            if a.admin_access or a.share_id:
                continue
            for other in self.checkpoint.claims.values():
                if other.uid == ref.uid:
                    continue
                for d in other.devices:
                    if d.device == a.device.name and not (d.admin_access or d.share_id):
                        raise ClaimRejected(
                            f"device {a.device.name} is already prepared for claim {other.namespace}/{other.name} "
                            f"(uid {other.uid}); delete that pod first, or use a shared claim or adminAccess"
                        )

    # -- unprepare -------------------------------------------------------------------

    async def unprepare(self, ref: ClaimRef) -> None:
        check_ref(ref)
        async with self._lock:
            await self._roll_back(ref, "unprepare")

    async def _roll_back(self, ref: ClaimRef, why: str) -> None:
        """Remove the claim's CDI spec, then its entry; both steps are idempotent."""
        await asyncio.to_thread(cdi.remove_claim_spec, self.cdi_dir, self.driver, ref.uid)
        _fault("unprepare-after-cdi-removed")
        if ref.uid in self.checkpoint.claims:
            await self._save(ckpt.without(self.checkpoint, ref.uid))
            log.info("claim state removed", reason=why, claim_namespace=ref.namespace, claim_name=ref.name,
                     claim_uid=ref.uid)
        _fault("unprepare-after-entry-removed")
