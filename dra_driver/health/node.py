"""Health monitoring in the node process: the monitor thread feeding the keeper, started and stopped.

`start_node_health` watches the process's NVML (pynvml, or for `--simulate` the FakeNvml with an
injected-event source following the control file: dra_driver.gpu.backend chose it), starts the
monitor thread and hands its batches to the keeper on the event loop. `NodeHealth.alive()` says whether the
monitor's loop turned recently; the health stream vouches for devices only while it does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import structlog

from dra_driver.devices import NodeDevice
from dra_driver.gpu.model import Inventory
from dra_driver.health.classify import HealthPolicy
from dra_driver.health.keeper import HealthKeeper
from dra_driver.health.monitor import Batch, GpuRef, NvmlEventsApi, NvmlHealthMonitor

log = structlog.get_logger(__name__)

SIMULATED_EVENTS_FILE: Final = "simulated-nvml-events.jsonl"
# Seconds between two checks of every GPU (lost? recovery action?): two NVML calls per GPU.
# Short, because the check never waits behind the event queue: behind a storm it is what sees
# a fatal XID's recovery action (NVML sets it with the XID) within 2 intervals (see monitor.py).
PROBE_INTERVAL: Final = 0.4
STALE_AFTER: Final = 20.0  # seconds without a turn of the monitor loop: stop vouching for the devices


@dataclass
class NodeHealth:
    keeper: HealthKeeper
    monitor: NvmlHealthMonitor

    def alive(self) -> bool:
        return time.monotonic() - self.monitor.alive_at < STALE_AFTER

    async def stop(self) -> None:
        await asyncio.to_thread(self.monitor.stop)


def gpu_refs(inventory: Inventory) -> list[GpuRef]:
    return [GpuRef(g.index, g.uuid, tuple(m.uuid for m in g.mig_devices)) for g in inventory.gpus]


async def start_node_health(
    inventory: Inventory,
    devices: Mapping[str, NodeDevice],
    driver: str,
    policy: HealthPolicy,
    nvml: NvmlEventsApi,
    count: Callable[[str, int], None] | None = None,
    probe_interval: float = PROBE_INTERVAL,
    count_wait: Callable[[str], None] | None = None,
) -> NodeHealth:
    """Start the monitor on `nvml`; raises HealthMonitorError when NVML cannot be used."""
    keeper = HealthKeeper(driver, devices, policy, count=count)
    loop = asyncio.get_running_loop()

    def deliver(batch: Batch) -> None:
        loop.call_soon_threadsafe(keeper.apply, batch)

    monitor = NvmlHealthMonitor(nvml, gpu_refs(inventory), deliver, probe_interval=probe_interval,
                                count_wait=count_wait)
    keeper.facts = await asyncio.to_thread(monitor.start)
    log.info(
        "health monitor started",
        gpus=len(inventory.gpus),
        max_effect=policy.max_effect,
        quiet_period=policy.quiet_period,
        xid_overrides={str(x): s.title for x, s in policy.xid_overrides.items()},
    )
    return NodeHealth(keeper, monitor)
