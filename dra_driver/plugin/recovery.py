"""Start-up recovery: make the checkpoint, the CDI specs, the sharing state and the dynamic
MIG instances agree again.

A crash anywhere leaves a state that this repairs, under the same lock as the transaction:
a `started` entry is a dead transaction's (a live one holds the lock), so it is rolled
back, which destroys the MIG instances it recorded (an intent without ids: the instance
of its profile at its placement, if the create happened before the crash); an entry whose
spec vanished gets it rewritten; a spec without an entry is removed; sharing of claims
that are not prepared is torn down and that of prepared ones runs again; the MIG
instances of prepared claims are adopted (checked through NVML, their spec rebuilt from
the recorded ids and UUID). An instance NVML will not destroy keeps its entry, so the
next start or the kubelet's Unprepare tries again.

A checkpoint that cannot be read, or that is missing while this boot's specs or sharing
daemons are on disk (a wiped or moved state dir), never costs a running pod its devices:
it is moved aside, and the specs on disk of claims that the API server says are allocated
to this node are adopted into a new checkpoint; only specs of claims that are gone are
removed, and none at all if the API server cannot say. A checkpoint from a newer build or
of another driver stops the plugin before anything on disk changes (CheckpointRefused
propagates). Only this driver's files are looked at: its checkpoint (it records the driver),
the CDI specs named with its vendor, and the sharing state under its own MPS root.

It must not serve the kubelet's calls (state.py does) nor decide what a claim needs
(ClaimSteps.plan does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from dra_driver.cdi.files import claim_spec_path, claim_uids_in, remove_claim_spec
from dra_driver.gpu.mig import MigError
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin import mig_steps
from dra_driver.plugin.claim_steps import JSON, ClaimSteps
from dra_driver.plugin.claims import ClaimRef, ClaimRejected
from dra_driver.plugin.lock import exclusive
from dra_driver.sharing.policy import SharingError

log = structlog.get_logger(__name__)

ListAllocated = Callable[[], Awaitable[list[JSON] | None]]


async def recover(steps: ClaimSteps, list_allocated: ListAllocated) -> None:
    """Repair the node's claim state; asks the API server (`list_allocated`: the claims
    allocated to this node, None if it cannot say) only when the checkpoint cannot."""
    listed: list[JSON] | None = None
    adopt = await asyncio.to_thread(_needs_adoption, steps)
    if adopt:
        log.error(
            "the checkpoint cannot say which claims are prepared here (unreadable, or missing while "
            "this boot's CDI specs or sharing daemons exist): asking the API server which claims are "
            "allocated to this node"
        )
        listed = await list_allocated()
    await asyncio.to_thread(_recover_locked, steps, adopt, listed)


def _needs_adoption(steps: ClaimSteps) -> bool:
    """The checkpoint is unreadable, or there is none (of this boot) although this boot's
    CDI specs or sharing daemons are on disk: the state dir was wiped or moved, and only
    the API server can tell which of them running pods use."""
    try:
        loaded = ckpt.load(steps.checkpoint_path, steps.boot_id, steps.driver)
    except ckpt.CheckpointUnreadable:
        return True
    return loaded.status != ckpt.LoadStatus.LOADED and bool(_state_on_disk(steps))


def _recover_locked(steps: ClaimSteps, adopt: bool, listed: list[JSON] | None) -> None:
    with exclusive(steps.lock_path):
        keep: frozenset[str] = frozenset()
        try:
            claims = dict(steps.load().claims)
            changed = False
        except ckpt.CheckpointUnreadable as e:
            moved = ckpt.quarantine(steps.checkpoint_path)
            log.error("checkpoint unreadable; moved aside", error=str(e), moved_to=str(moved))
            claims, changed, adopt = {}, True, True
        if adopt and not claims:  # another instance may have written one meanwhile
            claims, keep = _adopt(steps, listed)
            changed = True
        for entry in list(claims.values()):
            ref = ClaimRef(entry.namespace, entry.name, entry.uid)
            if entry.phase != ckpt.ClaimPhase.COMPLETED or not _has_spec(steps, entry):
                interrupted = entry.phase != ckpt.ClaimPhase.COMPLETED
                why = "interrupted prepare found at start" if interrupted else "devices gone"
                try:
                    steps.roll_back(ref, why, entry.mig)
                except MigError as e:  # the entry keeps the instances; the next start tries again
                    log.error("could not destroy a claim's MIG instances; keeping its entry", error=str(e),
                              **ref.log_fields())
                    continue
                del claims[entry.uid]
                changed = True
            elif entry.mig:
                _adopt_mig(steps, entry)
        for uid in claim_uids_in(steps.cdi_dir, steps.driver) - set(claims) - keep:
            log.warning("removing the CDI spec of a claim that is not prepared here", claim_uid=uid)
            remove_claim_spec(steps.cdi_dir, steps.driver, uid)
        _recover_sharing(steps, claims, keep)
        if changed:
            steps.save(claims)
        log.info("prepared-claim state recovered", claims=len(claims), kept_unknown=len(keep))


def _adopt(
    steps: ClaimSteps, listed: list[JSON] | None
) -> tuple[dict[str, ckpt.ClaimEntry], frozenset[str]]:
    """Entries for the specs and sharing state found on disk, from the claims the API
    server says are allocated here; and the UIDs to keep although not adopted."""
    on_disk = _state_on_disk(steps)
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
        ref = ClaimRef(str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", "")))
        if ref.uid not in on_disk:
            continue
        try:
            plan = steps.plan(ref, claim)
        except ClaimRejected as e:
            log.error(
                "cannot adopt a claim allocated here; keeping its files", error=str(e), **ref.log_fields()
            )
            keep.add(ref.uid)
            continue
        # its MIG instances' ids are lost with the checkpoint: as intents, Unprepare finds them
        intents = [mig_steps.intent(p) for p in plan.mig]
        started = ckpt.started_entry(ref.namespace, ref.name, ref.uid, plan.devices, mig=intents)
        claims[ref.uid] = ckpt.completed_entry(started)
        if plan.sharing is not None and steps.sharing.saved_plan(ref.uid) is None:
            keep.add(ref.uid)  # a daemon without its settings: leave it to Unprepare
        log.warning("adopted a prepared claim into the new checkpoint", **ref.log_fields())
    return claims, frozenset(keep)


def _state_on_disk(steps: ClaimSteps) -> frozenset[str]:
    return _specs_of_this_boot(steps) | steps.sharing.claims_with_state()


def _specs_of_this_boot(steps: ClaimSteps) -> frozenset[str]:
    """Claims with a CDI spec written since this boot (a persistent CDI dir may still hold
    specs of an earlier boot, whose pods are gone: never adopt those)."""
    booted = ckpt.boot_time()
    found = set()
    for uid in claim_uids_in(steps.cdi_dir, steps.driver):
        try:
            if claim_spec_path(steps.cdi_dir, steps.driver, uid).stat().st_mtime >= booted:
                found.add(uid)
        except FileNotFoundError:
            continue
    return frozenset(found)


def _has_spec(steps: ClaimSteps, entry: ckpt.ClaimEntry) -> bool:
    """A completed claim's spec is there, or was rewritten (e.g. someone cleaned the CDI
    dir); False if it cannot be, because its devices are gone from this node."""
    if claim_spec_path(steps.cdi_dir, steps.driver, entry.uid).exists():
        return True
    ref = ClaimRef(entry.namespace, entry.name, entry.uid)
    missing = [d.device for d in entry.devices if d.device not in steps.devices]
    if missing:
        log.error(
            "prepared claim refers to devices this node no longer has; dropping it",
            devices=missing,
            **ref.log_fields(),
        )
        return False
    hardware = list({d.device: steps.devices[d.device] for d in entry.devices}.values())
    try:
        hardware = steps.hardware(hardware, entry.mig)
    except ValueError as e:  # a MIG slice whose instance's ids were never recorded
        log.error("cannot rebuild the CDI spec of a prepared claim; dropping it", error=str(e),
                  **ref.log_fields())
        return False
    steps.write_spec(entry.uid, hardware, steps.sharing.saved_plan(entry.uid))
    log.warning("rewrote a missing CDI spec", **ref.log_fields())
    return True


def _adopt_mig(steps: ClaimSteps, entry: ckpt.ClaimEntry) -> None:
    """Check that a prepared claim's MIG instances are still there (a restart adopts them:
    nothing is created again). One that is gone is logged: its pod has lost the device."""
    ref = ClaimRef(entry.namespace, entry.name, entry.uid)
    for r in entry.mig:
        if steps.mig is None or r.gpu_instance_id is None:
            continue
        try:
            found = steps.mig.at(r.parent_uuid, r.gpu_instance_id)
        except MigError as e:
            log.error("could not check a prepared claim's MIG instance", device=r.device, error=str(e),
                      **ref.log_fields())
            continue
        if found == (r.profile_id, r.start):
            log.info("adopted the MIG instance of a prepared claim", device=r.device, mig_uuid=r.uuid,
                     gpu_instance_id=r.gpu_instance_id, **ref.log_fields())
        else:
            log.error("a prepared claim's MIG instance is gone (destroyed by hand?); its pod lost the device",
                      device=r.device, gpu_instance_id=r.gpu_instance_id, found=found, **ref.log_fields())


def _recover_sharing(steps: ClaimSteps, claims: dict[str, ckpt.ClaimEntry], keep: frozenset[str]) -> None:
    """Sharing of prepared claims runs again; sharing of unknown claims is torn down."""
    for uid in steps.sharing.claims_with_state():
        entry = claims.get(uid)
        if entry is None or steps.sharing.saved_plan(uid) is None:
            if uid in keep:
                continue
            log.warning("stopping the GPU sharing of a claim that is not prepared", claim_uid=uid)
            steps.sharing.release(uid)
            continue
        try:
            steps.sharing.ensure_running(uid)
        except SharingError as e:  # its pods fail to connect and are restarted; the claim stays
            log.error(
                "could not restart a claim's GPU sharing",
                error=str(e),
                **ClaimRef(entry.namespace, entry.name, uid).log_fields(),
            )
