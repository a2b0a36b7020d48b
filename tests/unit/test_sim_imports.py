"""The simulation (dra_driver.gpu.sim) is imported only with `--simulate`: a GPU host's processes
load every product module and choose the host's NVML without it; with it, one simulated NVML
serves the whole process."""

from __future__ import annotations

import subprocess
import sys

import pynvml

# Every subcommand, the node daemon and the slice controller, then the choice made without
# --simulate; the loaded simulation modules are printed, one a line.
_PROBE = """
import importlib, pkgutil, sys
import controller, dra_driver.commands
for pkg in (controller, dra_driver.commands):
    for m in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{m.name}")
import dra_driver.cli, dra_driver.node.daemon, dra_driver.node.publishing
from dra_driver.gpu import choose_backend
backend = choose_backend(SIMULATE)
print("\\n".join(sorted(n for n in sys.modules if n.startswith("dra_driver.gpu.sim"))))
"""


def _loaded(simulate: str | None) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE.replace("SIMULATE", repr(simulate))],
                         capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.split()


def test_the_real_path_does_not_import_the_simulation() -> None:
    assert _loaded(None) == []


def test_simulate_imports_it() -> None:
    assert "dra_driver.gpu.sim.fake_nvml" in _loaded("hgx-h200")


def test_one_simulated_nvml_serves_discovery_mig_and_compute_modes() -> None:
    """What one part of a simulated node does through its NVML, the others see (as on a host,
    where the driver's library is one): a MIG instance made through it is in the inventory
    read through it, and a compute mode set through it is read back."""
    from dra_driver.gpu import choose_backend, read_inventory
    from dra_driver.gpu.compute_mode import ComputeModes
    from dra_driver.gpu.mig import MigInstances

    backend = choose_backend("hgx-h200-mig")
    gpu0 = read_inventory(backend).gpus[0]
    one_g = next(p for p in gpu0.mig_profiles if p.name == "1g.18gb")
    made = MigInstances(backend.nvml).create(gpu0.uuid, one_g, 5)
    after = read_inventory(backend).gpus[0]
    assert made.uuid in {m.uuid for m in after.mig_devices}
    modes = ComputeModes(backend.nvml)
    modes.set(gpu0.uuid, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert ComputeModes(backend.nvml).get(gpu0.uuid) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
