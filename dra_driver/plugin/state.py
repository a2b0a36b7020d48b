"""The node's prepare/unprepare: crash-safe, and safe against a second plugin instance.

A Prepare, frame by frame from grpcio to the CDI file and to the checkpoint
(tests/unit/test_prepare_frames.py runs one and fails when the code's frames differ):
  to the CDI file:
    1 plugin.server._Bounded._wrap.<locals>.unary      grpcio calls it: the request decoded, a
                                                       deadline where the kubelet set none
    2 plugin.service._DraService.NodePrepareResources  the handler: answers, logs and the claim
                                                       status, once per claim
    3 plugin.state.NodePreparer.prepare                in chunks: PrepareTransaction.read (the
                                                       claims read and planned, outside the lock),
                                                       then asyncio.to_thread into a worker thread
    4 plugin.transaction.PrepareTransaction.run        lock, checkpoint read, _admit (prepared
                                                       already?, conflicts, MIG placements free?,
                                                       `started`), then each claim:
    5 plugin.transaction.PrepareTransaction._carry_out MIG instances (MigSteps), sharing, then
    6 plugin.claim_steps.ClaimSteps.write_spec         the spec assembled from what they returned
    7 cdi.files.write_spec                             written atomically
  to the checkpoint: frames 1-4, then
    5 plugin.claim_steps.ClaimSteps.save               every entry `completed`
    6 plugin.checkpoint.save                           written atomically
An Unprepare, the same way:
  to the CDI file:
    1 plugin.server._Bounded._wrap.<locals>.unary
    2 plugin.service._DraService.NodeUnprepareResources
    3 plugin.state.NodePreparer.unprepare
    4 plugin.transaction.UnprepareTransaction.run      lock, checkpoint read, then each claim:
    5 plugin.transaction.UnprepareTransaction._release spec, sharing, MIG instances, entry
    6 plugin.claim_steps.ClaimSteps.roll_back
    7 cdi.files.remove_claim_spec
  to the checkpoint: frames 1-4, then
    5 plugin.claim_steps.ClaimSteps.save
    6 plugin.checkpoint.save

The checkpoint on disk is the only source of truth. Every Prepare and Unprepare is ONE
synchronous section in a worker thread that holds an exclusive file lock
(`<state dir>/serialize.lock`), reads the checkpoint inside it and writes it back before it
lets go; nothing is kept across calls. So two plugin instances on one node (a rolling
update: the kubelet may call either) take turns on the same files and never undo each
other's work. The API server is read outside the lock, so a slow one never holds up other
claims' bookkeeping.

Prepare runs in two phases only where a crash could leave something behind that the next
section cannot find by itself: sharing daemons and dynamic MIG instances. A claim with
sharing is written as `started` before its daemon starts and `completed` after its CDI
spec; a claim with dynamic MIG slices is written as `started` with each instance's intent
(parent GPU, profile, start slice) before it is created, and `completed` with the made
instances' ids and MIG UUIDs after its spec, so a crash in between leaves an intent that
recovery destroys at its placement. A placement some other instance holds fails the claim
before anything is written. A claim with neither is written once, as `completed` after
its spec (recovery removes a spec without an entry, and the kubelet's retry writes it
again). The claims of one kubelet call share one section, in chunks of `CHUNK` (which
bounds what a huge call holds at once). Recovery at start lives in recovery.py; a
checkpoint found unreadable mid-life is repaired by it too, then the section runs once more.

This module drives the transactions (transaction.py holds their steps). It must not speak
gRPC (service.py) or read the API server itself (claim_source.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final

import structlog

from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles
from dra_driver.gpu.mig import MigInstances
from dra_driver.gpu.placements import Placement
from dra_driver.imex.daemons import ImexDaemons
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.channel_gate import ChannelGate
from dra_driver.plugin.claim_steps import ClaimSteps
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.prepared import ClaimResult
from dra_driver.plugin.recovery import ListAllocated, recover
from dra_driver.plugin.sick_devices import TaintsOf
from dra_driver.plugin.transaction import ClaimSource, PrepareTransaction, UnprepareTransaction
from dra_driver.sharing.policy import Sharing

log = structlog.get_logger(__name__)

CHUNK: Final = 1000  # claims per section; bounds what one huge kubelet call holds at once


class NodePreparer:
    """Prepares and unprepares the claims of one driver on one node."""

    def __init__(
        self,
        *,
        driver: str,
        pool: str,
        devices: dict[str, NodeDevice],
        claims: ClaimSource,
        driver_files: DriverFiles,
        cdi_dir: Path,
        state_dir: Path,
        sharing: Sharing,
        boot_id: str | None = None,
        mig: MigInstances | None = None,
        placements: Mapping[str, Placement] | None = None,
        imex: ImexDaemons | None = None,
        channel_major: int | None = None,
    ) -> None:
        self.claims = claims
        self.steps = ClaimSteps(
            driver, pool, devices, driver_files, cdi_dir, state_dir, sharing, boot_id or ckpt.read_boot_id(),
            mig, dict(placements or {}), imex, channel_major,
        )
        self.gate: ChannelGate | None = None  # set with --compute-domains (it needs the API client)
        self.taints_of: TaintsOf | None = None  # set once the health monitor runs

    def read_checkpoint(self) -> ckpt.Checkpoint:
        """The checkpoint as it is on disk now (atomic file: no lock needed to read it)."""
        return ckpt.load(self.steps.checkpoint_path, self.steps.boot_id, self.steps.driver).checkpoint

    async def recover(self, list_allocated: ListAllocated | None = None) -> None:
        """Make checkpoint, CDI specs and sharing state agree again (at start). `list_allocated`:
        the API server's claims of this node as the start already asked for them (once)."""
        steps = self.steps
        await recover(steps, list_allocated or (lambda: self.claims.allocated_here(steps.driver, steps.pool)))

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        """Prepare every claim; each gets its own answer (one bad claim never fails the rest)."""
        results: dict[str, ClaimResult] = {}
        held = self._held_now()
        for chunk in _chunks(refs, CHUNK):
            txn = PrepareTransaction(self.steps, chunk, held, self.gate, self.taints_of)
            await txn.read(self.claims)
            try:
                try:
                    results.update(await asyncio.to_thread(txn.run))
                except ckpt.CheckpointUnreadable:  # found unreadable mid-life: repaired as at start
                    await self.recover()
                    results.update(await asyncio.to_thread(txn.run))
            except ckpt.CheckpointRefused as e:  # a newer instance's: the kubelet turns to that one
                results.update(txn.refused(e))
        return results

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        """Unprepare every claim; as `prepare`."""
        results: dict[str, ClaimResult] = {}
        for chunk in _chunks(refs, CHUNK):
            txn = UnprepareTransaction(self.steps, chunk)
            try:
                try:
                    results.update(await asyncio.to_thread(txn.run))
                except ckpt.CheckpointUnreadable:
                    await self.recover()
                    results.update(await asyncio.to_thread(txn.run))
            except ckpt.CheckpointRefused as e:
                results.update(txn.refused(e))
        if self.gate is not None:
            await self.gate.leave()  # this node out of the status of each domain whose daemon stopped
        return results

    def _held_now(self) -> Mapping[str, ckpt.ClaimEntry]:
        """The checkpoint's entries as they are now (none if it cannot be read: the locked
        section decides what to do about that)."""
        try:
            return self.read_checkpoint().claims
        except (ckpt.CheckpointUnreadable, ckpt.CheckpointRefused):
            return {}


def _chunks(items: Sequence[ClaimRef], size: int) -> Iterator[Sequence[ClaimRef]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


__all__ = ["ClaimResult", "ClaimSource", "NodePreparer"]
