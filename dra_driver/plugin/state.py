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

Sharing: the claim's configuration for this driver (`dra_driver.config`) is read with the
claim, before the lock. If it asks for MPS, the claim's MPS control daemon
(`dra_driver.mps`) is started after `started` is durable and before the CDI spec is
written, and its client edits go into the spec; every rollback (unprepare, a redone or
interrupted prepare) stops it. The daemon's settings live in its own directory, so
`recover()` restarts a daemon that died with the plugin, rebuilds the spec with its
edits, and stops daemons of claims the checkpoint does not know.
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
from dra_driver.config import ConfigError, device_configs
from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles
from dra_driver.mps import MpsControl, MpsError, MpsSettings, settings_for_claim
from dra_driver.mps import default_root as mps_default_root
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
    # MPS daemons; default: claim directories under /run/<driver>/mps (short, because MPS
    # binds UNIX sockets there; searchable, because servers run as the client's user),
    # tools from the driver root.
    mps: MpsControl | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _checkpoint: ckpt.Checkpoint | None = None

    def __post_init__(self) -> None:
        if self.mps is None:
            self.mps = MpsControl(mps_default_root(self.driver), self.driver_files.driver_root)

    @property
    def _mps(self) -> MpsControl:
        assert self.mps is not None
        return self.mps

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
                log.warning(
                    "checkpoint from an earlier boot discarded (its CDI specs are gone with the tmpfs)",
                    claims=len(result.discarded.claims),
                )
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
            await self._recover_mps()
        log.info("prepared-claim state recovered", claims=len(self.checkpoint.claims))

    async def _rewrite_spec(self, entry: ckpt.ClaimEntry) -> None:
        missing = [d.device for d in entry.devices if d.device not in self.devices]
        ref = ClaimRef(entry.namespace, entry.name, entry.uid)
        if missing:
            log.error("prepared claim refers to devices this node no longer has; dropping it",
                      claim_namespace=ref.namespace, claim_name=ref.name, claim_uid=ref.uid, devices=missing)
            await self._roll_back(ref, "devices gone")
            return
        settings = await asyncio.to_thread(self._mps.saved_settings, entry.uid)
        spec = self._spec(entry.uid, _unique([self.devices[d.device] for d in entry.devices]), settings)
        await asyncio.to_thread(cdi.write_spec, self.cdi_dir, spec)
        log.warning("rewrote a missing CDI spec", claim_namespace=ref.namespace, claim_name=ref.name,
                    claim_uid=ref.uid)

    async def _recover_mps(self) -> None:
        """Daemons of completed claims run again; daemons of unknown claims are stopped."""
        for uid in await asyncio.to_thread(self._mps.claim_uids):
            entry = self.checkpoint.claims.get(uid)
            settings = await asyncio.to_thread(self._mps.saved_settings, uid)
            if entry is None or entry.phase != ckpt.COMPLETED or settings is None:
                log.warning("stopping an MPS daemon of a claim that is not prepared", claim_uid=uid)
                await asyncio.to_thread(self._mps.stop, uid)
            elif not await asyncio.to_thread(self._mps.is_running, uid):
                log.warning("MPS daemon of a prepared claim is not running; restarting it", claim_uid=uid)
                try:
                    await asyncio.to_thread(self._mps.start, settings)
                except MpsError as e:  # its pods fail to connect and are restarted; the claim stays
                    log.error("could not restart an MPS daemon", claim_uid=uid, error=str(e))

    # -- prepare ---------------------------------------------------------------------

    def _spec(self, uid: str, devices: list[NodeDevice], mps: MpsSettings | None = None) -> cdi.CdiSpec:
        extra: dict[str, cdi.ContainerEdits] = {}
        if mps is not None:
            served = {d.uuid for d in mps.devices}
            edits = self._mps.container_edits(mps)
            extra = {d.name: edits for d in devices if d.uuid in served}
        return cdi.build_claim_spec(self.driver, uid, devices, self.driver_files, extra_edits=extra)

    def _mps_settings(
        self, ref: ClaimRef, claim: dict[str, Any], devices: list[NodeDevice]
    ) -> MpsSettings | None:
        """The claim's MPS daemon settings, or None if it does not ask for MPS."""
        try:
            configs = device_configs(claim, self.driver, self.pool)
            mps = [d for d in devices if configs[d.name].uses_mps]
            if not mps:
                return None
            if len(mps) != len(devices):
                raise ConfigError(
                    "MPS must be configured for all devices of a claim or for none (an MPS client sees "
                    f"only the daemon's GPUs); MPS is set for {', '.join(d.name for d in mps)} only"
                )
            return settings_for_claim(
                ref.uid, [(d.uuid, mps_config) for d in mps if (mps_config := configs[d.name].sharing.mps)]
            )
        except ConfigError as e:
            raise ClaimRejected(f"claim {ref}: invalid configuration for driver {self.driver}: {e}") from e

    async def prepare(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        check_ref(ref)
        done = self.checkpoint.claims.get(ref.uid)
        if done is not None and done.phase == ckpt.COMPLETED:
            return tuple(d.to_prepared() for d in done.devices)
        claim = await self.fetch_claim(ref)
        allocated = allocated_devices(ref, claim, self.driver, self.pool, self.devices)
        unique = _unique([a.device for a in allocated])
        mps = self._mps_settings(ref, claim, unique)
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
            if mps is not None:
                try:
                    await asyncio.to_thread(self._mps.start, mps)
                except MpsError as e:
                    await self._roll_back(ref, "MPS daemon did not start")
                    raise ClaimRejected(
                        f"claim {ref}: MPS sharing could not be set up on this node: {e}"
                    ) from e
            await asyncio.to_thread(cdi.write_spec, self.cdi_dir, self._spec(ref.uid, unique, mps))
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
                            f"device {a.device.name} is already prepared for claim "
                            f"{other.namespace}/{other.name} (uid {other.uid}); delete that pod first, "
                            "or use a shared claim or adminAccess"
                        )

    # -- unprepare -------------------------------------------------------------------

    async def unprepare(self, ref: ClaimRef) -> None:
        check_ref(ref)
        async with self._lock:
            await self._roll_back(ref, "unprepare")

    async def _roll_back(self, ref: ClaimRef, why: str) -> None:
        """Remove the claim's CDI spec, stop its MPS daemon if any, then remove its entry;
        every step is idempotent, and the entry goes last so a failed step is retried."""
        await asyncio.to_thread(cdi.remove_claim_spec, self.cdi_dir, self.driver, ref.uid)
        _fault("unprepare-after-cdi-removed")
        await asyncio.to_thread(self._mps.stop, ref.uid)
        if ref.uid in self.checkpoint.claims:
            await self._save(ckpt.without(self.checkpoint, ref.uid))
            log.info("claim state removed", reason=why, claim_namespace=ref.namespace, claim_name=ref.name,
                     claim_uid=ref.uid)
        _fault("unprepare-after-entry-removed")


def _unique(devices: list[NodeDevice]) -> list[NodeDevice]:
    """Each device once (one device may serve several requests of a claim), in claim order."""
    return list({d.name: d for d in devices}.values())
