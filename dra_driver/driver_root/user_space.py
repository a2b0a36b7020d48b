"""The NVIDIA driver's user-space files under a driver root: the libraries and tools a GPU
container gets (nvidia-container-toolkit's `compute` and `utility` sets), the driver version
their names carry, and the firmware directory.

Only ELF files of this machine's architecture count; the real (versioned) file of each library
is kept with the names a program loads it by.

It only reads the driver root, and must not run a tool or load a library.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import structlog

from dra_driver.driver_root.paths import join_in_root, listdir, resolve_in_root

log = structlog.get_logger(__name__)

# nvidia-container-toolkit's `compute` and `utility` library sets (what a CUDA/NVML
# container gets), by the unversioned name every file of the library starts with.
COMPUTE_LIBRARIES: Final = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-cfg.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-opencl.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
    "libnvidia-fatbinaryloader.so",  # drivers < 450
    "libnvidia-compiler.so",  # drivers < 525
)
UTILITY_BINARIES: Final = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)

_MULTIARCH = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
_ELF_MACHINE = {"x86_64": 62, "aarch64": 183}


def multiarch_triplet(machine: str | None = None) -> str:
    """Debian multiarch directory name for this (or the given) machine."""
    m = machine or platform.machine()
    return _MULTIARCH.get(m, f"{m}-linux-gnu")


def library_dirs(machine: str | None = None) -> tuple[str, ...]:
    """Directories (relative to a driver root) searched for libraries, first match wins."""
    t = multiarch_triplet(machine)
    return (
        "lib64",
        f"lib/{t}",
        "usr/lib64",
        f"usr/lib/{t}",
        f"usr/lib/{t}/nvidia/current",  # Debian's packaged driver
        "lib",
        "usr/lib",
    )


BINARY_DIRS: Final = ("bin", "usr/bin", "usr/local/bin", "sbin", "usr/sbin")
FIRMWARE_DIRS: Final = ("lib/firmware/nvidia", "usr/lib/firmware/nvidia", "firmware/nvidia")


@dataclass(frozen=True)
class DriverLibrary:
    """One driver library: its real file on the host and the names a program loads it by."""

    host_path: str  # the versioned real file, e.g. .../libcuda.so.580.159.04
    names: tuple[str, ...]  # real name plus the SONAME/dev links that point at it, sorted


@dataclass(frozen=True)
class DriverBinary:
    """One driver tool, e.g. nvidia-smi."""

    host_path: str
    name: str


def find_tool(driver_root: str | os.PathLike[str], name: str) -> str | None:
    """The executable `name` in the driver root's binary dirs, as this process sees it."""
    root = os.fspath(driver_root)
    for d in BINARY_DIRS:
        real = resolve_in_root(root, f"{d}/{name}")
        if real is not None:
            path = os.path.join(root, real.lstrip("/"))
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    return None


def is_elf_for(path: str, machine: str | None = None) -> bool:
    """True if `path` is a 64-bit little-endian ELF file for this (or the given) machine."""
    want = _ELF_MACHINE.get(machine or platform.machine())
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    if len(head) < 20 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return False
    return want is None or int.from_bytes(head[18:20], "little") == want


def _pick_group(names_by_real: Mapping[str, list[str]]) -> tuple[str, list[str]]:
    # The active version is the one the short links (libcuda.so.1, libcuda.so) point at;
    # a stale versioned file left by an upgrade has only its own name.
    return min(names_by_real.items(), key=lambda kv: (-len(kv[1]), min(len(n) for n in kv[1]), kv[0]))


def scan_libraries(
    driver_root: str,
    host_driver_root: str,
    wanted: Iterable[str] = COMPUTE_LIBRARIES,
    machine: str | None = None,
) -> tuple[DriverLibrary, ...]:
    """The wanted libraries found under driver_root, each from the first directory holding it."""
    dirs: list[str] = []
    for d in library_dirs(machine):
        real = resolve_in_root(driver_root, d)
        if real is not None and real not in dirs and os.path.isdir(join_in_root(driver_root, real)):
            dirs.append(real)
    found: list[DriverLibrary] = []
    for lib in wanted:
        for d in dirs:
            names_by_real: dict[str, list[str]] = {}
            for name in listdir(join_in_root(driver_root, d)):
                if name != lib and not name.startswith(lib + "."):
                    continue
                real = resolve_in_root(driver_root, f"{d}/{name}")
                if real is None or not is_elf_for(join_in_root(driver_root, real), machine):
                    continue
                names_by_real.setdefault(real, []).append(name)
            if not names_by_real:
                continue
            real, names = _pick_group(names_by_real)
            found.append(
                DriverLibrary(
                    host_path=join_in_root(host_driver_root, real),
                    names=tuple(sorted({*names, os.path.basename(real)})),
                )
            )
            break
    return tuple(found)


def scan_binaries(
    driver_root: str,
    host_driver_root: str,
    wanted: Iterable[str] = UTILITY_BINARIES,
    machine: str | None = None,
) -> tuple[DriverBinary, ...]:
    """The wanted driver tools found under driver_root (ELF only: wrapper scripts that
    point back into a host path would not work inside a container)."""
    found: list[DriverBinary] = []
    for name in wanted:
        for d in BINARY_DIRS:
            real = resolve_in_root(driver_root, f"{d}/{name}")
            if real is None:
                continue
            if not is_elf_for(join_in_root(driver_root, real), machine):
                log.debug("driver tool is not an ELF binary, skipped", path=join_in_root(driver_root, real))
                continue
            found.append(DriverBinary(host_path=join_in_root(host_driver_root, real), name=name))
            break
    return tuple(found)


_LIBCUDA_VERSION = re.compile(r"libcuda\.so\.(\d+\.\d+(?:\.\d+)?)")


def driver_version_from_libraries(libraries: Iterable[DriverLibrary]) -> str | None:
    """The driver version in the real libcuda file name, e.g. "580.159.04"."""
    for lib in libraries:
        m = _LIBCUDA_VERSION.fullmatch(os.path.basename(lib.host_path))
        if m:
            return m.group(1)
    return None


def find_firmware_dir(driver_root: str, host_driver_root: str, version: str | None) -> str | None:
    """The GSP firmware directory `<...>/firmware/nvidia/<version>`, if there is one."""
    for d in FIRMWARE_DIRS:
        real = resolve_in_root(driver_root, d)
        if real is None:
            continue
        versions = [
            v
            for v in listdir(join_in_root(driver_root, real))
            if os.path.isdir(join_in_root(driver_root, f"{real}/{v}"))
        ]
        if version is not None:
            versions = [v for v in versions if v == version]
        if versions:
            return join_in_root(host_driver_root, f"{real}/{versions[-1]}")
    return None

