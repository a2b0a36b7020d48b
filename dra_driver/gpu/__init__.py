"""GPU discovery: what this node's GPUs are, read once at start, from NVML or a simulated profile.

Public API:
- `choose_backend(simulate, ...) -> GpuBackend` (dra_driver.gpu.backend): the NVML of this
  process, chosen once; real pynvml when `simulate` is None, else the simulated profile of
  that name (`hgx-h200`, see `profile_names()`) or a profile file path (dra_driver.gpu.sim).
- `read_inventory(backend) -> Inventory`: the inventory through that NVML.
- `discover(simulate=None) -> Inventory`: both at once, for a process that needs NVML only
  for the inventory. Raise `NvmlUnavailableError` (no NVIDIA driver), `ProfileError` (bad
  profile) or `GpuDiscoveryError` (a GPU NVML cannot identify); all are `GpuDiscoveryError`s.
- `dra_driver.gpu.topology.nvlink_topology(inventory) -> NvlinkTopology`: per-GPU NVLink
  peers, island, groups by size and maximal cliques.
- `dra_driver.gpu.model`: the data (`Inventory`, `GpuInfo`, `MigDevice`, ...).
- `dra_driver.gpu.report`: the JSON document and the table of `dra-driver inventory`.
Both paths run the same code: `nvml.discover(pynvml)` on a host, `nvml.discover(FakeNvml(profile),
FakeSysfs(profile))` for a simulation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dra_driver.gpu import nvml
from dra_driver.gpu.backend import GpuBackend, choose_backend
from dra_driver.gpu.errors import GpuDiscoveryError, NvmlUnavailableError, ProfileError
from dra_driver.gpu.model import Inventory

if TYPE_CHECKING:
    from dra_driver.gpu.sim.profile_model import Profile, ProfileSummary

__all__ = [
    "GpuBackend",
    "GpuDiscoveryError",
    "Inventory",
    "NvmlUnavailableError",
    "ProfileError",
    "choose_backend",
    "discover",
    "list_profiles",
    "load_profile",
    "profile_names",
    "read_inventory",
]


def read_inventory(backend: GpuBackend) -> Inventory:
    """The node's inventory, read through the process's NVML."""
    return nvml.discover(backend.nvml, backend.sysfs, source=backend.source)


def discover(simulate: str | None = None, mig_state_file: Path | None = None) -> Inventory:
    """The node's inventory: from NVML, or from the simulated profile named or pointed to by
    `simulate` (with the MIG instances kept in `mig_state_file`, if given: see FakeMig)."""
    return read_inventory(choose_backend(simulate, mig_state_file=mig_state_file))


# The simulation (profiles, YAML, FakeNvml) is imported only when asked for: a GPU node's
# plugin never needs it, and its import would lengthen every plugin start.


def load_profile(name_or_path: str) -> Profile:
    from dra_driver.gpu.sim import profiles

    return profiles.load_profile(name_or_path)


def list_profiles() -> tuple[ProfileSummary, ...]:
    from dra_driver.gpu.sim import profiles

    return profiles.list_profiles()


def profile_names() -> tuple[str, ...]:
    from dra_driver.gpu.sim import profiles

    return profiles.profile_names()
