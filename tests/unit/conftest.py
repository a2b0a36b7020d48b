"""Fixtures shared by the unit tests: the fake `nvidia-cuda-mps-control` and an MpsControl
over it, in a root the driver can use. Constants shared by the unit tests come from the
driver itself where it defines them (`from dra_driver import DEFAULT_DRIVER_NAME as DRIVER`);
tests/unit/test_names.py pins the default driver name. Nothing here talks to a cluster.
After each test structlog is back at its defaults (see `structlog_defaults_after_each_test`)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from dra_driver.sharing.mps.daemon import MpsControl
from tests.harness.fake_mps import install_fake_mps_control, set_mode


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    return install_fake_mps_control(tmp_path / "driver")


@pytest.fixture
def short_root() -> Iterator[Path]:
    """A root as the driver needs one: short (UNIX socket paths) and searchable by everyone
    (pytest's tmp_path is neither: long, and under a 0700 directory)."""
    root = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def mps(short_root: Path, fake_bin: Path) -> Iterator[MpsControl]:
    control = MpsControl(
        short_root / "mps", fake_bin.parent.parent, private_shm=False, start_timeout=5, stop_timeout=2
    )
    yield control
    set_mode(fake_bin)
    for uid in control.claim_uids():
        control.stop(uid)


@pytest.fixture(autouse=True)
def structlog_defaults_after_each_test() -> Iterator[None]:
    """A test that runs a command configures structlog as `dra-driver` does, with
    cache_logger_on_first_use: a module logger first used after that keeps that test's level and
    processors for the rest of the session, and a later `capture_logs` sees nothing from it
    (test_explain then test_feature_edges made test_health_monitor's log assertion fail).
    Back at the defaults, nothing is cached."""
    yield
    structlog.reset_defaults()
