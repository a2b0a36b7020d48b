"""The prepare transaction's last line of defence against a double allocation (a stale or
edited claim): a device prepared exclusively for two claims, or one GPU given out both
whole and as a memory share.

Pure: it reads the checkpoint's entries as the transaction's locked section holds them
and returns the refusal's text with the claim that holds the device (`Conflict`). It must
NOT read files, take the lock or change entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dra_driver.devices import NodeDevice
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claim_steps import ClaimPlan
from dra_driver.plugin.prepared import PreparedDevice


@dataclass(frozen=True)
class Conflict:
    """Why a plan cannot be prepared: `holder` holds what it asks for."""

    holder: ckpt.ClaimEntry
    text: str


def conflict(
    claims: Mapping[str, ckpt.ClaimEntry], plan: ClaimPlan, devices: Mapping[str, NodeDevice]
) -> Conflict | None:
    """Why `plan` cannot be prepared beside `claims`, None if it can."""
    return _exclusive_conflict(claims, plan) or _share_conflict(claims, plan, devices)


def _exclusive_conflict(claims: Mapping[str, ckpt.ClaimEntry], plan: ClaimPlan) -> Conflict | None:
    exclusive_here = {d.device for d in plan.devices if not (d.admin_access or d.share_id)}
    if not exclusive_here:
        return None
    for other in claims.values():
        if other.uid == plan.ref.uid:
            continue
        for d in other.devices:
            if d.device in exclusive_here and not (d.admin_access or d.share_id):
                return Conflict(other, (
                    f"device {d.device} is already prepared for claim {other.namespace}/{other.name} "
                    f"(uid {other.uid}); delete that pod first, or use a shared claim or adminAccess"
                ))
    return None


def _share_conflict(
    claims: Mapping[str, ckpt.ClaimEntry], plan: ClaimPlan, devices: Mapping[str, NodeDevice]
) -> Conflict | None:
    """A whole GPU and a memory share of it are two device names for one GPU; the scheduler
    keeps them apart (a shared counter), this refuses an allocation that did not."""

    def gpu(d: PreparedDevice) -> str | None:
        found = devices.get(d.device)
        return found.uuid if found is not None and not d.admin_access else None

    mine = {gpu(d): bool(d.share_id) for d in plan.devices if gpu(d) is not None}
    # every name of those GPUs (whole, share view): one set lookup per held device, however many
    names = frozenset(n for n, found in devices.items() if found.uuid in mine)
    for other in claims.values():
        for d in other.devices:
            if d.device not in names:
                continue
            shared = mine.get(gpu(d))
            if other.uid != plan.ref.uid and shared is not None and shared != bool(d.share_id):
                held, wanted = ("a memory share", "the whole GPU")
                if not d.share_id:
                    held, wanted = wanted, "a memory share"
                return Conflict(other, (
                    f"{d.device} ({gpu(d)}) is held as {held} by claim {other.namespace}/{other.name} "
                    f"(uid {other.uid}), so it cannot also be given out as {wanted}; delete that pod first"
                ))
    return None
