"""Fake NVML: a stand-in for the `pynvml` module that answers from a `Profile`.

`FakeNvml(profile)` has the same function names as the pynvml calls in
`dra_driver.gpu.nvml.NvmlApi`, returns the same shapes (the real pynvml ctypes structs,
ints, strs, lists) and raises real `pynvml.NVMLError` subclasses with real NVML codes
(NotSupported where the profile says so, Uninitialized before `nvmlInit`,
InvalidArgument past the last NVLink link). So `nvml.discover(FakeNvml(p), FakeSysfs(p))`
runs the very parsing code a GPU host runs with `nvml.discover(pynvml)`.

`FakeSysfs(profile)` answers the sysfs questions (PCIe root, NUMA node) the same way.
`calls` records the latest CALLS_KEPT calls, so tests can check that each query is made once.
With a `FakeEventSource` (dra_driver.gpu.sim.events) it also answers the health
monitor's event calls: injected XIDs, ECC errors, lost GPUs and recovery actions come out
of `nvmlEventSetWait_v2` and `nvmlDeviceGetFieldValues` as from the real library.
The MIG calls are `dra_driver.gpu.sim.mig_calls.MigCalls`, a base class of FakeNvml.
This module holds no discovery or health logic of its own.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from dra_driver.gpu.mig_profiles import GiProfile
from dra_driver.gpu.nvml import NVML_FUNCTIONS, normalize_pci_bus_id
from dra_driver.gpu.sim.events import ALL_EVENTS, POLL_EVERY, EventData, FakeEventSource
from dra_driver.gpu.sim.mig import FakeMig
from dra_driver.gpu.sim.mig_calls import MigCalls, MigHandle
from dra_driver.gpu.sim.profile_model import GpuSpec, Profile

# How often the simulated event wait looks for injected events: while a stream is pending, and
# while none is (an injected event then reaches the monitor up to this much later; each turn is
# CPU an idle simulated plugin spends, where real NVML's wait sleeps in the driver).
STORM_POLL_S = 0.005
IDLE_POLL_S = 0.05

CALLS_KEPT = 100_000


@dataclass(frozen=True)
class GpuHandle:
    index: int


@dataclass(frozen=True)
class _LinkEnd:
    gpu: int | None  # a GPU of the node, or None for an NVSwitch
    bus_id: str | None  # NVML spelling; None when NVML does not report it


def _fail(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _pci_info(bus_id: str) -> Any:
    domain, bus, rest = bus_id.split(":")
    info = pynvml.nvmlPciInfo_t()
    info.busId = bus_id.upper().encode()
    info.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{rest}".upper().encode()
    info.domain = int(domain, 16)
    info.bus = int(bus, 16)
    info.device = int(rest.split(".")[0], 16)
    return info


class FakeNvml(MigCalls):
    """The pynvml calls that discovery makes, answered from a profile."""

    def __init__(
        self,
        profile: Profile,
        events: FakeEventSource | None = None,
        supported_events: int = ALL_EVENTS,
        recovery_action_field: bool = True,
        mig_state_file: Path | None = None,
    ) -> None:
        self.profile = profile
        # the latest calls (a simulated node's health monitor asks every GPU a few times a second
        # for as long as it runs): enough for a test to count a discovery's queries
        self.calls: deque[tuple[str, tuple[Any, ...]]] = deque(maxlen=CALLS_KEPT)
        self._initialized = 0
        # one FakeNvml serves the whole process (discovery, MIG, compute modes, the health
        # monitor's thread), as the driver's library does: its init count is counted under a lock
        self._init_lock = threading.Lock()
        self._links = {g.index: self._link_table(g) for g in profile.gpus}
        self.events = events
        self.supported_events = supported_events
        self.recovery_action_field = recovery_action_field
        # Compute mode as NVML keeps it: per GPU, Default at boot; a GPU index in
        # compute_mode_errors refuses to change it with that NVML error (e.g. NO_PERMISSION)
        self.compute_modes = {g.index: int(pynvml.NVML_COMPUTEMODE_DEFAULT) for g in profile.gpus}
        self.compute_mode_errors: dict[int, int] = {}
        self.contexts: dict[int, set[str]] = {g.index: set() for g in profile.gpus}
        # MIG instances as NVML keeps them (dra_driver.gpu.sim.mig); in `mig_state_file`
        # they outlive this object as they outlive the plugin on a GPU
        self.mig = FakeMig(profile.gpus, mig_state_file)
        self._static_profiles = {m.profile.id: m.profile for g in profile.gpus for m in g.mig_devices}

    def _link_table(self, gpu: GpuSpec) -> tuple[_LinkEnd, ...]:
        ends: list[_LinkEnd] = []
        for a, b, count in self.profile.nvlink_pairs:
            if gpu.index in (a, b):
                peer = b if a == gpu.index else a
                ends += [_LinkEnd(peer, self.profile.gpus[peer].pci_bus_id)] * count
        for switch_bus, count in zip(self.profile.nvswitches, gpu.nvswitch_links, strict=True):
            ends += [_LinkEnd(None, switch_bus)] * count
        return tuple(ends)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """A per-GPU query of NvmlApi not spelled out here (a fact that no profile had to model):
        answered from the GPU's `nvml` answers in its profile, else NotSupported, which discovery
        reads as "unknown". So a new fact discovery reads needs no edit here."""
        if name not in NVML_FUNCTIONS or not name.startswith("nvmlDeviceGet"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

        def query(handle: Any, *args: Any) -> Any:
            self._enter(name, handle, *args)
            answers = self._gpu(handle).nvml
            if name not in answers:
                raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
            answer = answers[name]
            if isinstance(answer, dict):
                if not args or args[0] not in answer:
                    raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
                return answer[args[0]]
            return answer

        query.__name__ = name
        return query

    # -- plumbing ---------------------------------------------------------------------

    def _enter(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name != "nvmlInit" and not self._initialized:
            raise _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        if name in self.profile.errors:
            raise _fail(self.profile.errors[name])
        first = args[0] if args else None
        gpu_index = first.index if isinstance(first, GpuHandle) else getattr(first, "gpu", None)
        if gpu_index is not None and name in self.profile.gpus[gpu_index].errors:
            raise _fail(self.profile.gpus[gpu_index].errors[name])
        if gpu_index is not None and self.events is not None and self.events.is_lost(gpu_index):
            raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)

    def _gpu(self, handle: Any) -> GpuSpec:
        if not isinstance(handle, GpuHandle):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.profile.gpus[handle.index]

    def _link(self, handle: Any, link: int) -> _LinkEnd | None:
        gpu = self._gpu(handle)
        if not 0 <= link < gpu.nvlink_max_links:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        ends = self._links[gpu.index]
        return ends[link] if link < len(ends) else None

    def _nvlink_p2p(self, a: GpuSpec, b: GpuSpec) -> bool:
        direct = any({x, y} == {a.index, b.index} for x, y, _ in self.profile.nvlink_pairs)
        on_switch = sum(a.nvswitch_links) > 0 and sum(b.nvswitch_links) > 0
        same_fabric = a.fabric is None or b.fabric is None or a.fabric.cluster_uuid == b.fabric.cluster_uuid
        return direct or (on_switch and same_fabric)

    # -- system -----------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        with self._init_lock:
            self._initialized += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        with self._init_lock:
            self._initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.profile.driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.profile.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.profile.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.profile.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.profile.gpus):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return GpuHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        self._enter("nvmlDeviceGetHandleByUUID", uuid)
        for g in self.profile.gpus:
            if g.uuid == uuid:
                return GpuHandle(g.index)
        raise _fail(pynvml.NVML_ERROR_NOT_FOUND)

    # -- compute mode -----------------------------------------------------------------

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetComputeMode", handle)
        return self.compute_modes[self._gpu(handle).index]

    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        self._enter("nvmlDeviceSetComputeMode", handle, mode)
        index = self._gpu(handle).index
        if index in self.compute_mode_errors:
            raise _fail(self.compute_mode_errors[index])
        if mode not in (
            pynvml.NVML_COMPUTEMODE_DEFAULT,
            pynvml.NVML_COMPUTEMODE_PROHIBITED,
            pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        ):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self.compute_modes[index] = mode

    def open_context(self, index: int, process: str) -> None:
        """What CUDA does when `process` creates a context on GPU `index`, as the driver
        rules it by compute mode: Prohibited refuses every context, ExclusiveProcess every
        context of a second process (CUDA: "all CUDA-capable devices are busy or unavailable")."""
        mode = self.compute_modes[index]
        holders = self.contexts[index] - {process}
        if mode == pynvml.NVML_COMPUTEMODE_PROHIBITED or (
            mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS and holders
        ):
            raise _fail(pynvml.NVML_ERROR_IN_USE)
        self.contexts[index].add(process)

    def close_context(self, index: int, process: str) -> None:
        self.contexts[index].discard(process)

    # -- identity ---------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        if isinstance(handle, MigHandle):
            return str(self._mig(handle)[0].uuid)
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetName", handle)
        return self._gpu(handle).name

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetMinorNumber", handle)
        return self._gpu(handle).minor

    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetBrand", handle)
        return self._gpu(handle).brand

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetArchitecture", handle)
        return self._gpu(handle).architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability", handle)
        return self._gpu(handle).compute_capability

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        total = self._gpu(handle).memory_bytes
        return pynvml.c_nvmlMemory_t(total=total, free=total, used=0)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        self._enter("nvmlDeviceGetPciInfo", handle)
        return _pci_info(self._gpu(handle).pci_bus_id)

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetNumaNodeId", handle)
        numa = self._gpu(handle).numa_node
        if numa is None:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return numa

    def nvmlDeviceGetAddressingMode(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetAddressingMode", handle)
        mode = self._gpu(handle).addressing_mode
        if mode is None:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return mode

    def nvmlDeviceGetAttributes(self, handle: Any) -> Any:
        self._enter("nvmlDeviceGetAttributes", handle)
        attrs = pynvml.c_nvmlDeviceAttributes()
        if isinstance(handle, MigHandle):
            _, p = self._mig(handle)
            slices = p.compute_slices if isinstance(p, GiProfile) else p.slices
            attrs.multiprocessorCount = p.multiprocessors
            attrs.sharedCopyEngineCount = p.copy_engines
            attrs.sharedDecoderCount = p.decoders
            attrs.sharedEncoderCount = p.encoders
            attrs.sharedJpegCount = p.jpeg_engines
            attrs.sharedOfaCount = p.ofa_engines
            attrs.gpuInstanceSliceCount = slices
            attrs.computeInstanceSliceCount = slices
            attrs.memorySizeMB = p.memory_mib
            return attrs
        self._gpu(handle)
        # A real H200 (driver 580) answers this only for MIG device handles.
        raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    # -- NVLink, P2P, PCIe topology -----------------------------------------------------

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkState", handle, link)
        return int(pynvml.NVML_FEATURE_ENABLED if self._link(handle, link) else pynvml.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any:
        self._enter("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        end = self._link(handle, link)
        if end is None:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if end.bus_id is None:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _pci_info(end.bus_id)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        end = self._link(handle, link)
        if end is None:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        kind = (
            pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
            if end.gpu is not None
            else pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        )
        return int(kind)

    def nvmlDeviceGetP2PStatus(self, handle1: Any, handle2: Any, p2p_index: int) -> int:
        self._enter("nvmlDeviceGetP2PStatus", handle1, handle2, p2p_index)
        a, b = self._gpu(handle1), self._gpu(handle2)
        if p2p_index != pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # the profile models only NVLink P2P
        ok = self._nvlink_p2p(a, b)
        return int(pynvml.NVML_P2P_STATUS_OK if ok else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED)

    def nvmlDeviceGetTopologyCommonAncestor(self, handle1: Any, handle2: Any) -> int:
        self._enter("nvmlDeviceGetTopologyCommonAncestor", handle1, handle2)
        a, b = self._gpu(handle1), self._gpu(handle2)
        if a.pcie_switch is not None and a.pcie_switch == b.pcie_switch:
            return int(pynvml.NVML_TOPOLOGY_SINGLE)
        if a.pcie_root is not None and a.pcie_root == b.pcie_root:
            return int(pynvml.NVML_TOPOLOGY_HOSTBRIDGE)
        if a.sysfs_numa_node >= 0 and a.sysfs_numa_node == b.sysfs_numa_node:
            return int(pynvml.NVML_TOPOLOGY_NODE)
        return int(pynvml.NVML_TOPOLOGY_SYSTEM)

    # -- fabric -----------------------------------------------------------------------

    def _fill_fabric(self, handle: Any, info_ref: Any) -> int:
        spec = self._gpu(handle).fabric
        if spec is None:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = info_ref._obj  # the struct behind ctypes.byref(), as the C library writes it
        info.clusterUuid = (ctypes.c_uint8 * len(spec.cluster_uuid))(*spec.cluster_uuid)
        info.status = spec.status
        info.cliqueId = spec.clique_id
        info.state = spec.state
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, info: Any) -> int:
        self._enter("nvmlDeviceGetGpuFabricInfoV", handle, info)
        return self._fill_fabric(handle, info)

    def nvmlDeviceGetGpuFabricInfo(self, handle: Any, info: Any) -> int:
        self._enter("nvmlDeviceGetGpuFabricInfo", handle, info)
        return self._fill_fabric(handle, info)


    # -- health events (dra_driver.health.monitor) ----------------------------------------------

    def _source(self) -> FakeEventSource:
        if self.events is None:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # no event source: as a GPU without events
        return self.events

    def nvmlEventSetCreate(self) -> Any:
        self._enter("nvmlEventSetCreate")
        self._source()
        return _FakeEventSet()

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._enter("nvmlEventSetFree", event_set)
        event_set.registered.clear()

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetSupportedEventTypes", handle)
        self._gpu(handle)
        return self.supported_events

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle, event_types, event_set)
        gpu = self._gpu(handle)
        if event_types & ~self.supported_events:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set.registered[gpu.index] = event_set.registered.get(gpu.index, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        # Not recorded in `calls`: the monitor waits in a loop for as long as it runs.
        if not self._initialized:
            raise _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        source = self._source()
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            source.poll(POLL_EVERY)
            if source.take_lost_news():
                raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            now = time.monotonic()
            due = source.next_event(event_set.registered, now)
            if due is not None:
                gpu, event_type, data, gi, ci = due
                return EventData(GpuHandle(gpu), event_type, data, gi, ci)
            if now >= deadline:
                raise _fail(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(min(STORM_POLL_S if source.pending() else IDLE_POLL_S, deadline - now))

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[int]) -> Any:
        self._enter("nvmlDeviceGetFieldValues", handle, tuple(field_ids))
        gpu = self._gpu(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for value, field_id in zip(values, field_ids, strict=True):
            value.fieldId = field_id
            if field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and self.recovery_action_field:
                value.nvmlReturn = pynvml.NVML_SUCCESS
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = self._source().action(gpu.index) if self.events else 0
            else:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values


@dataclass
class _FakeEventSet:
    registered: dict[int, int] = field(default_factory=dict)  # GPU index -> event type bits


@dataclass(frozen=True)
class FakeSysfs:
    """The sysfs facts of a profile: PCIe root and NUMA node per PCI bus id."""

    profile: Profile

    def _spec(self, bus_id: str) -> GpuSpec | None:
        wanted = normalize_pci_bus_id(bus_id)
        return next((g for g in self.profile.gpus if normalize_pci_bus_id(g.pci_bus_id) == wanted), None)

    def pcie_root(self, bus_id: str) -> str | None:
        spec = self._spec(bus_id)
        return spec.pcie_root if spec else None

    def numa_node(self, bus_id: str) -> int | None:
        spec = self._spec(bus_id)
        if spec is None or spec.sysfs_numa_node < 0:
            return None
        return spec.sysfs_numa_node
