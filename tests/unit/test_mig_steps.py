"""A dynamic MIG claim end to end below the transaction: allocated name -> placement ->
instance made on FakeNvml -> the CDI edits with its caps nodes and its MIG UUID."""

from __future__ import annotations

import pytest

from dra_driver.cdi.builders import device_edits, device_env_name
from dra_driver.driver_root.device_nodes import mig_cap_minor
from dra_driver.gpu import discover, load_profile
from dra_driver.gpu.mig import MigInstances
from dra_driver.gpu.sim.fake_nvml import FakeNvml
from dra_driver.plugin.mig_steps import created_device, device_to_create
from tests.unit.test_cdi import h200_files

INVENTORY = discover("hgx-h200-mig")


def test_the_allocated_placement_is_created_and_its_spec_names_its_caps_and_uuid() -> None:
    placement = device_to_create(INVENTORY, "gpu-0-mig-3g-71gb-9-4")
    assert placement is not None and (placement.profile.name, placement.start) == ("3g.71gb", 4)
    fake = FakeNvml(load_profile("hgx-h200-mig"))
    made = MigInstances(fake).create(placement.gpu.uuid, placement.profile, placement.start)
    device = created_device(placement, made)
    edits = device_edits(device, h200_files())
    assert f"{device_env_name('gpu-0-mig-3g-71gb-9-4')}={made.uuid}" in edits.env
    minors = {n.minor for n in edits.device_nodes if n.path.startswith("/dev/nvidia-caps/")}
    gi, ci = made.gpu_instance_id, made.compute_instance_id
    assert minors == {mig_cap_minor(0, gi, None), mig_cap_minor(0, gi, ci)}
    assert "/dev/nvidia0" in {n.path for n in edits.device_nodes}


def test_names_that_are_no_placement_and_a_mismatched_instance() -> None:
    assert device_to_create(INVENTORY, "gpu-2") is None
    assert device_to_create(INVENTORY, "gpu-1-mig-1g-18gb-19-5") is None  # under the static 3g.71gb
    placement = device_to_create(INVENTORY, "gpu-0-mig-1g-18gb-19-0")
    other = device_to_create(INVENTORY, "gpu-0-mig-1g-18gb-19-1")
    assert placement is not None and other is not None
    made = MigInstances(FakeNvml(load_profile("hgx-h200-mig"))).create(other.gpu.uuid, other.profile, 1)
    with pytest.raises(ValueError, match="not the instance"):
        created_device(placement, made)
