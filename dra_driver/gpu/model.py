"""The node's GPUs as plain typed data.

Everything downstream (ResourceSlices, CDI specs, the inventory report) is a pure
function of an `Inventory`. Discovery backends (real NVML, simulated profiles) build
it once at start; nothing here talks to hardware. `None` always means "the hardware
did not say" (NVML answered NotSupported or the field does not apply).

Names: `Inventory`, `GpuInfo`, `MigDevice`, `NvLink`, `LinkEndpointKind`,
`FabricClique`, `PeerPath`, `PcieLevel`. NVLink peers, islands and groups are not
stored here: they are derived by `dra_driver.gpu.topology.nvlink_topology(inventory)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dra_driver.gpu.mig_profiles import GiProfile


class LinkEndpointKind(StrEnum):
    """What is at the far end of one NVLink link."""

    GPU = "gpu"
    NVSWITCH = "nvswitch"
    UNKNOWN = "unknown"


class PcieLevel(StrEnum):
    """The closest common PCIe ancestor of two GPUs (NVML topology level).

    `smi_code` is how `nvidia-smi topo -m` prints it.
    """

    INTERNAL = "internal"  # same board (multi-GPU boards)
    SINGLE = "single"  # one PCIe switch between them
    MULTIPLE = "multiple"  # several PCIe switches, no host bridge
    HOSTBRIDGE = "hostbridge"  # the same PCIe host bridge
    NODE = "node"  # different host bridges of one NUMA node
    SYSTEM = "system"  # across NUMA nodes (SMP interconnect)

    @property
    def smi_code(self) -> str:
        return _SMI_CODES[self]


_SMI_CODES = {
    PcieLevel.INTERNAL: "INT",
    PcieLevel.SINGLE: "PIX",
    PcieLevel.MULTIPLE: "PXB",
    PcieLevel.HOSTBRIDGE: "PHB",
    PcieLevel.NODE: "NODE",
    PcieLevel.SYSTEM: "SYS",
}


@dataclass(frozen=True)
class NvLink:
    """One NVLink link of a GPU, as NVML reports it."""

    link: int
    active: bool
    remote_kind: LinkEndpointKind
    remote_pci_bus_id: str | None  # normalized like GpuInfo.pci_bus_id


@dataclass(frozen=True)
class PeerPath:
    """How one GPU reaches another GPU of the node, as NVML answers pairwise questions."""

    peer_index: int
    pcie_level: PcieLevel | None  # nvmlDeviceGetTopologyCommonAncestor
    nvlink_p2p: bool | None  # nvmlDeviceGetP2PStatus(..., NVML_P2P_CAPS_INDEX_NVLINK) == OK


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
    gpu_instance_profile_id: int | None = None  # NVML GI profile id, e.g. 19 for A100 1g.5gb


@dataclass(frozen=True)
class FabricClique:
    """Membership of a multi-node NVLink domain (NVML GPU fabric info)."""

    cluster_uuid: str
    clique_id: int

    @property
    def id(self) -> str:
        """`<clusterUUID>.<cliqueId>`, the form NVIDIA's driver labels nodes with."""
        return f"{self.cluster_uuid}.{self.clique_id}"


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU."""

    index: int
    minor: int  # /dev/nvidia<minor>
    uuid: str
    product_name: str
    brand: str  # e.g. "Nvidia", "Tesla"; "Unknown" when NVML does not say
    architecture: str  # e.g. "Hopper"; "Unknown" when NVML does not say
    cuda_compute_capability: str  # "9.0"
    memory_bytes: int
    pci_bus_id: str  # normalized, lower case, "0000:3b:00.0"
    pcie_root: str | None  # e.g. "pci0000:00"
    numa_node: int | None
    mig_enabled: bool
    mig_devices: tuple[MigDevice, ...] = ()
    nvlinks: tuple[NvLink, ...] = ()  # only links NVML answered for; () = NVLink not reported
    fabric_clique: FabricClique | None = None
    multiprocessors: int | None = None
    peer_paths: tuple[PeerPath, ...] = ()  # one per other GPU of the node
    # GPU-instance profiles and their possible placements, read only in MIG mode (dynamic MIG)
    mig_profiles: tuple[GiProfile, ...] = ()
    # nvmlDeviceGetAddressingMode, spelled as NVIDIA's driver publishes it: "ATS" (GH200/GB200)
    # or "HMM" where the GPU addresses CPU memory through one, "None" where NVML answers but
    # neither is active (an x86 H100, driver 580)
    addressing_mode: str | None = None

    @property
    def active_nvlinks(self) -> int:
        return sum(1 for link in self.nvlinks if link.active)

    def path_to(self, peer_index: int) -> PeerPath | None:
        for path in self.peer_paths:
            if path.peer_index == peer_index:
                return path
        return None


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
