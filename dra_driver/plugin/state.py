"""The prepare/unprepare transaction: crash-safe, and safe against a second plugin instance.

A Prepare, top-down (each line a frame, from the handler to the CDI spec and the checkpoint):
    service._DraService.NodePrepareResources    grpcio calls it with the kubelet's request
    service._per_claim, service._answer_all      one answer per claim, logged with its identity
    NodePreparer.prepare                        refs checked; claims prepared already answered
      ClaimSource.read (claim_source.py)         the claims from the API server, outside the lock
      ClaimSteps.plan (claim_steps.py)           what each claim needs here (pure)
    NodePreparer._locked                        asyncio.to_thread; an unreadable checkpoint: recovery
    NodePreparer._prepare_locked                lock, read the checkpoint, prepared already?,
                                                conflicts, MIG placements free?, `started` (only
                                                if sharing daemons start or MIG instances are made)
    ClaimSteps.create_mig -> gpu.mig            dynamic MIG: GPU and compute instance (NVML)
    ClaimSteps.set_up -> ClaimSteps.write_spec  sharing, then cdi.files.write_spec
    ClaimSteps.save -> checkpoint.save          `completed`, with the MIG instances' ids

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
again). The claims of one kubelet call share one
section, in chunks of `CHUNK` (which bounds what a huge call holds at once). Recovery at
start lives in recovery.py; a checkpoint found unreadable mid-life is repaired by it too.

It must not speak gRPC (service.py) or read the API server itself (claim_source.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final, Protocol, TypeVar

import structlog

from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles
from dra_driver.gpu.mig import MigError, MigInstances
from dra_driver.gpu.placements import Placement
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin import mig_steps
from dra_driver.plugin.claim_steps import JSON, ClaimPlan, ClaimSteps, MigLeftBehind, fault
from dra_driver.plugin.claims import ClaimRef, ClaimRejected, check_ref
from dra_driver.plugin.lock import exclusive
from dra_driver.plugin.prepared import MigRecord, PreparedDevice
from dra_driver.plugin.recovery import ListAllocated, recover
from dra_driver.sharing.policy import Sharing, SharingError

log = structlog.get_logger(__name__)

CHUNK: Final = 1000  # claims per section; bounds what one huge kubelet call holds at once

Work = TypeVar("Work", ClaimPlan, ClaimRef)


class ClaimSource(Protocol):
    """Where claims come from (the API server; a dict in unit tests)."""

    async def read(self, refs: Sequence[ClaimRef]) -> dict[str, JSON | ClaimRejected]: ...

    async def allocated_here(self, driver: str, pool: str) -> list[JSON] | None: ...


@dataclass(frozen=True)
class ClaimResult:
    """One claim's answer to the kubelet: its devices, or an error the user can act on."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None
    # the claim as this Prepare read it (the claim status write reuses it: no second GET);
    # None where no read was needed (prepared already) and in every Unprepare
    claim: JSON | None = field(default=None, compare=False, repr=False)


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
    ) -> None:
        self.claims = claims
        self.steps = ClaimSteps(
            driver, pool, devices, driver_files, cdi_dir, state_dir, sharing, boot_id or ckpt.read_boot_id(),
            mig, dict(placements or {}),
        )

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
        done = self._completed_now(refs)
        for chunk in _chunks(refs, CHUNK):
            wanted = []
            for ref in _checked(chunk, results):
                if ref.uid in done:  # the kubelet asks again after a restart: no API read needed
                    results[ref.uid] = ClaimResult(done[ref.uid])
                else:
                    wanted.append(ref)
            fetched = await self.claims.read(wanted) if wanted else {}
            plans = []
            for ref in wanted:
                try:
                    claim = fetched[ref.uid]
                    if isinstance(claim, ClaimRejected):
                        raise claim
                    plans.append(self.steps.plan(ref, claim))
                except ClaimRejected as e:
                    results[ref.uid] = ClaimResult(error=str(e))
            if plans:
                for uid, result in (await self._locked(self._prepare_locked, plans)).items():
                    read = fetched.get(uid)  # kept for the claim status write: no second GET
                    ok = result.error is None and isinstance(read, dict)
                    results[uid] = replace(result, claim=read) if ok and isinstance(read, dict) else result
        return results

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        results: dict[str, ClaimResult] = {}
        for chunk in _chunks(refs, CHUNK):
            checked = _checked(chunk, results)
            if checked:
                results.update(await self._locked(self._unprepare_locked, checked))
        return results

    def _completed_now(self, refs: Sequence[ClaimRef]) -> dict[str, tuple[PreparedDevice, ...]]:
        """The devices of those of `refs` that are prepared already."""
        try:
            cp = self.read_checkpoint()
        except (ckpt.CheckpointUnreadable, ckpt.CheckpointRefused):
            return {}  # the locked section decides what to do about it
        entries = (cp.claims.get(r.uid) for r in refs)
        return {e.uid: e.devices for e in entries if e is not None and e.phase == ckpt.ClaimPhase.COMPLETED}

    async def _locked(
        self, section: Callable[[Sequence[Work]], dict[str, ClaimResult]], work: Sequence[Work]
    ) -> dict[str, ClaimResult]:
        """Run a locked section in a worker thread. A checkpoint found unreadable mid-life is
        repaired as at start, then the section runs once more. A newer instance's checkpoint
        (this one is the old pod of an update) refuses the calls: the kubelet turns to the
        newer one."""
        try:
            try:
                return await asyncio.to_thread(section, work)
            except ckpt.CheckpointUnreadable:
                await self.recover()
                return await asyncio.to_thread(section, work)
        except ckpt.CheckpointRefused as e:
            uids = [w.ref.uid if isinstance(w, ClaimPlan) else w.uid for w in work]
            return {uid: ClaimResult(error=str(e)) for uid in uids}

    def _prepare_locked(self, plans: Sequence[ClaimPlan]) -> dict[str, ClaimResult]:
        steps = self.steps
        results: dict[str, ClaimResult] = {}
        with exclusive(steps.lock_path):
            claims = dict(steps.load().claims)  # this section's working copy
            todo: list[ClaimPlan] = []
            planned: set[str] = set()
            for plan in plans:
                uid = plan.ref.uid
                if uid in results or uid in planned:
                    continue  # two calls for one claim (two pods sharing it) in one batch
                entry = claims.get(uid)
                # a kubelet retry, or the other instance prepared it meanwhile
                if entry is not None and entry.phase == ckpt.ClaimPhase.COMPLETED:
                    results[uid] = ClaimResult(entry.devices)
                    continue
                if entry is not None:
                    try:
                        steps.roll_back(plan.ref, "redoing an interrupted prepare", entry.mig)
                    except MigError as e:  # its instance stays recorded; the next call tries again
                        results[uid] = ClaimResult(error=f"claim {plan.ref}: undoing its interrupted prepare "
                                                         f"failed: {e}")
                        continue
                    del claims[uid]
                conflict = _conflict(claims, plan) or _share_conflict(claims, plan, steps.devices)
                conflict = conflict or steps.free(plan)
                if conflict:
                    results[uid] = ClaimResult(error=conflict)
                    continue
                todo.append(plan)
                planned.add(uid)
                intents = [mig_steps.intent(p) for p in plan.mig]
                ref = plan.ref
                claims[uid] = ckpt.started_entry(ref.namespace, ref.name, uid, plan.devices, mig=intents)
            if any(plan.sharing is not None or plan.mig for plan in todo):
                steps.save(claims)  # `started`, before a daemon or MIG instance that only this entry records
            fault("prepare-after-started")
            for plan in todo:
                uid = plan.ref.uid
                made: tuple[MigRecord, ...] = ()
                try:
                    made = steps.create_mig(plan)
                except MigLeftBehind as e:  # stays `started` with what is left: recovery destroys it
                    claims[uid] = replace(claims[uid], mig=e.left)
                    results[uid] = ClaimResult(error=f"claim {plan.ref}: {e}")
                    continue
                except MigError as e:
                    error: str | None = f"claim {plan.ref}: {e}"
                else:
                    if made:
                        fault("prepare-after-mig-create")
                    error = steps.set_up(plan, made)
                if error is None:
                    claims[uid] = ckpt.completed_entry(claims[uid], mig=made)
                    results[uid] = ClaimResult(plan.devices)
                    continue
                try:
                    steps.roll_back(plan.ref, "set-up failed", made)
                except MigError as e:  # stays `started` with the instances made: recovery destroys them
                    claims[uid] = replace(claims[uid], mig=made)
                    results[uid] = ClaimResult(error=f"{error}; destroying its MIG instances failed: {e}")
                    continue
                del claims[uid]
                results[uid] = ClaimResult(error=error)
            fault("prepare-after-cdi")
            if todo:
                steps.save(claims)
            fault("prepare-after-completed")
        return results

    def _unprepare_locked(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        steps = self.steps
        results: dict[str, ClaimResult] = {}
        with exclusive(steps.lock_path):
            claims = dict(steps.load().claims)
            changed = False
            for ref in refs:
                held = claims.get(ref.uid)
                try:
                    steps.roll_back(ref, "unprepare", held.mig if held is not None else ())
                except SharingError as e:  # the entry stays, so the kubelet's retry tries again
                    results[ref.uid] = ClaimResult(error=f"claim {ref}: stopping its GPU sharing failed: {e}")
                    continue
                except MigError as e:  # a process still in the instance (IN_USE): the retry tries again
                    error = f"claim {ref}: destroying its MIG instances failed: {e}"
                    results[ref.uid] = ClaimResult(error=error)
                    continue
                changed |= claims.pop(ref.uid, None) is not None
                results[ref.uid] = ClaimResult()
            if changed:
                steps.save(claims)
            fault("unprepare-after-entry-removed")
        return results


def _conflict(claims: dict[str, ckpt.ClaimEntry], plan: ClaimPlan) -> str | None:
    """The last line of defence against a double allocation (a stale or edited claim)."""
    exclusive_here = {d.device for d in plan.devices if not (d.admin_access or d.share_id)}
    if not exclusive_here:
        return None
    for other in claims.values():
        if other.uid == plan.ref.uid:
            continue
        for d in other.devices:
            if d.device in exclusive_here and not (d.admin_access or d.share_id):
                return (
                    f"device {d.device} is already prepared for claim {other.namespace}/{other.name} "
                    f"(uid {other.uid}); delete that pod first, or use a shared claim or adminAccess"
                )
    return None


def _share_conflict(
    claims: dict[str, ckpt.ClaimEntry], plan: ClaimPlan, devices: dict[str, NodeDevice]
) -> str | None:
    """A whole GPU and a memory share of it are two device names for one GPU; the scheduler
    keeps them apart (a shared counter), this refuses an allocation that did not."""

    def gpu(d: PreparedDevice) -> str | None:
        found = devices.get(d.device)
        return found.uuid if found is not None and not d.admin_access else None

    mine = {gpu(d): bool(d.share_id) for d in plan.devices if gpu(d) is not None}
    for other in claims.values():
        for d in other.devices:
            shared = mine.get(gpu(d))
            if other.uid != plan.ref.uid and shared is not None and shared != bool(d.share_id):
                held, wanted = ("a memory share", "the whole GPU")
                if not d.share_id:
                    held, wanted = wanted, "a memory share"
                return (
                    f"{d.device} ({gpu(d)}) is held as {held} by claim {other.namespace}/{other.name} "
                    f"(uid {other.uid}), so it cannot also be given out as {wanted}; delete that pod first"
                )
    return None


def _checked(refs: Sequence[ClaimRef], results: dict[str, ClaimResult]) -> list[ClaimRef]:
    """The refs that could come from the API server; the others get their error in `results`."""
    good = []
    for ref in refs:
        try:
            check_ref(ref)
            good.append(ref)
        except ClaimRejected as e:
            results[ref.uid] = ClaimResult(error=str(e))
    return good


def _chunks(items: Sequence[ClaimRef], size: int) -> Iterator[Sequence[ClaimRef]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


__all__ = ["ClaimResult", "ClaimSource", "NodePreparer"]
