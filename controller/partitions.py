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
Pure: no I/O; `controller.slices` puts the pieces in slices.
"""

from __future__ import annotations

from typing import Final

from controller.attributes import UUID, NvlinkFacts, binary_quantity, device_attributes
from dra_driver.devices import NodeDevice, gpu_device_name, mig_device_name
from dra_driver.gpu.mig_profiles import COMPUTE_SLICES, MEMORY_SLICES, GiProfile
from dra_driver.gpu.model import GpuInfo, Inventory, MigDevice
from dra_driver.gpu.placements import MIB, Placement, dynamic, placements, static_slices

__all__ = ["counter_set", "counter_set_name", "dynamic", "gpu_devices", "placements"]
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


def _consumes(gpu: GpuInfo, counters: JSON) -> list[JSON]:
    return [{"counterSet": counter_set_name(gpu.index), "counters": counters}]


def _profile_counters(p: GiProfile, slices: range) -> JSON:
    return _counters(slices, p.compute_slices, p.multiprocessors, p.copy_engines, p.decoders, p.encoders,
                     p.jpeg_engines, p.ofa_engines, p.memory_mib)


def _as_mig(p: Placement) -> MigDevice:
    g = p.profile
    return MigDevice(
        parent_index=p.gpu.index, profile=g.name, gpu_instance_id=0, compute_instance_id=0,
        placement_start=p.start, placement_size=g.memory_slices, uuid="", memory_bytes=g.memory_mib * MIB,
        multiprocessors=g.multiprocessors, copy_engines=g.copy_engines, decoders=g.decoders,
        encoders=g.encoders, jpeg_engines=g.jpeg_engines, ofa_engines=g.ofa_engines,
        gpu_instance_profile_id=g.id,
    )


def gpu_devices(
    gpu: GpuInfo, inventory: Inventory, nvlink: NvlinkFacts | None, list_attributes: bool
) -> list[JSON]:
    """Every device of one MIG-mode GPU, each consuming its counters: the whole GPU first,
    then the static instances, then every placement of every profile (small to large)."""
    out: list[JSON] = []
    if not gpu.mig_devices:
        whole = device_attributes(NodeDevice(gpu_device_name(gpu), gpu), inventory, nvlink,
                                  list_attributes=list_attributes)
        everything = counter_set(gpu)["counters"]
        out.append(_entry(gpu_device_name(gpu), whole.attributes, whole.capacity, everything, gpu))
    for mig in gpu.mig_devices:
        d = device_attributes(NodeDevice(mig_device_name(mig), gpu, mig), inventory, None,
                              list_attributes=list_attributes)
        out.append(_entry(mig_device_name(mig), d.attributes, d.capacity, None, gpu))
    for p in placements(gpu):
        placed = NodeDevice(p.name, gpu, _as_mig(p))
        d = device_attributes(placed, inventory, None, list_attributes=list_attributes)
        attributes = {k: v for k, v in d.attributes.items() if k != UUID}  # the UUID exists once created
        out.append(_entry(p.name, attributes, d.capacity, _profile_counters(p.profile, p.slices), gpu))
    return out


def _entry(name: str, attributes: JSON, capacity: JSON, counters: JSON | None, gpu: GpuInfo) -> JSON:
    entry: JSON = {"name": name}
    if attributes:
        entry["attributes"] = attributes
    if capacity:
        entry["capacity"] = capacity
    if counters is not None:
        entry["consumesCounters"] = _consumes(gpu, counters)
    return entry
