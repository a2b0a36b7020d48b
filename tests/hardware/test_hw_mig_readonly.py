"""Issue 29, "H200, read only": what NVML says about MIG on this GPU, beside FakeNvml's answers.

Every call here only reads: MIG mode (current, pending), GPU-instance profile info for each
NVML profile enum (`nvmlDeviceGetGpuInstanceProfileInfoV` and the v1 call), profile info by
id, possible placements (`nvmlDeviceGetGpuInstancePossiblePlacements_v2`) and remaining
capacity per profile id, and nvidia-smi's MIG listings. It must never set MIG mode, create
or destroy an instance, or change any other setting: the host is shared and its MIG mode
must stay as it is.

The same reads go through FakeNvml for the same product with the same MIG mode (the code
path the simulated GPUs take), and the test fails where the two answer differently (a value
or an NVML error), so that FakeNvml's H200 table (dra_driver/gpu/mig_profiles.py) and its
errors are held to what the hardware says, as far as the hardware's MIG mode lets NVML answer.
On the H200 with MIG mode off (2026-12-04) it failed on three differences, all FakeNvml's,
since fixed in FakeNvml: tests/hardware/MIG_H200.md lists them with what the GPU answered.
tests/unit/test_mig_h200_readonly.py holds FakeNvml to those recorded answers and rehearses
this test with FakeNvml in pynvml's place, MIG mode off and on.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from importlib import metadata
from typing import Any

import pynvml
import pytest
from hwutil import Recorder, run, smi

from dra_driver.gpu.mig_profiles import MEMORY_SLICES, table_for

pytestmark = pytest.mark.hardware

_ERROR_NAMES = {
    getattr(pynvml, n): n.removeprefix("NVML_ERROR_") for n in dir(pynvml) if n.startswith("NVML_ERROR_")
}
_ENUM_NAMES = {
    getattr(pynvml, n): n.removeprefix("NVML_GPU_INSTANCE_PROFILE_")
    for n in dir(pynvml)
    if n.startswith("NVML_GPU_INSTANCE_PROFILE_") and n != "NVML_GPU_INSTANCE_PROFILE_COUNT"
}
# Fields of nvmlGpuInstanceProfileInfo that FakeNvml answers too (not isP2pSupported, version).
_INFO_FIELDS = (
    "id",
    "sliceCount",
    "instanceCount",
    "multiprocessorCount",
    "copyEngineCount",
    "decoderCount",
    "encoderCount",
    "jpegCount",
    "ofaCount",
    "memorySizeMB",
)


def _call(fn: Any, *args: Any) -> tuple[Any, str | None]:
    """(value, None) or (None, NVML's error name): a read that NVML refuses is a finding.
    A call this nvidia-ml-py lacks (or takes other arguments) is recorded as such too."""
    try:
        return fn(*args), None
    except pynvml.NVMLError as err:
        return None, _ERROR_NAMES.get(err.value, str(err.value))
    except (AttributeError, TypeError) as err:
        return None, f"nvidia-ml-py: {err}"


def _absent(name: str) -> Any:
    def call(*args: Any) -> Any:
        raise AttributeError(f"no {name} in this nvidia-ml-py")

    return call


def _info(info: Any) -> dict[str, Any]:
    out = {f: int(getattr(info, f)) for f in _INFO_FIELDS}
    name = getattr(info, "name", b"")
    out["name"] = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    return out


def _placements(nvml: Any, handle: Any, profile_id: int) -> dict[str, Any]:
    """Possible placements as discovery asks for them (a buffer of 8), then the count alone."""
    buffer = (pynvml.c_nvmlGpuInstancePlacement_t * MEMORY_SLICES)()
    count = ctypes.c_uint(MEMORY_SLICES)
    _, error = _call(
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle, profile_id, buffer, ctypes.byref(count)
    )
    if error is not None:
        return {"error": error}
    return {"placements": [[int(s.start), int(s.size)] for s in buffer[: count.value]]}


def mig_report(nvml: Any, handle: Any, profile_ids: tuple[int, ...]) -> dict[str, Any]:
    """What `nvml` (pynvml or a FakeNvml) answers to every MIG read, as comparable data."""
    mode, mode_error = _call(nvml.nvmlDeviceGetMigMode, handle)
    by_enum: dict[str, Any] = {}
    v1: dict[str, Any] = {}
    ids = set(profile_ids)
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        info, error = _call(nvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, enum)
        key = f"{enum} {_ENUM_NAMES.get(enum, '?')}"
        by_enum[key] = {"error": error} if info is None else _info(info)
        if info is not None:
            ids.add(int(info.id))
        info, error = _call(nvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, enum, 1)
        v1[key] = {"error": error} if info is None else _info(info)
    by_id: dict[str, Any] = {}
    remaining: dict[str, Any] = {}
    by_id_fn, remaining_fn = (
        "nvmlDeviceGetGpuInstanceProfileInfoById",
        "nvmlDeviceGetGpuInstanceRemainingCapacity",
    )
    for pid in sorted(ids):
        info, error = _call(getattr(nvml, by_id_fn, _absent(by_id_fn)), handle, pid)
        by_id[str(pid)] = {"error": error} if info is None else _info(info)
        count, error = _call(getattr(nvml, remaining_fn, _absent(remaining_fn)), handle, pid)
        remaining[str(pid)] = {"error": error} if count is None else count
    return {
        "mig_mode": {"error": mode_error} if mode is None else {"current": mode[0], "pending": mode[1]},
        "profile_info_v": by_enum,
        "placements_by_id": {str(pid): _placements(nvml, handle, pid) for pid in sorted(ids)},
        "profile_info_v1": v1,
        "profile_info_by_id": by_id,
        "remaining_capacity_by_id": remaining,
    }


def _real_only(handle: Any) -> dict[str, Any]:
    """A read FakeNvml answers from the node profile, not as NVML does with MIG mode off
    (the driver reads it only for GPUs in MIG mode): recorded, not compared."""
    max_devices, error = _call(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
    return {"max_mig_device_count": {"error": error} if max_devices is None else max_devices}


def _fake_for(name: str, mig_enabled: bool) -> Any:
    """FakeNvml with one GPU of this product in this MIG mode (the h200-single profile's host)."""
    from dra_driver.gpu import load_profile
    from dra_driver.gpu.sim.fake_nvml import FakeNvml

    profile = load_profile("h200-single")
    gpu = dataclasses.replace(profile.gpus[0], name=name, mig_enabled=mig_enabled, mig_devices=())
    return FakeNvml(dataclasses.replace(profile, gpus=(gpu,)))


def _differences(real: Any, fake: Any, path: str = "") -> list[str]:
    if isinstance(real, dict) and isinstance(fake, dict):
        out = []
        for key in sorted(set(real) | set(fake)):
            out += _differences(real.get(key, "<absent>"), fake.get(key, "<absent>"), f"{path}/{key}")
        return out
    return [] if real == fake else [f"{path}: NVML {real!r}, FakeNvml {fake!r}"]


def test_mig_reads_match_fakenvml(record: Recorder, driver_root: str) -> None:
    if os.environ.get("HW_SIMULATE"):
        pytest.skip("compares real NVML with FakeNvml: nothing to compare in a simulated run")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        raw_name = pynvml.nvmlDeviceGetName(handle)
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        table = table_for(name)
        if not table:
            pytest.skip(f"{name} has no MIG profile table here")
        table_ids = tuple(sorted(p.id for p in table))
        before, _ = _call(pynvml.nvmlDeviceGetMigMode, handle)
        real = mig_report(pynvml, handle, table_ids)
        extra = _real_only(handle)
        after, _ = _call(pynvml.nvmlDeviceGetMigMode, handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()

    mig_on = before is not None and before[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    try:
        bindings = f"nvidia-ml-py {metadata.version('nvidia-ml-py')}"
    except metadata.PackageNotFoundError:
        bindings = f"pynvml from {pynvml.__file__}"
    fake_nvml = _fake_for(name, mig_on)
    fake_nvml.nvmlInit()
    fake = mig_report(fake_nvml, fake_nvml.nvmlDeviceGetHandleByIndex(0), table_ids)
    header = (
        f"GPU 0: {name}, driver {driver}, {bindings}, "
        f"MIG mode current/pending {real['mig_mode']} (1 = enabled)"
    )
    record.json(
        "mig-nvml-reads",
        "pynvml reads (tests/hardware/test_hw_mig_readonly.py)",
        {
            "gpu": header,
            "compared": real,
            "not_compared": extra,
        },
    )
    record.json("mig-fakenvml-reads", f"the same reads through FakeNvml ({name}, MIG on: {mig_on})", fake)

    query = [smi(driver_root), "--query-gpu=name,mig.mode.current,mig.mode.pending", "--format=csv,noheader"]
    out = run(query)
    record("mig-nvidia-smi-mode", query, out.stdout + out.stderr)
    for args in (["mig", "-lgip"], ["mig", "-lgipp"]):
        listing = run([smi(driver_root), *args])
        record(
            f"mig-nvidia-smi-{args[1].lstrip('-')}",
            [smi(driver_root), *args],
            f"(exit {listing.returncode})\n{listing.stdout}{listing.stderr}",
        )

    diffs = _differences(real, fake)
    record(
        "mig-differences", "compare (NVML, FakeNvml)", "\n".join(diffs) or "none: every read answered alike"
    )
    assert before is not None, f"NVML could not read the MIG mode: {real['mig_mode']}"
    assert after == before, f"MIG mode changed during a read-only test: {before} -> {after}"
    assert out.returncode == 0, out.stderr
    expected_smi = "Enabled" if mig_on else "Disabled"
    assert out.stdout.count(expected_smi) == 2, (out.stdout, before)
    assert not diffs, "FakeNvml answers MIG reads unlike this GPU:\n" + "\n".join(diffs)
