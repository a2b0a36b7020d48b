"""MIG as NVML keeps it, for FakeNvml: GPU instances at placements, one compute instance each.

`FakeMig` holds the live GPU and compute instances of every simulated GPU and answers
the MIG calls the way NVML does: profile info (by enum and by id), possible placements and
remaining capacity from the product's table (`dra_driver.gpu.mig_profiles`) whatever the
MIG mode (an H200 with driver 580 answers them with MIG mode off too), `INVALID_ARGUMENT`
for a profile enum that driver does not know, `NOT_SUPPORTED` for creating an instance
while MIG mode is off, `INVALID_ARGUMENT` for a placement the profile cannot start at,
`INSUFFICIENT_RESOURCES` for a placement whose memory slices are taken (NVML does not say
`ALREADY_EXISTS`) or a profile the GPU already holds as often as it can (one 1g+me),
`IN_USE` for destroying a GPU instance that still has a compute instance, `NOT_FOUND`
for ids that are gone.

Instances outlive the plugin on a real GPU. With `state_file` set, the live instances
are kept in that JSON file (read at every call, written at every change), so a plugin
killed with -9 and restarted finds what it created, as on hardware. This module holds
no driver logic: FakeNvml delegates to it after its own bookkeeping.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import pynvml

from dra_driver.atomic import write_file_atomic
from dra_driver.gpu.mig_profiles import NVML_PROFILE_ENUMS, GiProfile, table_for
from dra_driver.gpu.sim.profile_model import GpuSpec, MigInstanceSpec


@dataclass(frozen=True)
class LiveInstance:
    """One GPU instance and its compute instance (None until created)."""

    gpu: int
    gpu_instance_id: int
    profile_id: int
    placement: int
    size: int
    compute_instance_id: int | None
    uuid: str | None  # the MIG device's UUID, once it has a compute instance


@dataclass(frozen=True)
class GpuInstanceRef:
    gpu: int
    gpu_instance_id: int


@dataclass(frozen=True)
class ComputeInstanceRef:
    gpu: int
    gpu_instance_id: int
    compute_instance_id: int


@dataclass(frozen=True)
class ComputeInstanceInfo:
    """nvmlComputeInstanceInfo_t's fields (`device` is the MIG device's handle)."""

    device: object
    gpuInstance: GpuInstanceRef
    id: int
    profileId: int


def _fail(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeMig:
    """The MIG state of a simulated node's GPUs."""

    def __init__(self, gpus: tuple[GpuSpec, ...], state_file: Path | None = None) -> None:
        self.gpus = gpus
        self.state_file = state_file
        self.tables = {g.index: table_for(g.name) for g in gpus}
        self._memory: list[LiveInstance] = [self._static(g.index, m) for g in gpus for m in g.mig_devices]
        if state_file is not None and not state_file.exists():
            self._save(self._memory)

    @staticmethod
    def _static(gpu: int, m: MigInstanceSpec) -> LiveInstance:
        p = m.profile
        ci = m.compute_instance_id
        return LiveInstance(gpu, m.gpu_instance_id, p.id, m.placement, p.placement_size, ci, m.uuid)

    # -- state ------------------------------------------------------------------------

    def live(self, gpu: int | None = None) -> list[LiveInstance]:
        if self.state_file is not None:
            rows = json.loads(self.state_file.read_text())
            self._memory = [LiveInstance(**r) for r in rows]
        return [x for x in self._memory if gpu is None or x.gpu == gpu]

    def _save(self, rows: list[LiveInstance]) -> None:
        self._memory = rows
        if self.state_file is not None:
            write_file_atomic(self.state_file, json.dumps([asdict(r) for r in rows]).encode())

    def _find(self, gpu: int, gi: int) -> LiveInstance:
        for x in self.live(gpu):
            if x.gpu_instance_id == gi:
                return x
        raise _fail(pynvml.NVML_ERROR_NOT_FOUND)

    def mig_devices(self, gpu: int) -> list[LiveInstance]:
        """The MIG devices (instances with a compute instance), as NVML enumerates them."""
        return [x for x in self.live(gpu) if x.compute_instance_id is not None]

    # -- profiles ---------------------------------------------------------------------

    # Profile reads do not depend on the MIG mode (as on an H200 with driver 580); only
    # creating instances needs MIG mode on.

    def _require_mig(self, gpu: int) -> None:
        if not self.gpus[gpu].mig_enabled:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def profile_by_id(self, gpu: int, profile_id: int) -> GiProfile:
        for p in self.tables[gpu]:
            if p.id == profile_id:
                return p
        raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def profile_info(self, gpu: int, nvml_profile: int) -> GiProfile:
        if not 0 <= nvml_profile < NVML_PROFILE_ENUMS:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for p in self.tables[gpu]:
            if p.nvml_profile == nvml_profile:
                return p
        raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def possible_placements(self, gpu: int, profile_id: int) -> tuple[int, ...]:
        return self.profile_by_id(gpu, profile_id).placements

    def remaining_capacity(self, gpu: int, profile_id: int) -> int:
        """How many more instances of the profile could be created now: its placements whose
        memory slices are all free (one profile's placements never overlap), no more than its
        instance count less those already made. Not bounded by MaxMigDeviceCount, which is 0
        with MIG mode off while NVML still answers the full counts (an H200, driver 580)."""
        profile = self.profile_by_id(gpu, profile_id)
        mine = self.live(gpu)
        taken = {s for x in mine for s in range(x.placement, x.placement + x.size)}
        free = sum(1 for s in profile.placements if not taken & set(range(s, s + profile.memory_slices)))
        same = sum(1 for x in mine if x.profile_id == profile_id)
        return max(0, min(free, profile.instance_count - same))

    # -- create / destroy ---------------------------------------------------------------

    def create_gpu_instance(self, gpu: int, profile_id: int, start: int, size: int) -> GpuInstanceRef:
        self._require_mig(gpu)
        profile = self.profile_by_id(gpu, profile_id)
        if start not in profile.placements or size != profile.memory_slices:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        rows = self.live()
        mine = [x for x in rows if x.gpu == gpu]
        wanted = set(range(start, start + size))
        taken = {s for x in mine for s in range(x.placement, x.placement + x.size)}
        same = sum(1 for x in mine if x.profile_id == profile_id)
        if wanted & taken or len(mine) >= self.gpus[gpu].mig_max_devices or same >= profile.instance_count:
            raise _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        used = {x.gpu_instance_id for x in mine}
        gi = next(n for n in range(1, 64) if n not in used)
        self._save([*rows, LiveInstance(gpu, gi, profile_id, start, size, None, None)])
        return GpuInstanceRef(gpu, gi)

    def create_compute_instance(self, ref: GpuInstanceRef) -> ComputeInstanceRef:
        rows = self.live()
        gi = self._find(ref.gpu, ref.gpu_instance_id)
        if gi.compute_instance_id is not None:  # one full-size compute instance per GI
            raise _fail(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        parent = self.gpus[ref.gpu].uuid
        mig_uuid = f"MIG-{uuid.uuid5(uuid.NAMESPACE_OID, f'{parent}/{gi.gpu_instance_id}/{gi.placement}')}"
        done = LiveInstance(gi.gpu, gi.gpu_instance_id, gi.profile_id, gi.placement, gi.size, 0, mig_uuid)
        self._save([done if x == gi else x for x in rows])
        return ComputeInstanceRef(ref.gpu, ref.gpu_instance_id, 0)

    def destroy_compute_instance(self, ref: ComputeInstanceRef) -> None:
        rows = self.live()
        gi = self._find(ref.gpu, ref.gpu_instance_id)
        if gi.compute_instance_id != ref.compute_instance_id:
            raise _fail(pynvml.NVML_ERROR_NOT_FOUND)
        gone = LiveInstance(gi.gpu, gi.gpu_instance_id, gi.profile_id, gi.placement, gi.size, None, None)
        self._save([gone if x == gi else x for x in rows])

    def destroy_gpu_instance(self, ref: GpuInstanceRef) -> None:
        rows = self.live()
        gi = self._find(ref.gpu, ref.gpu_instance_id)
        if gi.compute_instance_id is not None:
            raise _fail(pynvml.NVML_ERROR_IN_USE)
        self._save([x for x in rows if x != gi])
