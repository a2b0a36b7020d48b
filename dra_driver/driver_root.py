"""Find the NVIDIA driver's device nodes and user-space files on this node, once, at start.

A GPU container needs more than its `/dev/nvidiaN`: the control nodes, the MIG
capability nodes of a MIG device, and the driver's user-space libraries and tools,
whose version must match the loaded kernel module. Those live under a *driver root*
that differs between hosts (`/` on most, `/usr/local/nvidia`, `/run/nvidia/driver`,
`/home/kubernetes/bin/nvidia` on others). This module scans a driver root and a dev
root and returns a frozen `DriverFiles`; the CDI builders are pure functions of it.

Two views of every path are kept apart: where this process *sees* a file (the scan
roots, which differ from the host's when the plugin runs in a container with the host's
driver root mounted somewhere else) and where the container runtime on the host finds it
(`host_*` roots, written into CDI specs). Absolute symlinks are resolved inside the scan
root, as the host would resolve them.

It must not run in the prepare path: call `discover_driver_files` (or
`simulated_driver_files` for simulated GPUs) once and keep the result.
"""

from __future__ import annotations

import os
import platform
import re
import stat as statmod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Final

import structlog

log = structlog.get_logger(__name__)

StatFn = Callable[[str], os.stat_result]

# Fixed by the NVIDIA kernel module (registered char major for nvidia and nvidiactl).
NVIDIA_MAJOR: Final = 195
NVIDIACTL_MINOR: Final = 255
# nvidia-uvm and nvidia-caps get dynamic majors; these are the values observed on the
# reference H200 host (reference/h200-host.md), used for simulated GPUs only when
# /proc/devices does not name the driver.
SIMULATED_UVM_MAJOR: Final = 238
SIMULATED_CAPS_MAJOR: Final = 241

CONTROL_NODE_NAMES: Final = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")

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
_GPU_NODE = re.compile(r"nvidia(\d+)")
_CAP_NODE = re.compile(r"nvidia-cap(\d+)")
_MIG_MINOR_LINE = re.compile(r"gpu(\d+)/gi(\d+)/(?:ci(\d+)/)?access\s+(\d+)")

# Layout of /proc/driver/nvidia-caps/mig-minors: minors 1 and 2 are mig/config and
# mig/monitor; then, for each of 32 GPU minors, 15 GPU instances of (gi access + 8 ci
# access). Checked on the H200 host: the first minor after the table (fabric-imex-mgmt)
# is 3 + 32 * 135 = 4323.
_MIG_FIRST_MINOR = 3
_MIG_CI_PER_GI = 8
_MIG_GI_PER_GPU = 15


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
class DeviceNodeInfo:
    """A char device node: where the container sees it, where the host has it, its numbers."""

    path: str  # inside the container, e.g. /dev/nvidia0
    host_path: str  # on the host, as the container runtime finds it
    major: int
    minor: int
    file_mode: int  # permission bits only, e.g. 0o666

    type: str = "c"


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


@dataclass(frozen=True)
class DriverFiles:
    """Everything a GPU container needs from the host's driver, found once at start."""

    driver_root: str  # host view
    control_nodes: tuple[DeviceNodeInfo, ...]
    gpu_nodes: tuple[DeviceNodeInfo, ...]  # /dev/nvidia<minor>, sorted by minor
    caps_nodes: tuple[DeviceNodeInfo, ...]  # /dev/nvidia-caps/* present at scan time
    libraries: tuple[DriverLibrary, ...]
    binaries: tuple[DriverBinary, ...]
    firmware_dir: str | None  # host view; informational, never mounted
    driver_version: str | None  # from the libcuda file name
    caps_major: int
    host_dev_root: str = "/dev"
    # (gpu minor, gi, ci or None for the gi access cap) -> nvidia-caps minor
    mig_minors: tuple[tuple[tuple[int, int, int | None], int], ...] = ()
    simulated: bool = False

    def gpu_node(self, minor: int) -> DeviceNodeInfo:
        """The node of GPU `minor`; synthesized (major 195 is fixed) if it was not created yet."""
        for n in self.gpu_nodes:
            if n.minor == minor:
                return n
        return _synthetic_node(f"nvidia{minor}", self.host_dev_root, NVIDIA_MAJOR, minor)

    @cached_property
    def _mig_minor_table(self) -> dict[tuple[int, int, int | None], int]:
        return dict(self.mig_minors)

    def mig_cap_nodes(
        self, gpu_minor: int, gpu_instance_id: int, compute_instance_id: int
    ) -> tuple[DeviceNodeInfo, DeviceNodeInfo]:
        """The (GPU instance access, compute instance access) capability nodes of a MIG device."""
        table = self._mig_minor_table
        gi_key = (gpu_minor, gpu_instance_id, None)
        ci_key = (gpu_minor, gpu_instance_id, compute_instance_id)
        gi = table.get(gi_key, mig_cap_minor(gpu_minor, gpu_instance_id, None))
        ci = table.get(ci_key, mig_cap_minor(gpu_minor, gpu_instance_id, compute_instance_id))
        return self._cap_node(gi), self._cap_node(ci)

    def _cap_node(self, minor: int) -> DeviceNodeInfo:
        for n in self.caps_nodes:
            if n.major == self.caps_major and n.minor == minor:
                return n
        return _synthetic_node(
            f"nvidia-caps/nvidia-cap{minor}", self.host_dev_root, self.caps_major, minor, 0o444
        )


def mig_cap_minor(gpu_minor: int, gpu_instance_id: int, compute_instance_id: int | None) -> int:
    """nvidia-caps minor of a MIG access capability, per the driver's fixed table."""
    base = _MIG_FIRST_MINOR + gpu_minor * _MIG_GI_PER_GPU * (1 + _MIG_CI_PER_GI)
    gi = base + gpu_instance_id * (1 + _MIG_CI_PER_GI)
    return gi if compute_instance_id is None else gi + 1 + compute_instance_id


def parse_mig_minors(text: str) -> tuple[tuple[tuple[int, int, int | None], int], ...]:
    """Parse /proc/driver/nvidia-caps/mig-minors into ((gpu, gi, ci|None), minor) pairs."""
    out: list[tuple[tuple[int, int, int | None], int]] = []
    for line in text.splitlines():
        m = _MIG_MINOR_LINE.fullmatch(line.strip())
        if m:
            ci = int(m.group(3)) if m.group(3) is not None else None
            out.append(((int(m.group(1)), int(m.group(2)), ci), int(m.group(4))))
    return tuple(out)


def parse_proc_devices(text: str) -> dict[str, int]:
    """Character-device majors by driver name from /proc/devices."""
    majors: dict[str, int] = {}
    section = ""
    for line in text.splitlines():
        if line.endswith(":"):
            section = line
            continue
        parts = line.split()
        if section.startswith("Character") and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def resolve_in_root(root: str, path: str, max_links: int = 40) -> str | None:
    """Canonical root-relative path ("/a/b") of `path` with symlinks followed as if `root`
    were "/"; None if a component is missing or links loop."""
    pending = [c for c in path.split("/") if c][::-1]
    resolved: list[str] = []
    links = 0
    while pending:
        c = pending.pop()
        if c == ".":
            continue
        if c == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root, *resolved, c)
        try:
            st = os.lstat(candidate)
        except OSError:
            return None
        if not statmod.S_ISLNK(st.st_mode):
            resolved.append(c)
            continue
        links += 1
        if links > max_links:
            return None
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = []
        pending.extend([t for t in target.split("/") if t][::-1])
    return "/" + "/".join(resolved)


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


def _join(root: str, rel: str) -> str:
    return os.path.normpath(os.path.join(root, rel.lstrip("/")))


def _synthetic_node(
    name: str, host_dev_root: str, major: int, minor: int, mode: int = 0o666
) -> DeviceNodeInfo:
    return DeviceNodeInfo(
        path=f"/dev/{name}", host_path=_join(host_dev_root, name), major=major, minor=minor, file_mode=mode
    )


def _char_node(dev_root: str, host_dev_root: str, name: str, stat_fn: StatFn) -> DeviceNodeInfo | None:
    try:
        st = stat_fn(os.path.join(dev_root, name))
    except OSError:
        return None
    if not statmod.S_ISCHR(st.st_mode):
        log.warning("not a char device, ignored", path=os.path.join(dev_root, name))
        return None
    return DeviceNodeInfo(
        path=f"/dev/{name}",
        host_path=_join(host_dev_root, name),
        major=os.major(st.st_rdev),
        minor=os.minor(st.st_rdev),
        file_mode=statmod.S_IMODE(st.st_mode),
    )


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def scan_device_nodes(
    dev_root: str, host_dev_root: str, stat_fn: StatFn = os.stat
) -> tuple[tuple[DeviceNodeInfo, ...], tuple[DeviceNodeInfo, ...], tuple[DeviceNodeInfo, ...]]:
    """(control nodes, per-GPU nodes by minor, nvidia-caps nodes) present under dev_root."""
    control = tuple(
        n for n in (_char_node(dev_root, host_dev_root, c, stat_fn) for c in CONTROL_NODE_NAMES) if n
    )
    gpus = [
        n
        for name in _listdir(dev_root)
        if _GPU_NODE.fullmatch(name)
        for n in [_char_node(dev_root, host_dev_root, name, stat_fn)]
        if n
    ]
    caps = [
        n
        for name in _listdir(os.path.join(dev_root, "nvidia-caps"))
        if _CAP_NODE.fullmatch(name)
        for n in [_char_node(dev_root, host_dev_root, f"nvidia-caps/{name}", stat_fn)]
        if n
    ]
    return control, tuple(sorted(gpus, key=lambda n: n.minor)), tuple(sorted(caps, key=lambda n: n.minor))


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
        if real is not None and real not in dirs and os.path.isdir(_join(driver_root, real)):
            dirs.append(real)
    found: list[DriverLibrary] = []
    for lib in wanted:
        for d in dirs:
            names_by_real: dict[str, list[str]] = {}
            for name in _listdir(_join(driver_root, d)):
                if name != lib and not name.startswith(lib + "."):
                    continue
                real = resolve_in_root(driver_root, f"{d}/{name}")
                if real is None or not is_elf_for(_join(driver_root, real), machine):
                    continue
                names_by_real.setdefault(real, []).append(name)
            if not names_by_real:
                continue
            real, names = _pick_group(names_by_real)
            found.append(
                DriverLibrary(
                    host_path=_join(host_driver_root, real),
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
            if not is_elf_for(_join(driver_root, real), machine):
                log.debug("driver tool is not an ELF binary, skipped", path=_join(driver_root, real))
                continue
            found.append(DriverBinary(host_path=_join(host_driver_root, real), name=name))
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
            v for v in _listdir(_join(driver_root, real)) if os.path.isdir(_join(driver_root, f"{real}/{v}"))
        ]
        if version is not None:
            versions = [v for v in versions if v == version]
        if versions:
            return _join(host_driver_root, f"{real}/{versions[-1]}")
    return None


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def discover_driver_files(
    driver_root: str = "/",
    dev_root: str = "/dev",
    *,
    host_driver_root: str | None = None,
    host_dev_root: str = "/dev",
    proc_root: str = "/proc",
    stat_fn: StatFn = os.stat,
    machine: str | None = None,
) -> DriverFiles:
    """Scan a real node. `driver_root`/`dev_root` are where this process sees the files,
    `host_driver_root` (default: driver_root) and `host_dev_root` where the host has them."""
    host_root = host_driver_root if host_driver_root is not None else driver_root
    control, gpus, caps = scan_device_nodes(dev_root, host_dev_root, stat_fn)
    libraries = scan_libraries(driver_root, host_root, machine=machine)
    binaries = scan_binaries(driver_root, host_root, machine=machine)
    version = driver_version_from_libraries(libraries)
    majors = parse_proc_devices(_read_text(os.path.join(proc_root, "devices")))
    files = DriverFiles(
        driver_root=host_root,
        control_nodes=control,
        gpu_nodes=gpus,
        caps_nodes=caps,
        libraries=libraries,
        binaries=binaries,
        firmware_dir=find_firmware_dir(driver_root, host_root, version),
        driver_version=version,
        caps_major=majors.get("nvidia-caps", SIMULATED_CAPS_MAJOR),
        host_dev_root=host_dev_root,
        mig_minors=parse_mig_minors(_read_text(os.path.join(proc_root, "driver/nvidia-caps/mig-minors"))),
    )
    _log_summary(files)
    return files


def simulated_driver_files(
    gpu_minors: Iterable[int],
    *,
    driver_root: str | None = None,
    host_driver_root: str | None = None,
    host_dev_root: str = "/dev",
    proc_root: str = "/proc",
    machine: str | None = None,
) -> DriverFiles:
    """The same shape as a real node's, with synthetic char nodes for simulated GPUs.

    Libraries and tools are scanned only when a driver root is given: a mount whose
    source is missing would make a real runtime fail the container, while a device node
    with type and major is created by the runtime whether the host has it or not."""
    majors = parse_proc_devices(_read_text(os.path.join(proc_root, "devices")))
    uvm = majors.get("nvidia-uvm", SIMULATED_UVM_MAJOR)
    control = (
        _synthetic_node("nvidiactl", host_dev_root, NVIDIA_MAJOR, NVIDIACTL_MINOR),
        _synthetic_node("nvidia-uvm", host_dev_root, uvm, 0),
        _synthetic_node("nvidia-uvm-tools", host_dev_root, uvm, 1),
    )
    gpus = tuple(
        _synthetic_node(f"nvidia{m}", host_dev_root, NVIDIA_MAJOR, m) for m in sorted(set(gpu_minors))
    )
    libraries: tuple[DriverLibrary, ...] = ()
    binaries: tuple[DriverBinary, ...] = ()
    firmware = None
    host_root = host_driver_root if host_driver_root is not None else (driver_root or "/")
    if driver_root is not None:
        libraries = scan_libraries(driver_root, host_root, machine=machine)
        binaries = scan_binaries(driver_root, host_root, machine=machine)
        firmware = find_firmware_dir(driver_root, host_root, driver_version_from_libraries(libraries))
    files = DriverFiles(
        driver_root=host_root,
        control_nodes=control,
        gpu_nodes=gpus,
        caps_nodes=(),
        libraries=libraries,
        binaries=binaries,
        firmware_dir=firmware,
        driver_version=driver_version_from_libraries(libraries),
        caps_major=majors.get("nvidia-caps", SIMULATED_CAPS_MAJOR),
        host_dev_root=host_dev_root,
        simulated=True,
    )
    _log_summary(files)
    return files


def _log_summary(files: DriverFiles) -> None:
    log.info(
        "driver files found",
        driver_root=files.driver_root,
        simulated=files.simulated,
        driver_version=files.driver_version,
        control_nodes=[n.path for n in files.control_nodes],
        gpu_nodes=[n.path for n in files.gpu_nodes],
        caps_nodes=len(files.caps_nodes),
        libraries=[os.path.basename(lib.host_path) for lib in files.libraries],
        binaries=[b.name for b in files.binaries],
    )
    if not files.simulated and not files.libraries:
        log.warning(
            "no NVIDIA driver libraries under the driver root; is --driver-root right?",
            driver_root=files.driver_root,
        )


def scan_driver_files(
    driver_root: str | os.PathLike[str] | None = "/",
    dev_root: str | os.PathLike[str] = "/dev",
    simulated: bool = False,
    *,
    host_driver_root: str | os.PathLike[str] | None = None,
    host_dev_root: str | os.PathLike[str] = "/dev",
    gpu_minors: Iterable[int] = (),
    proc_root: str | os.PathLike[str] = "/proc",
    stat_fn: StatFn = os.stat,
) -> DriverFiles:
    """The one entry point for the daemon and the CLI: `discover_driver_files` on a real
    node; `simulated_driver_files` (synthetic nodes, libraries only if the root has them)
    when the GPUs are simulated. Nodes of GPUs not seen here are synthesized on use.
    `driver_root=None`: "/" on a real node; no libraries or tools for simulated GPUs."""
    host_root = os.fspath(host_driver_root) if host_driver_root is not None else None
    if simulated:
        return simulated_driver_files(
            gpu_minors,
            driver_root=os.fspath(driver_root) if driver_root is not None else None,
            host_driver_root=host_root,
            host_dev_root=os.fspath(host_dev_root),
            proc_root=os.fspath(proc_root),
        )
    return discover_driver_files(
        os.fspath(driver_root) if driver_root is not None else "/",
        os.fspath(dev_root),
        host_driver_root=host_root,
        host_dev_root=os.fspath(host_dev_root),
        proc_root=os.fspath(proc_root),
        stat_fn=stat_fn,
    )
