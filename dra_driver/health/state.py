"""The recovery state machine of one device: conditions come with critical events and go
after the device checks out well again and a quiet period passed.

    healthy --critical event--> unhealthy (a condition per category: xid, ecc, gpu-lost, ...)
    unhealthy --more events--> unhealthy (a stronger event upgrades its category; weaker ones
                                           never weaken it, so a storm rewrites nothing)
    unhealthy --probe: GPU reachable, no recovery action pending--> clearing (clear_since set)
    clearing --critical event or a bad probe--> unhealthy (clear_since dropped)
    clearing --quiet period since max(last critical event, clear_since)--> healthy

Informational events only add to the history and the counts. A bad probe adds a
condition only when nothing at least as strong is already there (a "gpu-reset" recovery
action after XID 79 keeps the one XID taint, it does not add a second); and the event that
explains a probe's condition replaces it: the probe reads NVML's recovery action every
second whatever the event queue holds, so behind a storm it may see a fatal XID's action
before the XID itself is read, and the taint then names the XID once it comes.

Pure: every transition takes the time as an argument and returns a new state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Final

from dra_driver.health.classify import Severity, Verdict
from dra_driver.health.events import HealthEvent

HISTORY_LENGTH: Final = 20  # recent events kept per device
PROBE_CATEGORY: Final = "recovery-action"  # the condition a probe's recovery action adds


@dataclass(frozen=True)
class Condition:
    """Why a device is unhealthy in one category; becomes one taint."""

    category: str
    reason: str
    severity: Severity
    message: str
    since: float  # when this reason at this severity began (the taint's timeAdded)
    last_seen: float


@dataclass(frozen=True)
class Record:
    """One line of a device's history."""

    at: float
    what: str  # "xid-79", "double-bit-ecc", "probe", "recovered"
    severity: str  # Info / NoSchedule / NoExecute, or "" for a recovery
    message: str
    count: int = 1


@dataclass(frozen=True)
class DeviceState:
    conditions: Mapping[str, Condition] = field(default_factory=dict)  # by category
    clear_since: float | None = None  # since when the checks say the device is well
    last_critical: float = 0.0
    counts: Mapping[str, int] = field(default_factory=dict)  # event label -> events seen
    recent: tuple[Record, ...] = ()
    recoveries: int = 0

    @property
    def worst(self) -> Condition | None:
        """The strongest condition (the oldest among equals): what the health stream says."""
        return min(self.conditions.values(), key=lambda c: (-c.severity, c.since), default=None)


def _remember(state: DeviceState, record: Record) -> tuple[Record, ...]:
    return (*state.recent, record)[-HISTORY_LENGTH:]


def on_event(state: DeviceState, event: HealthEvent, verdict: Verdict, now: float) -> DeviceState:
    """A (possibly coalesced) NVML event classified as `verdict`."""
    counts = {**state.counts, event.label: state.counts.get(event.label, 0) + event.count}
    record = Record(now, event.label, verdict.severity.title, verdict.message, event.count)
    state = replace(state, counts=counts, recent=_remember(state, record))
    if verdict.severity is Severity.INFO:
        return state
    probed = state.conditions.get(PROBE_CATEGORY)
    if probed is not None and verdict.category != PROBE_CATEGORY and probed.severity <= verdict.severity:
        state = replace(state, conditions={k: c for k, c in state.conditions.items() if k != PROBE_CATEGORY})
    return _critical(state, verdict, now)


def on_probe(state: DeviceState, verdict: Verdict | None, now: float) -> DeviceState:
    """The periodic check: `verdict` None means the GPU answered and asks for no recovery."""
    if verdict is None:
        if state.conditions and state.clear_since is None:
            return replace(state, clear_since=now)
        return state
    worst = state.worst
    if worst is not None and worst.severity >= verdict.severity and verdict.category not in state.conditions:
        return replace(state, clear_since=None)
    if verdict.category not in state.conditions:
        record = Record(now, "probe", verdict.severity.title, verdict.message)
        state = replace(state, recent=_remember(state, record))
    return _critical(state, verdict, now, touch_last_critical=False)


def _critical(
    state: DeviceState, verdict: Verdict, now: float, touch_last_critical: bool = True
) -> DeviceState:
    current = state.conditions.get(verdict.category)
    if current is None or verdict.severity > current.severity:
        condition = Condition(verdict.category, verdict.reason, verdict.severity, verdict.message, now, now)
    else:
        condition = replace(current, last_seen=now)
    return replace(
        state,
        conditions={**state.conditions, verdict.category: condition},
        clear_since=None,
        last_critical=now if touch_last_critical else state.last_critical,
    )


def settle(state: DeviceState, now: float, quiet_period: float) -> DeviceState:
    """Clear the conditions of a device that checked out well for the quiet period."""
    if not state.conditions or state.clear_since is None:
        return state
    if now - max(state.last_critical, state.clear_since) < quiet_period:
        return state
    cleared = ", ".join(f"{c.category}={c.reason}" for c in state.conditions.values())
    record = Record(now, "recovered", "", f"healthy again; cleared {cleared}")
    recent = _remember(state, record)
    return replace(state, conditions={}, clear_since=None, recent=recent, recoveries=state.recoveries + 1)
