"""dra_driver.gpu.mig on FakeNvml: create at a placement, refuse a taken one, destroy, undo half-made."""

from __future__ import annotations

import dataclasses

import pynvml
import pytest

from dra_driver.gpu import load_profile, nvml
from dra_driver.gpu.mig import MigError, MigInstances, PlacementTaken
from dra_driver.gpu.mig_profiles import H200_141GB
from dra_driver.gpu.sim.fake_nvml import FakeNvml, FakeSysfs

PROFILE = load_profile("hgx-h200-mig")
GPU0, GPU1, GPU2 = (g.uuid for g in PROFILE.gpus)
BY_NAME = {p.name: p for p in H200_141GB}


def _migs(fake: FakeNvml, gpu: int) -> list[tuple[str, int, str]]:
    fake.nvmlInit()
    try:
        found = nvml.discover(fake, FakeSysfs(fake.profile)).gpus[gpu].mig_devices
    finally:
        fake.nvmlShutdown()
    return [(m.profile, m.placement_start, m.uuid) for m in found]


def test_create_at_the_placement_then_destroy() -> None:
    fake = FakeNvml(PROFILE)
    migs = MigInstances(fake)
    made = migs.create(GPU0, BY_NAME["3g.71gb"], 4)
    assert _migs(fake, 0) == [("3g.71gb", 4, made.uuid)]
    assert migs.at(GPU0, made.gpu_instance_id) == (9, 4)
    migs.destroy(GPU0, made.gpu_instance_id, made.compute_instance_id)
    assert _migs(fake, 0) == [] and migs.at(GPU0, made.gpu_instance_id) is None
    migs.destroy(GPU0, made.gpu_instance_id, made.compute_instance_id)  # again: nothing left, no error
    assert fake._initialized == 0  # every nvmlInit has its nvmlShutdown


def test_a_taken_placement_is_refused_with_the_reason_and_changes_nothing() -> None:
    fake = FakeNvml(PROFILE)
    before = _migs(fake, 1)
    with pytest.raises(PlacementTaken, match="placement is taken"):
        MigInstances(fake).create(GPU1, BY_NAME["1g.18gb"], 5)  # inside the static 3g.71gb at 4-7
    assert _migs(fake, 1) == before and fake.mig.live(1)[0].placement == 4


def test_a_gpu_not_in_mig_mode_is_refused_and_the_driver_does_not_change_it() -> None:
    fake = FakeNvml(PROFILE)
    with pytest.raises(MigError, match="not in MIG mode"):
        MigInstances(fake).create(GPU2, BY_NAME["1g.18gb"], 0)
    assert not any(name == "nvmlDeviceSetMigMode" for name, _ in fake.calls)


def test_a_failed_compute_instance_destroys_the_gpu_instance_made_for_it() -> None:
    errors = {"nvmlGpuInstanceCreateComputeInstance": pynvml.NVML_ERROR_UNKNOWN}
    broken = dataclasses.replace(PROFILE, errors=errors)
    fake = FakeNvml(broken)
    with pytest.raises(MigError, match="compute instance"):
        MigInstances(fake).create(GPU0, BY_NAME["2g.35gb"], 2)
    assert fake.mig.live(0) == []
