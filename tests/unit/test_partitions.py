"""Dynamic MIG slices: counter sets and placement devices per MIG-mode GPU, within the API's limits."""

from __future__ import annotations

import dataclasses

import pytest
from kubernetes.utils import parse_quantity

from controller import partitions
from controller.slices import MAX_DEVICES_PER_SLICE_RESTRICTED, SliceFeatures, desired_slices
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.gpu import discover
from dra_driver.gpu.mig_profiles import H200_141GB
from dra_driver.gpu.model import Inventory
from dra_driver.gpu.placements import find_placement
from dra_driver.health.effects import DeviceTaint
from dra_driver.jsontypes import JSON
from dra_driver.names import is_dns_label

ON = SliceFeatures(dynamic_mig=True)


@pytest.fixture(scope="module")
def inventory() -> Inventory:
    return discover("hgx-h200-mig")


def _all_mig_h200() -> Inventory:
    inv = discover("hgx-h200")
    gpus = tuple(dataclasses.replace(g, mig_enabled=True, mig_profiles=H200_141GB) for g in inv.gpus)
    return dataclasses.replace(inv, gpus=gpus)


def _devices(slices: tuple[JSON, ...]) -> dict[str, JSON]:
    return {d["name"]: d for s in slices for d in s.get("devices", [])}


def _sets(slices: tuple[JSON, ...]) -> dict[str, JSON]:
    return {c["name"]: c["counters"] for s in slices for c in s.get("sharedCounters", [])}


def test_one_h200_in_mig_mode_publishes_26_devices_and_one_counter_set(inventory: Inventory) -> None:
    slices = desired_slices(inventory, "node-a", DRIVER, ON)
    gpu0 = [d for d in _devices(slices) if d == "gpu-0" or d.startswith("gpu-0-")]
    assert len(gpu0) == 1 + 7 + 7 + 4 + 3 + 2 + 1 + 1  # whole GPU + every placement of every profile
    assert "gpu-0-mig-3g-71gb-9-4" in gpu0 and "gpu-0-mig-1g-18gb-me-20-6" in gpu0
    counters = _sets(slices)["gpu-0-counter-set"]
    assert {f"memory-slice-{i}" for i in range(8)} <= set(counters)
    assert counters["compute-slices"] == {"value": "7"} and counters["multiprocessors"] == {"value": "132"}
    assert "gpu-2" in _devices(slices) and "consumesCounters" not in _devices(slices)["gpu-2"]


def test_every_device_within_the_api_limits_on_eight_mig_gpus() -> None:
    slices = desired_slices(_all_mig_h200(), "node-a", DRIVER, ON)
    device_slices = [s for s in slices if s.get("devices")]
    counter_slices = [s for s in slices if s.get("sharedCounters")]
    assert len(device_slices) == 8 and len(counter_slices) == 1  # one per GPU; 8 sets fit one slice
    for s in slices:
        assert not (s.get("devices") and s.get("sharedCounters"))
        assert len(s.get("devices", [])) <= MAX_DEVICES_PER_SLICE_RESTRICTED
        assert len(s.get("sharedCounters", [])) <= 8
    for name, counters in _sets(slices).items():
        assert is_dns_label(name, 63) and len(counters) <= partitions.MAX_COUNTERS_PER_SET
        assert all(is_dns_label(c, 63) for c in counters)
    for name, device in _devices(slices).items():
        assert is_dns_label(name, 63)
        consumed = device["consumesCounters"]
        assert len(consumed) <= partitions.MAX_COUNTER_CONSUMPTIONS_PER_DEVICE
        assert all(len(c["counters"]) <= 32 for c in consumed)


def test_no_placement_consumes_more_than_its_gpu_has(inventory: Inventory) -> None:
    slices = desired_slices(inventory, "node-a", DRIVER, ON)
    sets = _sets(slices)
    for device in _devices(slices).values():
        name = device["name"]
        for use in device.get("consumesCounters", []):
            have = sets[use["counterSet"]]
            for counter, value in use["counters"].items():
                assert parse_quantity(value["value"]) <= parse_quantity(have[counter]["value"]), name


def test_the_whole_gpu_takes_all_and_a_static_instance_keeps_its_slices(inventory: Inventory) -> None:
    slices = desired_slices(inventory, "node-a", DRIVER, ON)
    devices, sets = _devices(slices), _sets(slices)
    assert devices["gpu-0"]["consumesCounters"][0]["counters"] == sets["gpu-0-counter-set"]
    # GPU 1 holds a static 3g.71gb at slices 4-7: counters only bind allocated devices, so
    # its slices are not in the set, nothing that overlaps it is published, nor the whole GPU.
    assert "consumesCounters" not in devices["gpu-1-mig-3g71gb-4"] and "gpu-1" not in devices
    held = sets["gpu-1-counter-set"]
    assert {k for k in held if k.startswith("memory-slice-")} == {f"memory-slice-{i}" for i in (0, 1, 2, 3)}
    assert held["compute-slices"] == {"value": "4"} and held["multiprocessors"] == {"value": "72"}
    gpu1 = {d for d in devices if d.startswith("gpu-1-mig-") and d != "gpu-1-mig-3g71gb-4"}
    assert "gpu-1-mig-3g-71gb-9-0" in gpu1 and "gpu-1-mig-4g-71gb-5-0" in gpu1
    assert not {d for d in gpu1 if d.endswith(("-4", "-5", "-6"))}
    assert "gpu-1-mig-7g-141gb-0-0" not in gpu1


def test_placements_that_overlap_share_a_memory_slice_counter(inventory: Inventory) -> None:
    devices = _devices(desired_slices(inventory, "node-a", DRIVER, ON))

    def uses(name: str) -> set[str]:
        return {k for k in devices[name]["consumesCounters"][0]["counters"] if k.startswith("memory-slice-")}

    assert uses("gpu-0-mig-3g-71gb-9-0") & uses("gpu-0-mig-1g-18gb-19-2")
    assert not uses("gpu-0-mig-3g-71gb-9-0") & uses("gpu-0-mig-3g-71gb-9-4")
    assert uses("gpu-0-mig-7g-141gb-0-0") == {f"memory-slice-{i}" for i in range(8)}


def test_placement_devices_carry_nvidia_attribute_names_and_no_uuid(inventory: Inventory) -> None:
    device = _devices(desired_slices(inventory, "node-a", DRIVER, ON))["gpu-0-mig-3g-71gb-9-4"]
    attributes = device["attributes"]
    assert attributes["type"] == {"string": "mig"} and attributes["profile"] == {"string": "3g.71gb"}
    assert attributes["parentUUID"] == {"string": inventory.gpus[0].uuid}
    assert "uuid" not in attributes
    assert device["capacity"]["memory"] == {"value": "71424Mi"}


def test_without_dynamic_mig_nothing_changes(inventory: Inventory) -> None:
    slices = desired_slices(inventory, "node-a", DRIVER, SliceFeatures())
    assert not any("consumesCounters" in d for d in _devices(slices).values())
    assert "gpu-0" not in _devices(slices)  # a MIG-mode GPU is published by its instances only
    assert find_placement(inventory, "gpu-0-mig-2g-35gb-14-2") is not None
    assert find_placement(inventory, "gpu-2-mig-2g-35gb-14-2") is None


def test_a_whole_gpu_taint_reaches_every_placement_and_an_instance_taint_only_its_device(
    inventory: Inventory,
) -> None:
    xid = DeviceTaint("gpu.dra-driver.dev/xid", "79", "NoSchedule", 1_800_000_000)
    own = DeviceTaint("gpu.dra-driver.dev/xid", "31", "NoSchedule", 1_800_000_000)
    taints = {"gpu-0": [xid], "gpu-1-mig-3g71gb-4": [own]}
    devices = _devices(desired_slices(inventory, "node-a", DRIVER, ON, taints))
    gpu0 = [d for n, d in devices.items() if n == "gpu-0" or n.startswith("gpu-0-")]
    assert len(gpu0) == 26 and all([t["value"] for t in d["taints"]] == ["79"] for d in gpu0)
    assert [t["value"] for t in devices["gpu-1-mig-3g71gb-4"]["taints"]] == ["31"]
    assert not any("taints" in d for n, d in devices.items() if n.startswith("gpu-1-mig-1g"))
