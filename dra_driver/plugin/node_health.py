"""Device health in the node daemon: the monitor started (or not) and the loops that keep
the health board, the taint history file, the claims' Events and the settle timer.

Must not decide health (dra_driver.health does) nor publish taints (the slice publisher's
`controller.taints` loop does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import structlog

from dra_driver import metrics
from dra_driver.devices import NodeDevice
from dra_driver.gpu.model import Inventory
from dra_driver.health import history
from dra_driver.health.classify import HealthPolicy
from dra_driver.health.monitor import HealthMonitorError, NvmlEventsApi
from dra_driver.health.node import NodeHealth, start_node_health
from dra_driver.health.notify import ClaimEvents, ClaimUse
from dra_driver.kube import ApiClient
from dra_driver.plugin.health import DeviceHealthBoard, claims_using, keep_fresh, mirror
from dra_driver.plugin.state import NodePreparer

log = structlog.get_logger(__name__)


async def start_health(
    inventory: Inventory,
    devices: Mapping[str, NodeDevice],
    driver: str,
    policy: HealthPolicy | None,
    nvml: NvmlEventsApi,
) -> NodeHealth | None:
    """The started monitor on the process's NVML; None when not asked for or NVML cannot be used
    (devices report Unknown)."""
    if policy is None:
        log.info("device health is not monitored (--no-health-monitor)")
        return None
    try:
        return await start_node_health(inventory, devices, driver, policy, nvml,
                                       count=_count, count_wait=_count_wait)
    except HealthMonitorError as e:
        log.error("device health monitor not started; devices report Unknown", error=str(e))
        return None


def _count(kind: str, n: int) -> None:
    metrics.health_events.labels(kind=kind).inc(n)


def _count_wait(result: str) -> None:
    metrics.health_monitor_waits.labels(result=result).inc()


def health_tasks(
    api: ApiClient,
    driver: str,
    pool: str,
    health: NodeHealth,
    board: DeviceHealthBoard,
    preparer: NodePreparer,
    data_dir: Path,
) -> list[asyncio.Task[None]]:
    """The loops that follow the keeper, started."""

    def uses() -> list[ClaimUse]:
        return [
            ClaimUse(e.namespace, e.name, e.uid, tuple(d.device for d in e.devices if d.pool == pool))
            for e in preparer.read_checkpoint().claims.values()
        ]

    keeper = health.keeper
    events = ClaimEvents(api, driver, pool, claims_using(uses))
    return [
        asyncio.create_task(keeper.settle_forever(), name="health-settle"),
        asyncio.create_task(mirror(board, keeper), name="health-stream"),
        asyncio.create_task(keep_fresh(board, health.alive), name="health-heartbeat"),
        asyncio.create_task(history.keep_file(keeper, data_dir / history.FILE_NAME), name="health-history"),
        asyncio.create_task(events.follow(keeper), name="health-events"),
    ]
