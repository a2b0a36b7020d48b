"""From a ResourceClaim (as the API server returns it) to the devices this node must prepare.

Pure functions: no I/O, no locks. Each check that can fail raises `ClaimRejected`
with a message that tells the user what is wrong and what to do, because the kubelet
shows it in the pod's events verbatim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dra_driver.devices import NodeDevice
from dra_driver.names import is_dns_subdomain
from dra_driver.plugin.own_allocation import foreign_allocation

_UID = re.compile(r"^[A-Za-z0-9-]{1,64}$")


class ClaimRejected(Exception):
    """This claim cannot be prepared here; the message is shown to the user."""


class ClaimGone(ClaimRejected):
    """The API server says the claim does not exist (404)."""


class ForeignAllocation(ClaimRejected):
    """The claim's allocation was made for another claim of the same name (own_allocation.py)."""

    def __init__(self, ref: ClaimRef, why: str) -> None:
        super().__init__(
            f"claim {ref}: its allocation was made for another claim, so nothing was prepared: {why}. "
            "The scheduler gave it the allocation of an earlier claim of the same name (deleted and "
            "re-created while the scheduler still saw the old one); delete the pods that use the claim so "
            "that it is deallocated, and its next pod gets an allocation of its own"
        )


def describe(e: BaseException) -> str:
    """An unexpected exception as a person reads it; never empty (str(TimeoutError()) is)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepare/NodeUnprepareResources."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"

    def log_fields(self) -> dict[str, str]:
        """The fields every log line about a claim carries."""
        return {"claim_namespace": self.namespace, "claim_name": self.name, "claim_uid": self.uid}


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of this driver on this node, resolved to hardware."""

    request: str  # base request name: "gpu" for the subrequest "gpu/h200"
    pool: str
    device: NodeDevice
    admin_access: bool = False
    share_id: str | None = None


def check_ref(ref: ClaimRef) -> None:
    """Reject names that could not come from the API server (and could escape a path)."""
    for what, value in (("namespace", ref.namespace), ("name", ref.name)):
        if not value:
            raise ClaimRejected(f"claim {what} is empty: the kubelet must name the claim it wants prepared")
        if not is_dns_subdomain(value):
            raise ClaimRejected(
                f"claim {what} {value!r} is not a valid Kubernetes name (lower-case DNS subdomain, "
                "no '/' or '..')"
            )
    if not _UID.match(ref.uid):
        raise ClaimRejected(f"claim uid {ref.uid!r} is not a valid UID")


def base_request_name(request: str) -> str:
    """`gpu/h200` -> `gpu`: the kubelet matches containers against main request names only."""
    return request.split("/", 1)[0]


def allocation_results(ref: ClaimRef, claim: dict[str, Any], driver: str, pool: str) -> list[dict[str, Any]]:
    """The allocation results of `claim` that this driver must prepare in `pool` (this node).

    Raises ClaimRejected when the claim was replaced, is not allocated, or was allocated
    to another node; ForeignAllocation when its allocation was made for another claim.
    """
    uid = claim.get("metadata", {}).get("uid")
    if uid != ref.uid:
        raise ClaimRejected(
            f"claim {ref.namespace}/{ref.name} now has uid {uid}, not {ref.uid}: it was deleted and "
            "re-created; the kubelet will retry with the new claim"
        )
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimRejected(f"claim {ref} is not allocated yet: the scheduler has not placed it")
    foreign = foreign_allocation(claim)
    if foreign:
        raise ForeignAllocation(ref, foreign)
    results = [r for r in allocation.get("devices", {}).get("results", []) if r.get("driver") == driver]
    if not results:
        raise ClaimRejected(f"claim {ref} has no device of driver {driver} allocated")
    for result in results:
        if result.get("pool") != pool:
            raise ClaimRejected(
                f"claim {ref} was allocated device {result.get('device')} in pool {result.get('pool')}, "
                f"but this plugin serves pool {pool}: the claim belongs to another node"
            )
    return results


def allocated_devices(
    ref: ClaimRef,
    claim: dict[str, Any],
    driver: str,
    pool: str,
    devices: dict[str, NodeDevice],
    results: list[dict[str, Any]] | None = None,
) -> tuple[AllocatedDevice, ...]:
    """The devices of `claim` that this driver must prepare in `pool` (this node), resolved to
    hardware (`results`: `allocation_results` where the caller has them already).

    Raises as `allocation_results`, and ClaimRejected for a device this node does not have.
    """
    prepared: list[AllocatedDevice] = []
    for result in allocation_results(ref, claim, driver, pool) if results is None else results:
        name = result.get("device", "")
        device = devices.get(name)
        if device is None:
            raise ClaimRejected(
                f"claim {ref} was allocated device {name!r}, which node {pool} does not have "
                f"(it has {', '.join(sorted(devices)) or 'no devices'}); the ResourceSlice may be stale"
            )
        prepared.append(
            AllocatedDevice(
                request=base_request_name(result.get("request", "")),
                pool=pool,
                device=device,
                admin_access=bool(result.get("adminAccess")),
                share_id=result.get("shareID"),
            )
        )
    return tuple(prepared)
