"""Which NVML this process talks to, decided once: the host's (`pynvml`) or, with `--simulate`,
the simulated GPUs' (`dra_driver.gpu.sim`).

`choose_backend` is the only place that makes the choice; everything that calls NVML
(discovery, compute modes, MIG instances, the health monitor) receives the one `GpuBackend` it
returns, so a simulated node has one FakeNvml whose MIG instances, compute modes and injected
events all parts of the process see, as they would see one driver on a GPU host.

The simulation is imported only when asked for: a GPU node's plugin never needs it, and its
import (YAML, profiles) would lengthen every plugin start. Must not call NVML itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from dra_driver.gpu.sysfs import HostSysfs, PciSysfs


@dataclass(frozen=True)
class GpuBackend:
    """The NVML of this process and the sysfs it reads beside it."""

    # the pynvml module, or a FakeNvml answering the same calls (untyped, as pynvml is)
    nvml: Any
    sysfs: PciSysfs
    source: str  # "nvml" or "simulated:<profile>", as Inventory.source says it


def choose_backend(
    simulate: str | None, *, mig_state_file: Path | None = None, events_file: Path | None = None
) -> GpuBackend:
    """The host's NVML when `simulate` is None, else the simulated profile of that name or path
    (MIG instances kept in `mig_state_file`, health events injected through `events_file`).
    Raises `ProfileError` for a profile that cannot be read."""
    if simulate is None:
        return GpuBackend(pynvml, HostSysfs(), "nvml")
    from dra_driver.gpu.sim import simulated_nvml

    nvml, sysfs = simulated_nvml(simulate, mig_state_file=mig_state_file, events_file=events_file)
    return GpuBackend(nvml, sysfs, f"simulated:{nvml.profile.name}")
