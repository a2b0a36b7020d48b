"""What one claim's MPS control daemon is started with, and what it and the claim's containers
are told: the settings (saved as `settings.json` in the claim's directory, so that a restarted
plugin can restart a daemon that died), the daemon's default limits, the clients' variables.

The daemon sees only the claim's GPUs (`CUDA_VISIBLE_DEVICES=<uuid>,...`), so client
device index i is `settings.devices[i]`. Limits are set twice: as defaults in the control
daemon (`set_default_*`, which apply to every server it starts) and as the client
variables in the container (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`,
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`).

Pure: it must not touch the file system, start anything or read the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from dra_driver.sharing.config import DEFAULT_SHM_SIZE, ConfigError, MpsConfig, format_mps_memory

CONTAINER_PIPE_DIR: Final = "/tmp/nvidia-mps"  # the default CUDA itself uses
CONTAINER_SHM_DIR: Final = "/dev/shm"


@dataclass(frozen=True)
class MpsDevice:
    """One GPU (or MIG device) the claim's daemon serves."""

    uuid: str
    pinned_memory_limit: int | None = None  # bytes per client; None: no limit


@dataclass(frozen=True)
class MpsSettings:
    """What one claim's daemon is started with. Client device index i is `devices[i]`."""

    claim_uid: str
    devices: tuple[MpsDevice, ...]
    active_thread_percentage: int | None = None
    shm_size: int = DEFAULT_SHM_SIZE  # bytes of the claim's /dev/shm tmpfs
    # whole GPUs the claim owns: exclusive-process mode while its daemon runs (if allowed)
    exclusive_gpus: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "claimUID": self.claim_uid,
            "devices": [{"uuid": d.uuid, "pinnedMemoryLimit": d.pinned_memory_limit} for d in self.devices],
            "activeThreadPercentage": self.active_thread_percentage,
            "shmSize": self.shm_size,
            "exclusiveGPUs": list(self.exclusive_gpus),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> MpsSettings:
        return cls(
            claim_uid=str(obj["claimUID"]),
            devices=tuple(
                MpsDevice(
                    str(d["uuid"]), None if d["pinnedMemoryLimit"] is None else int(d["pinnedMemoryLimit"])
                )
                for d in obj["devices"]
            ),
            active_thread_percentage=None
            if obj.get("activeThreadPercentage") is None
            else int(obj["activeThreadPercentage"]),
            shm_size=int(obj.get("shmSize", DEFAULT_SHM_SIZE)),
            exclusive_gpus=tuple(str(u) for u in obj.get("exclusiveGPUs", ())),
        )


def settings_for_claim(claim_uid: str, devices: Sequence[tuple[str, MpsConfig]]) -> MpsSettings:
    """The daemon settings of a claim from its MPS devices `(uuid, config)`, in client order.

    The active thread percentage applies to every client of the daemon, so all the
    claim's MPS devices must agree on it; the claim's /dev/shm is the largest any asks for."""
    if not devices:
        raise ValueError(f"claim {claim_uid}: an MPS daemon needs at least one device")
    percentages = sorted({c.default_active_thread_percentage for _, c in devices}, key=str)
    if len(percentages) > 1:
        raise ConfigError(
            "all MPS devices of one claim share one daemon and must have the same "
            f"mps.defaultActiveThreadPercentage (got {', '.join(map(str, percentages))})"
        )
    return MpsSettings(
        claim_uid=claim_uid,
        devices=tuple(MpsDevice(uuid, c.default_pinned_device_memory_limit) for uuid, c in devices),
        active_thread_percentage=percentages[0],
        shm_size=max((c.shm_size for _, c in devices if c.shm_size is not None), default=DEFAULT_SHM_SIZE),
    )


def control_commands(settings: MpsSettings) -> tuple[str, ...]:
    """The `nvidia-cuda-mps-control` commands that make the limits the daemon's defaults."""
    cmds = []
    if settings.active_thread_percentage is not None:
        cmds.append(f"set_default_active_thread_percentage {settings.active_thread_percentage}")
    for i, d in enumerate(settings.devices):
        if d.pinned_memory_limit is not None:
            cmds.append(f"set_default_device_pinned_mem_limit {i} {format_mps_memory(d.pinned_memory_limit)}")
    return tuple(cmds)


def client_env(settings: MpsSettings) -> tuple[str, ...]:
    """The variables an MPS client of this claim runs with."""
    env = [f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}"]
    limits = [
        f"{i}={format_mps_memory(d.pinned_memory_limit)}"
        for i, d in enumerate(settings.devices)
        if d.pinned_memory_limit is not None
    ]
    if limits:
        env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={','.join(limits)}")
    if settings.active_thread_percentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={settings.active_thread_percentage}")
    return tuple(env)
