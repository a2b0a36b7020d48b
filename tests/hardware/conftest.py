"""Fixtures for the tests on a real NVIDIA GPU host.

Every test marked `hardware` is SKIPPED (never failed) where there is no NVIDIA GPU:
no NVML library, no device, or no /dev/nvidiactl. Tests that build containers also need
root and a working `unshare`; they skip without them.

Every test records what it ran and what came back through the `record` fixture, into
`$HW_RESULTS_DIR` (default: a temporary directory); at the end of the session all
records are also joined into `ALL.md` there, which is what tests/hardware/RESULTS.md
quotes.

Other knobs: `DRA_DRIVER_ROOT` (default /usr/local/nvidia if present, else /), `CDICHECK`,
`HW_CONTAINER_PYTHON` (the Python with torch used inside containers, default this one),
`HW_MPS_ROOT` and `HW_MPS_DIR_MODE` (MPS root and directory mode, default the driver's).

`HW_SIMULATE=<profile>` (with `DRA_DRIVER_ROOT` pointing at a stand-in driver root) runs
the harness without a GPU on a simulated inventory: a check of the plumbing (prepare,
CDI, containers, MPS daemon handling) before spending device time; the assertions about
what the GPU answers then fail, as they should.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hwutil import Recorder, container_absent_reason, gpu_absent_reason

from tests.harness import container


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = None
        if item.get_closest_marker("hardware"):
            reason = gpu_absent_reason()
        if reason is None and item.get_closest_marker("container"):
            reason = container_absent_reason()
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "container: builds namespaced containers (root, unshare)")


@pytest.fixture(scope="session")
def record() -> Iterator[Recorder]:
    root = Path(os.environ.get("HW_RESULTS_DIR") or tempfile.mkdtemp(prefix="hw-results-"))
    root.mkdir(parents=True, exist_ok=True)
    rec = Recorder(root)
    yield rec
    rec.join()


# --------------------------------------------------------------------------- the host


@pytest.fixture(scope="session")
def driver_root() -> str:
    """Where the driver's user-space files are: $DRA_DRIVER_ROOT, /usr/local/nvidia, or /."""
    explicit = os.environ.get("DRA_DRIVER_ROOT")
    if explicit:
        return explicit
    return "/usr/local/nvidia" if os.path.isdir("/usr/local/nvidia/bin") else "/"


@pytest.fixture(scope="session")
def inventory() -> Any:
    from dra_driver.gpu import discover

    return discover(os.environ.get("HW_SIMULATE") or None)


@pytest.fixture(scope="session")
def driver_files(driver_root: str, inventory: Any) -> Any:
    from dra_driver.driver_root import scan_driver_files

    simulated = bool(os.environ.get("HW_SIMULATE"))
    return scan_driver_files(driver_root, "/dev", simulated, gpu_minors=[g.minor for g in inventory.gpus])


@pytest.fixture(scope="session")
def cdicheck() -> str | None:
    """hack/cluster's cdicheck (the real CDI library), if built or carried: $CDICHECK first."""
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    candidates = [os.environ.get("CDICHECK", ""), shutil.which("cdicheck") or ""]
    candidates += sorted(glob.glob(f"{cache}/gpu-dra-driver/cluster/*/cdicheck"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="session")
def container_options(driver_root: str) -> container.ContainerOptions:
    """The host as the image, minus every driver file it has outside the CDI edits."""
    hide = (driver_root,) if driver_root != "/" else ()
    return container.ContainerOptions(hide=hide, mask_dirs=container.host_driver_file_dirs(hide=hide))
