"""NVIDIA's consumable shares (`--consumable-shares`): what the slices publish in each mode,
beside NVIDIA's v0.5.0 rules (read from its source), and what Prepare of a shared whole GPU
does: an MPS daemon holding a claim to the memory it asked for, time-slicing for the rest,
against the fake `nvidia-cuda-mps-control` and the real transaction.

The scheduler's part (several claims on one GPU, the policy's defaults and rounding) is
proven against the real kube-scheduler in tests/integration/test_consumable_shares_scheduled.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from controller.slices import SliceFeatures, desired_slices
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.devices import node_devices
from dra_driver.driver_root import scan_driver_files
from dra_driver.gpu import discover
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.state import NodePreparer
from dra_driver.sharing.config import ConfigError
from dra_driver.sharing.consumable import ConsumableShares
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.policy import Sharing
from tests.harness.claims_in_memory import ClaimsInMemory
from tests.harness.fake_mps import run_unique_uid
from tests.harness.nvidia_reference import nvidia_source

POOL = "node-a"
NVIDIA_API = "resource.nvidia.com/v1beta1"
H200_MIB = 143771  # the h200-single profile's memory in MiB, as on the real H200


def _devices(mode: str | None, profile: str = "hgx-h200", **features: Any) -> dict[str, dict[str, Any]]:
    slices = desired_slices(discover(profile), POOL, DRIVER,
                            SliceFeatures(consumable_shares=ConsumableShares.parse(mode or ""), **features))
    return {d["name"]: d for s in slices for d in s.get("devices", [])}


# --------------------------------------------------------------------------- the flag


@pytest.mark.parametrize(("value", "parsed"), [
    ("disabled", None), ("", None), ("memory", ConsumableShares("memory")),
    (" unlimited ", ConsumableShares("unlimited")), ("4", ConsumableShares("count", 4)),
])
def test_the_flag_takes_nvidias_values(value: str, parsed: ConsumableShares | None) -> None:
    assert ConsumableShares.parse(value) == parsed


@pytest.mark.parametrize("value", ["0", "-1", "4.5", "Memory", "1025", "shares"])
def test_other_values_are_refused_saying_what_to_write(value: str) -> None:
    with pytest.raises(ValueError, match=r"write disabled, memory, unlimited or a whole number of shares"):
        ConsumableShares.parse(value)


# --------------------------------------------------------------------------- publishing


MAX = f"{H200_MIB}Mi"
MEMORY_POLICY = {"default": MAX, "validRange": {"min": "1Mi", "max": MAX, "step": "1Mi"}}
ZERO_POLICY = {"default": "0", "validRange": {"min": "0", "max": MAX, "step": "1Mi"}}


@pytest.mark.parametrize(("mode", "capacity"), [
    ("memory", {"memory": {"value": f"{H200_MIB}Mi", "requestPolicy": MEMORY_POLICY}}),
    ("unlimited", {"memory": {"value": f"{H200_MIB}Mi", "requestPolicy": ZERO_POLICY}}),
    ("4", {"memory": {"value": f"{H200_MIB}Mi", "requestPolicy": ZERO_POLICY},
           "shares": {"value": "4", "requestPolicy": {"default": "1",
                                                      "validRange": {"min": "1", "max": "4", "step": "1"}}}}),
])
def test_every_whole_gpu_is_published_for_several_claims(mode: str, capacity: dict[str, Any]) -> None:
    plain, shared = _devices(None), _devices(mode)
    assert set(plain) == set(shared)
    for name, device in shared.items():
        assert device["allowMultipleAllocations"] is True
        # multiprocessors has no policy: the first claim would consume all of it
        assert device["capacity"] == capacity
        assert device["attributes"] == plain[name]["attributes"]


def test_one_share_per_gpu_has_a_range_without_a_step() -> None:
    """min + step must fit the capacity (API validation): with N=1 there is no room for one."""
    shares = _devices("1", "h200-single")["gpu-0"]["capacity"]["shares"]
    assert shares == {"value": "1", "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1"}}}


def test_mig_devices_and_the_share_class_views_stay_as_they_are() -> None:
    plain, shared = _devices(None, "hgx-h200-mig"), _devices("4", "hgx-h200-mig")
    mig = [n for n, d in plain.items() if d["attributes"]["type"]["string"] == "mig"]
    assert mig and all(shared[n] == plain[n] for n in mig)
    both = _devices("memory", "h200-single", memory_shares=True)
    assert both["gpu-0"]["allowMultipleAllocations"] is True
    assert both["gpu-0-share"]["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Gi"
    # the whole GPU and its share view still consume one counter: never both at once
    assert both["gpu-0"]["consumesCounters"] == both["gpu-0-share"]["consumesCounters"]


def test_the_policies_are_nvidias() -> None:
    """NVIDIA's applyConsumableShares (v0.5.0): which mode sets which default and min, the 1Mi
    step, and the `shares` policy: read from its source so a drift on either side shows."""
    source = (nvidia_source() / "cmd" / "gpu-kubelet-plugin" / "consumable_shares.go").read_text()
    pattern = (r'case "(\w+)":\s*memCap\.RequestPolicy = &resourceapi\.CapacityRequestPolicy\{\s*'
               r'Default:\s*new\((\w+)\.DeepCopy\(\)\),\s*ValidRange: &resourceapi\.'
               r'CapacityRequestPolicyRange\{\s*Min:\s*new\((\w+)\.DeepCopy')
    cases = {mode: (default, minimum) for mode, default, minimum in re.findall(pattern, source, re.S)}
    assert cases == {"unlimited": ("zero", "zero"), "memory": ("maxMem", "step")}, cases
    assert 'step := resource.MustParse("1Mi")' in source
    assert re.search(r'dev\.Capacity\["shares"\] = resourceapi\.DeviceCapacity\{\s*Value: sharesVal,.*'
                     r'Default: new\(oneVal\.DeepCopy\(\)\),.*Min:\s*new\(oneVal.*Max:\s*new\(sharesVal.*'
                     r'Step: new\(oneVal', source, re.S)
    names = {"zero": "0", "maxMem": f"{H200_MIB}Mi", "step": "1Mi"}
    for mode, (default, minimum) in cases.items():
        policy = _devices(mode, "h200-single")["gpu-0"]["capacity"]["memory"]["requestPolicy"]
        assert (policy["default"], policy["validRange"]["min"]) == (names[default], names[minimum]), mode


# --------------------------------------------------------------------------- prepare


A, B, C = run_unique_uid("aaaa1111"), run_unique_uid("bbbb1111"), run_unique_uid("cccc1111")


def claim(
    uid: str, memory: str | None, share_id: str | None = "s1", parameters: Any = None
) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": "gpu-0"}
    if share_id is not None:
        result["shareID"] = share_id
    if memory is not None:
        result["consumedCapacity"] = {"memory": memory}
    devices: dict[str, Any] = {"results": [result]}
    if parameters is not None:
        devices["config"] = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}]
    return {"metadata": {"uid": uid, "namespace": "default", "name": f"c-{uid[:4]}"},
            "status": {"allocation": {"devices": devices}}}


def _sharing(tmp_path: Path) -> Sharing:
    return Sharing(DRIVER, POOL, MpsControl(tmp_path, "/driver"))


def test_part_of_the_memory_is_an_mps_daemon_holding_the_claim_to_it(tmp_path: Path) -> None:
    gpu = node_devices(discover("h200-single"))["gpu-0"]
    plan = _sharing(tmp_path).plan(A, claim(A, "4Gi"), [gpu])
    assert plan is not None
    assert [(d.uuid, d.pinned_memory_limit) for d in plan.devices] == [(gpu.uuid, 4 * 2**30)]
    # the whole GPU's compute, time-sliced, as NVIDIA's driver gives it: only memory is held
    assert plan.active_thread_percentage is None
    assert plan.exclusive_gpus == ()


@pytest.mark.parametrize("memory", ["0", f"{H200_MIB}Mi", None])
def test_no_memory_or_all_of_it_is_time_sliced(tmp_path: Path, memory: str | None) -> None:
    gpu = node_devices(discover("h200-single"))["gpu-0"]
    assert _sharing(tmp_path).plan(A, claim(A, memory), [gpu]) is None


def test_mps_asked_on_a_shared_gpu_never_makes_it_exclusive(tmp_path: Path) -> None:
    gpu = node_devices(discover("h200-single"))["gpu-0"]
    mps = {"apiVersion": NVIDIA_API, "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
    plan = _sharing(tmp_path).plan(A, claim(A, "0", parameters=mps), [gpu])
    assert plan is not None and plan.exclusive_gpus == ()
    alone = _sharing(tmp_path).plan(A, claim(A, None, share_id=None, parameters=mps), [gpu])
    assert alone is not None and alone.exclusive_gpus == (gpu.uuid,)


@pytest.mark.parametrize(("parameters", "message"), [
    ({"apiVersion": NVIDIA_API, "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}},
     r"gpu-0 is a memory share.*without capacity\.requests\.memory\) to time-slice"),
    ({"apiVersion": NVIDIA_API, "kind": "GpuConfig",
      "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "8Gi"}}},
     r"more than the share of gpu-0"),
])
def test_configs_that_contradict_the_memory_asked_are_refused(
    tmp_path: Path, parameters: dict[str, Any], message: str
) -> None:
    gpu = node_devices(discover("h200-single"))["gpu-0"]
    with pytest.raises(ConfigError, match=message):
        _sharing(tmp_path).plan(A, claim(A, "4Gi", parameters=parameters), [gpu])


def test_a_consumed_memory_the_scheduler_never_writes_is_refused(tmp_path: Path) -> None:
    gpu = node_devices(discover("h200-single"))["gpu-0"]
    with pytest.raises(ConfigError, match=r"not a whole number of bytes.*delete the claim"):
        _sharing(tmp_path).plan(A, claim(A, "1500m"), [gpu])


@pytest.fixture
def preparer(tmp_path: Path, mps: MpsControl) -> Any:
    inventory = discover("h200-single")
    files = scan_driver_files(None, "/dev", True, gpu_minors=[g.minor for g in inventory.gpus])

    def make(*claims: dict[str, Any]) -> NodePreparer:
        (tmp_path / "state").mkdir(exist_ok=True)
        return NodePreparer(driver=DRIVER, pool=POOL, devices=node_devices(inventory),
                            claims=ClaimsInMemory(*claims), driver_files=files, cdi_dir=tmp_path / "cdi",
                            state_dir=tmp_path / "state", sharing=Sharing(DRIVER, POOL, mps),
                            boot_id="boot-1")

    return make


def _ref(c: dict[str, Any]) -> ClaimRef:
    return ClaimRef(c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"]["uid"])


def _env(preparer: NodePreparer, uid: str) -> list[str]:
    spec = json.loads(next(preparer.steps.cdi_dir.glob(f"*{uid}*.json")).read_text())
    env: list[str] = spec["devices"][0]["containerEdits"]["env"]
    return env


def test_three_claims_share_one_gpu_each_as_it_asked(preparer: Any, mps: MpsControl) -> None:
    """4Gi and 8Gi: a daemon each with its own limit; a third with no memory: time-sliced
    beside them, nothing started; a claim holding the GPU alone is refused while they run."""
    four, eight, free = claim(A, "4Gi", "sa"), claim(B, "8Gi", "sb"), claim(C, "0", "sc")
    alone = claim(run_unique_uid("dddd1111"), None, share_id=None)
    node = preparer(four, eight, free, alone)
    asyncio.run(node.recover())
    results = asyncio.run(node.prepare([_ref(c) for c in (four, eight, free)]))
    assert all(r.error is None for r in results.values()), results
    assert [d.share_id for d in results[C].devices] == ["sc"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G" in _env(node, A)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G" in _env(node, B)
    assert not any(e.startswith("CUDA_MPS_") for e in _env(node, C))
    assert mps.is_running(A) and mps.is_running(B) and not mps.has_state(C)
    error = asyncio.run(node.prepare([_ref(alone)]))[alone["metadata"]["uid"]].error
    assert error is not None and "held as a memory share" in error
    asyncio.run(node.unprepare([_ref(c) for c in (four, eight, free)]))
    assert not mps.claim_uids()
