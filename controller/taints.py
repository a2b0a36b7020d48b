"""The health keeper's taints into a pool's slices: the loop that keeps them current.

Changes within TAINT_WRITE_INTERVAL coalesce into one write. Must not decide taints (the
keeper does) nor write slices itself (the slice controller does).
"""

from __future__ import annotations

import asyncio
from typing import Final

import structlog

from controller.reconciler import SliceController
from dra_driver.health.keeper import HealthKeeper

log = structlog.get_logger(__name__)

TAINT_WRITE_INTERVAL: Final = 1.0  # health taint changes within this interval coalesce into one write


async def follow_taints(
    ctl: SliceController, keeper: HealthKeeper, pool: str, interval: float = TAINT_WRITE_INTERVAL
) -> None:
    """Forever: each new snapshot of the keeper's taints into the pool's slices."""
    async for snapshot in keeper.watch():
        taints = snapshot.taints()
        if ctl.set_taints(pool, taints):
            log.info("publishing device taints", taints={d: [f"{t.key}={t.value}:{t.effect}" for t in ts]
                                                         for d, ts in taints.items()})
        await asyncio.sleep(interval)
