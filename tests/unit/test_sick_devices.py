"""Prepare's guard against a device the health monitor tainted (dra_driver.plugin.sick_devices)."""

from __future__ import annotations

from typing import Any

from dra_driver.health.effects import DeviceTaint
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.sick_devices import refusal, tolerates

DRIVER, POOL = "gpu.dra-driver.dev", "node-a"
REF = ClaimRef("ns", "c", "uid-1")
XID = DeviceTaint(f"{DRIVER}/xid", "79", "NoSchedule", 0)


def _claim(**result: Any) -> dict[str, Any]:
    return {"status": {"allocation": {"devices": {"results": [
        {"driver": DRIVER, "pool": POOL, "device": "gpu-3", "request": "gpu", **result}]}}}}


def test_a_toleration_matches_as_the_schedulers_does() -> None:
    assert tolerates({"operator": "Exists"}, XID)
    assert tolerates({"key": XID.key, "operator": "Exists", "effect": "NoSchedule"}, XID)
    assert tolerates({"key": XID.key, "value": "79"}, XID)
    assert not tolerates({"key": XID.key, "value": "48"}, XID)
    assert not tolerates({"key": f"{DRIVER}/ecc", "operator": "Exists"}, XID)
    assert not tolerates({"operator": "Exists", "effect": "NoExecute"}, XID)


def test_a_tainted_device_is_prepared_only_for_a_claim_that_tolerates_it() -> None:
    def taints_of(name: str) -> tuple[DeviceTaint, ...]:
        return (XID,) if name == "gpu-3" else ()

    why = refusal(REF, _claim(), DRIVER, POOL, taints_of)
    assert why is not None and "gpu-3" in why and "xid=79:NoSchedule" in why and "tolerate" in why
    tolerant = _claim(tolerations=[{"key": XID.key, "operator": "Exists"}])
    assert refusal(REF, tolerant, DRIVER, POOL, taints_of) is None
    assert refusal(REF, _claim(adminAccess=True), DRIVER, POOL, taints_of) is None  # monitoring sees it
    assert refusal(REF, _claim(device="gpu-1"), DRIVER, POOL, taints_of) is None
    assert refusal(REF, _claim(pool="node-b"), DRIVER, POOL, taints_of) is None
