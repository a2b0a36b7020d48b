"""The names under which a node's GPUs are published and allocated.

The controller names devices in ResourceSlices with these functions and the plugin
resolves allocation results back to hardware with the same ones, so the two halves
can never disagree. Names are DNS labels and stable across restarts: they depend on
the GPU index and MIG placement only, never on enumeration order of anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dra_driver.gpu.model import GpuInfo, Inventory, MigDevice


@dataclass(frozen=True)
class NodeDevice:
    """One allocatable device of this node: a whole GPU or a MIG instance of one."""

    name: str
    gpu: GpuInfo  # the physical GPU (the parent, for MIG)
    mig: MigDevice | None = None

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid


def gpu_device_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}"


def mig_device_name(mig: MigDevice) -> str:
    profile = re.sub(r"[^a-z0-9]", "", mig.profile.lower())
    return f"gpu-{mig.parent_index}-mig-{profile}-{mig.placement_start}"


def node_devices(inventory: Inventory) -> dict[str, NodeDevice]:
    """Every allocatable device by name: whole GPUs without MIG, and each MIG instance."""
    devices: dict[str, NodeDevice] = {}
    for gpu in inventory.gpus:
        if gpu.mig_enabled:
            for mig in gpu.mig_devices:
                devices[mig_device_name(mig)] = NodeDevice(mig_device_name(mig), gpu, mig)
        else:
            devices[gpu_device_name(gpu)] = NodeDevice(gpu_device_name(gpu), gpu)
    return devices
