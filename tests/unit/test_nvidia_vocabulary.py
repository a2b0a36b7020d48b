"""Every attribute NVIDIA's GPU DRA driver publishes for a device is published here under the
same name with the same type, for the same (simulated) GPU: a claim written for that driver
must find what it selects on after the domain is changed.

NVIDIA's vocabulary below is read from `sigs.k8s.io/dra-driver-nvidia-gpu@v0.5.0` (get it with
`go mod download -json sigs.k8s.io/dra-driver-nvidia-gpu@v0.5.0`), with its default feature
gates:
- whole GPU: `cmd/gpu-kubelet-plugin/deviceinfo.go`, `GpuInfo.Attributes()` and, for the
  capacity, `cmd/gpu-kubelet-plugin/partitions.go`, `GpuInfo.fullGpuCapacity()`;
- MIG device: `cmd/gpu-kubelet-plugin/mig.go`, `CommonAttributesMig()` and
  `CommonCapacitiesMig()`, plus `uuid` and `memorySlice<i>` in `deviceinfo.go`,
  `MigDeviceInfo.GetDevice()` (dynamic MIG's `partitions.go`, `MigSpec.Attributes()`, is the
  same `CommonAttributesMig()`);
- the three standard names come from `k8s.io/dynamic-resource-allocation/deviceattribute`
  (v0.37.0-rc.0, `pci_linux.go`, `numa_linux.go`): `numaNode` is a scalar int unless NVIDIA's
  own alpha `DRAListTypeAttributes` gate is on (`cmd/gpu-kubelet-plugin/numa.go`,
  `configuredNUMAAttributeForm()`; default off in `pkg/featuregates/featuregates.go`);
- `addressingMode` is go-nvlib v0.12.0's `GetAddressingModeAsString()`
  (`pkg/nvlib/device/device.go`): "ATS", "HMM" or "None" when nvmlDeviceGetAddressingMode
  answers, left out (NVIDIA's `nvlib.go`: `mode != ""`) when it answers NotSupported or the
  library lacks the symbol.
Left out of the table: the alpha FabricManagerPartitioning gate's `gpuModuleID` and
`partition<N>` (default off) and the VFIO devices, which this driver does not offer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml
import pytest

from controller.slices import SliceFeatures, desired_slices
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.gpu import ProfileError, discover, profile_names
from dra_driver.gpu import nvml as gpu_nvml
from dra_driver.gpu.model import GpuInfo, Inventory
from dra_driver.gpu.sim.fake_nvml import FakeNvml, FakeSysfs
from dra_driver.gpu.sim.profile_model import Profile
from dra_driver.gpu.sim.profiles import ADDRESSING_MODES, load_profile, parse_profile

NODE = "node-1"
GA = SliceFeatures(list_attributes=False)
LIST = SliceFeatures(list_attributes=True)
FEATURES = pytest.mark.parametrize("features", [GA, LIST], ids=["ga", "list-attrs"])


def _always(gpu: GpuInfo) -> bool:
    return True


@dataclass(frozen=True)
class NvidiaAttribute:
    """One attribute as NVIDIA's driver publishes it: name, DeviceAttribute field, and when."""

    name: str
    type: str  # the resource.k8s.io/v1 DeviceAttribute field: string, int, bool, version
    published: Callable[[GpuInfo], bool] = _always  # from the (parent) GPU's NVML facts


def _numa_known(gpu: GpuInfo) -> bool:
    # deviceattribute leaves the attribute out for sysfs numa_node -1 (no NUMA affinity).
    return gpu.numa_node is not None and gpu.numa_node >= 0


def _pcie_root_known(gpu: GpuInfo) -> bool:
    return gpu.pcie_root is not None


def _addressing_mode_known(gpu: GpuInfo) -> bool:
    return gpu.addressing_mode is not None


_COMMON = (
    NvidiaAttribute("uuid", "string"),
    NvidiaAttribute("productName", "string"),
    NvidiaAttribute("brand", "string"),
    NvidiaAttribute("architecture", "string"),
    NvidiaAttribute("cudaComputeCapability", "version"),
    NvidiaAttribute("driverVersion", "version"),
    NvidiaAttribute("cudaDriverVersion", "version"),
    NvidiaAttribute("resource.kubernetes.io/pciBusID", "string"),
    NvidiaAttribute("resource.kubernetes.io/pcieRoot", "string", _pcie_root_known),
    NvidiaAttribute("resource.kubernetes.io/numaNode", "int", _numa_known),
    NvidiaAttribute("addressingMode", "string", _addressing_mode_known),
)
NVIDIA_GPU: tuple[NvidiaAttribute, ...] = (NvidiaAttribute("type", "string"), *_COMMON)
NVIDIA_MIG: tuple[NvidiaAttribute, ...] = (
    NvidiaAttribute("type", "string"),
    NvidiaAttribute("parentUUID", "string"),
    NvidiaAttribute("profile", "string"),
    *_COMMON,
)
NVIDIA_GPU_CAPACITY = frozenset({"memory"})
NVIDIA_MIG_CAPACITY = frozenset(
    {"multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines", "ofaEngines", "memory"}
)
# go-nvlib's GetAddressingModeAsString, by NVML enum
NVIDIA_ADDRESSING_MODES = {
    pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE: "None",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM: "HMM",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS: "ATS",
}


def published(inv: Inventory, features: SliceFeatures) -> list[dict[str, Any]]:
    return [d for s in desired_slices(inv, NODE, DRIVER, features) for d in s.get("devices", [])]


def kinds(device: dict[str, Any]) -> dict[str, str]:
    """Attribute name -> the DeviceAttribute field its value is in."""
    out = {}
    for name, value in device["attributes"].items():
        (field,) = value
        out[name] = str(field)
    return out


def expected(table: tuple[NvidiaAttribute, ...], gpu: GpuInfo) -> dict[str, str]:
    return {a.name: a.type for a in table if a.published(gpu)}


def parent(inv: Inventory, device: dict[str, Any]) -> GpuInfo:
    uuid_kind = "parentUUID" if device["attributes"]["type"]["string"] == "mig" else "uuid"
    wanted = device["attributes"][uuid_kind]["string"]
    return next(g for g in inv.gpus if g.uuid == wanted)


def check_device(inv: Inventory, device: dict[str, Any]) -> None:
    gpu = parent(inv, device)
    is_mig = device["attributes"]["type"]["string"] == "mig"
    table, capacity = (NVIDIA_MIG, NVIDIA_MIG_CAPACITY) if is_mig else (NVIDIA_GPU, NVIDIA_GPU_CAPACITY)
    want = expected(table, gpu)
    have = kinds(device)
    assert {n: have.get(n, "missing") for n in want} == want, device["name"]
    assert capacity <= set(device.get("capacity", {})), device["name"]


def with_addressing_mode(profile: Profile, mode: int) -> Profile:
    gpus = tuple(dataclasses.replace(g, addressing_mode=mode) for g in profile.gpus)
    return dataclasses.replace(profile, gpus=gpus)


def run(profile: Profile) -> Inventory:
    return gpu_nvml.discover(FakeNvml(profile), FakeSysfs(profile), source="test")


# ---------------------------------------------------------------- the vocabulary


@FEATURES
def test_gb200_gpus_publish_every_nvidia_attribute_with_its_type(features: SliceFeatures) -> None:
    inv = discover(simulate="gb200-nvl-node")
    devices = published(inv, features)
    assert len(devices) == 4
    everything = {a.name: a.type for a in NVIDIA_GPU}  # NVIDIA publishes all of them on a GB200
    for device in devices:
        have = kinds(device)
        assert {n: have.get(n, "missing") for n in everything} == everything, device["name"]
        check_device(inv, device)
        assert device["attributes"]["addressingMode"] == {"string": "ATS"}
        assert device["attributes"]["resource.kubernetes.io/numaNode"]["int"] in (0, 1)


@FEATURES
def test_mig_devices_publish_every_nvidia_attribute_with_its_type(features: SliceFeatures) -> None:
    inv = run(with_addressing_mode(load_profile("a100-mig"), pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM))
    migs = [d for d in published(inv, features) if d["attributes"]["type"]["string"] == "mig"]
    assert migs
    everything = {a.name: a.type for a in NVIDIA_MIG}
    for device in migs:
        have = kinds(device)
        assert {n: have.get(n, "missing") for n in everything} == everything, device["name"]
        check_device(inv, device)
        assert device["attributes"]["addressingMode"] == {"string": "HMM"}  # the parent's, as NVIDIA


@pytest.mark.parametrize("name", profile_names())
@FEATURES
def test_every_profile_publishes_nvidias_names_and_types(name: str, features: SliceFeatures) -> None:
    inv = discover(simulate=name)
    devices = published(inv, features)
    assert devices
    for device in devices:
        check_device(inv, device)


@FEATURES
def test_numa_node_is_a_scalar_a_claim_can_compare(features: SliceFeatures) -> None:
    """`device.attributes["resource.kubernetes.io"].numaNode == 0` never matches a list."""
    inv = discover(simulate="dgx1-v100")
    numa = {d["name"]: d["attributes"]["resource.kubernetes.io/numaNode"] for d in published(inv, features)}
    assert numa and all(set(v) == {"int"} for v in numa.values()), numa


def test_unknown_facts_leave_the_attribute_out_as_nvidia_does() -> None:
    profile = load_profile("h200-single")  # NUMA NotSupported by NVML and sysfs, no addressing mode
    inv = run(profile)
    (device,) = published(inv, LIST)
    assert not {"resource.kubernetes.io/numaNode", "addressingMode"} & set(device["attributes"])
    check_device(inv, device)


# ---------------------------------------------------------------- addressing mode from NVML


@pytest.mark.parametrize("mode", sorted(NVIDIA_ADDRESSING_MODES))
def test_addressing_mode_spelled_as_go_nvlib(mode: int) -> None:
    inv = run(with_addressing_mode(load_profile("l4x4"), mode))
    assert {g.addressing_mode for g in inv.gpus} == {NVIDIA_ADDRESSING_MODES[mode]}
    for device in published(inv, GA):
        assert device["attributes"]["addressingMode"] == {"string": NVIDIA_ADDRESSING_MODES[mode]}


@pytest.mark.parametrize("error", ["NOT_SUPPORTED", "FUNCTION_NOT_FOUND", "UNKNOWN"])
def test_addressing_mode_unknown_on_an_nvml_error(error: str) -> None:
    profile = with_addressing_mode(load_profile("gb200-nvl-node"), pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS)
    code = getattr(pynvml, f"NVML_ERROR_{error}")
    gpus = tuple(dataclasses.replace(g, errors={**g.errors, "nvmlDeviceGetAddressingMode": code})
                 for g in profile.gpus)
    inv = run(dataclasses.replace(profile, gpus=gpus))
    assert len(inv.gpus) == 4 and {g.addressing_mode for g in inv.gpus} == {None}
    assert all("addressingMode" not in d["attributes"] for d in published(inv, GA))


def test_addressing_mode_not_known_to_this_driver_is_left_out() -> None:
    inv = run(with_addressing_mode(load_profile("l4x4"), 7))
    assert {g.addressing_mode for g in inv.gpus} == {None}


def test_profile_names_nvml_addressing_modes() -> None:
    assert ADDRESSING_MODES == {"NONE": 0, "HMM": 1, "ATS": 2}
    assert {g.addressing_mode for g in load_profile("gb200-nvl-node").gpus} == {
        pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS
    }
    data = {"driver": {"version": "580.95.05", "cuda_version": 13000},
            "gpus": [{"uuid": "GPU-00000000-0000-4000-8000-000000000000", "name": "NVIDIA GH200 480GB",
                      "brand": "NVIDIA", "architecture": "HOPPER", "cuda_compute_capability": "9.0",
                      "memory_bytes": 102005473280, "pci_bus_id": "00000009:01:00.0",
                      "addressing_mode": "SOMETIMES"}]}
    with pytest.raises(ProfileError, match=r"gpus\[0\]\.addressing_mode: unknown value 'SOMETIMES'"):
        parse_profile(data, "gh200.yaml", "gh200")
