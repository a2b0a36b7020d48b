"""The NVIDIA driver's device nodes: the control nodes, `/dev/nvidia<minor>` of each GPU and
the `/dev/nvidia-caps` capability nodes of MIG devices, with their numbers.

Majors and minors come from the node (`/proc/devices`, `/proc/driver/nvidia-caps/mig-minors`,
a stat of each node) where it has them, else from the driver's fixed numbering (a node the
driver creates only when first used is synthesized with the numbers it will have).

It reads /dev and /proc and must not create or change a node.
"""

from __future__ import annotations

import os
import re
import stat as statmod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import structlog

from dra_driver.driver_root.paths import join_in_root, listdir

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
# IMEX channels (/dev/nvidia-caps-imex-channels/channelN) get a dynamic major too; this one
# stands in on simulated GPUs, where runc makes the node from its numbers.
IMEX_CHANNELS_DEVICE: Final = "nvidia-caps-imex-channels"
SIMULATED_IMEX_CHANNELS_MAJOR: Final = 234

CONTROL_NODE_NAMES: Final = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")

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


@dataclass(frozen=True)
class DeviceNodeInfo:
    """A char device node: where the container sees it, where the host has it, its numbers."""

    path: str  # inside the container, e.g. /dev/nvidia0
    host_path: str  # on the host, as the container runtime finds it
    major: int
    minor: int
    file_mode: int  # permission bits only, e.g. 0o666

    type: str = "c"


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


def synthetic_node(
    name: str, host_dev_root: str, major: int, minor: int, mode: int = 0o666
) -> DeviceNodeInfo:
    return DeviceNodeInfo(
        path=f"/dev/{name}",
        host_path=join_in_root(host_dev_root, name),
        major=major,
        minor=minor,
        file_mode=mode,
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
        host_path=join_in_root(host_dev_root, name),
        major=os.major(st.st_rdev),
        minor=os.minor(st.st_rdev),
        file_mode=statmod.S_IMODE(st.st_mode),
    )


def scan_device_nodes(
    dev_root: str, host_dev_root: str, stat_fn: StatFn = os.stat
) -> tuple[tuple[DeviceNodeInfo, ...], tuple[DeviceNodeInfo, ...], tuple[DeviceNodeInfo, ...]]:
    """(control nodes, per-GPU nodes by minor, nvidia-caps nodes) present under dev_root."""
    control = tuple(
        n for n in (_char_node(dev_root, host_dev_root, c, stat_fn) for c in CONTROL_NODE_NAMES) if n
    )
    gpus = [
        n
        for name in listdir(dev_root)
        if _GPU_NODE.fullmatch(name)
        for n in [_char_node(dev_root, host_dev_root, name, stat_fn)]
        if n
    ]
    caps = [
        n
        for name in listdir(os.path.join(dev_root, "nvidia-caps"))
        if _CAP_NODE.fullmatch(name)
        for n in [_char_node(dev_root, host_dev_root, f"nvidia-caps/{name}", stat_fn)]
        if n
    ]
    return control, tuple(sorted(gpus, key=lambda n: n.minor)), tuple(sorted(caps, key=lambda n: n.minor))

