"""The opaque claim configuration: quantities, strict validation, and which entry applies."""

from __future__ import annotations

from typing import Any

import pytest

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.sharing.config import (
    DEFAULT_CONFIG,
    ConfigError,
    GpuConfig,
    MpsConfig,
    SharingConfig,
    SharingStrategy,
    claim_config_entries,
    config_for_request,
    device_configs,
    format_mps_memory,
    memory_quantity,
    parse_gpu_config,
    quantity_value,
)

GI = 2**30


def params(**sharing: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig"}
    if sharing:
        obj["sharing"] = sharing
    return obj


MPS_10GI = params(
    strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "10Gi", "defaultActiveThreadPercentage": 50}
)


# --------------------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10Gi", 10 * GI),
        ("512Mi", 512 * 2**20),
        ("1.5Gi", 3 * GI // 2),
        ("10G", 10 * 10**9),
        ("1e9", 10**9),
        ("2E3", 2000),
        ("1073741824", GI),
        (1073741824, GI),
        ("1048576000m", 2**20),  # the API server's grammar: sub-units too
        ("1Ti", 2**40),
        ("1048576.5", 2**20),  # fractions of a byte dropped (MPS counts whole MiB)
    ],
)
def test_quantities(text: Any, expected: int) -> None:
    if expected < 2**20:
        assert quantity_value(str(text)) == expected
    else:
        assert memory_quantity(text, "x") == expected


@pytest.mark.parametrize(
    "text",
    ["10GB", "ten", "10gi", "NaN", "1e3Gi", " 3Ti ", "0", "-1Gi", "0.5", "512Ki", "1Ei", "1025Gi", 2**63,
     2**64, True, 1.5, None, [], {}],
)
def test_bad_quantities_say_what_to_write(text: Any) -> None:
    with pytest.raises(ConfigError, match=r"from 1Mi to 1Ti, e\.g\. 10Gi") as err:
        memory_quantity(text, "sharing.mps.defaultPinnedDeviceMemoryLimit")
    assert str(err.value).startswith("sharing.mps.defaultPinnedDeviceMemoryLimit: must be")


@pytest.mark.parametrize(
    ("limit", "text"), [(10 * GI, "10G"), (GI + 2**20, "1025M"), (10**10, "9536M"), (2**20, "1M")]
)
def test_mps_memory_units_round_down_to_mib(limit: int, text: str) -> None:
    assert format_mps_memory(limit) == text


def test_mps_memory_below_one_mib_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 1Mi"):
        format_mps_memory(2**20 - 1)


# --------------------------------------------------------------------------- the object


def test_mps_config_parses() -> None:
    cfg = parse_gpu_config(MPS_10GI, DRIVER)
    assert cfg == GpuConfig(
        SharingConfig(
            SharingStrategy.MPS,
            MpsConfig(default_active_thread_percentage=50, default_pinned_device_memory_limit=10 * GI),
        )
    )
    assert cfg.uses_mps


def test_defaults() -> None:
    assert parse_gpu_config(params(), DRIVER) == DEFAULT_CONFIG
    assert not DEFAULT_CONFIG.uses_mps
    assert parse_gpu_config(params(strategy="MPS"), DRIVER).sharing.mps == MpsConfig()
    assert parse_gpu_config(params(strategy="TimeSlicing"), DRIVER).sharing == SharingConfig()


def test_a_null_sharing_or_mps_is_left_out_as_in_nvidias_form() -> None:
    assert parse_gpu_config({"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "sharing": None}) == (
        DEFAULT_CONFIG
    )
    assert parse_gpu_config(params(strategy="MPS", mps=None), DRIVER).sharing.mps == MpsConfig()
    assert parse_gpu_config(params(strategy="TimeSlicing", mps=None), DRIVER).sharing == SharingConfig()


def test_a_renamed_driver_accepts_its_own_group_and_the_default() -> None:
    for group in ("gpu.example.com", DRIVER):
        obj = {**MPS_10GI, "apiVersion": f"{group}/v1alpha1"}
        assert parse_gpu_config(obj, "gpu.example.com").uses_mps


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({**MPS_10GI, "extra": 1}, r"parameters: unknown field 'extra'; allowed: apiVersion, kind, sharing"),
        (params(strategy="MPS", mps={"pinned": "1Gi"}), r"parameters.sharing.mps: unknown field 'pinned'"),
        (params(strategy="MPS", timeSlicing={}), r"parameters.sharing.timeSlicing: a time-slice interval"),
        (params(strategy="Mps"), r"'Mps' is not a sharing strategy; use one of: TimeSlicing, MPS"),
        (params(mps={}), r"parameters.sharing.strategy is missing"),
        (params(strategy="TimeSlicing", mps={}), r"mps is only allowed with strategy MPS"),
        (
            {**MPS_10GI, "apiVersion": "gpu.dra-driver.dev/v1"},
            r"apiVersion: 'gpu.dra-driver.dev/v1' is not supported",
        ),
        ({**MPS_10GI, "kind": "GPUConfig"}, r"kind: 'GPUConfig' is not supported; use GpuConfig"),
        (params(strategy="MPS", mps={"defaultActiveThreadPercentage": 0}), r"from 1 to 100"),
        (params(strategy="MPS", mps={"defaultActiveThreadPercentage": 101}), r"from 1 to 100"),
        (params(strategy="MPS", mps={"defaultActiveThreadPercentage": "50"}), r"from 1 to 100"),
        (params(strategy="MPS", mps={"defaultActiveThreadPercentage": True}), r"from 1 to 100"),
        (
            params(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "10 GiB"}),
            r"defaultPinnedDeviceMemoryLimit: must be a quantity from 1Mi to 1Ti, e\.g\. 10Gi",
        ),
        (params(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "1Ki"}), r"from 1Mi to 1Ti"),
        (params(strategy="MPS", mps={"defaultPinnedDeviceMemoryLimit": "1Ei"}), r"from 1Mi to 1Ti"),
        (params(strategy="MPS", mps={"shmSize": "lots"}), r"shmSize: must be a quantity from 1Mi to 1Ti"),
        (params(strategy="MPS", mps={"shmSize": "-64Mi"}), r"shmSize: must be a quantity from 1Mi to 1Ti"),
        ({"apiVersion": f"{DRIVER}/v1alpha1"}, r"parameters.kind is missing; set it to GpuConfig"),
        (params(strategy="MPS", mps="yes"), r"parameters.sharing.mps must be an object"),
        ("MPS", r"parameters must be an object"),
    ],
)
def test_invalid_configs_name_the_field_and_the_fix(obj: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_gpu_config(obj, DRIVER)


# --------------------------------------------------------------------------- a claim's entries


def entry(
    parameters: Any, requests: list[str] | None = None, source: str = "FromClaim", driver: str = DRIVER
) -> dict[str, Any]:
    e: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        e["requests"] = requests
    return e


def claim(config: list[dict[str, Any]], results: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    results = results or [{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}]
    return {"status": {"allocation": {"devices": {"results": results, "config": config}}}}


def test_entries_of_other_drivers_are_ignored_even_if_invalid() -> None:
    c = claim([entry("not even an object", driver="gpu.nvidia.com"), entry(MPS_10GI)])
    entries = claim_config_entries(c, DRIVER)
    assert len(entries) == 1 and entries[0].config.uses_mps


def test_an_invalid_entry_says_where_it_came_from() -> None:
    with pytest.raises(ConfigError, match=r"config\[1\] \(from the DeviceClass\) opaque.parameters.kind"):
        claim_config_entries(
            claim([entry(params()), entry({**MPS_10GI, "kind": "X"}, source="FromClass")]), DRIVER
        )


def test_claim_entries_win_over_class_entries_and_later_over_earlier() -> None:
    ts, mps = params(strategy="TimeSlicing"), MPS_10GI
    # the claim's entry wins although the class's comes later in the list
    entries = claim_config_entries(claim([entry(mps), entry(ts, source="FromClass")]), DRIVER)
    assert config_for_request(entries, "gpu").uses_mps
    entries = claim_config_entries(claim([entry(mps), entry(ts)]), DRIVER)
    assert not config_for_request(entries, "gpu").uses_mps
    assert config_for_request((), "gpu") == DEFAULT_CONFIG


def test_requests_select_entries_and_a_main_request_covers_its_subrequests() -> None:
    entries = claim_config_entries(claim([entry(MPS_10GI, requests=["gpu"])]), DRIVER)
    assert config_for_request(entries, "gpu").uses_mps
    assert config_for_request(entries, "gpu/h200").uses_mps
    assert not config_for_request(entries, "other").uses_mps
    entries = claim_config_entries(claim([entry(MPS_10GI, requests=["gpu/h200"])]), DRIVER)
    assert config_for_request(entries, "gpu/h200").uses_mps
    assert not config_for_request(entries, "gpu/l4").uses_mps


def test_device_configs_by_device_for_this_pool_only() -> None:
    results = [
        {"request": "a", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"},
        {"request": "b", "driver": DRIVER, "pool": "node-a", "device": "gpu-1"},
        {"request": "b", "driver": DRIVER, "pool": "node-b", "device": "gpu-7"},
        {"request": "b", "driver": "other.example.com", "pool": "node-a", "device": "gpu-9"},
    ]
    configs = device_configs(claim([entry(MPS_10GI, requests=["b"])], results), DRIVER, "node-a")
    assert set(configs) == {"gpu-0", "gpu-1"}
    assert not configs["gpu-0"].uses_mps and configs["gpu-1"].uses_mps


def test_one_device_with_two_different_configs_is_refused() -> None:
    results = [
        {"request": "a", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"},
        {"request": "b", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"},
    ]
    with pytest.raises(ConfigError, match="different configurations"):
        device_configs(claim([entry(MPS_10GI, requests=["b"])], results), DRIVER, "node-a")


def test_a_claim_without_config_gets_the_default() -> None:
    c = {
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "n", "device": "gpu-0"}]}
            }
        }
    }
    assert device_configs(c, DRIVER, "n") == {"gpu-0": DEFAULT_CONFIG}


def test_malformed_requests_are_refused() -> None:
    with pytest.raises(ConfigError, match="list of request names"):
        claim_config_entries(claim([entry(MPS_10GI, requests="gpu")]), DRIVER)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text", ["10Gi", "512Mi", "1e9", "1.5Gi", "40G", "143771Mi", "1E3", "-2Ki", "0.5", "5.", "1e-3", "7Ei"]
)
def test_quantities_have_the_value_the_kubernetes_client_gives_them(text: str) -> None:
    from kubernetes.utils import parse_quantity as client_parse

    assert quantity_value(text) == client_parse(text)


def test_a_time_slice_interval_is_refused_with_what_to_write_instead() -> None:
    with pytest.raises(ConfigError, match=r"cannot be set per claim.*remove timeSlicingConfig"):
        parse_gpu_config(
            {
                "apiVersion": "gpu.dra-driver.dev/v1alpha1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
            }
        )
