"""A claim is prepared from an allocation made for it, never from another claim's (issue 55).

The case that happened: claim `cell` (a whole GPU with NVIDIA's GpuConfig MPS) was deleted
and `cell` re-created for a static MIG device without any config; kube-scheduler, still
seeing the old claim, allocated for it and wrote that allocation onto the new claim (it
re-reads by name after a conflict). The plugin then prepared the new claim with the old
one's MPS. Each test here builds the claim as the API server returned it: the new spec
with the old allocation.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver import metrics
from dra_driver.devices import node_devices
from dra_driver.driver_root import scan_driver_files
from dra_driver.gpu import discover
from dra_driver.plugin.claims import ClaimRef, ForeignAllocation, allocated_devices
from dra_driver.plugin.own_allocation import (
    GPU,
    MIG,
    MIG_SLICE,
    SHARE,
    foreign_allocation,
    foreign_device,
    shipped_classes,
)
from dra_driver.plugin.state import NodePreparer
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.policy import Sharing
from tests.harness.claims_in_memory import ClaimsInMemory

POOL = "node-a"
NV = "resource.nvidia.com/v1beta1"
MPS = {"driver": DRIVER, "parameters": {"apiVersion": NV, "kind": "GpuConfig",
                                        "sharing": {"strategy": "MPS"}}}
TIME_SLICING = {"driver": DRIVER, "parameters": {"apiVersion": NV, "kind": "GpuConfig",
                                                 "sharing": {"strategy": "TimeSlicing"}}}


def claim(requests: list[dict[str, Any]], config: list[dict[str, Any]], results: list[dict[str, Any]],
          allocated_config: list[dict[str, Any]], uid: str = "uid-new") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "cell", "uid": uid},
        "spec": {"devices": {"requests": requests, "config": config}},
        "status": {"allocation": {"devices": {"results": results, "config": allocated_config}}},
    }


def result(request: str, device: str = "gpu-0", **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": POOL, "device": device, **extra}


def exactly(name: str, cls: str = f"mig.{DRIVER}", **extra: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": cls, **extra}}


def from_claim(opaque: dict[str, Any], requests: list[str] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"source": "FromClaim", "opaque": opaque}
    if requests is not None:
        entry["requests"] = requests
    return entry


FIRST_AVAILABLE = {"name": "gpu", "firstAvailable": [
    {"name": "big", "deviceClassName": DRIVER}, {"name": "small", "deviceClassName": DRIVER, "count": 2}]}


# the old claim's allocation (a whole GPU, its MPS config) on the new claim (MIG, no config)
RECREATED = claim([exactly("dev")], [], [result("dev")], [from_claim(MPS, ["dev"])])
# the same, where both claims asked MPS: only the device's kind shows it
RECREATED_SAME_CONFIG = claim(
    [exactly("dev")], [{"requests": ["dev"], "opaque": MPS}], [result("dev")], [from_claim(MPS, ["dev"])]
)


def test_the_old_claims_allocation_on_a_new_claim_is_refused_naming_the_foreign_config() -> None:
    why = foreign_allocation(RECREATED)
    assert why is not None and "configuration for driver" in why and "0 config entries" in why
    devices = node_devices(discover("h200-single"))
    with pytest.raises(ForeignAllocation, match="delete the pods that use the claim"):
        allocated_devices(ClaimRef("ns", "cell", "uid-new"), RECREATED, DRIVER, POOL, devices)


@pytest.mark.parametrize("recreated", [RECREATED, RECREATED_SAME_CONFIG])
def test_the_plugin_prepares_nothing_and_starts_no_daemon_for_it(
    tmp_path: Path, mps: MpsControl, recreated: dict[str, Any]
) -> None:
    inventory = discover("h200-single")
    (tmp_path / "state").mkdir()
    preparer = NodePreparer(
        driver=DRIVER, pool=POOL, devices=node_devices(inventory), claims=ClaimsInMemory(recreated),
        driver_files=scan_driver_files(None, "/dev", True, gpu_minors=[g.minor for g in inventory.gpus]),
        cdi_dir=tmp_path / "cdi", state_dir=tmp_path / "state", sharing=Sharing(DRIVER, POOL, mps),
        boot_id="boot-1",
    )
    before = metrics.REGISTRY.get_sample_value("gpu_dra_foreign_allocations_total") or 0
    answer = asyncio.run(preparer.prepare([ClaimRef("ns", "cell", "uid-new")]))["uid-new"]
    assert metrics.REGISTRY.get_sample_value("gpu_dra_foreign_allocations_total") == before + 1
    assert answer.error is not None and "allocation was made for another claim" in answer.error
    assert not list((tmp_path / "cdi").glob("*.json")), "a CDI spec was written"
    assert not mps.claim_uids(), "an MPS daemon was started for a claim that asked for none"
    assert preparer.read_checkpoint().claims == {}


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        (claim([exactly("gpu")], [], [result("dev")], []), "request(s) dev, which the claim does not have"),
        (claim([exactly("gpu", count=2)], [], [result("gpu")], []), "asks for 2 device(s)"),
        (claim([exactly("gpu")], [], [result("gpu"), result("gpu", "gpu-1")], []), "asks for 1"),
        (claim([exactly("gpu")], [], [result("gpu", adminAccess=True)], []), "adminAccess"),
        (claim([exactly("gpu")], [{"requests": ["gpu"], "opaque": TIME_SLICING}], [result("gpu")],
               [from_claim(MPS, ["gpu"])]), "not among the claim's own 1 config entry"),
        (claim([exactly("gpu")], [{"opaque": MPS}, {"opaque": TIME_SLICING}], [result("gpu")],
               [from_claim(TIME_SLICING), from_claim(MPS)]), "not among"),  # the order is the claim's
        (claim([exactly("gpu")], [{"requests": ["gpu"], "opaque": MPS}], [result("gpu")],
               [from_claim(MPS, ["other"])]), "not among"),
        # the old claim had no config: the new one's MPS would be lost
        (claim([exactly("gpu")], [{"requests": ["gpu"], "opaque": MPS}], [result("gpu")], []),
         "lacks the claim's own configuration"),
        (claim([exactly("a"), exactly("b")], [], [result("a")], []),
         "request b asks for 1 device(s), the allocation has 0"),
        (claim([exactly("a", allocationMode="All")], [], [], []), "request a asks for all device(s)"),
        (claim([FIRST_AVAILABLE], [], [result("gpu/big"), result("gpu/small", "gpu-1")], []),
         "results for 2 of its firstAvailable subrequests"),
    ],
)
def test_each_sign_of_another_claims_allocation_is_named(case: dict[str, Any], fragment: str) -> None:
    why = foreign_allocation(case)
    assert why is not None and fragment in why, why


@pytest.mark.parametrize(
    "case",
    [
        # the allocator's own copies: configs in order, requests emptied when they name every request
        claim([exactly("gpu")], [{"requests": ["gpu"], "opaque": MPS}], [result("gpu")], [from_claim(MPS)]),
        claim([exactly("a"), exactly("b")], [{"requests": ["a"], "opaque": MPS}, {"opaque": TIME_SLICING}],
              [result("a"), result("b", "gpu-1")], [from_claim(MPS, ["a"]), from_claim(TIME_SLICING)]),
        # a config for a subrequest that was not chosen is left out; one for the request is not
        claim([FIRST_AVAILABLE], [{"requests": ["gpu/big"], "opaque": MPS}],
              [result("gpu/small"), result("gpu/small", "gpu-1")], []),
        claim([FIRST_AVAILABLE],
              [{"requests": ["gpu/big"], "opaque": MPS}, {"requests": ["gpu"], "opaque": MPS}],
              [result("gpu/small"), result("gpu/small", "gpu-1")], [from_claim(MPS, ["gpu"])]),
        # class configs are not the claim's to check
        claim([exactly("gpu")], [], [result("gpu")],
              [{"source": "FromClass", "requests": ["gpu"], "opaque": MPS}]),
        claim([exactly("gpu", allocationMode="All")], [], [result("gpu"), result("gpu", "gpu-1")], []),
        claim([exactly("gpu", adminAccess=True)], [], [result("gpu", adminAccess=True)], []),
        # results of other drivers count towards the request too
        claim([exactly("n", count=2)], [], [result("n"), {**result("n", "eth0"), "driver": "nic"}], []),
        # kube-scheduler 1.34 and 1.35 copy an entry once per request it names (1.37: once)
        claim([exactly("a"), exactly("b"), exactly("c")], [{"requests": ["a", "b"], "opaque": MPS}],
              [result("a"), result("b", "gpu-1"), result("c", "gpu-2")],
              [from_claim(MPS, ["a", "b"]), from_claim(MPS, ["a", "b"])]),
    ],
)
def test_an_allocation_made_for_the_claim_passes(case: dict[str, Any]) -> None:
    assert foreign_allocation(case) is None


def test_a_repeated_copy_still_shows_another_claims_config() -> None:
    """Repeats count once, but an entry the claim does not have is still another claim's."""
    case = claim([exactly("a"), exactly("b")], [{"requests": ["a", "b"], "opaque": MPS}],
                 [result("a"), result("b", "gpu-1")],
                 [from_claim(MPS, ["a", "b"]), from_claim(MPS, ["a", "b"]), from_claim(TIME_SLICING)])
    assert "not among the claim's own 1 config entry" in (foreign_allocation(case) or "")


# --------------------------------------------------------------------------- the device's kind

KINDS = {"gpu-2": GPU, "gpu-2-share": SHARE, "gpu-1-mig-3g71gb-4": MIG, "gpu-0-mig-1g-18gb-19-0": MIG_SLICE}


@pytest.mark.parametrize(
    ("cls", "device", "foreign"),
    [
        (f"mig-dynamic.{DRIVER}", "gpu-2", True),  # the old claim's whole GPU, same shape and config
        (f"mig.{DRIVER}", "gpu-2", True),
        (DRIVER, "gpu-2-share", True),
        (f"gpu-share.{DRIVER}", "gpu-2", True),
        (DRIVER, "gpu-1-mig-3g71gb-4", True),
        (f"mig-dynamic.{DRIVER}", "gpu-1-mig-3g71gb-4", True),
        (DRIVER, "gpu-2", False),
        (f"mig.{DRIVER}", "gpu-1-mig-3g71gb-4", False),
        (f"mig.{DRIVER}", "gpu-0-mig-1g-18gb-19-0", False),
        (f"mig-dynamic.{DRIVER}", "gpu-0-mig-1g-18gb-19-0", False),
        (f"gpu-share.{DRIVER}", "gpu-2-share", False),
        ("my-own-class", "gpu-2-share", False),  # its selectors are the scheduler's to evaluate
    ],
)
def test_a_device_the_requests_shipped_class_does_not_select_is_named(
    cls: str, device: str, foreign: bool
) -> None:
    case = claim([exactly("dev", cls)], [], [result("dev", device)], [])
    why = foreign_device(case, DRIVER, POOL, KINDS.get)
    assert (why is not None) == foreign, why
    if foreign:
        assert why is not None and f"class {cls}" in why and f"gives {device} ({KINDS[device]})" in why


def test_every_class_the_chart_ships_is_known() -> None:
    deploy = Path(__file__).resolve().parents[2] / "deploy" / "deviceclasses"
    names = {
        doc["metadata"]["name"]
        for f in deploy.glob("*.yaml")
        for doc in yaml.safe_load_all(f.read_text())
        if doc and doc.get("kind") == "DeviceClass"
    }
    assert names and names <= set(shipped_classes(DRIVER)), names - set(shipped_classes(DRIVER))
