"""The node's device health, owned by the plugin's event loop: monitor batches in, device views out.

`HealthKeeper.apply(batch)` runs the pure classifier and state machine for each event and
probe of a batch (the monitor thread hands batches over with `call_soon_threadsafe`);
`settle_forever()` lets cleared devices recover after the quiet period. Whoever shows the
health (the kubelet's health stream, the slice taints, the Events) follows `watch()`: it
yields a `HealthSnapshot` at once and then after every change of any device's view, and
always the latest one, so a slow follower skips what it missed (coalescing) instead of
queueing it. Views change only on transitions, so a storm of events changes nothing
after its first one.

Logs: every transition (unhealthy, upgraded, healthy again) at warning/info; events at
most once per `LOG_EVERY` seconds per GPU and kind, with the count since the last line.
It must NOT talk to NVML or Kubernetes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import structlog

from dra_driver.devices import NodeDevice
from dra_driver.health.classify import HealthPolicy, Verdict, classify, classify_probe
from dra_driver.health.effects import HEALTHY, DeviceTaint, DeviceView, affected_devices, device_view
from dra_driver.health.events import HealthEvent, MonitorFacts, Probe
from dra_driver.health.state import DeviceState, on_event, on_probe, settle

log = structlog.get_logger(__name__)

LOG_EVERY: Final = 10.0
SETTLE_INTERVAL: Final = 1.0


@dataclass(frozen=True)
class HealthSnapshot:
    version: int
    views: Mapping[str, DeviceView]  # by device name

    def taints(self) -> dict[str, tuple[DeviceTaint, ...]]:
        return {name: view.taints for name, view in self.views.items() if view.taints}


class HealthKeeper:
    def __init__(
        self,
        driver: str,
        devices: Mapping[str, NodeDevice],
        policy: HealthPolicy,
        clock: Callable[[], float] = time.time,
        count: Callable[[str, int], None] | None = None,
    ) -> None:
        """`count(kind, n)` is told of every event (by kind) and transition ("unhealthy",
        "recovered"): the metrics hook."""
        self.driver = driver
        # not copied: with dynamic MIG a placement resolves to the instance made for it now,
        # so an event naming that instance's ids taints that device only
        self.devices = devices
        self.policy = policy
        self.clock = clock
        self.states: dict[str, DeviceState] = {name: DeviceState() for name in devices}
        self.views: dict[str, DeviceView] = dict.fromkeys(devices, HEALTHY)
        self.facts = MonitorFacts({}, {}, {})
        self.events_seen = 0
        self.history_version = 0  # moves on every applied batch that changed a state or a count
        self._count = count
        self._version = 0
        self._changed = asyncio.Event()
        # (gpu, event label) -> (time of the last log line, events not logged since)
        self._logged: dict[tuple[int, str], tuple[float, int]] = {}

    # -- input -------------------------------------------------------------------------------------

    def apply(self, batch: Sequence[HealthEvent | Probe]) -> bool:
        """Apply a batch from the monitor; True when some device's view changed (followers are woken)."""
        now = self.clock()
        touched: set[str] = set()
        for item in batch:
            if isinstance(item, Probe):
                verdict = classify_probe(item)
                for name in affected_devices(self.devices, item.gpu):
                    checked = on_probe(self.states[name], verdict, now)
                    if checked is not self.states[name]:  # a well GPU's check changes nothing
                        self.states[name] = checked
                        touched.add(name)
                continue
            verdict = classify(item, self.policy)
            self.events_seen += item.count
            if self._count is not None:
                self._count(str(item.kind), item.count)
            self._log_event(item, verdict, now)
            for name in affected_devices(self.devices, item.gpu, item.gpu_instance, item.compute_instance):
                self.states[name] = on_event(self.states[name], item, verdict, now)
                touched.add(name)
        if touched or any(not isinstance(item, Probe) for item in batch):
            self.history_version += 1  # the history file is rewritten; not for checks that changed nothing
        return self._refresh(touched)

    def settle(self) -> bool:
        """Recover the devices whose quiet period has passed; True when a view changed."""
        now = self.clock()
        touched = set()
        for name, state in self.states.items():
            settled = settle(state, now, self.policy.quiet_period)
            if settled is not state:
                self.states[name] = settled
                touched.add(name)
        if touched:
            self.history_version += 1
        return self._refresh(touched)

    async def settle_forever(self, interval: float = SETTLE_INTERVAL) -> None:
        while True:
            await asyncio.sleep(interval)
            self.settle()

    def _refresh(self, names: set[str]) -> bool:
        changed = False
        for name in sorted(names):
            view = device_view(self.states[name], self.driver, self.policy)
            old = self.views[name]
            if view == old:
                continue
            changed = True
            self.views[name] = view
            self._log_transition(name, old, view)
            if self._count is not None and view.healthy != old.healthy:
                self._count("recovered" if view.healthy else "unhealthy", 1)
        if changed:
            self._version += 1
            woken, self._changed = self._changed, asyncio.Event()
            woken.set()
        return changed

    # -- output ------------------------------------------------------------------------------------

    def snapshot(self) -> HealthSnapshot:
        return HealthSnapshot(self._version, dict(self.views))

    async def watch(self) -> AsyncIterator[HealthSnapshot]:
        """The current snapshot, then the latest one after each change."""
        seen = -1
        while True:
            if self._version == seen:
                await self._changed.wait()
                continue
            seen = self._version
            yield self.snapshot()

    # -- logs --------------------------------------------------------------------------------------

    def _log_transition(self, name: str, old: DeviceView, new: DeviceView) -> None:
        taints = [f"{t.key}={t.value}:{t.effect}" for t in new.taints]
        if new.healthy:
            log.info("device healthy again", device=name, was=old.message,
                     recoveries=self.states[name].recoveries)
        elif old.healthy:
            log.warning("device unhealthy", device=name, message=new.message, taints=taints)
        else:
            log.warning("device health changed", device=name, message=new.message, taints=taints)

    def _log_event(self, event: HealthEvent, verdict: Verdict, now: float) -> None:
        key = (event.gpu, event.label)
        last, unlogged = self._logged.get(key, (0.0, 0))
        unlogged += event.count
        if now - last < LOG_EVERY:
            self._logged[key] = (last, unlogged)
            return
        self._logged[key] = (now, 0)
        log.info(
            "gpu health event",
            gpu=event.gpu,
            kind=event.label,
            count=unlogged,
            severity=verdict.severity.title,
            decided_by=verdict.source,
            message=verdict.message,
            recovery_action=event.recovery_action,
        )
