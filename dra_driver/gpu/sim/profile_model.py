"""What a simulated-hardware profile holds once read and checked: a frozen `Profile` of
`GpuSpec`s (with their MIG devices, MIG profiles and fabric) as NVML would report them.

Data only: reading and checking a profile file is `dra_driver.gpu.sim.profiles`'; answering NVML
calls from it is `dra_driver.gpu.sim.fake_nvml`'s. It must not do I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MigProfileSpec:
    """One GPU-instance profile of the product (what `nvidia-smi mig -lgip` lists)."""

    name: str
    id: int
    slices: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[int, ...]
    placement_size: int


@dataclass(frozen=True)
class MigInstanceSpec:
    """One MIG device: a GPU instance of `profile` at `placement` with one full compute instance."""

    profile: MigProfileSpec
    placement: int
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str


@dataclass(frozen=True)
class FabricSpec:
    state: int
    cluster_uuid: bytes  # 16 bytes, zeros when not part of a cluster
    clique_id: int
    status: int = 0


@dataclass(frozen=True)
class GpuSpec:
    index: int
    uuid: str
    name: str
    brand: int
    architecture: int
    compute_capability: tuple[int, int]
    memory_bytes: int
    pci_bus_id: str  # as NVML prints it, "00000000:18:00.0"
    minor: int
    numa_node: int | None
    sysfs_numa_node: int
    pcie_root: str | None
    pcie_switch: str | None
    nvlink_max_links: int
    nvswitch_links: tuple[int, ...]
    mig_enabled: bool
    mig_max_devices: int
    mig_devices: tuple[MigInstanceSpec, ...]
    fabric: FabricSpec | None
    errors: Mapping[str, int] = field(default_factory=dict)
    # answers to the per-GPU queries FakeNvml does not spell out: call -> value, or -> {argument: value};
    # a query not here answers NotSupported (so a new fact needs no profile edit)
    nvml: Mapping[str, Any] = field(default_factory=dict)
    addressing_mode: int | None = None  # NVML_DEVICE_ADDRESSING_MODE_*; None: NotSupported


@dataclass(frozen=True)
class Profile:
    """A whole simulated node, validated."""

    name: str
    description: str
    path: str
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[GpuSpec, ...]
    nvlink_pairs: tuple[tuple[int, int, int], ...]
    nvswitches: tuple[str | None, ...]  # PCI bus id of each NVSwitch, None when not reported
    errors: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ProfileSummary:
    name: str
    description: str
    gpus: int
    product: str
