"""Dynamic MIG in a node's ResourceSlices: partitionable devices with shared counters (KEP-4815).

For every GPU in MIG mode whose profiles discovery read (`GpuInfo.mig_profiles`):
- one counter set, `gpu-<index>-counter-set`, holding `memory-slice-<i>` = 1 for each of
  the 8 memory slices, `compute-slices` = 7 and the capacities of the full instance
  (multiprocessors, copy engines, decoders, encoders, JPEG and OFA engines, memory);
- one device per possible placement of every GPU-instance profile,
  `gpu-<index>-mig-<profile>-<profileId>-<start>` (NVIDIA's dynamic MIG names with our
  prefix), consuming its memory slices and its capacities;
- the whole GPU, `gpu-<index>`, consuming everything, so a whole-GPU claim and a MIG claim
  never share the GPU;
- the instances that existed at start (static MIG), under their static names, as today.
Counters are taken only by allocated devices, so a static instance cannot hold its slices
through them: its slices and capacities are left out of the counter set instead, the
placements that overlap it are not published, nor the whole GPU (it is not whole).
All of one GPU's devices go in one slice (at most 64 with counters: an H200 has 26 + its
static instances); the counter sets go in counter-only slices, as the API wants since 1.35.
Pure: no I/O. This module holds the counters (the sets and what each device consumes);
`controller.device_entries` authors the devices, `controller.slices` puts them in slices.
"""

from __future__ import annotations

from typing import Final

from controller.quantities import binary_quantity
from dra_driver.gpu.mig_profiles import COMPUTE_SLICES, MEMORY_SLICES, GiProfile
from dra_driver.gpu.model import GpuInfo, MigDevice
from dra_driver.gpu.placements import MIB, Placement, dynamic, placements, static_slices

__all__ = ["consumes", "counter_set", "counter_set_name", "dynamic", "placement_counters", "placements"]
from dra_driver.jsontypes import JSON

MAX_COUNTERS_PER_SET: Final = 32
MAX_COUNTER_CONSUMPTIONS_PER_DEVICE: Final = 2
MAX_DEVICES_WITH_COUNTERS: Final = 64


def counter_set_name(gpu_index: int) -> str:
    return f"gpu-{gpu_index}-counter-set"


def _full(gpu: GpuInfo) -> GiProfile:
    return max(gpu.mig_profiles, key=lambda p: (p.compute_slices, p.memory_slices))


def _counters(slices: range, compute: int, sms: int, ce: int, dec: int, enc: int, jpeg: int, ofa: int,
              memory_mib: int) -> JSON:
    counters: JSON = {f"memory-slice-{i}": {"value": "1"} for i in slices}
    for name, value in (("compute-slices", compute), ("multiprocessors", sms), ("copy-engines", ce),
                        ("decoders", dec), ("encoders", enc), ("jpeg-engines", jpeg), ("ofa-engines", ofa)):
        if value:
            counters[name] = {"value": str(value)}
    counters["memory"] = {"value": binary_quantity(memory_mib * MIB)}
    return counters


def counter_set(gpu: GpuInfo) -> JSON:
    """The GPU's counters less what its static instances hold."""
    f, s = _full(gpu), gpu.mig_devices
    free = [i for i in range(MEMORY_SLICES) if i not in static_slices(gpu)]
    counters = _counters(
        range(0),
        COMPUTE_SLICES - sum(_static_compute(gpu, m) for m in s),
        f.multiprocessors - sum(m.multiprocessors for m in s),
        f.copy_engines - sum(m.copy_engines for m in s),
        f.decoders - sum(m.decoders for m in s),
        f.encoders - sum(m.encoders for m in s),
        f.jpeg_engines - sum(m.jpeg_engines for m in s),
        f.ofa_engines - sum(m.ofa_engines for m in s),
        max(0, f.memory_mib - sum(m.memory_bytes // MIB for m in s)),
    )
    return {"name": counter_set_name(gpu.index),
            "counters": {**{f"memory-slice-{i}": {"value": "1"} for i in free}, **counters}}


def _static_compute(gpu: GpuInfo, mig: MigDevice) -> int:
    profile = next((p for p in gpu.mig_profiles if p.id == mig.gpu_instance_profile_id), None)
    return profile.compute_slices if profile is not None else 0


def consumes(gpu: GpuInfo, counters: JSON) -> list[JSON]:
    """A device's `consumesCounters`: `counters` of the GPU's counter set."""
    return [{"counterSet": counter_set_name(gpu.index), "counters": counters}]


def placement_counters(p: Placement) -> JSON:
    """What the device of one placement takes: its memory slices and its profile's capacities."""
    g = p.profile
    return _counters(p.slices, g.compute_slices, g.multiprocessors, g.copy_engines, g.decoders, g.encoders,
                     g.jpeg_engines, g.ofa_engines, g.memory_mib)
