"""The prepare/unprepare transaction: crash-safe, and safe against a second plugin instance.

The checkpoint on disk is the only source of truth. Every Prepare, Unprepare and start-up
recovery is ONE synchronous function that holds an exclusive file lock
(`<state dir>/serialize.lock`), reads the checkpoint inside it and writes it back before it
lets go; nothing is kept across calls (a decoded checkpoint is reused only for the very
same bytes). So two plugin instances on one node (a rolling update: the kubelet may call
either) take turns on the same files and never undo each other's work. The async face
(`prepare`, `unprepare`, `recover`) reads from the API server outside the lock (a slow API
server never holds up other claims' bookkeeping) and reaches the locked section with one
hop, `asyncio.to_thread`, unless the section cannot wait for anything: a batch of at most
`INLINE_MAX` claims without sharing daemons to start or stop, with the lock free. That
one touches only the state and CDI dirs (tmpfs), so it runs on the event loop itself (the
hop to a worker and back cost ~0.25 ms of a ~3 ms Prepare); so does the check for claims
prepared already (a kubelet asking again needs no API read).

Prepare runs in two phases, each on disk before the next step: `started` (the devices we
are about to hand out) -> sharing set up, CDI spec written -> `completed`; a claim
without sharing skips the `started` write (see `_prepare_locked`). The claims of one
kubelet call, and of all calls that arrive together or while a transaction runs (`GroupCommit`), share
a transaction (one lock, one `started` write, one `completed` write), in chunks of `CHUNK`,
which also bounds the memory a huge call holds. A crash anywhere leaves
a state that the next locked section repairs: a `started` entry is a dead transaction's
(a live one holds the lock), so it is rolled back; at start a spec without an entry is
removed and an entry whose spec vanished gets it rewritten.

A checkpoint that cannot be read, or that is missing while this boot's specs are on disk
(a wiped or moved state dir), never costs a running pod its devices: it is moved aside,
and the specs on disk of claims that the API server says are allocated to this node are
adopted into a new checkpoint; only specs of claims that are gone are removed, and none at
all if the API server cannot say. A checkpoint from a newer build stops the plugin.

`DRA_DRIVER_FAULT=<point>` makes the process die (as kill -9 would) at a named point, for
the crash-safety tests: prepare-after-started, prepare-after-cdi, prepare-after-completed,
unprepare-after-cdi-removed, unprepare-after-entry-removed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import structlog

from dra_driver import cdi
from dra_driver.devices import NodeDevice
from dra_driver.driver_root import DriverFiles
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claims import (
    AllocatedDevice,
    ClaimRef,
    ClaimRejected,
    allocated_devices,
    check_ref,
    describe,
)
from dra_driver.plugin.group_commit import GroupCommit
from dra_driver.plugin.lock import LockBusy, exclusive
from dra_driver.plugin.prepared import PreparedDevice
from dra_driver.sharing.policy import ConfigError, Sharing, SharingError, SharingPlan

log = structlog.get_logger(__name__)

FAULT_ENV: Final = "DRA_DRIVER_FAULT"
LOCK_FILE: Final = "serialize.lock"
CHUNK: Final = 1000  # claims per transaction; bounds what one huge kubelet call holds at once
INLINE_MAX: Final = 16  # claims a section may handle on the event loop (~20 us each)

JSON = dict[str, Any]


_FAULT_POINT: Final = os.environ.get(FAULT_ENV)  # read once: the check sits on every Prepare


def _fault(point: str) -> None:
    if point == _FAULT_POINT:
        log.warning("fault injection: dying", point=point)
        os._exit(137)


class ClaimSource(Protocol):
    """Where claims come from (the API server; a dict in unit tests)."""

    async def read(self, refs: Sequence[ClaimRef]) -> dict[str, JSON | ClaimRejected]: ...

    async def allocated_here(self, driver: str, pool: str) -> list[JSON] | None: ...


@dataclass(frozen=True)
class ClaimResult:
    """One claim's answer to the kubelet: its devices, or an error the user can act on."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class _Plan:
    """What preparing one claim means on this node, decided before the lock."""

    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]  # in allocation order, as answered
    hardware: tuple[NodeDevice, ...]  # each device once, for the CDI spec
    sharing: SharingPlan | None


_Work = Sequence[_Plan] | Sequence[ClaimRef]


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
    ) -> None:
        self.driver = driver
        self.pool = pool
        self.devices = devices
        self.claims = claims
        self.driver_files = driver_files
        self.cdi_dir = cdi_dir
        self.state_dir = state_dir
        self.checkpoint_path = ckpt.checkpoint_path(state_dir)
        self.lock_path = state_dir / LOCK_FILE
        self.sharing = sharing
        self.boot_id = boot_id or ckpt.read_boot_id()
        self._decoded = ckpt.CodecCache()
        self._spec_edits = cdi.RenderedEdits.of(cdi.common_edits(driver_files))
        self._prepares: GroupCommit[_Plan, ClaimResult] = GroupCommit(
            lambda plans: self._locked(self._prepare_locked, plans)
        )
        self._unprepares: GroupCommit[ClaimRef, ClaimResult] = GroupCommit(
            lambda refs: self._locked(self._unprepare_locked, refs)
        )

    def read_checkpoint(self) -> ckpt.Checkpoint:
        """The checkpoint as it is on disk now (atomic file: no lock needed to read it)."""
        return ckpt.load(self.checkpoint_path, self.boot_id, self._decoded).checkpoint

    # -- the async face ----------------------------------------------------------------

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        """Prepare every claim; each gets its own answer (one bad claim never fails the rest)."""
        results: dict[str, ClaimResult] = {}
        done = self._completed_now(refs)
        for chunk in _chunks(refs, CHUNK):
            results.update(await self._prepare_chunk(chunk, done))
        return results

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        results: dict[str, ClaimResult] = {}
        for chunk in _chunks(refs, CHUNK):
            checked = _checked(chunk, results)
            if checked:
                batch = await self._unprepares.submit(checked)
                results.update((r.uid, batch[r.uid]) for r in checked)
        return results

    async def recover(self) -> None:
        """Make checkpoint, CDI specs and sharing state agree again (at start)."""
        listed: list[JSON] | None = None
        adopt = await asyncio.to_thread(self._needs_adoption)
        if adopt:
            log.error(
                "the checkpoint cannot say which claims are prepared here (unreadable, or missing while "
                "this boot's CDI specs or sharing daemons exist): asking the API server which claims are "
                "allocated to this node"
            )
            listed = await self.claims.allocated_here(self.driver, self.pool)
        await asyncio.to_thread(self._recover_locked, adopt, listed)

    async def _prepare_chunk(
        self, refs: Sequence[ClaimRef], done: dict[str, tuple[PreparedDevice, ...]]
    ) -> dict[str, ClaimResult]:
        results: dict[str, ClaimResult] = {}
        checked = _checked(refs, results)
        for ref in checked:
            if ref.uid in done:  # the kubelet asks again after a restart: no API read needed
                results[ref.uid] = ClaimResult(done[ref.uid])
        wanted = [r for r in checked if r.uid not in results]
        fetched = await self.claims.read(wanted) if wanted else {}
        plans: list[_Plan] = []
        for ref in wanted:
            claim = fetched[ref.uid]
            try:
                if isinstance(claim, ClaimRejected):
                    raise claim
                plans.append(self._plan(ref, claim))
            except ClaimRejected as e:
                results[ref.uid] = ClaimResult(error=str(e))
        del fetched
        if plans:
            batch = await self._prepares.submit(plans)
            results.update((p.ref.uid, batch[p.ref.uid]) for p in plans)
        return results

    async def _locked(self, section: Any, work: _Work) -> dict[str, ClaimResult]:
        """Run a locked section; a checkpoint found unreadable mid-life is repaired like at
        start, then the section runs once more. A newer instance's checkpoint (this one is
        the old pod of an update) refuses the calls: the kubelet turns to the newer one."""
        try:
            try:
                result: dict[str, ClaimResult] = await self._section(section, work)
            except ckpt.CheckpointUnreadable:
                await self.recover()
                result = await asyncio.to_thread(section, work)
        except ckpt.CheckpointFromNewerVersion as e:
            uids = [w.ref.uid if isinstance(w, _Plan) else w.uid for w in work]
            return {uid: ClaimResult(error=str(e)) for uid in uids}
        return result

    async def _section(self, section: Any, work: _Work) -> dict[str, ClaimResult]:
        """Run `section` on the event loop if it cannot wait for anything, else in a thread."""
        if len(work) <= INLINE_MAX and not any(self._may_wait(w) for w in work):
            try:
                result: dict[str, ClaimResult] = section(work, False)
                return result
            except LockBusy:  # the other instance is in a section: wait for it in a thread
                pass
        return await asyncio.to_thread(section, work)

    def _may_wait(self, work: _Plan | ClaimRef) -> bool:
        """Whether a claim's part of a section may wait for a sharing daemon to start or stop."""
        if isinstance(work, _Plan):
            return work.sharing is not None
        return self.sharing.has_state(work.uid)

    def _completed_now(self, refs: Sequence[ClaimRef]) -> dict[str, tuple[PreparedDevice, ...]]:
        """The devices of those of `refs` that are prepared already."""
        try:
            cp = self.read_checkpoint()
        except (ckpt.CheckpointUnreadable, ckpt.CheckpointFromNewerVersion):
            return {}  # the locked section decides what to do about it
        entries = (cp.claims.get(r.uid) for r in refs)
        return {e.uid: e.devices for e in entries if e is not None and e.phase == ckpt.COMPLETED}

    # -- pure planning -----------------------------------------------------------------

    def _plan(self, ref: ClaimRef, claim: JSON) -> _Plan:
        allocated = allocated_devices(ref, claim, self.driver, self.pool, self.devices)
        hardware = tuple({a.device.name: a.device for a in allocated}.values())
        try:
            sharing = self.sharing.plan(ref.uid, claim, hardware)
        except ConfigError as e:
            raise ClaimRejected(f"claim {ref}: invalid configuration for driver {self.driver}: {e}") from e
        return _Plan(ref, tuple(self._prepared(ref, a) for a in allocated), hardware, sharing)

    def _prepared(self, ref: ClaimRef, a: AllocatedDevice) -> PreparedDevice:
        return PreparedDevice(
            request_names=(a.request,),
            pool=a.pool,
            device=a.device.name,
            cdi_device_ids=(cdi.claim_device_id(self.driver, ref.uid, a.device.name),),
            share_id=a.share_id,
            admin_access=a.admin_access,
        )

    def _spec(self, uid: str, hardware: Sequence[NodeDevice], sharing: SharingPlan | None) -> cdi.CdiSpec:
        extra = self.sharing.edits(sharing, hardware)
        common = self._spec_edits.edits
        return cdi.build_claim_spec(
            self.driver, uid, list(hardware), self.driver_files, extra_edits=extra, common=common
        )

    # -- locked sections (blocking; run in a worker thread) ------------------------------

    def _load_locked(self) -> ckpt.Checkpoint:
        result = ckpt.load(self.checkpoint_path, self.boot_id, self._decoded)
        if result.discarded is not None:
            log.warning(
                "checkpoint from an earlier boot discarded (its CDI specs died with the tmpfs)",
                claims=len(result.discarded.claims),
            )
        return result.checkpoint

    def _prepare_locked(self, plans: Sequence[_Plan], wait: bool = True) -> dict[str, ClaimResult]:
        results: dict[str, ClaimResult] = {}
        with exclusive(self.lock_path, wait):
            claims = dict(self._load_locked().claims)  # this transaction's working copy
            todo: list[_Plan] = []
            planned: set[str] = set()
            for plan in plans:
                uid = plan.ref.uid
                if uid in results or uid in planned:
                    continue  # two calls for one claim (two pods sharing it) in one batch
                entry = claims.get(uid)
                if entry is not None and entry.phase == ckpt.COMPLETED:  # the other instance, or a retry
                    results[uid] = ClaimResult(entry.devices)
                    continue
                if entry is not None:
                    self._roll_back(plan.ref, "redoing an interrupted prepare")
                    del claims[uid]
                conflict = _conflict(claims, plan) or _share_conflict(claims, plan, self.devices)
                if conflict:
                    results[uid] = ClaimResult(error=conflict)
                    continue
                todo.append(plan)
                planned.add(uid)
                claims[uid] = ckpt.started_entry(plan.ref.namespace, plan.ref.name, uid, plan.devices)
            # `started` must be on disk before anything a crash could leave behind that the
            # next locked section cannot find by itself: sharing daemons. A CDI spec alone
            # needs no record (recovery removes a spec without an entry; the kubelet's retry
            # rewrites it), so claims without sharing cost one checkpoint write, not two.
            if any(plan.sharing is not None for plan in todo):
                self._save(claims)
            _fault("prepare-after-started")
            for plan in todo:
                uid = plan.ref.uid
                error = self._set_up(plan)
                if error is None:
                    claims[uid] = ckpt.completed_entry(claims[uid])
                    results[uid] = ClaimResult(plan.devices)
                else:
                    self._roll_back(plan.ref, "set-up failed")
                    del claims[uid]
                    results[uid] = ClaimResult(error=error)
            _fault("prepare-after-cdi")
            if todo:
                self._save(claims)
            _fault("prepare-after-completed")
        return results

    def _save(self, claims: dict[str, ckpt.ClaimEntry]) -> None:
        ckpt.save(self.checkpoint_path, ckpt.Checkpoint(self.boot_id, dict(claims)), self._decoded)

    def _set_up(self, plan: _Plan) -> str | None:
        """Sharing, then the CDI spec, for one claim already recorded as started; the error
        text for the kubelet if that failed (the caller rolls back)."""
        ref = plan.ref
        try:
            self.sharing.apply(plan.sharing)
        except SharingError as e:
            return f"claim {ref}: GPU sharing could not be set up on this node: {e}"
        try:
            cdi.write_spec(self.cdi_dir, self._spec(ref.uid, plan.hardware, plan.sharing), self._spec_edits)
        except OSError as e:
            log.exception("writing the CDI spec failed", **ref.log_fields())
            return f"internal error preparing claim {ref}: writing its CDI spec failed: {describe(e)}"
        return None

    def _unprepare_locked(self, refs: Sequence[ClaimRef], wait: bool = True) -> dict[str, ClaimResult]:
        results: dict[str, ClaimResult] = {}
        with exclusive(self.lock_path, wait):
            claims = dict(self._load_locked().claims)
            changed = False
            for ref in refs:
                try:
                    self._roll_back(ref, "unprepare")
                except SharingError as e:  # the entry stays, so the kubelet's retry tries again
                    results[ref.uid] = ClaimResult(error=f"claim {ref}: stopping its GPU sharing failed: {e}")
                    continue
                changed |= claims.pop(ref.uid, None) is not None
                results[ref.uid] = ClaimResult()
            if changed:
                self._save(claims)
            _fault("unprepare-after-entry-removed")
        return results

    def _roll_back(self, ref: ClaimRef, why: str) -> None:
        """Remove the claim's CDI spec, then its sharing; the caller then drops its entry.
        Each step is idempotent and the entry goes last, so a crash repeats them."""
        cdi.remove_claim_spec(self.cdi_dir, self.driver, ref.uid)
        _fault("unprepare-after-cdi-removed")
        self.sharing.release(ref.uid)
        # the service already says "unprepared" for the ordinary case
        (log.debug if why == "unprepare" else log.info)("claim state removed", reason=why, **ref.log_fields())

    # -- recovery ----------------------------------------------------------------------

    def _needs_adoption(self) -> bool:
        """The checkpoint is unreadable, or there is none (of this boot) although this boot's
        CDI specs or sharing daemons are on disk: the state dir was wiped or moved, and only
        the API server can tell which of them running pods use."""
        try:
            loaded = ckpt.load(self.checkpoint_path, self.boot_id)
        except ckpt.CheckpointUnreadable:
            return True
        except ckpt.CheckpointFromNewerVersion:
            return False  # raised again by the locked section, with the lock held
        return loaded.status != ckpt.LoadStatus.LOADED and bool(self._state_on_disk())

    def _recover_locked(self, adopt: bool, listed: list[JSON] | None) -> None:
        with exclusive(self.lock_path):
            keep: frozenset[str] = frozenset()
            try:
                claims = dict(self._load_locked().claims)
                changed = False
            except ckpt.CheckpointUnreadable as e:
                moved = ckpt.quarantine(self.checkpoint_path)
                log.error("checkpoint unreadable; moved aside", error=str(e), moved_to=str(moved))
                claims, changed, adopt = {}, True, True
            if adopt and not claims:  # another instance may have written one meanwhile
                claims, keep = self._adopt(listed)
                changed = True
            for entry in list(claims.values()):
                ref = ClaimRef(entry.namespace, entry.name, entry.uid)
                if entry.phase != ckpt.COMPLETED or not self._has_spec(entry):
                    why = (
                        "interrupted prepare found at start"
                        if entry.phase != ckpt.COMPLETED
                        else "devices gone"
                    )
                    self._roll_back(ref, why)
                    del claims[entry.uid]
                    changed = True
            known = set(claims) | keep
            for uid in cdi.claim_uids_in(self.cdi_dir, self.driver) - known:
                log.warning("removing the CDI spec of a claim that is not prepared here", claim_uid=uid)
                cdi.remove_claim_spec(self.cdi_dir, self.driver, uid)
            self._recover_sharing(claims, keep)
            if changed:
                self._save(claims)
            log.info("prepared-claim state recovered", claims=len(claims), kept_unknown=len(keep))

    def _adopt(self, listed: list[JSON] | None) -> tuple[dict[str, ckpt.ClaimEntry], frozenset[str]]:
        """Entries for the specs and sharing state found on disk, from the claims the API
        server says are allocated here; and the UIDs to keep although not adopted."""
        on_disk = self._state_on_disk()
        if listed is None:
            log.error(
                "the API server could not say which claims are allocated here: keeping every CDI spec "
                "and sharing daemon; the kubelet's Unprepare calls remove them",
                claims=len(on_disk),
            )
            return {}, on_disk
        claims: dict[str, ckpt.ClaimEntry] = {}
        keep: set[str] = set()
        for claim in listed:
            meta = claim.get("metadata") or {}
            ref = ClaimRef(
                str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", ""))
            )
            if ref.uid not in on_disk:
                continue
            try:
                plan = self._plan(ref, claim)
            except ClaimRejected as e:
                log.error(
                    "cannot adopt a claim allocated here; keeping its files",
                    error=str(e),
                    **ref.log_fields(),
                )
                keep.add(ref.uid)
                continue
            started = ckpt.started_entry(ref.namespace, ref.name, ref.uid, plan.devices)
            claims[ref.uid] = ckpt.completed_entry(started)
            if plan.sharing is not None and self.sharing.saved_plan(ref.uid) is None:
                keep.add(ref.uid)  # a daemon without its settings: leave it to Unprepare
            log.warning("adopted a prepared claim into the new checkpoint", **ref.log_fields())
        return claims, frozenset(keep)

    def _state_on_disk(self) -> frozenset[str]:
        return self._specs_of_this_boot() | self.sharing.claims_with_state()

    def _specs_of_this_boot(self) -> frozenset[str]:
        """Claims with a CDI spec written since this boot (a persistent CDI dir may still hold
        specs of an earlier boot, whose pods are gone: never adopt those)."""
        booted = ckpt.boot_time()
        found = set()
        for uid in cdi.claim_uids_in(self.cdi_dir, self.driver):
            try:
                if cdi.claim_spec_path(self.cdi_dir, self.driver, uid).stat().st_mtime >= booted:
                    found.add(uid)
            except FileNotFoundError:
                continue
        return frozenset(found)

    def _has_spec(self, entry: ckpt.ClaimEntry) -> bool:
        """A completed claim's spec is there, or was rewritten (e.g. someone cleaned the CDI
        dir); False if it cannot be, because its devices are gone from this node."""
        if cdi.claim_spec_path(self.cdi_dir, self.driver, entry.uid).exists():
            return True
        ref = ClaimRef(entry.namespace, entry.name, entry.uid)
        missing = [d.device for d in entry.devices if d.device not in self.devices]
        if missing:
            log.error(
                "prepared claim refers to devices this node no longer has; dropping it",
                devices=missing,
                **ref.log_fields(),
            )
            return False
        hardware = list({d.device: self.devices[d.device] for d in entry.devices}.values())
        spec = self._spec(entry.uid, hardware, self.sharing.saved_plan(entry.uid))
        cdi.write_spec(self.cdi_dir, spec, self._spec_edits)
        log.warning("rewrote a missing CDI spec", **ref.log_fields())
        return True

    def _recover_sharing(self, claims: dict[str, ckpt.ClaimEntry], keep: frozenset[str]) -> None:
        """Sharing of prepared claims runs again; sharing of unknown claims is torn down."""
        for uid in self.sharing.claims_with_state():
            entry = claims.get(uid)
            if entry is None or self.sharing.saved_plan(uid) is None:
                if uid in keep:
                    continue
                log.warning("stopping the GPU sharing of a claim that is not prepared", claim_uid=uid)
                self.sharing.release(uid)
                continue
            try:
                self.sharing.ensure_running(uid)
            except SharingError as e:  # its pods fail to connect and are restarted; the claim stays
                log.error(
                    "could not restart a claim's GPU sharing",
                    error=str(e),
                    **ClaimRef(entry.namespace, entry.name, uid).log_fields(),
                )


def _conflict(claims: dict[str, ckpt.ClaimEntry], plan: _Plan) -> str | None:
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
    claims: dict[str, ckpt.ClaimEntry], plan: _Plan, devices: dict[str, NodeDevice]
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
