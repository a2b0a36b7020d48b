"""Event -> severity: the pure classifier of the health monitor, and the policy that tunes it.

Order of precedence for an XID: the operator's override (`--health-xid-severity`), then
NVML's recovery action read right after the event (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`,
drivers from R570 on), then the XID table below (our reading of NVIDIA's Xid catalog,
docs/health.md), then NoSchedule for an XID the table does not know. Other event types
have fixed severities. The severity is what the event *warrants*; the taint effect
written is capped by `HealthPolicy.max_effect` (`--health-taint-effect`, NoSchedule by
default), so a running job is evicted only where the operator asked for NoExecute.

It must NOT do I/O, read clocks or keep state: same event and policy, same verdict.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal

from dra_driver.health.events import EventKind, HealthEvent, Probe

TaintEffect = Literal["NoSchedule", "NoExecute"]


class Severity(enum.IntEnum):
    INFO = 0  # counted and logged; no taint, the device stays Healthy
    NO_SCHEDULE = 1  # no new allocations; running work goes on
    NO_EXECUTE = 2  # running work on the device is not safe either

    @property
    def title(self) -> str:
        return _TITLES[self]


_TITLES: Final = {Severity.INFO: "Info", Severity.NO_SCHEDULE: "NoSchedule", Severity.NO_EXECUTE: "NoExecute"}
# Spellings accepted in configuration ("None" as the taint effect of the same name).
SEVERITY_NAMES: Final = MappingProxyType(
    {"info": Severity.INFO, "none": Severity.INFO, "noschedule": Severity.NO_SCHEDULE,
     "noexecute": Severity.NO_EXECUTE}
)

_IN, _NS, _NX = Severity.INFO, Severity.NO_SCHEDULE, Severity.NO_EXECUTE
# XID -> severity where NVML offers no recovery action (docs/health.md has the reasons).
# Informational: errors of the application, which NVIDIA's catalog answers with
# "restart the application"; NoExecute: the GPU needs a reset or the node a reboot.
XID_TABLE: Final[Mapping[int, Severity]] = MappingProxyType(
    {
        **dict.fromkeys((8, 11, 13, 31, 43, 45, 63, 68, 69, 109, 121), _IN),
        **dict.fromkeys((32, 38, 56, 61, 64, 74, 92, 94), _NS),
        **dict.fromkeys((48, 62, 79, 95, 119, 120, 140, 143), _NX),
    }
)
UNKNOWN_XID_SEVERITY: Final = Severity.NO_SCHEDULE
XID_DESCRIPTIONS: Final[Mapping[int, str]] = MappingProxyType(
    {
        13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
        45: "preemptive cleanup", 48: "double-bit ECC error", 61: "internal micro-controller warning",
        62: "internal micro-controller halt", 63: "ECC page retirement or row remapping recorded",
        64: "ECC page retirement or row remapping failed", 74: "NVLink error",
        79: "GPU has fallen off the bus",
        92: "high single-bit ECC error rate", 94: "contained ECC error", 95: "uncontained ECC error",
        109: "context switch timeout", 119: "GSP RPC timeout", 120: "GSP error", 140: "unrecovered ECC error",
        143: "GPU initialization failure", 154: "GPU recovery action changed",
    }
)

# NVML_GPU_RECOVERY_ACTION_* (nvml.h) -> (name used as a taint value, severity).
RECOVERY_ACTIONS: Final[Mapping[int, tuple[str, Severity]]] = MappingProxyType(
    {
        0: ("none", Severity.INFO),
        1: ("gpu-reset", Severity.NO_EXECUTE),
        2: ("node-reboot", Severity.NO_EXECUTE),
        3: ("drain-p2p", Severity.NO_SCHEDULE),
        4: ("drain-and-reset", Severity.NO_SCHEDULE),
        5: ("recover-imex-domain", Severity.INFO),
        6: ("bus-reset", Severity.NO_EXECUTE),
        7: ("system-reboot", Severity.NO_EXECUTE),
    }
)
RECOVERY_ACTION_NONE: Final = 0
GPU_LOST_MESSAGE: Final = "GPU is lost (NVML cannot reach it)"

# Fixed severities of the event types other than XIDs (and of the GPU-lost check).
KIND_SEVERITY: Final[Mapping[EventKind, tuple[str, Severity]]] = MappingProxyType(
    {
        EventKind.DOUBLE_BIT_ECC: ("ecc", Severity.NO_EXECUTE),
        EventKind.SINGLE_BIT_ECC: ("ecc", Severity.INFO),
        EventKind.SINGLE_BIT_ECC_STORM: ("ecc", Severity.NO_SCHEDULE),
        EventKind.DRAM_RETIREMENT: ("memory", Severity.INFO),
        EventKind.DRAM_RETIREMENT_FAILURE: ("memory", Severity.NO_SCHEDULE),
        EventKind.NON_FATAL_POISON: ("poison", Severity.INFO),
        EventKind.FATAL_POISON: ("poison", Severity.NO_EXECUTE),
        EventKind.GPU_UNAVAILABLE: ("gpu-lost", Severity.NO_EXECUTE),
        EventKind.GPU_LOST: ("gpu-lost", Severity.NO_EXECUTE),
    }
)


@dataclass(frozen=True)
class HealthPolicy:
    """The operator's choices: overrides, the strongest effect written, the quiet period."""

    xid_overrides: Mapping[int, Severity] = field(default_factory=dict)
    max_effect: TaintEffect = "NoSchedule"
    quiet_period: float = 60.0  # seconds without a critical event before a cleared device is untainted

    def effect(self, severity: Severity) -> TaintEffect | None:
        """The taint effect written for `severity`; None: no taint."""
        if severity is Severity.INFO:
            return None
        if severity is Severity.NO_EXECUTE and self.max_effect == "NoExecute":
            return "NoExecute"
        return "NoSchedule"


@dataclass(frozen=True)
class Verdict:
    severity: Severity
    category: str  # the taint key's name under the driver's domain: xid, ecc, gpu-lost, ...
    reason: str  # the taint value: a label value ("79", "double-bit-ecc", "gpu-reset")
    message: str  # for people: the health stream, Events, logs
    source: str  # what decided the severity: config, recovery-action, xid-table, default, event-type


def recovery_action(action: int) -> tuple[str, Severity]:
    """The name and severity of an NVML recovery action; an unknown one is NoSchedule."""
    return RECOVERY_ACTIONS.get(action, (f"action-{action}", Severity.NO_SCHEDULE))


def classify(event: HealthEvent, policy: HealthPolicy) -> Verdict:
    """The severity an event warrants, with the taint key name, value and a message."""
    if event.kind is EventKind.XID:
        return _classify_xid(event.data, event.recovery_action, policy)
    if event.kind is EventKind.RECOVERY_ACTION:
        return _recovery_verdict(event.data, "NVML asks for recovery action")
    category, severity = KIND_SEVERITY[event.kind]
    message = {
        EventKind.GPU_LOST: GPU_LOST_MESSAGE,
        EventKind.GPU_UNAVAILABLE: "GPU is unavailable (NVML event)",
    }.get(event.kind, f"{event.kind} reported by NVML")
    return Verdict(severity, category, str(event.kind), message, "event-type")


def classify_probe(probe: Probe) -> Verdict | None:
    """What the periodic check says is wrong with a GPU; None when nothing is."""
    if probe.lost:
        return Verdict(Severity.NO_EXECUTE, "gpu-lost", "gpu-lost", GPU_LOST_MESSAGE, "probe")
    if probe.recovery_action in (None, RECOVERY_ACTION_NONE):
        return None
    verdict = _recovery_verdict(probe.recovery_action, "NVML asks for recovery action")
    return verdict if verdict.severity > Severity.INFO else None


def _recovery_verdict(action: int, what: str) -> Verdict:
    name, severity = recovery_action(action)
    return Verdict(severity, "recovery-action", name, f"{what} {name}", "recovery-action")


def _classify_xid(xid: int, action: int | None, policy: HealthPolicy) -> Verdict:
    what = XID_DESCRIPTIONS.get(xid)
    message = f"XID {xid}" + (f" ({what})" if what else "") + " reported by NVML"
    if xid in policy.xid_overrides:
        return Verdict(policy.xid_overrides[xid], "xid", str(xid), message, "config")
    # NVML's recovery action is the GPU's, read after the event, not the event's own: an XID
    # the table calls an application error (13, 43, ...) never asks for one, so in a storm of
    # them the action belongs to the fatal XID among them, which must name the taint.
    if action is not None and XID_TABLE.get(xid) is not Severity.INFO:
        name, severity = recovery_action(action)
        return Verdict(severity, "xid", str(xid), f"{message}; recovery action: {name}", "recovery-action")
    if xid in XID_TABLE:
        return Verdict(XID_TABLE[xid], "xid", str(xid), message, "xid-table")
    return Verdict(UNKNOWN_XID_SEVERITY, "xid", str(xid), message, "default")


_OVERRIDE = re.compile(r"^\s*(\d{1,5})\s*=\s*([A-Za-z]+)\s*$")


def parse_xid_severities(text: str) -> dict[int, Severity]:
    """`"13=NoSchedule,79=NoExecute,43=None"` -> {13: NO_SCHEDULE, ...}.

    Raises ValueError naming the bad entry and what is accepted.
    """
    overrides: dict[int, Severity] = {}
    for entry in (e for e in text.split(",") if e.strip()):
        match = _OVERRIDE.match(entry)
        severity = SEVERITY_NAMES.get(match.group(2).lower()) if match else None
        if match is None or severity is None:
            raise ValueError(
                f"bad XID severity {entry.strip()!r}: write XID=SEVERITY with SEVERITY one of "
                "None (or Info), NoSchedule, NoExecute, e.g. '13=NoSchedule,43=None'"
            )
        overrides[int(match.group(1))] = severity
    return overrides
