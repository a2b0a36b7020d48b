"""Where dynamic MIG instances may go: the placements of a MIG-mode GPU and their device names.

`controller.partitions` publishes one device per `Placement` under `Placement.name`; the
plugin resolves an allocated name back to its placement with `find_placement`, so the two
halves cannot disagree. Names follow NVIDIA's dynamic MIG devices:
`gpu-<index>-mig-<profile>-<profileId>-<start>`. A placement that overlaps an instance
that existed at start (static MIG) is no placement. `find_placement(..., over_instances=True)`
resolves a name whatever instances sit on the GPU: after an unreadable checkpoint, the
instance this plugin made for an allocated placement looks static until it is adopted.
Pure data, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from dra_driver.gpu.mig_profiles import GiProfile
from dra_driver.gpu.model import GpuInfo, Inventory

MIB: Final = 1024 * 1024


@dataclass(frozen=True)
class Placement:
    """One place a GPU instance of `profile` may be created on GPU `gpu`."""

    gpu: GpuInfo
    profile: GiProfile
    start: int

    @property
    def name(self) -> str:
        return placement_device_name(self.gpu.index, self.profile, self.start)

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.profile.memory_slices)


def placement_device_name(gpu_index: int, profile: GiProfile, start: int) -> str:
    label = re.sub(r"[^a-z0-9]+", "-", profile.name.lower()).strip("-")
    return f"gpu-{gpu_index}-mig-{label}-{profile.id}-{start}"


def dynamic(gpu: GpuInfo) -> bool:
    """Whether the GPU is carved by claims: MIG mode on and its profiles known."""
    return gpu.mig_enabled and bool(gpu.mig_profiles)


def static_slices(gpu: GpuInfo) -> frozenset[int]:
    held = (range(m.placement_start, m.placement_start + m.placement_size) for m in gpu.mig_devices)
    return frozenset(s for r in held for s in r)


def placements(gpu: GpuInfo) -> tuple[Placement, ...]:
    """Every placement of every profile that no static instance overlaps."""
    held = static_slices(gpu)
    every = (Placement(gpu, p, s) for p in gpu.mig_profiles for s in p.placements)
    return tuple(p for p in every if not held.intersection(p.slices))


def find_placement(
    inventory: Inventory, device_name: str, *, over_instances: bool = False
) -> Placement | None:
    """The placement a device name stands for, None if it names none (the plugin's lookup).
    `over_instances`: also one that an instance on the GPU now overlaps."""
    for gpu in inventory.gpus:
        if dynamic(gpu):
            every = (Placement(gpu, p, s) for p in gpu.mig_profiles for s in p.placements)
            for p in every if over_instances else placements(gpu):
                if p.name == device_name:
                    return p
    return None

