"""The simulation (dra_driver.gpu.sim) is imported only with `--simulate`: a GPU host's processes
load every product module and choose the host's NVML without it."""

from __future__ import annotations

import subprocess
import sys

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
