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
removed, and none at all if the API server cannot say. An adopted claim's dynamic MIG
instances are found through NVML at its allocated placements and recorded with their ids
and MIG UUID, as if the checkpoint had kept them; a claim with a placement where no instance
is found is not adopted (its files are kept for the kubelet's Unprepare, as for any claim
that cannot be adopted). `instances_at_start` says which instances are this plugin's before
discovery's devices are published: the checkpoint's, or, while the checkpoint cannot say,
those at the placements of the claims recovery will adopt. A checkpoint from a newer build or
of another driver stops the plugin before anything on disk changes (CheckpointRefused
propagates). Only this driver's files are looked at: its checkpoint (it records the driver),
the CDI specs named with its vendor, and the sharing state under its own MPS root.

It must not serve the kubelet's calls (state.py does) nor decide what a claim needs
(ClaimSteps.plan does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from dra_driver.cdi.files import claim_spec_path, claim_uids_in, remove_claim_spec
from dra_driver.gpu.mig import MigError
from dra_driver.gpu.model import Inventory
from dra_driver.gpu.placements import Placement, dynamic, find_placement
from dra_driver.jsontypes import JSON
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin import mig_steps
from dra_driver.plugin.claim_steps import ClaimSteps
from dra_driver.plugin.claims import ClaimRef, ClaimRejected
from dra_driver.plugin.lock import exclusive
from dra_driver.plugin.prepared import MigRecord
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
        if steps.imex is not None:  # daemons of domains with no claim here left
            steps.imex.sweep(frozenset(claims) | keep)
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
            mig = _found_instances(steps, ref, plan.mig)
        except ClaimRejected as e:
            log.error(
                "cannot adopt a claim allocated here; keeping its files", error=str(e), **ref.log_fields()
            )
            keep.add(ref.uid)
            continue
        started = ckpt.started_entry(ref.namespace, ref.name, ref.uid, plan.devices, mig=mig)
        claims[ref.uid] = ckpt.completed_entry(started)
        if plan.sharing is not None and steps.sharing.saved_plan(ref.uid) is None:
            keep.add(ref.uid)  # a daemon without its settings: leave it to Unprepare
        log.warning("adopted a prepared claim into the new checkpoint", **ref.log_fields())
    return claims, frozenset(keep)


def _found_instances(steps: ClaimSteps, ref: ClaimRef, placements: Sequence[Placement]) -> list[MigRecord]:
    """The MIG records of an adopted claim: the instance found at each allocated placement,
    with its ids and MIG UUID (lost with the checkpoint). ClaimRejected where none is there
    (the claim's pod lost that device: not adopted). If NVML cannot be read, the intent:
    Unprepare destroys whatever instance of its profile sits at its start."""
    records = []
    for p in placements:
        if steps.mig is None:  # plan() refuses placements without --dynamic-mig
            raise ClaimRejected(f"claim {ref}: {p.name} is a dynamic MIG slice and --dynamic-mig is off")
        try:
            made = steps.mig.find_at(p.gpu.uuid, p.profile.id, p.start)
        except MigError as e:
            log.error("could not read an adopted claim's MIG instance; recording its placement only",
                      device=p.name, error=str(e), **ref.log_fields())
            records.append(mig_steps.intent(p))
            continue
        if made is None:
            raise ClaimRejected(
                f"claim {ref}: no MIG instance of {p.profile.name} at memory slice {p.start} of GPU "
                f"{p.gpu.uuid} (its placement {p.name}): the instance made for it is gone, and "
                "with it its pod's device"
            )
        records.append(mig_steps.made_record(p, made))
        log.warning("adopted a prepared claim's MIG instance found at its placement", device=p.name,
                    gpu_instance_id=made.gpu_instance_id, mig_uuid=made.uuid, **ref.log_fields())
    return records


def asked_once(list_allocated: ListAllocated) -> ListAllocated:
    """`list_allocated`, asked at most once: at start, the MIG instances taken out of
    discovery and the claims recovery adopts come from the same answer."""
    answer: list[list[JSON] | None] = []

    async def listed() -> list[JSON] | None:
        if not answer:
            answer.append(await list_allocated())
        return answer[0]

    return listed


@dataclass(frozen=True)
class StartPaths:
    """What `instances_at_start` reads before the plugin's `ClaimSteps` exist."""

    checkpoint_path: Path
    boot_id: str
    driver: str
    pool: str
    cdi_dir: Path


async def instances_at_start(
    inventory: Inventory, steps_at: StartPaths, list_allocated: ListAllocated, *, ask_api: bool = True
) -> list[MigRecord]:
    """The dynamic MIG instances that are this plugin's, for discovery to take out before
    anything is published (`mig_steps.without_own`): the checkpoint's records; or, while the
    checkpoint cannot say (unreadable, or not this boot's) and some dynamic GPU holds an
    instance, those at the allocated placements of the claims recovery will adopt (listed
    by the API server, CDI spec of this boot on disk), as intents. Without them an instance
    this plugin made would be published as static. `ask_api` False (no --dynamic-mig): the
    checkpoint's records only."""
    unreadable: str | None = None  # recovery says so itself; here it is said only where it matters
    try:
        at = steps_at
        loaded = await asyncio.to_thread(ckpt.load, at.checkpoint_path, at.boot_id, at.driver)
    except ckpt.CheckpointRefused:
        return []  # recovery stops the plugin before anything is published
    except (ckpt.CheckpointUnreadable, OSError, ValueError) as e:
        unreadable = str(e)
    else:
        if loaded.status == ckpt.LoadStatus.LOADED:
            return [r for entry in loaded.checkpoint.claims.values() for r in entry.mig]
    if not ask_api or not any(dynamic(g) and g.mig_devices for g in inventory.gpus):
        return []  # no instance on a dynamic GPU to tell apart: nothing to ask
    on_disk = await asyncio.to_thread(specs_of_this_boot, steps_at.cdi_dir, steps_at.driver)
    if not on_disk:
        return []  # no claim to adopt: every instance there is someone else's
    if unreadable is not None:
        log.error("cannot read which MIG instances are this plugin's from the checkpoint; asking the API "
                  "server which claims are allocated here", error=unreadable)
    listed = await list_allocated()
    if listed is None:
        log.error("the API server could not say which claims are allocated here: every MIG instance on a "
                  "dynamic GPU is taken for a static one")
        return []
    return listed_instances(inventory, listed, steps_at.driver, steps_at.pool, on_disk)


def listed_instances(
    inventory: Inventory, listed: Sequence[JSON], driver: str, pool: str, uids: frozenset[str]
) -> list[MigRecord]:
    """Intents for the dynamic MIG placements allocated in `pool` to the listed claims of
    `uids`, resolved whatever instance sits on them now (that instance may be the claim's)."""
    found = []
    for claim in listed:
        if str((claim.get("metadata") or {}).get("uid", "")) not in uids:
            continue
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
        for r in results:
            if r.get("driver") != driver or r.get("pool") != pool:
                continue
            placement = find_placement(inventory, str(r.get("device", "")), over_instances=True)
            if placement is not None:
                found.append(mig_steps.intent(placement))
    return found


def _state_on_disk(steps: ClaimSteps) -> frozenset[str]:
    return specs_of_this_boot(steps.cdi_dir, steps.driver) | steps.sharing.claims_with_state()


def specs_of_this_boot(cdi_dir: Path, driver: str) -> frozenset[str]:
    """Claims with a CDI spec written since this boot (a persistent CDI dir may still hold
    specs of an earlier boot, whose pods are gone: never adopt those)."""
    booted = ckpt.boot_time()
    found = set()
    for uid in claim_uids_in(cdi_dir, driver):
        try:
            if claim_spec_path(cdi_dir, driver, uid).stat().st_mtime >= booted:
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
    channel = steps.imex.request_of(entry.uid) if steps.imex is not None and entry.devices else None
    if channel is not None and steps.channel_major is not None:
        steps.write_spec(entry.uid, (), None, (entry.devices[0].device, channel))
        log.warning("rewrote a missing CDI spec", **ref.log_fields())
        return True
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
        hardware = steps.mig_steps.devices(hardware, entry.mig)
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
