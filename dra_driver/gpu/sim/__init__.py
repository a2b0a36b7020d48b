"""Simulated GPUs: a FakeNvml answering pynvml's calls from a hardware profile (YAML), for CI and
for nodes without GPUs. Imported only with `--simulate` (`dra_driver.gpu.backend` decides);
nothing on a GPU host's path imports it.

- `simulated_nvml(name_or_path, ...)`: the one FakeNvml and FakeSysfs of a process.
- `profiles`: reading and checking profile files (`load_profile`, `profile_names`, `list_profiles`);
  `profile_model`: what a profile holds.
- `fake_nvml`, `mig_calls`, `mig`, `events`: the NVML calls answered, MIG instances kept, health
  events injected.
"""

from __future__ import annotations

from pathlib import Path

from dra_driver.gpu.sim.events import FakeEventSource
from dra_driver.gpu.sim.fake_nvml import FakeNvml, FakeSysfs
from dra_driver.gpu.sim.profiles import load_profile


def simulated_nvml(
    name_or_path: str, *, mig_state_file: Path | None = None, events_file: Path | None = None
) -> tuple[FakeNvml, FakeSysfs]:
    """One FakeNvml over the profile: its MIG instances in `mig_state_file` (if given, so that
    they outlive the process as they outlive a plugin on a GPU), its health events injected
    through `events_file` (if given: a writer of it can taint every GPU)."""
    profile = load_profile(name_or_path)
    events = FakeEventSource(len(profile.gpus), events_file)
    nvml = FakeNvml(profile, events, mig_state_file=mig_state_file)
    return nvml, FakeSysfs(profile)
