"""What the health monitor reports: plain records of NVML events and of the periodic GPU check.

A `HealthEvent` is one NVML event (or several identical ones coalesced, `count`), as the
monitor thread read it: which GPU, which kind, the event's data (the XID number for XID
events) and, where the driver offers it, NVML's recovery action read right after the
event. A `Probe` is the periodic check of one GPU: is it lost, and what recovery action
NVML asks for now. Both are data only: nothing here talks to NVML or decides severity.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

# NVML's "whole GPU" placement in an event's gpuInstanceId/computeInstanceId.
WHOLE_GPU = 0xFFFFFFFF


class EventKind(enum.StrEnum):
    """The NVML event types the monitor registers; the values name them in logs and history."""

    XID = "xid"
    DOUBLE_BIT_ECC = "double-bit-ecc"
    SINGLE_BIT_ECC = "single-bit-ecc"
    SINGLE_BIT_ECC_STORM = "single-bit-ecc-storm"
    DRAM_RETIREMENT = "dram-retirement"
    DRAM_RETIREMENT_FAILURE = "dram-retirement-failure"
    NON_FATAL_POISON = "non-fatal-poison"
    FATAL_POISON = "fatal-poison"
    GPU_UNAVAILABLE = "gpu-unavailable"
    RECOVERY_ACTION = "recovery-action"
    GPU_LOST = "gpu-lost"  # not an NVML event type: the wait or the periodic check found the GPU gone


@dataclass(frozen=True)
class HealthEvent:
    gpu: int  # the GPU's index in the inventory
    kind: EventKind
    data: int = 0  # XID number, recovery action, or NVML's raw eventData
    gpu_instance: int | None = None  # MIG scope; None: the whole GPU
    compute_instance: int | None = None
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION read after the event; None: not offered
    recovery_action: int | None = None
    count: int = 1  # identical events coalesced into this one
    at: float = 0.0  # wall clock, seconds

    @property
    def label(self) -> str:
        """Short name for counts and logs: "xid-79", "double-bit-ecc"."""
        return f"xid-{self.data}" if self.kind is EventKind.XID else str(self.kind)


@dataclass(frozen=True)
class Probe:
    """The periodic check of one GPU."""

    gpu: int
    lost: bool
    recovery_action: int | None  # None: NVML does not offer the field (or the GPU is lost)
    at: float = 0.0


@dataclass(frozen=True)
class MonitorFacts:
    """What the monitor could watch on each GPU, for logs, the history file and RESULTS.md."""

    registered: Mapping[int, tuple[str, ...]]  # GPU index -> event kinds registered
    unsupported: Mapping[int, tuple[str, ...]]  # GPU index -> wanted kinds the GPU does not offer
    recovery_action_field: Mapping[int, bool]  # GPU index -> NVML offers the recovery-action field
