"""Prepare's last guard against a sick device: a device the health monitor tainted is prepared
only for a claim whose allocation tolerates each of its taints (the scheduler copies the
tolerations it used into the allocation result). The scheduler's view lags the monitor by a
slice write, and where the server keeps no device taints (1.34/1.35 default gates) a sick
device is only left out of the slice: a claim allocated in between would otherwise start on it.

Pure: the taints come in by device name (the health keeper's), the claim as read. It must not
read the health keeper itself, nor decide what is sick (dra_driver.health does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dra_driver.health.effects import DeviceTaint
from dra_driver.plugin.claims import ClaimRef

TaintsOf = Callable[[str], Sequence[DeviceTaint]]


def tolerates(toleration: Mapping[str, Any], taint: DeviceTaint) -> bool:
    """A DeviceToleration (resource.k8s.io/v1) against one taint, as the scheduler matches them."""
    if toleration.get("effect") and toleration["effect"] != taint.effect:
        return False
    if toleration.get("key") and toleration["key"] != taint.key:
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return True
    return bool(toleration.get("value", "") == taint.value)


def refusal(
    ref: ClaimRef, claim: Mapping[str, Any], driver: str, pool: str, taints_of: TaintsOf
) -> str | None:
    """Why the claim may not be prepared here: a device of its allocation with a taint its
    allocation does not tolerate (None: none)."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    for result in (allocation.get("devices") or {}).get("results") or []:
        if result.get("driver") != driver or result.get("pool") != pool or result.get("adminAccess"):
            continue
        device = str(result.get("device", ""))
        tolerations = [t for t in result.get("tolerations") or [] if isinstance(t, Mapping)]
        sick = [t for t in taints_of(device) if not any(tolerates(tol, t) for tol in tolerations)]
        if sick:
            what = ", ".join(f"{t.key}={t.value}:{t.effect}" for t in sick)
            return (f"claim {ref}: device {device} is unhealthy ({what}) and the claim does not tolerate "
                    "it: it was allocated before the scheduler saw the device's condition. Delete the pod "
                    "(and the claim, if it is not from a template) so that a healthy device is allocated, "
                    "or tolerate the taint in the claim's request to use the device anyway")
    return None


__all__ = ["TaintsOf", "refusal", "tolerates"]
