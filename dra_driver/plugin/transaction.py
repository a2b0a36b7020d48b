"""One Prepare or Unprepare of a chunk of claims, as one object whose named methods are its steps.

`PrepareTransaction`: `read` admits outside the lock (refs checked, the claims prepared
already answered without an API read, the others read from the API server and planned;
where the checkpoint says another claim holds a planned device, that claim is read too, and
one the API server says is gone is marked `stale`); `run` is the locked section, in a worker
thread: lock, read the checkpoint, `_admit` (prepared already?, leftovers of an interrupted
prepare undone, conflicts, a stale holder released rather than refused, MIG placements
free?, each admitted claim's `started` entry, saved only if a sharing daemon starts, a MIG
instance is made or a holder was released), then `_carry_out` each claim (MIG instances, sharing, the CDI
spec), then the checkpoint with every entry `completed`. `UnprepareTransaction.run`
removes each claim's spec, sharing and MIG instances, then its entry. Each claim's answer
goes to `results`; one claim's failure never touches another's.

It must not speak gRPC or report claim status (service.py), retry a transaction or repair
an unreadable checkpoint (state.py and recovery.py), or read the API server other than
through the `ClaimSource` it is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import structlog

from dra_driver import metrics
from dra_driver.devices import NodeDevice
from dra_driver.gpu.mig import MigError
from dra_driver.jsontypes import JSON
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claim_steps import ClaimPlan, ClaimSteps, fault
from dra_driver.plugin.claims import (
    ClaimGone,
    ClaimRef,
    ClaimRejected,
    ForeignAllocation,
    check_ref,
    describe,
)
from dra_driver.plugin.conflicts import conflict
from dra_driver.plugin.lock import exclusive
from dra_driver.plugin.mig_steps import MigLeftBehind, intent
from dra_driver.plugin.prepared import ClaimResult, MigRecord, PreparedDevice
from dra_driver.plugin.sick_devices import TaintsOf, refusal
from dra_driver.sharing.policy import ConfigError, SharingError, SharingPlan

if TYPE_CHECKING:
    from dra_driver.plugin.channel_gate import ChannelGate

log = structlog.get_logger(__name__)


class ClaimSource(Protocol):
    """Where claims come from (the API server; a dict in unit tests)."""

    async def read(self, refs: Sequence[ClaimRef]) -> dict[str, JSON | ClaimRejected]: ...

    async def allocated_here(self, driver: str, pool: str) -> list[JSON] | None: ...


class _StepFailed(Exception):
    """A step of one claim failed; the message is the claim's answer."""


class PrepareTransaction:
    """Prepares the claims of one chunk of a kubelet call."""

    def __init__(
        self, steps: ClaimSteps, refs: Sequence[ClaimRef], held: Mapping[str, ckpt.ClaimEntry],
        gate: ChannelGate | None = None,
        taints_of: TaintsOf | None = None,
    ) -> None:
        self.steps = steps
        self.gate = gate  # holds IMEX channel claims until their ComputeDomain is ready
        self.taints_of = taints_of  # the health keeper's taints by device name (sick_devices)
        self.refs = refs
        self.held = held  # the checkpoint's entries before the call, read outside the lock
        # the devices of the claims the checkpoint had `completed` before the call
        self.done = {
            r.uid: held[r.uid].devices for r in refs
            if r.uid in held and held[r.uid].phase == ckpt.ClaimPhase.COMPLETED
        }
        self.results: dict[str, ClaimResult] = {}
        self.plans: list[ClaimPlan] = []
        self.read_claims: dict[str, JSON | ClaimRejected] = {}
        self.stale: frozenset[str] = frozenset()  # holders the API server released (`_stale_holders`)
        self.released: list[ClaimRef] = []  # those of them the locked section released

    async def read(self, source: ClaimSource) -> None:
        """Admit, outside the lock: a slow API server never holds up other claims' bookkeeping."""
        wanted = []
        for ref in checked(self.refs, self.results):
            if ref.uid in self.done:  # the kubelet asks again after a restart: no API read needed
                self.results[ref.uid] = ClaimResult(self.done[ref.uid])
            else:
                wanted.append(ref)
        self.read_claims = await source.read(wanted) if wanted else {}
        for ref in wanted:
            try:
                claim = self.read_claims[ref.uid]
                if isinstance(claim, ClaimRejected):
                    raise claim
                plan = self.steps.plan(ref, claim)
                sick = refusal(ref, claim, self.steps.driver, self.steps.pool, self.taints_of) \
                    if self.taints_of is not None else None
                if sick:
                    raise ClaimRejected(sick)
                self.plans.append(plan)
            except ClaimRejected as e:
                if isinstance(e, ForeignAllocation):
                    metrics.foreign_allocations.inc()
                self.results[ref.uid] = ClaimResult(error=str(e))
        await self._gate_channels()
        self.stale = await self._stale_holders(source)

    async def _gate_channels(self) -> None:
        """Channel claims wait here, outside the lock, until their domain is ready (channel_gate)."""
        channels = [p for p in self.plans if p.channel is not None]
        if not channels:
            return
        gate = self.gate
        if gate is None:  # planned only with --compute-domains, which makes a gate
            raise RuntimeError("an IMEX channel claim was planned without a channel gate")
        answers = await asyncio.gather(*(gate.admit(p.ref, p.channel) for p in channels if p.channel))
        for plan, why in zip(channels, answers, strict=True):
            if why is not None:
                self.results[plan.ref.uid] = ClaimResult(error=why)
                self.plans.remove(plan)

    async def _stale_holders(self, source: ClaimSource) -> frozenset[str]:
        """The claims that the checkpoint says hold what a plan asks for and that the API server
        says are gone or no longer hold those devices here: a pod deleted with --force before
        the kubelet unprepared its claim, whose devices the scheduler gave to the next pod.
        The locked section releases them rather than telling the next pod to delete a pod
        that no longer exists. Asked only where there is such a conflict (one GET each)."""
        holders: dict[str, ckpt.ClaimEntry] = {}
        for plan in self.plans:
            rest = self.held  # copied only where there is a conflict
            while (found := conflict(rest, plan, self.steps.devices)) is not None:
                holders[found.holder.uid] = found.holder
                rest = {uid: e for uid, e in rest.items() if uid != found.holder.uid}
        if not holders:
            return frozenset()
        answers = await source.read([ClaimRef(h.namespace, h.name, h.uid) for h in holders.values()])
        steps = self.steps
        return frozenset(
            uid for uid, h in holders.items()
            if released_by_api(answers.get(uid), h, steps.driver, steps.pool)
        )

    def run(self) -> dict[str, ClaimResult]:
        """The locked section (blocking: run it in a worker thread). Raises CheckpointUnreadable
        before it changed anything, and CheckpointRefused."""
        if not self.plans:
            return self.results
        steps = self.steps
        with exclusive(steps.lock_path):
            claims = dict(steps.load().claims)  # this section's working copy
            todo = self._admit(claims)
            if self.released or any(plan.sharing is not None or plan.mig for plan in todo):
                # `started`, before a daemon or MIG instance that only this entry records; a
                # released claim's entry gone with its files
                steps.save(claims)
            fault("prepare-after-started")
            for plan in todo:
                self._carry_out(plan, claims)
            fault("prepare-after-cdi")
            if todo:
                steps.save(claims)  # `completed`
            fault("prepare-after-completed")
        return self.results

    def refused(self, e: ckpt.CheckpointRefused) -> dict[str, ClaimResult]:
        """The answers when the checkpoint is a newer instance's (the kubelet turns to it)."""
        return self.results | {plan.ref.uid: ClaimResult(error=str(e)) for plan in self.plans}

    def _admit(self, claims: dict[str, ckpt.ClaimEntry]) -> list[ClaimPlan]:
        """Admit, inside the lock: the claims to carry out, each with its `started` entry in
        `claims`; the others answered."""
        todo: list[ClaimPlan] = []
        seen: set[str] = set()
        for plan in self.plans:
            ref, uid = plan.ref, plan.ref.uid
            if uid in seen:
                continue  # two calls for one claim (two pods sharing it) in one batch
            seen.add(uid)
            entry = claims.get(uid)
            # a kubelet retry, or the other instance prepared it meanwhile
            if entry is not None and entry.phase == ckpt.ClaimPhase.COMPLETED:
                self._prepared(uid, entry.devices)
                continue
            if entry is not None:
                try:
                    self.steps.roll_back(ref, "redoing an interrupted prepare", entry.mig)
                except MigError as e:  # its instance stays recorded; the next call tries again
                    error = f"claim {ref}: undoing its interrupted prepare failed: {e}"
                    self.results[uid] = ClaimResult(error=error)
                    continue
                del claims[uid]
            refusal = self._conflict(claims, plan) or self.steps.mig_steps.free(ref, plan.mig)
            if refusal:
                self.results[uid] = ClaimResult(error=refusal)
                continue
            todo.append(plan)
            mig = [intent(p) for p in plan.mig]
            claims[uid] = ckpt.started_entry(ref.namespace, ref.name, uid, plan.devices, mig=mig)
        return todo

    def _conflict(self, claims: dict[str, ckpt.ClaimEntry], plan: ClaimPlan) -> str | None:
        """Why `plan` cannot be prepared beside `claims`; a holder the API server released
        (`stale`) is released here first, its spec, sharing and MIG instances removed."""
        while (found := conflict(claims, plan, self.steps.devices)) is not None:
            holder = found.holder
            if holder.uid not in self.stale:
                return found.text
            ref = ClaimRef(holder.namespace, holder.name, holder.uid)
            try:
                why = "released: the API server says it is gone or holds nothing here"
                self.steps.roll_back(ref, why, holder.mig)
            except (MigError, SharingError) as e:
                return f"{found.text} (releasing it, since the API server says it is gone, failed: {e})"
            try:
                self.steps.release_channel(ref)
            except SharingError as e:
                return f"{found.text} (releasing it, since the API server says it is gone, failed: {e})"
            del claims[holder.uid]
            self.released.append(ref)
            log.warning(
                "released a claim that the API server says is gone, to prepare another on its devices "
                "(its pod was deleted before the kubelet unprepared it)",
                released=str(ref), **plan.ref.log_fields(),
            )
        return None

    def _carry_out(self, plan: ClaimPlan, claims: dict[str, ckpt.ClaimEntry]) -> None:
        """MIG instances, sharing, then the CDI spec from what they returned; the entry becomes
        `completed`, or what was made is undone and the entry dropped."""
        ref, uid = plan.ref, plan.ref.uid
        made: tuple[MigRecord, ...] = ()
        try:
            made = self.steps.mig_steps.create(ref, plan.mig)
            if made:
                fault("prepare-after-mig-create")
            devices = self.steps.mig_steps.devices(plan.hardware, made)
            sharing = self._share(plan, devices)
            channel = (plan.devices[0].device, plan.channel) if plan.channel is not None else None
            try:
                self.steps.write_spec(uid, devices, sharing, channel)
            except OSError as e:
                log.exception("writing the CDI spec failed", **ref.log_fields())
                raise _StepFailed(f"internal error preparing claim {ref}: writing its CDI spec failed: "
                                  f"{describe(e)}") from e
        except MigLeftBehind as e:  # stays `started` with what is left: recovery destroys it
            claims[uid] = replace(claims[uid], mig=e.left)
            self.results[uid] = ClaimResult(error=f"claim {ref}: {e}")
            return
        except MigError as e:
            error = f"claim {ref}: {e}"
        except _StepFailed as e:
            error = str(e)
        else:
            claims[uid] = ckpt.completed_entry(claims[uid], mig=made)
            self._prepared(uid, plan.devices)
            return
        try:
            self.steps.roll_back(ref, "set-up failed", made)
        except MigError as e:  # stays `started` with the instances made: recovery destroys them
            claims[uid] = replace(claims[uid], mig=made)
            self.results[uid] = ClaimResult(error=f"{error}; destroying its MIG instances failed: {e}")
            return
        del claims[uid]
        self.results[uid] = ClaimResult(error=error)

    def _share(self, plan: ClaimPlan, devices: Sequence[NodeDevice]) -> SharingPlan | None:
        """The claim's sharing set up (its MPS daemon started); the plan it was set up with."""
        ref, sharing = plan.ref, plan.sharing
        if plan.claim is not None:
            # MPS on a dynamic MIG slice: its daemon serves the instance's MIG UUID, known only now
            try:
                sharing = self.steps.sharing.plan(ref.uid, plan.claim, devices)
            except ConfigError as e:
                why = f"claim {ref}: invalid configuration for driver {self.steps.driver}: {e}"
                raise _StepFailed(why) from e
        try:
            self.steps.sharing.apply(sharing)
        except SharingError as e:
            raise _StepFailed(f"claim {ref}: GPU sharing could not be set up on this node: {e}") from e
        return sharing

    def _prepared(self, uid: str, devices: tuple[PreparedDevice, ...]) -> None:
        read = self.read_claims.get(uid)  # kept for the claim status write: no second GET
        self.results[uid] = ClaimResult(devices, claim=read if isinstance(read, dict) else None)


class UnprepareTransaction:
    """Unprepares the claims of one chunk of a kubelet call."""

    def __init__(self, steps: ClaimSteps, refs: Sequence[ClaimRef]) -> None:
        self.steps = steps
        self.results: dict[str, ClaimResult] = {}
        self.refs = checked(refs, self.results)

    def run(self) -> dict[str, ClaimResult]:
        """The locked section (blocking: run it in a worker thread); raises as PrepareTransaction.run."""
        if not self.refs:
            return self.results
        steps = self.steps
        with exclusive(steps.lock_path):
            claims = dict(steps.load().claims)
            changed = False
            for ref in self.refs:
                changed |= self._release(ref, claims)
            if changed:
                steps.save(claims)
            fault("unprepare-after-entry-removed")
        return self.results

    def refused(self, e: ckpt.CheckpointRefused) -> dict[str, ClaimResult]:
        return self.results | {ref.uid: ClaimResult(error=str(e)) for ref in self.refs}

    def _release(self, ref: ClaimRef, claims: dict[str, ckpt.ClaimEntry]) -> bool:
        """The claim's spec, sharing and MIG instances removed, then its entry; whether there was one."""
        held = claims.get(ref.uid)
        try:
            self.steps.roll_back(ref, "unprepare", held.mig if held is not None else ())
            self.steps.release_channel(ref)
        except SharingError as e:  # the entry stays, so the kubelet's retry tries again
            self.results[ref.uid] = ClaimResult(error=f"claim {ref}: stopping its GPU sharing failed: {e}")
            return False
        except MigError as e:  # a process still in the instance (IN_USE): the retry tries again
            error = f"claim {ref}: destroying its MIG instances failed: {e}"
            self.results[ref.uid] = ClaimResult(error=error)
            return False
        self.results[ref.uid] = ClaimResult()
        return claims.pop(ref.uid, None) is not None


def released_by_api(
    answer: JSON | ClaimRejected | None, held: ckpt.ClaimEntry, driver: str, pool: str
) -> bool:
    """Whether the API server's answer for a claim this node holds says the claim no longer
    holds those devices here: gone (404), re-created under its name, or allocated without
    them. Any other answer (an error, a timeout) says nothing."""
    if isinstance(answer, ClaimGone):
        return True
    if not isinstance(answer, dict):
        return False
    if (answer.get("metadata") or {}).get("uid") != held.uid:
        return True
    allocation = (answer.get("status") or {}).get("allocation") or {}
    here = {
        r.get("device") for r in (allocation.get("devices") or {}).get("results") or []
        if r.get("driver") == driver and r.get("pool") == pool
    }
    return not here & {d.device for d in held.devices}


def checked(refs: Sequence[ClaimRef], results: dict[str, ClaimResult]) -> list[ClaimRef]:
    """The refs that could come from the API server; the others get their error in `results`."""
    good = []
    for ref in refs:
        try:
            check_ref(ref)
            good.append(ref)
        except ClaimRejected as e:
            results[ref.uid] = ClaimResult(error=str(e))
    return good


__all__ = ["ClaimSource", "PrepareTransaction", "UnprepareTransaction", "released_by_api"]
