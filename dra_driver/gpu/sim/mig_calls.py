"""The MIG calls of FakeNvml (`dra_driver.gpu.sim.fake_nvml`): MIG mode, MIG device handles, and
the GPU and compute instances that dynamic MIG creates and destroys, answered as NVML does.

`MigCalls` is a base class of `FakeNvml`, which supplies the call bookkeeping (`_enter`: the
call log, injected errors, uninitialized and lost GPUs) and the GPU handles (`_gpu`). The
live instances are `dra_driver.gpu.sim.mig.FakeMig`'s; a MIG device configured in the
profile (static MIG) is described by the profile. This module holds no driver logic, and
must not answer a call that is not a MIG call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pynvml

from dra_driver.gpu.mig_profiles import GiProfile
from dra_driver.gpu.sim.mig import (
    ComputeInstanceInfo,
    ComputeInstanceRef,
    FakeMig,
    GpuInstanceRef,
    LiveInstance,
)
from dra_driver.gpu.sim.profile_model import GpuSpec, MigProfileSpec


@dataclass(frozen=True)
class MigHandle:
    gpu: int
    slot: int


@dataclass(frozen=True)
class GpuInstanceHandle:
    gpu: int
    gpu_instance_id: int


def _fail(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _gi_profile_info(p: GiProfile, version: int) -> Any:
    """nvmlGpuInstanceProfileInfo as the V call (v2 struct, with a name) or the v1 call fills it."""
    info: Any
    if version == 1:
        info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
    else:
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.version = pynvml.nvmlGpuInstanceProfileInfo_v2
        info.name = f"MIG {p.name}".encode()
    info.id, info.sliceCount, info.instanceCount = p.id, p.compute_slices, p.instance_count
    info.multiprocessorCount, info.copyEngineCount = p.multiprocessors, p.copy_engines
    info.decoderCount, info.encoderCount = p.decoders, p.encoders
    info.jpegCount, info.ofaCount, info.memorySizeMB = p.jpeg_engines, p.ofa_engines, p.memory_mib
    return info


# A compute instance as large as its GPU instance, by compute slices.
_CI_PROFILES = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
}


class MigCalls:
    """The MIG half of FakeNvml's calls."""

    mig: FakeMig  # the live instances
    _static_profiles: dict[int, MigProfileSpec]  # profile id -> the profile's static MIG device

    def _enter(self, name: str, *args: Any) -> None:
        raise NotImplementedError  # FakeNvml's

    def _gpu(self, handle: Any) -> GpuSpec:
        raise NotImplementedError  # FakeNvml's

    def _mig(self, handle: Any) -> tuple[LiveInstance, GiProfile | MigProfileSpec]:
        if not isinstance(handle, MigHandle):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        live = self.mig.mig_devices(handle.gpu)
        if handle.slot >= len(live):
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return live[handle.slot], self._gi_profile(handle.gpu, live[handle.slot].profile_id)

    def _gi_profile(self, gpu: int, profile_id: int) -> GiProfile | MigProfileSpec:
        static = self._static_profiles.get(profile_id)
        return static if static is not None else self.mig.profile_by_id(gpu, profile_id)

    # -- MIG --------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", handle)
        mode = (
            pynvml.NVML_DEVICE_MIG_ENABLE if self._gpu(handle).mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        )
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        return self._gpu(handle).mig_max_devices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle, index)
        gpu = self._gpu(handle)
        if not gpu.mig_enabled or not 0 <= index < gpu.mig_max_devices:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(self.mig.mig_devices(gpu.index)):
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return MigHandle(gpu.index, index)

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId", handle)
        return self._mig(handle)[0].gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId", handle)
        return int(self._mig(handle)[0].compute_instance_id or 0)

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gpu_instance_id: int) -> Any:
        self._enter("nvmlDeviceGetGpuInstanceById", handle, gpu_instance_id)
        gpu = self._gpu(handle)
        if not any(m.gpu_instance_id == gpu_instance_id for m in self.mig.live(gpu.index)):
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return GpuInstanceHandle(gpu.index, gpu_instance_id)

    def nvmlGpuInstanceGetInfo(self, gpu_instance: Any) -> Any:
        self._enter("nvmlGpuInstanceGetInfo", gpu_instance)
        if not isinstance(gpu_instance, GpuInstanceHandle):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        mig = next(
            (m for m in self.mig.live(gpu_instance.gpu) if m.gpu_instance_id == gpu_instance.gpu_instance_id),
            None,
        )
        if mig is None:
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id = mig.gpu_instance_id
        info.profileId = mig.profile_id
        info.placement.start = mig.placement
        info.placement.size = mig.size
        return info

    # -- dynamic MIG (dra_driver.gpu.sim.mig holds the state) -----------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int, version: int = 2) -> Any:
        self._enter("nvmlDeviceGetGpuInstanceProfileInfo", handle, profile)
        if version not in (1, 2):
            raise _fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # as the bindings answer
        return _gi_profile_info(self.mig.profile_info(self._gpu(handle).index, profile), version)

    def nvmlDeviceGetGpuInstanceProfileInfoById(self, handle: Any, profile_id: int) -> Any:
        self._enter("nvmlDeviceGetGpuInstanceProfileInfoById", handle, profile_id)
        return _gi_profile_info(self.mig.profile_by_id(self._gpu(handle).index, profile_id), 2)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, handle: Any, profile_id: int) -> int:
        self._enter("nvmlDeviceGetGpuInstanceRemainingCapacity", handle, profile_id)
        return self.mig.remaining_capacity(self._gpu(handle).index, profile_id)

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: Any, profile_id: int, placements: Any, count_ref: Any
    ) -> int:
        self._enter("nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id)
        starts = self.mig.possible_placements(self._gpu(handle).index, profile_id)
        size = self.mig.profile_by_id(self._gpu(handle).index, profile_id).memory_slices
        count = count_ref._obj  # the c_uint behind ctypes.byref(), as the C library writes it
        if placements is None:
            count.value = len(starts)
            return int(pynvml.NVML_SUCCESS)
        if count.value < len(starts):
            count.value = len(starts)
            raise _fail(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for slot, start in enumerate(starts):
            placements[slot].start, placements[slot].size = start, size
        count.value = len(starts)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int, placement: Any) -> Any:
        self._enter("nvmlDeviceCreateGpuInstanceWithPlacement", handle, profile_id, placement.start)
        gpu = self._gpu(handle).index
        ref = self.mig.create_gpu_instance(gpu, profile_id, placement.start, placement.size)
        return GpuInstanceHandle(ref.gpu, ref.gpu_instance_id)

    def nvmlGpuInstanceCreateComputeInstance(self, gpu_instance: Any, profile_id: int) -> Any:
        self._enter("nvmlGpuInstanceCreateComputeInstance", gpu_instance, profile_id)
        gi = self._gi(gpu_instance)
        if profile_id != self._full_ci_profile(gi):
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)  # this model offers full-size CIs only
        return self.mig.create_compute_instance(gi)

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpu_instance: Any, profile: int, eng_profile: int, version: int = 2
    ) -> Any:
        self._enter("nvmlGpuInstanceGetComputeInstanceProfileInfo", gpu_instance, profile, eng_profile)
        gi = self._gi(gpu_instance)
        wanted = self._full_ci_profile(gi)
        if profile != wanted or eng_profile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        p = self._gi_profile(gi.gpu, self.mig._find(gi.gpu, gi.gpu_instance_id).profile_id)
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id = wanted
        info.sliceCount = p.compute_slices if isinstance(p, GiProfile) else p.slices
        info.instanceCount = 1
        info.multiprocessorCount = p.multiprocessors
        return info

    def nvmlComputeInstanceGetInfo(self, compute_instance: Any) -> Any:
        self._enter("nvmlComputeInstanceGetInfo", compute_instance)
        if not isinstance(compute_instance, ComputeInstanceRef):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        live = self.mig.mig_devices(compute_instance.gpu)
        slot = next(
            (n for n, m in enumerate(live) if m.gpu_instance_id == compute_instance.gpu_instance_id), None
        )
        if slot is None:
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        gi = GpuInstanceRef(compute_instance.gpu, compute_instance.gpu_instance_id)
        device = MigHandle(compute_instance.gpu, slot)
        ci_id = compute_instance.compute_instance_id
        return ComputeInstanceInfo(device, gi, ci_id, self._full_ci_profile(gi))

    def nvmlGpuInstanceGetComputeInstanceById(self, gpu_instance: Any, ci_id: int) -> Any:
        self._enter("nvmlGpuInstanceGetComputeInstanceById", gpu_instance, ci_id)
        gi = self._gi(gpu_instance)
        if self.mig._find(gi.gpu, gi.gpu_instance_id).compute_instance_id != ci_id:
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        return ComputeInstanceRef(gi.gpu, gi.gpu_instance_id, ci_id)

    def nvmlComputeInstanceDestroy(self, compute_instance: Any) -> None:
        self._enter("nvmlComputeInstanceDestroy", compute_instance)
        if not isinstance(compute_instance, ComputeInstanceRef):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self.mig.destroy_compute_instance(compute_instance)

    def nvmlGpuInstanceDestroy(self, gpu_instance: Any) -> None:
        self._enter("nvmlGpuInstanceDestroy", gpu_instance)
        self.mig.destroy_gpu_instance(self._gi(gpu_instance))

    def _gi(self, handle: Any) -> GpuInstanceRef:
        if not isinstance(handle, GpuInstanceHandle | GpuInstanceRef):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return GpuInstanceRef(handle.gpu, handle.gpu_instance_id)

    def _full_ci_profile(self, gi: GpuInstanceRef) -> int:
        p = self._gi_profile(gi.gpu, self.mig._find(gi.gpu, gi.gpu_instance_id).profile_id)
        slices = p.compute_slices if isinstance(p, GiProfile) else p.slices
        return int(_CI_PROFILES[slices])
