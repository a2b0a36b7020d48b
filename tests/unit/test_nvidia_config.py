"""NVIDIA's claim config (resource.nvidia.com/v1beta1) read as ours: what maps, what is
refused and why, per-device limits, and one claim with a time-sliced and an MPS GPU."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.devices import NodeDevice, node_devices
from dra_driver.gpu import discover
from dra_driver.sharing import nvidia_config as nv
from dra_driver.sharing import rules
from dra_driver.sharing.config import (
    ConfigError,
    GpuConfig,
    MpsConfig,
    SharingConfig,
    SharingStrategy,
)
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.settings import client_env
from dra_driver.sharing.policy import Sharing

POOL = "node-a"
GI = 2**30
POLICY = Path(__file__).resolve().parents[2] / "deploy/helm/gpu-dra-driver/templates/claim-config-policy.yaml"


def nvidia(kind: str = "GpuConfig", sharing: Any = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind}
    if sharing is not None:
        obj["sharing"] = sharing
    return obj


def mps(**config: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mpsConfig": config}


@pytest.fixture(scope="module")
def h200() -> dict[str, NodeDevice]:
    logging.disable(logging.DEBUG)
    return node_devices(discover("hgx-h200"))


@pytest.fixture(scope="module")
def a100_mig() -> dict[str, NodeDevice]:
    return node_devices(discover("a100-mig"))


# --------------------------------------------------------------------------- what maps


def test_nvidia_quickstart_mps_config_maps_to_ours() -> None:
    parsed = nv.parse_claim_config(
        nvidia(sharing=mps(defaultActiveThreadPercentage=50, defaultPinnedDeviceMemoryLimit="10Gi"))
    )
    assert parsed == GpuConfig(
        sharing=SharingConfig(SharingStrategy.MPS, MpsConfig(50, 10 * GI)), nvidia_kind="GpuConfig"
    )
    assert parsed.uses_mps


@pytest.mark.parametrize(
    "sharing",
    [
        {"strategy": "TimeSlicing"},
        {"strategy": "TimeSlicing", "timeSlicingConfig": {}},
        {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}},
    ],
)
def test_time_slicing_at_the_default_interval_is_what_a_gpu_does(sharing: dict[str, Any]) -> None:
    parsed = nv.parse_claim_config(nvidia(sharing=sharing))
    assert parsed.sharing == SharingConfig(SharingStrategy.TIME_SLICING) and not parsed.uses_mps


@pytest.mark.parametrize(
    ("sharing", "expected"),
    [
        # what `kubectl create` leaves once docs/migrating.md's `interval` is removed
        ({"strategy": "TimeSlicing", "timeSlicingConfig": None}, SharingConfig()),
        ({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": None}}, SharingConfig()),
        ({"strategy": "TimeSlicing", "mpsConfig": None}, SharingConfig()),
        (
            {
                "strategy": "MPS",
                "timeSlicingConfig": None,
                "mpsConfig": {"defaultActiveThreadPercentage": None},
            },
            SharingConfig(SharingStrategy.MPS, MpsConfig()),
        ),
    ],
)
def test_a_null_or_empty_object_is_the_default_nvidia_normalizes_it_to(
    sharing: dict[str, Any], expected: SharingConfig
) -> None:
    """NVIDIA's decoder reads null as a field left out (a nil pointer), and its Normalize
    defaults a nil timeSlicingConfig to interval Default and a nil mpsConfig to MPS's own."""
    assert nv.parse_claim_config(nvidia(sharing=sharing)).sharing == expected


def test_no_sharing_mps_without_settings_and_mig_kinds_map() -> None:
    assert nv.parse_claim_config(nvidia()) == GpuConfig(nvidia_kind="GpuConfig")
    assert nv.parse_claim_config(nvidia(sharing={"strategy": "MPS"})).sharing.mps == MpsConfig()
    mig = nv.parse_claim_config(nvidia("MigDeviceConfig", mps(defaultActiveThreadPercentage=20)))
    assert mig.nvidia_kind == "MigDeviceConfig" and mig.sharing.mps == MpsConfig(20)
    assert not nv.parse_claim_config(nvidia("MigDeviceConfig", {"strategy": "TimeSlicing"})).uses_mps


def test_multi_user_false_and_an_integer_limit_are_accepted() -> None:
    parsed = nv.parse_claim_config(nvidia(sharing=mps(multiUser=False, defaultPinnedDeviceMemoryLimit=GI)))
    assert parsed.sharing.mps == MpsConfig(None, GI)


# --------------------------------------------------------------------------- what is refused


@pytest.mark.parametrize(
    ("parameters", "where", "reason"),
    [
        (nvidia("VfioDeviceConfig"), "kind", f"VfioDeviceConfig {nv.NO_COUNTERPART_REASON}"),
        (
            nvidia("ComputeDomainChannelConfig"),
            "kind",
            f"ComputeDomainChannelConfig {nv.NO_COUNTERPART_REASON}",
        ),
        # As NVIDIA's users write them (its demo's gpu-test-vfio-config.yaml, its ComputeDomain
        # channel and daemon configs): refused for the kind, not for a field of that kind.
        (
            {**nvidia("VfioDeviceConfig"), "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": True}},
            "kind",
            f"VfioDeviceConfig {nv.NO_COUNTERPART_REASON}",
        ),
        (
            {**nvidia("ComputeDomainChannelConfig"), "domainID": "4f1b", "allocationMode": "All"},
            "kind",
            f"ComputeDomainChannelConfig {nv.NO_COUNTERPART_REASON}",
        ),
        (
            {**nvidia("ComputeDomainDaemonConfig"), "domainID": "4f1b"},
            "kind",
            f"ComputeDomainDaemonConfig {nv.NO_COUNTERPART_REASON}",
        ),
        (nvidia("GPUConfig"), "kind", nv.KIND_REASON),
        (
            nvidia(sharing=mps(defaultActiveThreadPercentage=1000)),
            "sharing.mpsConfig.defaultActiveThreadPercentage",
            rules.PERCENTAGE_REASON,
        ),
        (
            nvidia(sharing=mps(defaultPinnedDeviceMemoryLimit="1Ei")),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
            rules.LIMIT_REASON,
        ),
        (nvidia(sharing={"strategy": "Fabric"}), "sharing.strategy", nv.STRATEGY_REASON),
        (nvidia(sharing={}), "sharing.strategy", nv.STRATEGY_REASON),
        (
            nvidia(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
            "sharing.timeSlicingConfig.interval",
            rules.INTERVAL_REASON,
        ),
        (
            nvidia(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Forever"}}),
            "sharing.timeSlicingConfig.interval",
            rules.INTERVAL_REASON,
        ),
        (
            nvidia(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}),
            "sharing.mpsConfig",
            nv.MPS_ONLY_REASON,
        ),
        (
            nvidia(sharing={"strategy": "MPS", "timeSlicingConfig": {}}),
            "sharing.timeSlicingConfig",
            nv.TIME_SLICING_ONLY_REASON,
        ),
        (
            nvidia("MigDeviceConfig", {"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
            "sharing.timeSlicingConfig",
            nv.TIME_SLICING_ONLY_REASON,
        ),
        (
            nvidia(sharing=mps(defaultActiveThreadPercentage=0)),
            "sharing.mpsConfig.defaultActiveThreadPercentage",
            rules.ZERO_PERCENTAGE_REASON,
        ),
        (
            nvidia(sharing=mps(defaultActiveThreadPercentage=101)),
            "sharing.mpsConfig.defaultActiveThreadPercentage",
            rules.PERCENTAGE_REASON,
        ),
        (
            nvidia(sharing=mps(defaultPinnedDeviceMemoryLimit="512Ki")),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
            rules.LIMIT_REASON,
        ),
        (
            nvidia(sharing=mps(defaultPinnedDeviceMemoryLimit="lots")),
            "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
            rules.LIMIT_REASON,
        ),
        (
            nvidia(sharing=mps(defaultPerDevicePinnedMemoryLimit={"first": "1Gi"})),
            "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit",
            rules.PER_DEVICE_REASON,
        ),
        (
            nvidia(sharing=mps(defaultPerDevicePinnedMemoryLimit={"0": "1Ki"})),
            "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit",
            rules.PER_DEVICE_REASON,
        ),
        (nvidia(sharing=mps(multiUser=True)), "sharing.mpsConfig.multiUser", rules.MULTI_USER_REASON),
        (nvidia(sharing=mps(multiUser="yes")), "sharing.mpsConfig.multiUser", rules.BOOL_REASON),
    ],
)
def test_what_cannot_be_honoured_is_refused_with_the_reason(parameters: Any, where: str, reason: str) -> None:
    with pytest.raises(ConfigError) as refused:
        nv.parse_claim_config(parameters, DRIVER, "opaque.parameters")
    assert str(refused.value) == f"opaque.parameters.{where}: {reason}"


def test_a_missing_or_misspelled_kind_is_answered_with_the_kinds_that_exist() -> None:
    """Issue 38: both were answered with a remark about VFIO and ComputeDomain."""
    for params in ({"apiVersion": "resource.nvidia.com/v1beta1"}, nvidia("GpuConfg")):
        with pytest.raises(ConfigError) as refused:
            nv.parse_claim_config(params, DRIVER, "opaque.parameters")
        assert "GpuConfig (whole GPUs) or MigDeviceConfig (MIG devices)" in str(refused.value)
        assert "VFIO" not in str(refused.value)


def test_a_thread_percentage_of_1000_is_answered_with_the_bound_not_a_remark_about_0() -> None:
    with pytest.raises(ConfigError) as refused:
        nv.parse_claim_config(nvidia(sharing=mps(defaultActiveThreadPercentage=1000)), DRIVER, "p")
    expected = "p.sharing.mpsConfig.defaultActiveThreadPercentage: must be a whole number from 1 to 100"
    assert str(refused.value) == expected


def test_unknown_fields_are_refused_as_nvidia_decodes_strictly() -> None:
    with pytest.raises(ConfigError, match=r"sharing.mpsConfig: unknown field 'pinned'; allowed: default"):
        nv.parse_claim_config(nvidia(sharing=mps(pinned="1Gi")))
    with pytest.raises(ConfigError, match=r"^parameters: unknown field 'spec'"):
        nv.parse_claim_config({**nvidia(), "spec": {}})


def test_an_unknown_api_version_names_nvidias_as_accepted() -> None:
    with pytest.raises(ConfigError, match=r"use gpu.dra-driver.dev/v1alpha1 or resource.nvidia.com/v1beta1"):
        nv.parse_claim_config({"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"})


def test_every_refusal_is_worded_the_same_in_the_admission_policy() -> None:
    template = " ".join(POLICY.read_text().split())
    for reason in nv.reasons():
        assert " ".join(reason.split()) in template, reason


# --------------------------------------------------------------------------- per device


def _claim(results: list[tuple[str, str]], configs: list[tuple[list[str], Any]]) -> dict[str, Any]:
    return {
        "metadata": {"uid": "u1", "namespace": "default", "name": "c"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": DRIVER, "pool": POOL, "device": d} for r, d in results
                    ],
                    "config": [
                        {
                            "source": "FromClaim",
                            "requests": req,
                            "opaque": {"driver": DRIVER, "parameters": p},
                        }
                        for req, p in configs
                    ],
                }
            }
        },
    }


def test_per_device_limits_by_index_and_uuid_override_the_default(
    h200: dict[str, NodeDevice], tmp_path: Path
) -> None:
    gpus = [h200["gpu-0"], h200["gpu-1"], h200["gpu-2"]]
    config = mps(
        defaultPinnedDeviceMemoryLimit="10Gi",
        defaultPerDevicePinnedMemoryLimit={"1": "5Gi", gpus[2].uuid: "7Gi"},
    )
    claim = _claim([("gpus", g.name) for g in gpus], [(["gpus"], nvidia(sharing=config))])
    plan = Sharing(DRIVER, POOL, MpsControl(tmp_path, "/driver")).plan("u1", claim, gpus)
    assert plan is not None
    assert [(d.uuid, d.pinned_memory_limit) for d in plan.devices] == [
        (gpus[0].uuid, 10 * GI),
        (gpus[1].uuid, 5 * GI),
        (gpus[2].uuid, 7 * GI),
    ]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10G,1=5G,2=7G" in client_env(plan)


def test_a_per_device_key_naming_no_device_of_the_config_is_refused(h200: dict[str, NodeDevice]) -> None:
    gpus = [h200["gpu-0"], h200["gpu-1"]]
    config = nvidia(sharing=mps(defaultPerDevicePinnedMemoryLimit={"2": "5Gi"}))
    with pytest.raises(ConfigError, match=r"key '2' names none of the 2 device\(s\) .*index from 0 to 1"):
        nv.per_device({g.name: nv.parse_claim_config(config) for g in gpus}, gpus)


def test_a_gpu_config_on_a_mig_device_is_refused_as_nvidia_refuses_it(
    a100_mig: dict[str, NodeDevice],
) -> None:
    mig = a100_mig["gpu-6-mig-1g5gb-2"]
    with pytest.raises(
        ConfigError, match=r"cannot apply GpuConfig to device gpu-6-mig-1g5gb-2.*MigDeviceConfig"
    ):
        nv.per_device({mig.name: nv.parse_claim_config(nvidia(sharing=mps()))}, [mig])
    ok = nv.per_device({mig.name: nv.parse_claim_config(nvidia("MigDeviceConfig", mps()))}, [mig])
    assert ok[mig.name].uses_mps


def test_one_claim_with_a_time_sliced_gpu_and_an_mps_gpu(h200: dict[str, NodeDevice], tmp_path: Path) -> None:
    """NVIDIA's quickstart gpu-test5: requests ts-gpu and mps-gpu, a config for each."""
    ts, shared = h200["gpu-0"], h200["gpu-1"]
    claim = _claim(
        [("ts-gpu", ts.name), ("mps-gpu", shared.name)],
        [
            (["ts-gpu"], nvidia(sharing={"strategy": "TimeSlicing"})),
            (
                ["mps-gpu"],
                nvidia(sharing=mps(defaultActiveThreadPercentage=50, defaultPinnedDeviceMemoryLimit="10Gi")),
            ),
        ],
    )
    sharing = Sharing(DRIVER, POOL, MpsControl(tmp_path, "/driver"))
    plan = sharing.plan("u1", claim, [ts, shared])
    assert plan is not None and [d.uuid for d in plan.devices] == [shared.uuid]
    assert plan.active_thread_percentage == 50
    assert set(sharing.edits(plan, [ts, shared])) == {shared.name}


def test_mps_and_time_slicing_in_one_request_are_refused(h200: dict[str, NodeDevice], tmp_path: Path) -> None:
    a, b = h200["gpu-0"], h200["gpu-1"]
    claim = _claim(
        [("gpus/one", a.name), ("gpus/two", b.name)],
        [(["gpus/one"], nvidia(sharing={"strategy": "TimeSlicing"})), (["gpus/two"], nvidia(sharing=mps()))],
    )
    with pytest.raises(ConfigError, match=r"request gpus has MPS for gpu-1 only"):
        Sharing(DRIVER, POOL, MpsControl(tmp_path, "/driver")).plan("u1", claim, [a, b])


def test_two_thread_percentages_in_one_claim_are_refused_with_the_fix(
    h200: dict[str, NodeDevice], tmp_path: Path
) -> None:
    a, b = h200["gpu-0"], h200["gpu-1"]
    claim = _claim(
        [("a", a.name), ("b", b.name)],
        [(["a"], nvidia(sharing=mps(defaultActiveThreadPercentage=25))),
         (["b"], nvidia(sharing=mps(defaultActiveThreadPercentage=50)))],
    )
    with pytest.raises(ConfigError, match=r"\(got 25, 50\): give every MPS config of the claim and of its "
                                          r"DeviceClasses the same one"):
        Sharing(DRIVER, POOL, MpsControl(tmp_path, "/driver")).plan("u1", claim, [a, b])
