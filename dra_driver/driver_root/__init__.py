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
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import structlog

from dra_driver.driver_root.device_nodes import (
    IMEX_CHANNELS_DEVICE,
    NVIDIA_MAJOR,
    NVIDIACTL_MINOR,
    SIMULATED_CAPS_MAJOR,
    SIMULATED_IMEX_CHANNELS_MAJOR,
    SIMULATED_UVM_MAJOR,
    DeviceNodeInfo,
    StatFn,
    mig_cap_minor,
    parse_mig_minors,
    parse_proc_devices,
    scan_device_nodes,
    synthetic_node,
)
from dra_driver.driver_root.user_space import (
    DriverBinary,
    DriverLibrary,
    driver_version_from_libraries,
    find_firmware_dir,
    scan_binaries,
    scan_libraries,
)

log = structlog.get_logger(__name__)


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
    # nvidia-caps-imex-channels from /proc/devices (IMEX channels); None where the driver has none
    imex_channels_major: int | None = None

    def gpu_node(self, minor: int) -> DeviceNodeInfo:
        """The node of GPU `minor`; synthesized (major 195 is fixed) if it was not created yet."""
        for n in self.gpu_nodes:
            if n.minor == minor:
                return n
        return synthetic_node(f"nvidia{minor}", self.host_dev_root, NVIDIA_MAJOR, minor)

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
        return synthetic_node(
            f"nvidia-caps/nvidia-cap{minor}", self.host_dev_root, self.caps_major, minor, 0o444
        )


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
        imex_channels_major=majors.get(IMEX_CHANNELS_DEVICE),
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
        synthetic_node("nvidiactl", host_dev_root, NVIDIA_MAJOR, NVIDIACTL_MINOR),
        synthetic_node("nvidia-uvm", host_dev_root, uvm, 0),
        synthetic_node("nvidia-uvm-tools", host_dev_root, uvm, 1),
    )
    gpus = tuple(
        synthetic_node(f"nvidia{m}", host_dev_root, NVIDIA_MAJOR, m) for m in sorted(set(gpu_minors))
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
        imex_channels_major=majors.get(IMEX_CHANNELS_DEVICE, SIMULATED_IMEX_CHANNELS_MAJOR),
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
