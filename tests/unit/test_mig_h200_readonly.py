"""FakeNvml's MIG reads held to what a real H200 answered (issue 29), and a rehearsal of
tests/hardware/test_hw_mig_readonly.py with FakeNvml in pynvml's place.

The recorded answers are tests/hardware/results/mig-h200-ALL.md (driver 580.159.04, MIG
mode off, 2026-12-04); the reads are the hardware test's own (`mig_report`), so the two
sides are asked exactly alike. The rehearsal runs the hardware test's real-NVML path, MIG
mode off and on, on a machine without a GPU: what it proves is the plumbing and that
FakeNvml answers every read it makes, not anything about a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pynvml
import pytest

from dra_driver.gpu import load_profile
from dra_driver.gpu.mig_profiles import H200_141GB
from dra_driver.gpu.sim.fake_nvml import FakeNvml

HARDWARE = Path(__file__).resolve().parents[1] / "hardware"
RECORDED = HARDWARE / "results" / "mig-h200-ALL.md"


def _hardware_test() -> ModuleType:
    sys.path.insert(0, str(HARDWARE))  # the hardware tests import their helpers as `hwutil`
    try:
        spec = importlib.util.spec_from_file_location("hw_mig_readonly", HARDWARE / "test_hw_mig_readonly.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(HARDWARE))


def _recorded_nvml_reads() -> dict[str, Any]:
    """The JSON of `01-mig-nvml-reads.txt` in the recorded results (after its `$ ...` line)."""
    text = RECORDED.read_text()
    block = text.split("## 01-mig-nvml-reads.txt", 1)[1].split("```", 2)[1]
    reads: dict[str, Any] = json.loads(block.strip().split("\n", 1)[1])
    return reads


def _fake_h200(mig_on: bool) -> FakeNvml:
    return _hardware_test()._fake_for("NVIDIA H200", mig_on)  # type: ignore[no-any-return]


def test_fakenvml_answers_the_mig_reads_as_the_h200_did_with_mig_mode_off() -> None:
    recorded = _recorded_nvml_reads()
    if len(recorded["compared"]["profile_info_v"]) != pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
        pytest.skip("these bindings know another number of profile enums than those of the H200 run")
    real = {**recorded["compared"], **recorded["not_compared"]}
    real.pop("max_mig_device_count")  # FakeNvml answers the node profile's, not NVML's 0 with MIG off
    fake = _fake_h200(mig_on=False)
    fake.nvmlInit()
    ids = tuple(sorted(p.id for p in H200_141GB))
    report = _hardware_test().mig_report(fake, fake.nvmlDeviceGetHandleByIndex(0), ids)
    assert report == real


def test_mig_mode_changes_only_the_mig_mode_read() -> None:
    hw = _hardware_test()
    ids = tuple(sorted(p.id for p in H200_141GB))
    reports = []
    for mig_on in (False, True):
        fake = _fake_h200(mig_on)
        fake.nvmlInit()
        reports.append(hw.mig_report(fake, fake.nvmlDeviceGetHandleByIndex(0), ids))
    off, on = reports
    assert off.pop("mig_mode") == {"current": 0, "pending": 0}
    assert on.pop("mig_mode") == {"current": 1, "pending": 1}
    assert off == on


def _standin_smi(root: Path, mig_on: bool) -> None:
    """An nvidia-smi that answers the test's three invocations as the H200's did."""
    mode = "Enabled" if mig_on else "Disabled"
    smi = root / "bin" / "nvidia-smi"
    smi.parent.mkdir(parents=True)
    answer = f"echo 'NVIDIA H200, {mode}, {mode}'"
    smi.write_text(f'#!/bin/sh\ncase "$1" in mig) echo "mig $2";; *) {answer};; esac\n')
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("mig_on", [False, True], ids=["mig-off", "mig-on"])
def test_rehearse_the_hardware_test_on_fakenvml(
    mig_on: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hw = _hardware_test()
    monkeypatch.delenv("HW_SIMULATE", raising=False)
    gpu = FakeNvml(load_profile("h200-single")).profile.gpus[0]
    real = hw._fake_for(gpu.name, mig_on)  # the "GPU": a FakeNvml answering as pynvml's module does
    for name in dir(real):
        if name.startswith("nvml"):
            monkeypatch.setattr(pynvml, name, getattr(real, name), raising=False)
    _standin_smi(tmp_path / "root", mig_on)
    results = tmp_path / "results"
    results.mkdir()
    record = sys.modules["hwutil"].Recorder(results)
    hw.test_mig_reads_match_fakenvml(record, str(tmp_path / "root"))
    differences = next(results.glob("*-mig-differences.txt")).read_text()
    assert "none: every read answered alike" in differences
    reads = json.loads(next(results.glob("*-mig-nvml-reads.txt")).read_text().split("\n", 1)[1])
    assert reads["compared"]["mig_mode"]["current"] == int(mig_on)
    assert "nvidia-ml-py:" not in json.dumps(reads)  # FakeNvml answers every read the test makes
