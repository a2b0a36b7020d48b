"""The node's GPUs as plain typed data.

Everything downstream (ResourceSlices, CDI specs, the inventory report) is a pure
function of an `Inventory`. Discovery backends (real NVML, simulated profiles) build
it once at start; nothing here talks to hardware. `None` always means "the hardware
did not say" (NVML answered NotSupported or the field does not apply).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class LinkEndpointKind(str, Enum):
    """What is at the far end of one NVLink link."""

    GPU = "gpu"
    NVSWITCH = "nvswitch"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class NvLink:
    """One NVLink link of a GPU, as NVML reports it."""

    link: int
    active: bool
    remote_kind: LinkEndpointKind
    remote_pci_bus_id: str | None  # normalized like GpuInfo.pci_bus_id


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance (GPU instance + compute instance) on a parent GPU."""

    parent_index: int
    profile: str  # e.g. "1g.10gb"
    gpu_instance_id: int
    compute_instance_id: int
    placement_start: int
    placement_size: int
    uuid: str
    memory_bytes: int
    multiprocessors: int
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


@dataclass(frozen=True)
class FabricClique:
    """Membership of a multi-node NVLink domain (NVML GPU fabric info)."""

    cluster_uuid: str
    clique_id: int


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU."""

    index: int
    minor: int  # /dev/nvidia<minor>
    uuid: str
    product_name: str
    brand: str  # e.g. "Nvidia", "Tesla"
    architecture: str  # e.g. "Hopper"
    cuda_compute_capability: str  # "9.0"
    memory_bytes: int
    pci_bus_id: str  # normalized, lower case, "0000:3b:00.0"
    pcie_root: str | None  # e.g. "pci0000:00"
    numa_node: int | None
    mig_enabled: bool
    mig_devices: tuple[MigDevice, ...] = ()
    nvlinks: tuple[NvLink, ...] = ()
    fabric_clique: FabricClique | None = None
    multiprocessors: int | None = None


@dataclass(frozen=True)
class Inventory:
    """All GPUs of one node plus the driver facts that apply to all of them."""

    driver_version: str  # "570.195.03"
    cuda_driver_version: str  # "12.8"
    gpus: tuple[GpuInfo, ...]
    source: str = "nvml"  # "nvml" or "simulated:<profile>"

    def gpu(self, index: int) -> GpuInfo:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU with index {index}")
