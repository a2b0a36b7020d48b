"""Resolving a ResourceClaim to this node's devices: every refusal says what is wrong."""

from __future__ import annotations

from typing import Any

import pytest

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.devices import NodeDevice
from dra_driver.gpu.model import GpuInfo
from dra_driver.plugin.claims import (
    AllocatedDevice,
    ClaimRef,
    ClaimRejected,
    allocated_devices,
    base_request_name,
    check_ref,
)
from tests.harness.claims_in_memory import with_spec

NODE = "node-a"


def _gpu(index: int) -> GpuInfo:
    return GpuInfo(
        index=index,
        minor=index,
        uuid=f"GPU-{index}",
        product_name="NVIDIA H200",
        brand="Nvidia",
        architecture="Hopper",
        cuda_compute_capability="9.0",
        memory_bytes=150754820096,
        pci_bus_id=f"0000:0{index}:00.0",
        pcie_root=None,
        numa_node=None,
        mig_enabled=False,
    )


DEVICES = {f"gpu-{i}": NodeDevice(f"gpu-{i}", _gpu(i)) for i in range(2)}
REF = ClaimRef("ns", "claim", "uid-1")


def _claim(results: list[dict[str, Any]] | None, uid: str = "uid-1") -> dict[str, Any]:
    claim: dict[str, Any] = {"metadata": {"namespace": "ns", "name": "claim", "uid": uid}, "status": {}}
    if results is not None:
        claim["status"]["allocation"] = {"devices": {"results": results}}
    return with_spec(claim)


def _result(
    device: str, request: str = "gpu", pool: str = NODE, driver: str = DRIVER, **extra: Any
) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}


def test_resolves_this_drivers_results_on_this_node() -> None:
    nic = _result("eth0", "nic", driver="net.example.com")
    claim = _claim([_result("gpu-1", "gpu/h200", shareID="s-1"), nic])
    got = allocated_devices(REF, claim, DRIVER, NODE, DEVICES)
    assert got == (AllocatedDevice(request="gpu", pool=NODE, device=DEVICES["gpu-1"], share_id="s-1"),)


def test_admin_access_is_carried() -> None:
    got = allocated_devices(REF, _claim([_result("gpu-0", adminAccess=True)]), DRIVER, NODE, DEVICES)
    assert got[0].admin_access


@pytest.mark.parametrize(
    ("claim", "fragment"),
    [
        (_claim([_result("gpu-0")], uid="other"), "re-created"),
        (_claim(None), "not allocated"),
        (_claim([_result("eth0", driver="net.example.com")]), "no device of driver"),
        (_claim([_result("gpu-0", pool="node-b")]), "belongs to another node"),
        (_claim([_result("gpu-7")]), "does not have"),
    ],
)
def test_refusals_name_the_problem(claim: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ClaimRejected, match=fragment):
        allocated_devices(REF, claim, DRIVER, NODE, DEVICES)


@pytest.mark.parametrize(
    "ref",
    [
        ClaimRef("", "c", "u"),
        ClaimRef("ns", "", "u"),
        ClaimRef("ns/../x", "c", "u"),
        ClaimRef("ns", "..", "u"),
        ClaimRef("ns", "a/b", "u"),
        ClaimRef("ns", "c", ""),
        ClaimRef("ns", "c", "../../etc"),
    ],
)
def test_bad_references_are_refused(ref: ClaimRef) -> None:
    with pytest.raises(ClaimRejected):
        check_ref(ref)


def test_valid_reference_passes() -> None:
    check_ref(ClaimRef("kube-system", "pod-gpu-x7k2p", "8d2f4c1e-1111-2222-3333-444455556666"))


def test_base_request_name_strips_subrequest() -> None:
    assert base_request_name("gpu/h200") == "gpu"
    assert base_request_name("gpu") == "gpu"
