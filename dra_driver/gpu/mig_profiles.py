"""GPU-instance profiles and their placements, per MIG-capable product: plain data.

What `nvidia-smi mig -lgip` / `-lgipp` list (NVML's `nvmlDeviceGetGpuInstanceProfileInfo`
and `nvmlDeviceGetGpuInstancePossiblePlacements`), for the products NVIDIA's MIG user
guide tables ("Supported MIG Profiles"): A100-SXM4-40GB, A100-SXM4-80GB, H100-SXM5-80GB,
H200-141GB. Memory sizes are NVML's `memorySizeMB` (MiB); the H200 ones, and every other
H200 field, are what a real H200 with driver 580 reports (tests/unit/test_gpu_nvml.py,
tests/hardware/MIG_H200.md). `GiProfile` is also the type
discovery reads from real NVML into `GpuInfo.mig_profiles`.

FakeNvml answers from these tables; the controller derives counters and placement
devices from whatever discovery read. Nothing here talks to hardware or decides policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import pynvml

MEMORY_SLICES: Final = 8  # every MIG-capable GPU so far (A100, H100, H200, B200)
COMPUTE_SLICES: Final = 7
# How many GPU-instance profile enums the driver's NVML knows: 0..16 with driver 580 (an H200
# answers INVALID_ARGUMENT for 17, NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX, which newer
# nvidia-ml-py bindings define), whatever the installed bindings' PROFILE_COUNT says.
NVML_PROFILE_ENUMS: Final = 17


@dataclass(frozen=True)
class GiProfile:
    """One GPU-instance profile of a GPU: its size, its engines and where it may start."""

    name: str  # "3g.71gb", "1g.18gb+me"
    id: int  # NVML's profile id (nvmlGpuInstanceProfileInfo_t.id), e.g. 9 for 3g
    nvml_profile: int  # NVML_GPU_INSTANCE_PROFILE_* asked for to get this profile
    compute_slices: int  # sliceCount
    memory_slices: int  # placement size, in memory slices
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[int, ...]  # possible placement starts
    # instanceCount: how many of it one GPU holds at most. Not always len(placements): a +me
    # profile may start anywhere a 1g may, but takes the GPU's only OFA engine, so one per GPU
    # (NVIDIA's MIG user guide; an H200 with driver 580 answers 1 for 1g.18gb+me).
    instance_count: int


# NVML's profile enum -> the profile id NVML answers for it (the same on A100, H100, H200).
_P = pynvml
_ENUM_BY_ID: Final = {
    19: _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE,
    20: _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,  # +me
    15: _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2,  # one compute slice, two memory slices
    14: _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE,
    9: _P.NVML_GPU_INSTANCE_PROFILE_3_SLICE,
    5: _P.NVML_GPU_INSTANCE_PROFILE_4_SLICE,
    0: _P.NVML_GPU_INSTANCE_PROFILE_7_SLICE,
}
_ALL: Final = (0, 1, 2, 3, 4, 5, 6)


def _row(
    name: str, pid: int, cs: int, ms: int, mib: int, sms: int, ce: int, dec: int, jpeg: int, ofa: int,
    placements: tuple[int, ...],
) -> GiProfile:
    count = 1 if name.endswith("+me") else len(placements)
    enum = int(_ENUM_BY_ID[pid])
    return GiProfile(name, pid, enum, cs, ms, mib, sms, ce, dec, 0, jpeg, ofa, placements, count)


def _ampere(mem: tuple[int, int, int, int], names: tuple[str, ...]) -> tuple[GiProfile, ...]:
    one, two, four, eight = mem
    n1, n1me, n1x2, n2, n3, n4, n7 = names
    return (
        _row(n1, 19, 1, 1, one, 14, 1, 0, 0, 0, _ALL),
        _row(n1me, 20, 1, 1, one, 14, 1, 1, 1, 1, _ALL),
        _row(n1x2, 15, 1, 2, two, 14, 1, 1, 0, 0, (0, 2, 4, 6)),
        _row(n2, 14, 2, 2, two, 28, 2, 1, 0, 0, (0, 2, 4)),
        _row(n3, 9, 3, 4, four, 42, 3, 2, 0, 0, (0, 4)),
        _row(n4, 5, 4, 4, four, 56, 4, 2, 0, 0, (0,)),
        _row(n7, 0, 7, 8, eight, 98, 7, 5, 1, 1, (0,)),
    )


def _hopper(mem: tuple[int, int, int, int], names: tuple[str, ...]) -> tuple[GiProfile, ...]:
    one, two, four, eight = mem
    n1, n1me, n1x2, n2, n3, n4, n7 = names
    return (
        _row(n1, 19, 1, 1, one, 16, 1, 1, 1, 0, _ALL),
        _row(n1me, 20, 1, 1, one, 16, 1, 1, 1, 1, _ALL),
        _row(n1x2, 15, 1, 2, two, 26, 1, 1, 1, 0, (0, 2, 4, 6)),
        _row(n2, 14, 2, 2, two, 32, 2, 2, 2, 0, (0, 2, 4)),
        _row(n3, 9, 3, 4, four, 60, 3, 3, 3, 0, (0, 4)),
        _row(n4, 5, 4, 4, four, 64, 4, 4, 4, 0, (0,)),
        _row(n7, 0, 7, 8, eight, 132, 8, 7, 7, 1, (0,)),
    )


A100_40GB: Final = _ampere(
    (4864, 9984, 20096, 40448),
    ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
)
A100_80GB: Final = _ampere(
    (9728, 19968, 40192, 80640),
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
)
H100_80GB: Final = _hopper(
    (9984, 20096, 40448, 81152),
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
)
H200_141GB: Final = _hopper(
    (16384, 33280, 71424, 143360),
    ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
)

# Product name as NVML reports it (substring) -> its table; the first match wins.
TABLES: Final[tuple[tuple[str, tuple[GiProfile, ...]], ...]] = (
    ("A100-SXM4-40GB", A100_40GB),
    ("A100-PCIE-40GB", A100_40GB),
    ("A100-SXM4-80GB", A100_80GB),
    ("A100 80GB", A100_80GB),
    ("H100 80GB", H100_80GB),
    ("H100-SXM5-80GB", H100_80GB),
    ("H200", H200_141GB),
)


def table_for(product_name: str) -> tuple[GiProfile, ...]:
    """The profile table of a product, () when it is not MIG-capable (or not known here)."""
    for key, table in TABLES:
        if key in product_name:
            return table
    return ()
