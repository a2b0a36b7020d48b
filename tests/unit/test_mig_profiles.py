"""GPU-instance profile tables against NVIDIA's published ones; FakeNvml's MIG model against NVML."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pynvml
import pytest

from dra_driver.gpu import load_profile, nvml
from dra_driver.gpu.mig_profiles import A100_40GB, A100_80GB, H100_80GB, H200_141GB, GiProfile, table_for
from dra_driver.gpu.sim.fake_nvml import FakeNvml, FakeSysfs

# nvidia-smi mig -lgip / -lgipp as NVIDIA's MIG user guide prints them:
# name, id, memory GiB, SMs, DEC, ENC, CE, JPEG, OFA, placements (start list), placement size.
Row = tuple[str, int, float, int, int, int, int, int, int, tuple[int, ...], int]
ALL7 = (0, 1, 2, 3, 4, 5, 6)
PUBLISHED: dict[str, list[Row]] = {
    "A100-SXM4-40GB": [
        ("1g.5gb", 19, 4.75, 14, 0, 0, 1, 0, 0, ALL7, 1),
        ("1g.5gb+me", 20, 4.75, 14, 1, 0, 1, 1, 1, ALL7, 1),
        ("1g.10gb", 15, 9.75, 14, 1, 0, 1, 0, 0, (0, 2, 4, 6), 2),
        ("2g.10gb", 14, 9.75, 28, 1, 0, 2, 0, 0, (0, 2, 4), 2),
        ("3g.20gb", 9, 19.62, 42, 2, 0, 3, 0, 0, (0, 4), 4),
        ("4g.20gb", 5, 19.62, 56, 2, 0, 4, 0, 0, (0,), 4),
        ("7g.40gb", 0, 39.50, 98, 5, 0, 7, 1, 1, (0,), 8),
    ],
    "A100-SXM4-80GB": [
        ("1g.10gb", 19, 9.50, 14, 0, 0, 1, 0, 0, ALL7, 1),
        ("1g.10gb+me", 20, 9.50, 14, 1, 0, 1, 1, 1, ALL7, 1),
        ("1g.20gb", 15, 19.50, 14, 1, 0, 1, 0, 0, (0, 2, 4, 6), 2),
        ("2g.20gb", 14, 19.50, 28, 1, 0, 2, 0, 0, (0, 2, 4), 2),
        ("3g.40gb", 9, 39.25, 42, 2, 0, 3, 0, 0, (0, 4), 4),
        ("4g.40gb", 5, 39.25, 56, 2, 0, 4, 0, 0, (0,), 4),
        ("7g.80gb", 0, 78.75, 98, 5, 0, 7, 1, 1, (0,), 8),
    ],
    "H100 80GB HBM3": [
        ("1g.10gb", 19, 9.75, 16, 1, 0, 1, 1, 0, ALL7, 1),
        ("1g.10gb+me", 20, 9.75, 16, 1, 0, 1, 1, 1, ALL7, 1),
        ("1g.20gb", 15, 19.62, 26, 1, 0, 1, 1, 0, (0, 2, 4, 6), 2),
        ("2g.20gb", 14, 19.62, 32, 2, 0, 2, 2, 0, (0, 2, 4), 2),
        ("3g.40gb", 9, 39.50, 60, 3, 0, 3, 3, 0, (0, 4), 4),
        ("4g.40gb", 5, 39.50, 64, 4, 0, 4, 4, 0, (0,), 4),
        ("7g.80gb", 0, 79.25, 132, 7, 0, 8, 7, 1, (0,), 8),
    ],
    "NVIDIA H200": [
        ("1g.18gb", 19, 16.00, 16, 1, 0, 1, 1, 0, ALL7, 1),
        ("1g.18gb+me", 20, 16.00, 16, 1, 0, 1, 1, 1, ALL7, 1),
        ("1g.35gb", 15, 32.50, 26, 1, 0, 1, 1, 0, (0, 2, 4, 6), 2),
        ("2g.35gb", 14, 32.50, 32, 2, 0, 2, 2, 0, (0, 2, 4), 2),
        ("3g.71gb", 9, 69.75, 60, 3, 0, 3, 3, 0, (0, 4), 4),
        ("4g.71gb", 5, 69.75, 64, 4, 0, 4, 4, 0, (0,), 4),
        ("7g.141gb", 0, 140.00, 132, 7, 0, 8, 7, 1, (0,), 8),
    ],
}
TOTALS = {
    "A100-SXM4-40GB": 42505076736,
    "A100-SXM4-80GB": 85899345920,
    "H100 80GB HBM3": 85520809984,
    "NVIDIA H200": 150754820096,
}


def _as_row(p: GiProfile) -> Row:
    gib = round(p.memory_mib / 1024 * 100) / 100
    return (
        p.name,
        p.id,
        gib,
        p.multiprocessors,
        p.decoders,
        p.encoders,
        p.copy_engines,
        p.jpeg_engines,
        p.ofa_engines,
        p.placements,
        p.memory_slices,
    )


@pytest.mark.parametrize("product", sorted(PUBLISHED))
def test_tables_equal_the_published_ones(product: str) -> None:
    rows = [_as_row(p) for p in table_for(product)]
    expected = [(n, i, pytest.approx(g, abs=0.01), *rest) for n, i, g, *rest in PUBLISHED[product]]
    assert rows == expected


@pytest.mark.parametrize("product", sorted(PUBLISHED))
def test_profile_names_follow_from_memory_as_nvidia_smi_names_them(product: str) -> None:
    for p in table_for(product):
        gb = nvml.mig_memory_size_gb(TOTALS[product], p.memory_mib)
        assert p.name.removesuffix("+me") == nvml.mig_profile_name(p.compute_slices, p.compute_slices, gb)


@pytest.mark.parametrize("table", [A100_40GB, A100_80GB, H100_80GB, H200_141GB])
def test_instance_counts_are_the_published_ones(table: tuple[GiProfile, ...]) -> None:
    # NVIDIA's MIG user guide: seven 1g, one 1g+me (the only OFA engine), four 1g of two
    # memory slices, three 2g, two 3g, one 4g, one 7g, on A100, H100 and H200 alike.
    assert [p.instance_count for p in table] == [7, 1, 4, 3, 2, 1, 1]


@pytest.mark.parametrize("table", [A100_40GB, A100_80GB, H100_80GB, H200_141GB])
def test_the_full_instance_holds_each_profile_as_often_as_it_fits(
    table: tuple[GiProfile, ...],
) -> None:
    full = next(p for p in table if p.compute_slices == 7)
    for p in table:
        n = p.instance_count
        assert n * p.multiprocessors <= full.multiprocessors
        assert n * p.memory_mib <= full.memory_mib
        assert n * p.compute_slices <= 7
        assert n * p.copy_engines <= full.copy_engines


# -- FakeNvml's MIG model -----------------------------------------------------------------------


def _fake(tmp_path: Path | None = None) -> FakeNvml:
    fake = FakeNvml(load_profile("hgx-h200-mig"), mig_state_file=tmp_path / "mig.json" if tmp_path else None)
    fake.nvmlInit()
    return fake


def _placement(start: int, size: int) -> pynvml.c_nvmlGpuInstancePlacement_t:
    p = pynvml.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return p


def _code(err: pytest.ExceptionInfo[pynvml.NVMLError]) -> int:
    return int(err.value.value)


def test_discovery_reads_the_h200_table_only_for_gpus_in_mig_mode() -> None:
    fake = _fake()
    inventory = nvml.discover(fake, FakeSysfs(fake.profile))
    assert inventory.gpus[0].mig_profiles == H200_141GB
    assert inventory.gpus[1].mig_profiles == H200_141GB
    assert inventory.gpus[2].mig_profiles == ()  # MIG mode off: not read, though NVML answers


def test_create_a_gpu_and_compute_instance_then_discovery_sees_the_mig_device() -> None:
    fake = _fake()
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 9, _placement(4, 4))
    ci_info = fake.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    ci = fake.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    mig_uuid = fake.nvmlDeviceGetUUID(fake.nvmlComputeInstanceGetInfo(ci).device)
    assert mig_uuid.startswith("MIG-")
    (mig,) = nvml.discover(fake, FakeSysfs(fake.profile)).gpus[0].mig_devices
    assert (mig.profile, mig.placement_start, mig.placement_size, mig.uuid) == ("3g.71gb", 4, 4, mig_uuid)
    with pytest.raises(pynvml.NVMLError) as err:
        fake.nvmlGpuInstanceDestroy(gi)  # a compute instance is still in it
    assert _code(err) == pynvml.NVML_ERROR_IN_USE
    fake.nvmlComputeInstanceDestroy(ci)
    fake.nvmlGpuInstanceDestroy(gi)
    assert nvml.discover(fake, FakeSysfs(fake.profile)).gpus[0].mig_devices == ()


def test_nvml_errors_for_taken_invalid_and_mig_off() -> None:
    fake = _fake()
    static_gpu = fake.nvmlDeviceGetHandleByIndex(1)  # 3g.71gb made by hand at slices 4-7
    with pytest.raises(pynvml.NVMLError) as err:
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(static_gpu, 19, _placement(5, 1))
    assert _code(err) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(pynvml.NVMLError) as err:
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(static_gpu, 9, _placement(2, 4))  # 3g starts at 0 or 4
    assert _code(err) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError) as err:
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(
            fake.nvmlDeviceGetHandleByIndex(2), 19, _placement(0, 1)
        )
    assert _code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(static_gpu, 9, _placement(0, 4))  # the free half


def test_seven_1g_instances_fill_an_h200() -> None:
    fake = _fake()
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    for start in range(7):
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 19, _placement(start, 1))
    with pytest.raises(pynvml.NVMLError) as err:
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 15, _placement(6, 2))
    assert _code(err) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES


def test_possible_placements_as_the_c_library_fills_them() -> None:
    fake = _fake()
    count = ctypes.c_uint(0)
    fake.nvmlDeviceGetGpuInstancePossiblePlacements(
        fake.nvmlDeviceGetHandleByIndex(0), 14, None, ctypes.byref(count)
    )
    assert count.value == 3
    small = (pynvml.c_nvmlGpuInstancePlacement_t * 2)()
    count = ctypes.c_uint(2)
    with pytest.raises(pynvml.NVMLError) as err:
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(
            fake.nvmlDeviceGetHandleByIndex(0), 14, small, ctypes.byref(count)
        )
    assert _code(err) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE


def test_instances_outlive_the_fake_in_its_state_file(tmp_path: Path) -> None:
    fake = _fake(tmp_path)
    gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(
        fake.nvmlDeviceGetHandleByIndex(0), 19, _placement(3, 1)
    )
    again = _fake(tmp_path)  # a restarted plugin on the same GPUs
    assert [(x.gpu, x.gpu_instance_id, x.placement) for x in again.mig.live(0)] == [
        (0, gi.gpu_instance_id, 3)
    ]
    assert [x.uuid for x in again.mig.live(1)] == ["MIG-7c0d9e4a-1f2b-4c3d-8e5f-6a7b8c9d0e12"]


def _remaining(fake: FakeNvml, gpu: object) -> dict[str, int]:
    return {p.name: fake.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu, p.id) for p in H200_141GB}


def test_one_me_instance_per_gpu_as_nvml_answers() -> None:
    fake = _fake()
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    me = fake.nvmlDeviceGetGpuInstanceProfileInfo(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1)
    assert (me.id, me.instanceCount) == (20, 1)  # an H200, driver 580, answers 1 (not 7 starts)
    assert _remaining(fake, gpu)["1g.18gb+me"] == 1
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 20, _placement(2, 1))
    with pytest.raises(pynvml.NVMLError) as err:
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 20, _placement(5, 1))  # a free start
    assert _code(err) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert _remaining(fake, gpu) == {
        "1g.18gb": 6,
        "1g.18gb+me": 0,
        "1g.35gb": 3,  # 2-3 is taken
        "2g.35gb": 2,
        "3g.71gb": 1,
        "4g.71gb": 0,
        "7g.141gb": 0,
    }
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 19, _placement(5, 1))  # a plain 1g still fits


def test_profile_reads_with_mig_mode_off_answer_as_with_it_on() -> None:
    fake = _fake()
    on, off = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(2)
    assert fake.nvmlDeviceGetMigMode(off)[0] == pynvml.NVML_DEVICE_MIG_DISABLE
    for p in H200_141GB:
        for version in (1, 2):
            a, b = (fake.nvmlDeviceGetGpuInstanceProfileInfo(h, p.nvml_profile, version) for h in (on, off))
            assert bytes(a) == bytes(b), p.name
        a, b = (fake.nvmlDeviceGetGpuInstanceProfileInfoById(h, p.id) for h in (on, off))
        assert bytes(a) == bytes(b) and a.instanceCount == p.instance_count, p.name
        for h in (on, off):
            count = ctypes.c_uint(8)
            buffer = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
            fake.nvmlDeviceGetGpuInstancePossiblePlacements(h, p.id, buffer, ctypes.byref(count))
            assert tuple(s.start for s in buffer[: count.value]) == p.placements
            assert {s.size for s in buffer[: count.value]} == {p.memory_slices}
    assert _remaining(fake, off) == _remaining(fake, on) == {p.name: p.instance_count for p in H200_141GB}
    with pytest.raises(pynvml.NVMLError) as err:  # creating still needs MIG mode on
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(off, 0, _placement(0, 8))
    assert _code(err) == pynvml.NVML_ERROR_NOT_SUPPORTED


@pytest.mark.parametrize(
    ("enum", "error"),
    [
        (pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE, pynvml.NVML_ERROR_NOT_SUPPORTED),  # not on an H200
        (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME, pynvml.NVML_ERROR_NOT_SUPPORTED),
        (17, pynvml.NVML_ERROR_INVALID_ARGUMENT),  # 3_SLICE_GFX: unknown to driver 580's NVML
        (-1, pynvml.NVML_ERROR_INVALID_ARGUMENT),
    ],
)
def test_profile_enums_an_h200_lacks(enum: int, error: int) -> None:
    fake = _fake()
    with pytest.raises(pynvml.NVMLError) as err:
        fake.nvmlDeviceGetGpuInstanceProfileInfo(fake.nvmlDeviceGetHandleByIndex(2), enum)
    assert _code(err) == error
