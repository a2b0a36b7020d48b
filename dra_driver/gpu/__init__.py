"""GPU discovery: what this node's GPUs are, read once at start, from NVML or a simulated profile.

Public API:
- `discover(simulate=None) -> Inventory`: real NVML when `simulate` is None, else the
  shipped profile of that name (`hgx-h200`, see `profile_names()`) or a profile file path.
  Raises `NvmlUnavailableError` (no NVIDIA driver), `ProfileError` (bad profile) or
  `GpuDiscoveryError` (a GPU NVML cannot identify); all are `GpuDiscoveryError`s.
- `dra_driver.gpu.topology.nvlink_topology(inventory) -> NvlinkTopology`: per-GPU NVLink
  peers, island, groups by size and maximal cliques.
- `dra_driver.gpu.model`: the data (`Inventory`, `GpuInfo`, `MigDevice`, ...).
- `dra_driver.gpu.report`: the JSON document and the table of `dra-driver inventory`.
Both paths run the same code: `nvml.discover(pynvml)` on a host,
`nvml.discover(FakeNvml(profile), FakeSysfs(profile))` for a simulation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pynvml

from dra_driver.gpu import nvml
from dra_driver.gpu.errors import GpuDiscoveryError, NvmlUnavailableError, ProfileError
from dra_driver.gpu.model import Inventory
from dra_driver.gpu.sysfs import HostSysfs

if TYPE_CHECKING:
    from dra_driver.gpu.profile_model import Profile, ProfileSummary

__all__ = [
    "GpuDiscoveryError",
    "Inventory",
    "NvmlUnavailableError",
    "ProfileError",
    "discover",
    "list_profiles",
    "load_profile",
    "profile_names",
]


def discover(simulate: str | None = None, mig_state_file: Path | None = None) -> Inventory:
    """The node's inventory: from NVML, or from the simulated profile named or pointed to by
    `simulate` (with the MIG instances kept in `mig_state_file`, if given: see FakeMig)."""
    if simulate is None:
        return nvml.discover(pynvml, HostSysfs(), source="nvml")
    from dra_driver.gpu.simulated import FakeNvml, FakeSysfs

    profile = load_profile(simulate)
    fake = FakeNvml(profile, mig_state_file=mig_state_file)
    return nvml.discover(fake, FakeSysfs(profile), source=f"simulated:{profile.name}")


# The simulation (profiles, YAML, FakeNvml) is imported only when asked for: a GPU node's
# plugin never needs it, and its import would lengthen every plugin start.


def load_profile(name_or_path: str) -> Profile:
    from dra_driver.gpu import profiles

    return profiles.load_profile(name_or_path)


def list_profiles() -> tuple[ProfileSummary, ...]:
    from dra_driver.gpu import profiles

    return profiles.list_profiles()


def profile_names() -> tuple[str, ...]:
    from dra_driver.gpu import profiles

    return profiles.profile_names()
