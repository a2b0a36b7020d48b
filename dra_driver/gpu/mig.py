"""MIG instances through NVML for dynamic MIG: create one at a placement, find, destroy.

A dynamic MIG claim names a placement (`controller.partitions`): GPU-instance profile id
and start slice on a parent GPU. `MigInstances.create` makes the GPU instance at exactly
that placement, then its one full-size compute instance, and returns the MIG device's
UUID and ids; `destroy` removes the compute instance, then the GPU instance; `at` finds
what a GPU instance id holds (for adopting after a crash), `find_at` the instance at
exactly a placement with its compute instance and MIG UUID (for adopting one whose ids
were lost with an unreadable checkpoint), `occupants` which GPU instances
hold any of a placement's slices (a taken placement is refused before anything is
recorded), and `destroy_at` removes the instance at exactly a placement (an intent whose
create may have happened before a crash). A placement that is taken (by
hand, by another tool, by a static instance) is refused by NVML with
INSUFFICIENT_RESOURCES; that is said as such, with nothing created. If the compute
instance cannot be made, the GPU instance just made is destroyed again before the error
goes up. Each call is one `nvmlInit`/`nvmlShutdown` pair, so it can run in the prepare
path. `api` is the pynvml module on a GPU node, a FakeNvml (which models MIG as NVML
does) in simulations and tests. It must not decide which placement, nor record anything:
the caller writes its checkpoint before calling `create` (two-phase).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import pynvml

from dra_driver.gpu.mig_profiles import GiProfile

_T = TypeVar("_T")

# A compute instance as large as its GPU instance, by compute slices.
FULL_CI_PROFILE: Final = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
}


# GPU instance ids NVML hands out are small (one per instance, at most 7 per GPU live at
# once); scanning this range finds every one without nvmlDeviceGetGpuInstances' buffers.
GPU_INSTANCE_IDS: Final = range(64)
COMPUTE_INSTANCE_IDS: Final = range(8)


@dataclass(frozen=True)
class GpuInstanceAt:
    """A live GPU instance on a parent GPU, as NVML describes it."""

    gpu_instance_id: int
    profile_id: int
    start: int
    size: int


class MigError(Exception):
    """NVML refused a MIG step; the message says which step, on what, and why."""


class PlacementTaken(MigError):
    """Something else already holds some of the placement's memory slices."""


@dataclass(frozen=True)
class Created:
    """A MIG device made for a claim: enough to find it again and to destroy it."""

    parent_uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str
    profile_id: int
    start: int


class MigApi(Protocol):
    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any: ...
    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int, at: Any) -> Any: ...
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpu_instance: Any, profile: int, eng_profile: int, version: int = 2
    ) -> Any: ...
    def nvmlGpuInstanceCreateComputeInstance(self, gpu_instance: Any, profile_id: int) -> Any: ...
    def nvmlComputeInstanceGetInfo(self, compute_instance: Any) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gpu_instance_id: int) -> Any: ...
    def nvmlGpuInstanceGetInfo(self, gpu_instance: Any) -> Any: ...
    def nvmlGpuInstanceGetComputeInstanceById(self, gpu_instance: Any, ci_id: int) -> Any: ...
    def nvmlComputeInstanceDestroy(self, compute_instance: Any) -> None: ...
    def nvmlGpuInstanceDestroy(self, gpu_instance: Any) -> None: ...


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class MigInstances:
    """Dynamic MIG instances of this node's GPUs (`api`: pynvml or a FakeNvml)."""

    def __init__(self, api: MigApi) -> None:
        self.api = api

    def create(self, parent_uuid: str, profile: GiProfile, start: int) -> Created:
        profile_id = profile.id
        where = f"GPU {parent_uuid}, {profile.name} at memory slice {start}"
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, profile.memory_slices
        self.api.nvmlInit()
        try:
            gpu = self._handle(parent_uuid)
            try:
                gi = self.api.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, profile_id, placement)
            except pynvml.NVMLError as e:
                if e.value == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES:
                    raise PlacementTaken(
                        f"{where}: the placement is taken (an instance made by hand or by another tool "
                        f"holds some of its memory slices; `nvidia-smi mig -lgi` shows it): {e}"
                    ) from e
                if e.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                    raise MigError(f"{where}: the GPU is not in MIG mode (the operator sets it): {e}") from e
                raise MigError(f"{where}: creating the GPU instance failed: {e}") from e
            try:
                gi_id = int(self.api.nvmlGpuInstanceGetInfo(gi).id)
                shared = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                full = FULL_CI_PROFILE[profile.compute_slices]
                ci_profile = self.api.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, full, shared)
                ci = self.api.nvmlGpuInstanceCreateComputeInstance(gi, int(ci_profile.id))
                info = self.api.nvmlComputeInstanceGetInfo(ci)
                mig_uuid = _text(self.api.nvmlDeviceGetUUID(info.device))
            except (pynvml.NVMLError, KeyError) as e:
                # if this fails too, recovery finds it: not recorded as done, so it is destroyed
                with contextlib.suppress(pynvml.NVMLError):
                    self.api.nvmlGpuInstanceDestroy(gi)
                raise MigError(f"{where}: creating the compute instance failed: {e}") from e
            return Created(parent_uuid, gi_id, int(info.id), mig_uuid, profile_id, start)
        finally:
            self.api.nvmlShutdown()

    def at(self, parent_uuid: str, gpu_instance_id: int) -> tuple[int, int] | None:
        """(profile id, start) of the GPU instance with that id, None if there is none."""
        self.api.nvmlInit()
        try:
            where = f"GPU {parent_uuid}: reading GPU instance {gpu_instance_id}"
            gi = self._gpu_instance(parent_uuid, gpu_instance_id, where)
            if gi is None:
                return None
            info = self.api.nvmlGpuInstanceGetInfo(gi)
            return int(info.profileId), int(info.placement.start)
        finally:
            self.api.nvmlShutdown()

    def find_at(self, parent_uuid: str, profile_id: int, start: int) -> Created | None:
        """The instance of `profile_id` at exactly `start`, with its (first) compute instance
        and MIG UUID; None if there is no such GPU instance or it has no compute instance."""

        def created(found: GpuInstanceAt, gi: Any) -> Created | None:
            for ci in self._compute_instances(gi):
                info = self.api.nvmlComputeInstanceGetInfo(ci)
                mig_uuid = _text(self.api.nvmlDeviceGetUUID(info.device))
                return Created(parent_uuid, found.gpu_instance_id, int(info.id), mig_uuid, profile_id, start)
            return None

        return self._at(parent_uuid, profile_id, start, "reading its compute instance failed", created)

    def destroy(self, parent_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        """Compute instance, then GPU instance; what is already gone is fine (idempotent).
        NVML's IN_USE ("In use by another client") goes up: the kubelet retries Unprepare."""
        where = f"GPU {parent_uuid}, GPU instance {gpu_instance_id}"
        self.api.nvmlInit()
        try:
            gi = self._gpu_instance(parent_uuid, gpu_instance_id, where)
            if gi is None:
                return
            try:
                ci = self.api.nvmlGpuInstanceGetComputeInstanceById(gi, compute_instance_id)
                self.api.nvmlComputeInstanceDestroy(ci)
            except pynvml.NVMLError as e:
                if e.value != pynvml.NVML_ERROR_NOT_FOUND:
                    raise MigError(f"{where}: destroying compute instance {compute_instance_id}: {e}") from e
            try:
                self.api.nvmlGpuInstanceDestroy(gi)
            except pynvml.NVMLError as e:
                if e.value != pynvml.NVML_ERROR_NOT_FOUND:
                    raise MigError(f"{where}: destroying the GPU instance failed: {e}") from e
        finally:
            self.api.nvmlShutdown()

    def occupants(self, parent_uuid: str, start: int, size: int) -> tuple[GpuInstanceAt, ...]:
        """The GPU instances that hold any of memory slices start..start+size-1."""
        wanted = range(start, start + size)
        self.api.nvmlInit()
        try:
            return tuple(
                gi for gi in self._instances(self._handle(parent_uuid))
                if set(wanted) & set(range(gi.start, gi.start + gi.size))
            )
        finally:
            self.api.nvmlShutdown()

    def destroy_at(self, parent_uuid: str, profile_id: int, start: int) -> GpuInstanceAt | None:
        """Destroy the instance of `profile_id` at exactly `start` (its compute instances
        first), if there is one; returns what was destroyed. For an intent whose create may
        or may not have happened: only an instance of that profile at that start is touched."""

        def destroyed(found: GpuInstanceAt, gi: Any) -> GpuInstanceAt:
            for ci in list(self._compute_instances(gi)):
                self.api.nvmlComputeInstanceDestroy(ci)
            self.api.nvmlGpuInstanceDestroy(gi)
            return found

        return self._at(parent_uuid, profile_id, start, "destroying it failed", destroyed)

    def _at(self, parent_uuid: str, profile_id: int, start: int, failed: str,
            act: Callable[[GpuInstanceAt, Any], _T | None]) -> _T | None:
        """`act` on the GPU instance of `profile_id` at exactly `start` and its NVML handle; None
        where there is none. An NVML error of `act` is a MigError saying what `failed`."""
        self.api.nvmlInit()
        try:
            gpu = self._handle(parent_uuid)
            found = self._instance_at(gpu, profile_id, start)
            if found is None:
                return None
            try:
                return act(found, self.api.nvmlDeviceGetGpuInstanceById(gpu, found.gpu_instance_id))
            except pynvml.NVMLError as e:
                where = f"GPU {parent_uuid}, GPU instance {found.gpu_instance_id}"
                raise MigError(f"{where}: {failed}: {e}") from e
        finally:
            self.api.nvmlShutdown()

    def _gpu_instance(self, parent_uuid: str, gpu_instance_id: int, where: str) -> Any | None:
        """The GPU instance's NVML handle; None where NVML has none (already gone)."""
        try:
            return self.api.nvmlDeviceGetGpuInstanceById(self._handle(parent_uuid), gpu_instance_id)
        except pynvml.NVMLError as e:
            if e.value == pynvml.NVML_ERROR_NOT_FOUND:
                return None
            raise MigError(f"{where}: {e}") from e

    def _instance_at(self, gpu: Any, profile_id: int, start: int) -> GpuInstanceAt | None:
        at = (profile_id, start)
        return next((gi for gi in self._instances(gpu) if (gi.profile_id, gi.start) == at), None)

    def _compute_instances(self, gi: Any) -> Iterator[Any]:
        """The GPU instance's compute instances, by id; NVML errors other than NOT_FOUND go up."""
        for ci_id in COMPUTE_INSTANCE_IDS:
            try:
                yield self.api.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
            except pynvml.NVMLError as e:
                if e.value != pynvml.NVML_ERROR_NOT_FOUND:
                    raise

    def _instances(self, gpu: Any) -> list[GpuInstanceAt]:
        found = []
        for gi_id in GPU_INSTANCE_IDS:
            try:
                info = self.api.nvmlGpuInstanceGetInfo(self.api.nvmlDeviceGetGpuInstanceById(gpu, gi_id))
            except pynvml.NVMLError as e:
                if e.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise MigError(f"reading GPU instance {gi_id}: {e}") from e
            found.append(
                GpuInstanceAt(gi_id, int(info.profileId), int(info.placement.start), int(info.placement.size))
            )
        return found

    def _handle(self, parent_uuid: str) -> Any:
        try:
            return self.api.nvmlDeviceGetHandleByUUID(parent_uuid)
        except pynvml.NVMLError as e:
            raise MigError(f"GPU {parent_uuid} not found by NVML: {e}") from e
