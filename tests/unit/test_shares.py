"""Memory shares: what the slices publish (pure) and what Prepare of a share does, against
the fake `nvidia-cuda-mps-control` (tests/harness/fake_mps.py) and the real transaction.

The scheduler's part (the counter keeping whole GPUs and shares apart, the rounding) is
proven against the real kube-scheduler in tests/integration/test_memory_shares.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from controller.slices import MAX_DEVICES_PER_SLICE_RESTRICTED, SliceFeatures, desired_slices
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.devices import node_devices
from dra_driver.gpu import discover
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.state import ClaimResult, NodePreparer
from dra_driver.sharing.config import ConfigError
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.settings import client_env
from dra_driver.sharing.policy import Sharing
from dra_driver.sharing.shares import (
    GI,
    allocated_shares,
    derived_thread_percentage,
    memory_policy,
    share_view_name,
    share_views,
)
from tests.harness.checkpoints import back_to_started
from tests.harness.fake_mps import kill_daemons, run_unique_uid
from tests.harness.simulated_preparer import preparer_factory

POOL = "node-a"
H200 = 143771 * 2**20  # the h200-single profile's memory, as on the real H200
ONLY = SliceFeatures(memory_shares=True, shares_only=True)  # --memory-shares-only


def _slices(profile: str, shares: bool = True) -> tuple[dict[str, Any], ...]:
    return desired_slices(discover(profile), POOL, DRIVER, SliceFeatures(memory_shares=shares))


def _devices(slices: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s.get("devices", [])}


# --------------------------------------------------------------------------- publishing


def test_off_by_default_nothing_changes() -> None:
    plain = _slices("hgx-h200", shares=False)
    assert plain == desired_slices(discover("hgx-h200"), POOL, DRIVER, SliceFeatures())
    assert not any("sharedCounters" in s for s in plain)
    assert not any(n.endswith("-share") for n in _devices(plain))


def test_each_whole_gpu_gets_a_share_view_and_a_counter_set() -> None:
    slices = _slices("h200-single")
    devices = _devices(slices)
    assert list(devices) == ["gpu-0", "gpu-0-share"]
    whole, share = devices["gpu-0"], devices["gpu-0-share"]
    counter = [{"counterSet": "gpu-0-memory", "counters": {"memory": {"value": "143771Mi"}}}]
    assert whole["consumesCounters"] == counter and share["consumesCounters"] == counter
    assert "allowMultipleAllocations" not in whole
    assert share["allowMultipleAllocations"] is True
    assert share["attributes"]["type"] == {"string": "gpu-share"}
    assert whole["attributes"]["type"] == {"string": "gpu"}
    assert share["attributes"]["isolation"] == {"string": "cooperative"}, "a policy can tell shares apart"
    assert "isolation" not in whole["attributes"]
    assert {k: v for k, v in share["attributes"].items() if k not in ("type", "isolation")} == {
        k: v for k, v in whole["attributes"].items() if k != "type"
    }
    # memory is the share view's only capacity: another one without a policy would be
    # consumed whole by the first share
    assert share["capacity"] == {
        "memory": {
            "value": "143771Mi",
            "requestPolicy": {"default": "8Gi", "validRange": {"min": "1Gi", "max": "140Gi", "step": "1Gi"}},
        }
    }
    # since 1.35 a slice holds devices or counters, not both
    counter_slices = [s for s in slices if "sharedCounters" in s]
    assert len(counter_slices) == 1 and "devices" not in counter_slices[0]
    assert counter_slices[0]["sharedCounters"] == [
        {"name": "gpu-0-memory", "counters": {"memory": {"value": "143771Mi"}}}
    ]


def test_many_gpus_respect_the_slice_limits() -> None:
    slices = _slices("gb200-nvl-node") + _slices("hgx-h200")
    for s in slices:
        assert len(s.get("devices", [])) <= MAX_DEVICES_PER_SLICE_RESTRICTED
        assert len(s.get("sharedCounters", [])) <= 8
        for d in s.get("devices", []):
            assert len(d.get("attributes", {})) + len(d.get("capacity", {})) <= 32
    hgx = _slices("hgx-h200")
    assert sum(len(s.get("sharedCounters", [])) for s in hgx) == 8
    assert len(_devices(hgx)) == 16


def test_gpus_in_mig_mode_are_not_shared() -> None:
    inventory = discover("a100-mig")
    devices = _devices(desired_slices(inventory, POOL, DRIVER, SliceFeatures(memory_shares=True)))
    mig_gpus = {g.index for g in inventory.gpus if g.mig_enabled}
    assert mig_gpus, "the profile must have a GPU in MIG mode"
    assert not any(n in devices for n in (share_view_name(f"gpu-{i}") for i in mig_gpus))
    for name, d in devices.items():
        if "mig" in name:
            assert "consumesCounters" not in d and "allowMultipleAllocations" not in d


def test_shares_only_publishes_each_whole_gpu_as_its_share_view_alone_without_counters() -> None:
    both = _devices(_slices("hgx-h200"))
    only_slices = desired_slices(discover("hgx-h200"), POOL, DRIVER, ONLY)
    only = _devices(only_slices)
    assert list(only) == [f"gpu-{i}-share" for i in range(8)], "no whole GPU for a whole-GPU claim"
    assert not any("sharedCounters" in s for s in only_slices)
    for name, device in only.items():
        assert "consumesCounters" not in device, f"{name}: nothing else to keep apart, so no counter"
        assert device["allowMultipleAllocations"] is True
        assert device == {k: v for k, v in both[name].items() if k != "consumesCounters"}


def test_shares_only_leaves_gpus_in_mig_mode_as_they_are() -> None:
    inventory = discover("a100-mig")
    both = _devices(desired_slices(inventory, POOL, DRIVER, SliceFeatures(memory_shares=True)))
    only = _devices(desired_slices(inventory, POOL, DRIVER, ONLY))
    assert {n: d for n, d in only.items() if "mig" in n} == {n: d for n, d in both.items() if "mig" in n}
    whole = [g.index for g in inventory.gpus if not g.mig_enabled]
    assert whole, "the profile must have a GPU out of MIG mode"
    assert all(f"gpu-{i}" not in only and f"gpu-{i}-share" in only for i in whole)


def test_policy_rounding_and_small_gpus() -> None:
    policy = memory_policy(H200)
    assert policy is not None
    assert (policy.minimum, policy.step, policy.maximum, policy.default) == (GI, GI, 140 * GI, 8 * GI)
    assert policy.rounded(40 * 10**9) == 38 * GI  # "40G" is 37.25Gi: rounded up
    assert policy.rounded(512 * 2**20) == GI
    assert policy.is_valid(40 * GI) and not policy.is_valid(40 * GI + 1) and not policy.is_valid(141 * GI)
    assert memory_policy(int(1.5 * GI)) is None
    small = memory_policy(4 * GI)
    assert small is not None and small.default == 4 * GI
    assert derived_thread_percentage(40 * GI, H200) == 29
    assert derived_thread_percentage(1, H200) == 1


# --------------------------------------------------------------------------- allocated shares


def share_claim(
    uid: str,
    memory: str | None = "40Gi",
    device: str = "gpu-0-share",
    share_id: str | None = "s1",
    parameters: Any = None,
    extra_results: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "share", "driver": DRIVER, "pool": POOL, "device": device}
    if share_id is not None:
        result["shareID"] = share_id
    if memory is not None:
        result["consumedCapacity"] = {"memory": memory}
    devices: dict[str, Any] = {"results": [result, *extra_results]}
    if parameters is not None:
        devices["config"] = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}]
    return {
        "metadata": {"uid": uid, "namespace": "default", "name": f"c-{uid[:4]}"},
        "status": {"allocation": {"devices": devices}},
    }


@pytest.fixture(scope="module")
def h200_devices() -> dict[str, Any]:
    devices = node_devices(discover("h200-single"))
    return {**devices, **share_views(devices)}


def test_a_share_is_read_from_the_allocation(h200_devices: dict[str, Any]) -> None:
    shares = allocated_shares(share_claim("u1"), DRIVER, POOL, [h200_devices["gpu-0-share"]])
    assert [(s.device, s.share_id, s.memory, s.gpu_memory) for s in shares.values()] == [
        ("gpu-0-share", "s1", 40 * GI, H200)
    ]
    assert allocated_shares(share_claim("u1"), DRIVER, POOL, [h200_devices["gpu-0"]]) == {}


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        (share_claim("u1", memory=None), r"no consumedCapacity\.memory .*DRAConsumableCapacity"),
        (share_claim("u1", share_id=None), r"without a shareID"),
        (share_claim("u1", memory="512Mi"), r"not a whole number of Gi of at least 1Gi: .* e\.g\. 1Gi"),
        (share_claim("u1", memory="40G"), r"not a whole number of Gi.* e\.g\. 38Gi"),
        (share_claim("u1", memory="141Gi"), r"more than the GPU has \(140Gi.* at most 140Gi"),
        (
            share_claim(
                "u1",
                extra_results=[
                    {
                        "request": "b",
                        "driver": DRIVER,
                        "pool": POOL,
                        "device": "gpu-0-share",
                        "shareID": "s2",
                        "consumedCapacity": {"memory": "1Gi"},
                    }
                ],
            ),
            r"two shares of gpu-0-share.*distinctAttribute",
        ),
    ],
)
def test_bad_allocations_are_refused_with_what_to_write(
    h200_devices: dict[str, Any], claim: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        allocated_shares(claim, DRIVER, POOL, [h200_devices["gpu-0-share"]])


def _params(sharing: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "sharing": sharing}


def test_the_plan_of_a_share_is_an_mps_daemon_with_its_limit(
    h200_devices: dict[str, Any], tmp_path: Path
) -> None:
    sharing = Sharing(DRIVER, POOL, MpsControl(tmp_path, "/driver"))
    view = h200_devices["gpu-0-share"]
    plan = sharing.plan("u1", share_claim("u1"), [view])
    assert plan is not None
    assert [(d.uuid, d.pinned_memory_limit) for d in plan.devices] == [(view.uuid, 40 * GI)]
    assert plan.active_thread_percentage == 29
    assert client_env(plan) == (
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40G",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=29",
    )
    # the config may set the percentage, and a lower limit
    own = _params(
        {
            "strategy": "MPS",
            "mps": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "30Gi"},
        }
    )
    plan = sharing.plan("u1", share_claim("u1", parameters=own), [view])
    assert plan is not None and plan.active_thread_percentage == 50
    assert plan.devices[0].pinned_memory_limit == 30 * GI


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            _params({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "50Gi"}}),
            r"more than the share of gpu-0-share.*remove defaultPinnedDeviceMemoryLimit",
        ),
        (_params({"strategy": "TimeSlicing"}), r"always served by MPS.*strategy TimeSlicing cannot apply"),
    ],
)
def test_configs_that_contradict_a_share_are_refused(
    h200_devices: dict[str, Any], tmp_path: Path, parameters: dict[str, Any], message: str
) -> None:
    sharing = Sharing(DRIVER, POOL, MpsControl(tmp_path, "/driver"))
    with pytest.raises(ConfigError, match=message):
        sharing.plan("u1", share_claim("u1", parameters=parameters), [h200_devices["gpu-0-share"]])


def test_a_share_and_a_whole_gpu_without_mps_in_one_request_are_refused(tmp_path: Path) -> None:
    devices = node_devices(discover("hgx-h200"))
    devices.update(share_views(devices))
    whole = {"request": "share/whole", "driver": DRIVER, "pool": POOL, "device": "gpu-1"}
    claim = share_claim("u1", extra_results=[whole])
    sharing = Sharing(DRIVER, POOL, MpsControl(tmp_path, "/driver"))
    with pytest.raises(ConfigError, match=r"request share has MPS for gpu-0-share only: put the other"):
        sharing.plan("u1", claim, [devices["gpu-0-share"], devices["gpu-1"]])


def test_a_share_and_a_whole_gpu_in_two_requests_of_one_claim_are_served_apart(tmp_path: Path) -> None:
    """A container names the request whose devices it gets: the whole GPU's containers get no
    MPS edits, so nothing hides that GPU from them."""
    devices = node_devices(discover("hgx-h200"))
    devices.update(share_views(devices))
    whole = {"request": "whole", "driver": DRIVER, "pool": POOL, "device": "gpu-1"}
    claim = share_claim("u1", extra_results=[whole])
    sharing = Sharing(DRIVER, POOL, MpsControl(tmp_path, "/driver"))
    hardware = [devices["gpu-0-share"], devices["gpu-1"]]
    plan = sharing.plan("u1", claim, hardware)
    assert plan is not None
    assert [d.uuid for d in plan.devices] == [devices["gpu-0-share"].uuid]
    assert set(sharing.edits(plan, hardware)) == {"gpu-0-share"}


# --------------------------------------------------------------------------- prepare, for real


A = run_unique_uid("aaaa0000")
B = run_unique_uid("bbbb0000")
W = run_unique_uid("cccc0000")


def _ref(claim: dict[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(meta["namespace"], meta["name"], meta["uid"])


@pytest.fixture
def node(tmp_path: Path, mps: MpsControl) -> Any:
    return preparer_factory(tmp_path, mps, POOL, shares=True)


def _prepare(preparer: NodePreparer, *claims: dict[str, Any]) -> dict[str, ClaimResult]:
    return asyncio.run(preparer.prepare([_ref(c) for c in claims]))


def _env(preparer: NodePreparer, uid: str) -> list[str]:
    spec = json.loads(next(preparer.steps.cdi_dir.glob(f"*{uid}*.json")).read_text())
    env: list[str] = spec["devices"][0]["containerEdits"]["env"]
    return env


def test_two_shares_of_one_gpu_get_two_daemons_and_two_limits(node: Any, mps: MpsControl) -> None:
    a, b = share_claim(A, "40Gi", share_id="share-a"), share_claim(B, "60Gi", share_id="share-b")
    preparer = node(a, b)
    asyncio.run(preparer.recover())
    results = _prepare(preparer, a, b)
    assert results[A].error is None and results[B].error is None
    assert [d.share_id for d in results[A].devices] == ["share-a"]
    assert [d.share_id for d in results[B].devices] == ["share-b"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40G" in _env(preparer, A)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=60G" in _env(preparer, B)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=43" in _env(preparer, B)
    assert mps.is_running(A) and mps.is_running(B)
    assert set(mps.daemon_pids(A)).isdisjoint(mps.daemon_pids(B))
    assert mps.dirs(A).pipe != mps.dirs(B).pipe
    log_a = (mps.dirs(A).log / "control.log").read_text()
    assert "cmd set_default_device_pinned_mem_limit 0 40G" in log_a
    # the checkpoint keeps the share ids: a retry after a restart answers the same
    entry = preparer.read_checkpoint().claims[A]
    assert entry.phase == ckpt.ClaimPhase.COMPLETED and entry.devices[0].share_id == "share-a"

    asyncio.run(preparer.unprepare([_ref(a)]))
    assert not mps.is_running(A) and not mps.dirs(A).base.exists()
    assert mps.is_running(B), "unprepare of one share stopped another share's daemon"
    asyncio.run(preparer.unprepare([_ref(b)]))
    assert not mps.claim_uids()


def test_a_whole_gpu_and_a_share_of_it_are_never_prepared_together(node: Any, mps: MpsControl) -> None:
    share = share_claim(A)
    whole = {
        "metadata": {"uid": W, "namespace": "default", "name": "whole"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": DRIVER, "pool": POOL, "device": "gpu-0"}]
                }
            }
        },
    }
    preparer = node(share, whole)
    asyncio.run(preparer.recover())
    assert _prepare(preparer, share)[A].error is None
    error = _prepare(preparer, whole)[W].error
    assert error is not None and "held as a memory share by claim default/c-aaaa" in error
    asyncio.run(preparer.unprepare([_ref(share)]))
    assert _prepare(preparer, whole)[W].error is None
    error = _prepare(preparer, share)[A].error
    assert error is not None and "held as the whole GPU by claim default/whole" in error


def test_a_bad_share_is_refused_before_anything_is_touched(node: Any, mps: MpsControl) -> None:
    bad = share_claim(A, "40G")
    preparer = node(bad)
    asyncio.run(preparer.recover())
    error = _prepare(preparer, bad)[A].error
    assert error is not None and "invalid configuration" in error and "e.g. 38Gi" in error
    assert A not in preparer.read_checkpoint().claims
    assert not mps.claim_uids()


def test_a_crash_between_started_and_completed_stops_the_shares_daemon(node: Any, mps: MpsControl) -> None:
    a, b = share_claim(A, "40Gi"), share_claim(B, "60Gi", share_id="s2")
    preparer = node(a, b)
    asyncio.run(preparer.recover())
    _prepare(preparer, a, b)
    ckpt.save(preparer.steps.checkpoint_path, back_to_started(preparer.read_checkpoint(), A))
    restarted = node(a, b)
    asyncio.run(restarted.recover())
    assert A not in restarted.read_checkpoint().claims and not mps.is_running(A)
    assert mps.is_running(B) and restarted.read_checkpoint().claims[B].phase == ckpt.ClaimPhase.COMPLETED


def test_a_dead_share_daemon_comes_back_with_its_limit(node: Any, mps: MpsControl) -> None:
    a = share_claim(A, "40Gi")
    preparer = node(a)
    asyncio.run(preparer.recover())
    _prepare(preparer, a)
    kill_daemons(mps, A)  # the daemon dies (the plugin's container restarts)
    (mps.dirs(A).pipe / "control").unlink()
    restarted = node(a)
    asyncio.run(restarted.recover())
    assert mps.is_running(A)
    assert "cmd set_default_device_pinned_mem_limit 0 40G" in (mps.dirs(A).log / "control.log").read_text()
