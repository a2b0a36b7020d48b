"""Discovery backend: read every GPU fact from NVML once, at start, into an `Inventory`.

`discover(nvml, sysfs)` is the one code path for real and simulated hardware: `nvml` is
the `pynvml` module (nvidia-ml-py) on a GPU host, or a `FakeNvml` built from a profile
(dra_driver.gpu.sim.fake_nvml) in CI; both answer the same calls in `NvmlApi` with the same
return shapes and raise `pynvml.NVMLError` the same way.

Rules kept here:
- one `nvmlInit`/`nvmlShutdown` pair per discovery, and each query made once;
- an NVML error on an optional fact (NUMA, addressing mode, NVLink, fabric, P2P, topology) means
  "unknown" (`None` / left out), never a failure: a real H200 VM answers NotSupported
  for every NVLink link and for the NUMA id;
- an error on an identity fact (UUID, name, memory, PCI bus id, minor, compute
  capability) raises `GpuDiscoveryError` naming the GPU and the call: such a GPU cannot
  be published, and publishing the others would hide it.
This module must not be called from the prepare path.
"""

from __future__ import annotations

import ctypes
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pynvml
import structlog

from dra_driver.gpu.errors import GpuDiscoveryError, NvmlUnavailableError
from dra_driver.gpu.mig_profiles import MEMORY_SLICES as MIG_MEMORY_SLICES
from dra_driver.gpu.mig_profiles import GiProfile
from dra_driver.gpu.model import (
    FabricClique,
    GpuInfo,
    Inventory,
    LinkEndpointKind,
    MigDevice,
    NvLink,
    PcieLevel,
    PeerPath,
)
from dra_driver.gpu.sysfs import HostSysfs, PciSysfs

log = structlog.get_logger(__name__)

T = TypeVar("T")

MIB = 1024 * 1024
GIB = 1024 * MIB


class NvmlApi(Protocol):
    """The pynvml calls discovery makes; `pynvml` itself and `FakeNvml` both provide them."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlSystemGetCudaDriverVersion_v2(self) -> int: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int: ...
    def nvmlDeviceGetBrand(self, handle: Any) -> int: ...
    def nvmlDeviceGetArchitecture(self, handle: Any) -> int: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int: ...
    def nvmlDeviceGetAddressingMode(self, handle: Any) -> int: ...
    def nvmlDeviceGetAttributes(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]: ...
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any: ...
    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int: ...
    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int: ...
    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gpu_instance_id: int) -> Any: ...
    def nvmlGpuInstanceGetInfo(self, gpu_instance: Any) -> Any: ...
    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int, version: int = 2) -> Any: ...
    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: Any, profile_id: int, placements: Any, count_ref: Any
    ) -> int: ...
    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int: ...
    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any: ...
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int: ...
    def nvmlDeviceGetP2PStatus(self, handle1: Any, handle2: Any, p2p_index: int) -> int: ...
    def nvmlDeviceGetTopologyCommonAncestor(self, handle1: Any, handle2: Any) -> int: ...
    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, info: Any) -> int: ...
    def nvmlDeviceGetGpuFabricInfo(self, handle: Any, info: Any) -> int: ...


# Every name in NvmlApi; FakeNvml answers each (spelled out, or from a profile's `nvml` answers),
# and a profile may make any fail.
NVML_FUNCTIONS: tuple[str, ...] = tuple(
    name for name in NvmlApi.__dict__ if name.startswith("nvml") and callable(NvmlApi.__dict__[name])
)


def normalize_pci_bus_id(bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" as sysfs spells it: "0000:3b:00.0" (lower case, 4-digit domain)."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or ":" not in rest:
        return text
    try:
        value = int(domain, 16)
    except ValueError:
        return text
    return f"{value:04x}:{rest}"


def cuda_version_string(version: int) -> str:
    """NVML's integer CUDA driver version (12080) as "12.8"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def mig_memory_size_gb(total_device_bytes: int, mig_memory_mib: int) -> int:
    """The "Ngb" of a MIG profile name, rounded the way nvidia-smi and go-nvlib name profiles.

    The instance's share of memory is rounded up to eighths, then scaled to the GPU's
    whole GiB and rounded half away from zero (H200: 71424 MiB -> 70.5 -> "3g.71gb").
    """
    eighths = math.ceil(mig_memory_mib * MIB * 8 / total_device_bytes)
    total_gb = (total_device_bytes + GIB - 1) // GIB
    return math.floor(eighths * total_gb / 8 + 0.5)


def mig_profile_name(gi_slices: int, ci_slices: int, memory_gb: int) -> str:
    if ci_slices == gi_slices:
        return f"{gi_slices}g.{memory_gb}gb"
    return f"{ci_slices}c.{gi_slices}g.{memory_gb}gb"


def _enum_names(prefix: str) -> dict[int, str]:
    return {
        getattr(pynvml, name): name[len(prefix) :]
        for name in dir(pynvml)
        if name.startswith(prefix) and isinstance(getattr(pynvml, name), int)
    }


_ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "Volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "Turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "Ada Lovelace",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
    pynvml.NVML_DEVICE_ARCH_RUBIN: "Rubin",
}

# Spelled as go-nvlib's GetBrandAsString, which NVIDIA's DRA driver publishes.
_BRANDS = {
    pynvml.NVML_BRAND_UNKNOWN: "Unknown",
    pynvml.NVML_BRAND_QUADRO: "Quadro",
    pynvml.NVML_BRAND_TESLA: "Tesla",
    pynvml.NVML_BRAND_NVS: "NVS",
    pynvml.NVML_BRAND_GRID: "Grid",
    pynvml.NVML_BRAND_GEFORCE: "GeForce",
    pynvml.NVML_BRAND_TITAN: "Titan",
    pynvml.NVML_BRAND_NVIDIA_VAPPS: "NvidiaVApps",
    pynvml.NVML_BRAND_NVIDIA_VPC: "NvidiaVPC",
    pynvml.NVML_BRAND_NVIDIA_VCS: "NvidiaVCS",
    pynvml.NVML_BRAND_NVIDIA_VWS: "NvidiaVWS",
    pynvml.NVML_BRAND_NVIDIA_CLOUD_GAMING: "NvidiaCloudGaming",
    pynvml.NVML_BRAND_QUADRO_RTX: "QuadroRTX",
    pynvml.NVML_BRAND_NVIDIA_RTX: "NvidiaRTX",
    pynvml.NVML_BRAND_NVIDIA: "Nvidia",
    pynvml.NVML_BRAND_GEFORCE_RTX: "GeForceRTX",
    pynvml.NVML_BRAND_TITAN_RTX: "TitanRTX",
}

# Spelled as go-nvlib's GetAddressingModeAsString, which NVIDIA's DRA driver publishes.
_ADDRESSING_MODES = {
    pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE: "None",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM: "HMM",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS: "ATS",
}

_PCIE_LEVELS = {
    pynvml.NVML_TOPOLOGY_INTERNAL: PcieLevel.INTERNAL,
    pynvml.NVML_TOPOLOGY_SINGLE: PcieLevel.SINGLE,
    pynvml.NVML_TOPOLOGY_MULTIPLE: PcieLevel.MULTIPLE,
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: PcieLevel.HOSTBRIDGE,
    pynvml.NVML_TOPOLOGY_NODE: PcieLevel.NODE,
    pynvml.NVML_TOPOLOGY_SYSTEM: PcieLevel.SYSTEM,
}

_REMOTE_KINDS = {
    pynvml.NVML_NVLINK_DEVICE_TYPE_GPU: LinkEndpointKind.GPU,
    pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH: LinkEndpointKind.NVSWITCH,
}

# Answers that mean "this fact does not exist here", as opposed to something going wrong.
_EXPECTED_UNKNOWN = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_NO_DATA,
    }
)

_ERROR_NAMES = _enum_names("NVML_ERROR_")


def _error_name(err: pynvml.NVMLError) -> str:
    return _ERROR_NAMES.get(err.value, str(err.value))


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _optional(gpu: int | None, call: Callable[..., T], *args: Any, quiet: bool = False) -> T | None:
    """`call(*args)`, or None when NVML cannot answer; an unexpected answer is logged, not raised.

    `quiet` leaves the expected "does not exist here" answers unlogged (the caller sums them up).
    """
    try:
        return call(*args)
    except pynvml.NVMLError as err:
        what = getattr(call, "__name__", repr(call))
        if err.value not in _EXPECTED_UNKNOWN:
            log.warning(
                "nvml query failed, fact left unknown", query=what, gpu=gpu, nvml_error=_error_name(err)
            )
        elif not quiet:
            log.debug("nvml fact unknown", query=what, gpu=gpu, nvml_error=_error_name(err))
        return None


def _required(gpu: int | None, call: Callable[..., T], *args: Any, context: str = "") -> T:
    try:
        return call(*args)
    except pynvml.NVMLError as err:
        what = getattr(call, "__name__", repr(call))
        where = f"GPU {gpu}" if gpu is not None else "the system"
        raise GpuDiscoveryError(
            f"NVML {what} failed for {where}{context}: {err} ({_error_name(err)})"
        ) from err


@dataclass(frozen=True)
class _Device:
    index: int
    handle: Any


def discover(nvml: NvmlApi, sysfs: PciSysfs | None = None, source: str = "nvml") -> Inventory:
    """Read the whole inventory through `nvml` (pynvml or a FakeNvml) and `sysfs`."""
    try:
        nvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailableError(
            f"NVML could not be initialized ({err}, {_error_name(err)}): "
            "no usable NVIDIA driver on this machine"
        ) from err
    try:
        return _read_inventory(nvml, sysfs or HostSysfs(), source)
    finally:
        try:
            nvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            log.warning("nvmlShutdown failed", nvml_error=_error_name(err))


def _read_inventory(nvml: NvmlApi, sysfs: PciSysfs, source: str) -> Inventory:
    driver_version = _text(_required(None, nvml.nvmlSystemGetDriverVersion))
    cuda = _optional(None, nvml.nvmlSystemGetCudaDriverVersion_v2)
    if cuda is None:
        cuda = _required(None, nvml.nvmlSystemGetCudaDriverVersion)
    count = _required(None, nvml.nvmlDeviceGetCount)
    devices = [_Device(i, _required(i, nvml.nvmlDeviceGetHandleByIndex, i)) for i in range(count)]
    bus_ids = {
        d.index: normalize_pci_bus_id(_text(_required(d.index, nvml.nvmlDeviceGetPciInfo, d.handle).busId))
        for d in devices
    }
    paths = _read_peer_paths(nvml, devices)
    gpus = tuple(_read_gpu(nvml, sysfs, d, bus_ids[d.index], paths.get(d.index, ())) for d in devices)
    inventory = Inventory(
        driver_version=driver_version,
        cuda_driver_version=cuda_version_string(cuda),
        gpus=gpus,
        source=source,
    )
    log.info(
        "gpu inventory discovered",
        source=source,
        gpus=len(gpus),
        driver_version=driver_version,
        cuda_driver_version=inventory.cuda_driver_version,
    )
    return inventory


def _read_gpu(
    nvml: NvmlApi, sysfs: PciSysfs, dev: _Device, bus_id: str, paths: tuple[PeerPath, ...]
) -> GpuInfo:
    i, h = dev.index, dev.handle
    major_cc, minor_cc = _required(i, nvml.nvmlDeviceGetCudaComputeCapability, h)
    memory = int(_required(i, nvml.nvmlDeviceGetMemoryInfo, h).total)
    brand = _optional(i, nvml.nvmlDeviceGetBrand, h)
    arch = _optional(i, nvml.nvmlDeviceGetArchitecture, h)
    numa = _optional(i, nvml.nvmlDeviceGetNumaNodeId, h)
    if numa is None or numa < 0:
        numa = sysfs.numa_node(bus_id)
    attributes = _optional(i, nvml.nvmlDeviceGetAttributes, h)
    addressing = _optional(i, nvml.nvmlDeviceGetAddressingMode, h)
    mig_mode = _optional(i, nvml.nvmlDeviceGetMigMode, h)
    mig_enabled = mig_mode is not None and mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    return GpuInfo(
        index=i,
        minor=int(_required(i, nvml.nvmlDeviceGetMinorNumber, h)),
        uuid=_text(_required(i, nvml.nvmlDeviceGetUUID, h)),
        product_name=_text(_required(i, nvml.nvmlDeviceGetName, h)),
        brand=_BRANDS.get(brand, "Unknown") if brand is not None else "Unknown",
        architecture=_ARCHITECTURES.get(arch, "Unknown") if arch is not None else "Unknown",
        cuda_compute_capability=f"{major_cc}.{minor_cc}",
        memory_bytes=memory,
        pci_bus_id=bus_id,
        pcie_root=sysfs.pcie_root(bus_id),
        numa_node=numa,
        mig_enabled=mig_enabled,
        mig_devices=_read_mig_devices(nvml, dev, memory) if mig_enabled else (),
        # NVML answers profile reads with MIG mode off too (an H200, driver 580), but a GPU
        # not in MIG mode must not be offered as slices: no profiles read, none published.
        mig_profiles=_read_gi_profiles(nvml, dev) if mig_enabled else (),
        nvlinks=_read_nvlinks(nvml, dev),
        fabric_clique=_read_fabric_clique(nvml, dev),
        multiprocessors=int(attributes.multiprocessorCount) if attributes is not None else None,
        peer_paths=paths,
        addressing_mode=_addressing_mode(i, addressing),
    )


def _addressing_mode(gpu: int, mode: int | None) -> str | None:
    if mode is None:
        return None
    name = _ADDRESSING_MODES.get(mode)
    if name is None:
        # go-nvlib fails discovery here; one attribute left out is the smaller loss.
        log.warning("nvml addressing mode not known, fact left unknown", gpu=gpu, mode=mode)
    return name


def _read_nvlinks(nvml: NvmlApi, dev: _Device) -> tuple[NvLink, ...]:
    i, h = dev.index, dev.handle
    links = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        state = _optional(i, nvml.nvmlDeviceGetNvLinkState, h, link, quiet=True)
        if state is None:
            continue
        if state != pynvml.NVML_FEATURE_ENABLED:
            links.append(
                NvLink(link, active=False, remote_kind=LinkEndpointKind.UNKNOWN, remote_pci_bus_id=None)
            )
            continue
        pci = _optional(i, nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
        remote_type = _optional(i, nvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
        remote_bus = normalize_pci_bus_id(_text(pci.busId)) if pci is not None else None
        links.append(
            NvLink(
                link,
                active=True,
                remote_kind=_REMOTE_KINDS.get(remote_type, LinkEndpointKind.UNKNOWN),
                remote_pci_bus_id=remote_bus or None,
            )
        )
    log.debug("nvlink links read", gpu=i, answered=len(links), active=sum(1 for x in links if x.active))
    return tuple(links)


def _read_fabric_clique(nvml: NvmlApi, dev: _Device) -> FabricClique | None:
    i, h = dev.index, dev.handle
    # This binding declares no argtypes: the struct must be passed by reference, and
    # calling with the handle alone raises TypeError (seen on a real H200 host).
    info: Any = pynvml.c_nvmlGpuFabricInfoV_t()
    done = _optional(i, nvml.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info))
    if done is None:
        info = pynvml.c_nvmlGpuFabricInfo_t()
        done = _optional(i, nvml.nvmlDeviceGetGpuFabricInfo, h, ctypes.byref(info))
    if done is None:
        return None
    raw_uuid = bytes(info.clusterUuid)
    if (
        info.state != pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
        or info.status != pynvml.NVML_SUCCESS
        or raw_uuid == bytes(len(raw_uuid))
    ):
        return None
    return FabricClique(cluster_uuid=str(uuid.UUID(bytes=raw_uuid)), clique_id=int(info.cliqueId))


def _read_mig_devices(nvml: NvmlApi, dev: _Device, parent_memory: int) -> tuple[MigDevice, ...]:
    i, h = dev.index, dev.handle
    migs = []
    for slot in range(_optional(i, nvml.nvmlDeviceGetMaxMigDeviceCount, h) or 0):
        mig = _optional(i, nvml.nvmlDeviceGetMigDeviceHandleByIndex, h, slot, quiet=True)
        if mig is None:  # an empty slot
            continue
        ctx = f", MIG slot {slot}"
        gi_id = _required(i, nvml.nvmlDeviceGetGpuInstanceId, mig, context=ctx)
        attrs = _required(i, nvml.nvmlDeviceGetAttributes, mig, context=ctx)
        gi = _required(i, nvml.nvmlDeviceGetGpuInstanceById, h, gi_id, context=ctx)
        gi_info = _required(i, nvml.nvmlGpuInstanceGetInfo, gi, context=ctx)
        memory_mib = int(attrs.memorySizeMB)
        migs.append(
            MigDevice(
                parent_index=i,
                profile=mig_profile_name(
                    int(attrs.gpuInstanceSliceCount),
                    int(attrs.computeInstanceSliceCount),
                    mig_memory_size_gb(parent_memory, memory_mib),
                ),
                gpu_instance_id=int(gi_id),
                compute_instance_id=int(_required(i, nvml.nvmlDeviceGetComputeInstanceId, mig, context=ctx)),
                placement_start=int(gi_info.placement.start),
                placement_size=int(gi_info.placement.size),
                uuid=_text(_required(i, nvml.nvmlDeviceGetUUID, mig, context=ctx)),
                memory_bytes=memory_mib * MIB,
                multiprocessors=int(attrs.multiprocessorCount),
                copy_engines=int(attrs.sharedCopyEngineCount),
                decoders=int(attrs.sharedDecoderCount),
                encoders=int(attrs.sharedEncoderCount),
                jpeg_engines=int(attrs.sharedJpegCount),
                ofa_engines=int(attrs.sharedOfaCount),
                gpu_instance_profile_id=int(gi_info.profileId),
            )
        )
    return tuple(sorted(migs, key=lambda m: (m.placement_start, m.gpu_instance_id, m.compute_instance_id)))


def _read_gi_profiles(nvml: NvmlApi, dev: _Device) -> tuple[GiProfile, ...]:
    """Every GPU-instance profile the GPU offers and where each may start. NVML answers
    NotSupported for the profile enums the product does not have and InvalidArgument for
    enums the driver does not know (17 with driver 580); it answers the others whatever the
    MIG mode (seen on an H200, driver 580: tests/hardware/MIG_H200.md)."""
    i, h = dev.index, dev.handle
    found: dict[int, GiProfile] = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        info = _optional(i, nvml.nvmlDeviceGetGpuInstanceProfileInfo, h, enum, quiet=True)
        if info is None or int(info.id) in found:
            continue
        buffer = (pynvml.c_nvmlGpuInstancePlacement_t * MIG_MEMORY_SLICES)()
        count = ctypes.c_uint(MIG_MEMORY_SLICES)
        asked = (h, info.id, buffer, ctypes.byref(count))
        if _optional(i, nvml.nvmlDeviceGetGpuInstancePossiblePlacements, *asked) is None:
            continue
        slots = buffer[: count.value]
        name = _text(info.name).removeprefix("MIG ")
        found[int(info.id)] = GiProfile(
            name=name,
            id=int(info.id),
            nvml_profile=enum,
            compute_slices=int(info.sliceCount),
            memory_slices=int(slots[0].size) if slots else 0,
            memory_mib=int(info.memorySizeMB),
            multiprocessors=int(info.multiprocessorCount),
            copy_engines=int(info.copyEngineCount),
            decoders=int(info.decoderCount),
            encoders=int(info.encoderCount),
            jpeg_engines=int(info.jpegCount),
            ofa_engines=int(info.ofaCount),
            placements=tuple(int(s.start) for s in slots),
            instance_count=int(info.instanceCount),
        )
    return tuple(sorted(found.values(), key=lambda p: (p.compute_slices, p.memory_slices, p.name)))


def _read_peer_paths(nvml: NvmlApi, devices: list[_Device]) -> dict[int, tuple[PeerPath, ...]]:
    """Ask the pairwise questions once per unordered pair; both GPUs get the answer."""
    paths: dict[int, list[PeerPath]] = {d.index: [] for d in devices}
    for pos, a in enumerate(devices):
        for b in devices[pos + 1 :]:
            level = _optional(a.index, nvml.nvmlDeviceGetTopologyCommonAncestor, a.handle, b.handle)
            p2p = _optional(
                a.index, nvml.nvmlDeviceGetP2PStatus, a.handle, b.handle, pynvml.NVML_P2P_CAPS_INDEX_NVLINK
            )
            pcie = _PCIE_LEVELS.get(level) if level is not None else None
            nvlink_p2p = None if p2p is None else p2p == pynvml.NVML_P2P_STATUS_OK
            paths[a.index].append(PeerPath(peer_index=b.index, pcie_level=pcie, nvlink_p2p=nvlink_p2p))
            paths[b.index].append(PeerPath(peer_index=a.index, pcie_level=pcie, nvlink_p2p=nvlink_p2p))
    return {index: tuple(sorted(p, key=lambda x: x.peer_index)) for index, p in paths.items()}
