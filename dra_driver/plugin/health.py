"""Per-device health as the kubelet's health stream reports it.

A `DeviceHealthBoard` holds the current status of every device of the node and lets
any number of streams follow it: each follower first gets the complete list, then the
complete list again after every change (the protocol wants full lists, not deltas).
`mirror` keeps the board equal to the health keeper's views; `keep_fresh` resends the
list every `HEARTBEAT_SECONDS` with fresh timestamps while the monitor is alive, because
the kubelet marks a device Unknown 30 s after its last report. Without a monitor the
devices are Unknown ("not monitored"), never claimed Healthy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Final, Literal

from dra_driver.health.keeper import HealthKeeper
from dra_driver.health.notify import ClaimUse

HealthStatus = Literal["UNKNOWN", "HEALTHY", "UNHEALTHY"]

HEARTBEAT_SECONDS: Final = 10.0  # well inside the kubelet's 30 s
NOT_MONITORED: Final = "device health is not monitored (--no-health-monitor)"


@dataclass(frozen=True)
class DeviceHealth:
    pool: str
    device: str
    status: HealthStatus
    updated: float
    message: str = ""
    timeout_seconds: int = 0  # <= 0: the kubelet's default


class DeviceHealthBoard:
    """The node's device health; asyncio-only, owned by the plugin's event loop."""

    def __init__(
        self, pool: str, devices: Iterable[str], status: HealthStatus = "HEALTHY", message: str = ""
    ) -> None:
        now = time.time()
        self._health = {d: DeviceHealth(pool, d, status, now, message) for d in devices}
        self._changed = asyncio.Condition()
        self._version = 0

    def snapshot(self) -> tuple[DeviceHealth, ...]:
        return tuple(self._health[d] for d in sorted(self._health))

    async def set_many(self, updates: Mapping[str, tuple[HealthStatus, str]]) -> None:
        now = time.time()
        changed = False
        for device, (status, message) in updates.items():
            current = self._health[device]
            if (current.status, current.message) != (status, message):
                self._health[device] = replace(current, status=status, message=message, updated=now)
                changed = True
        if changed:
            await self._bump()

    async def refresh(self) -> None:
        """Vouch for every status again now: a new timestamp, and the full list resent."""
        now = time.time()
        self._health = {d: replace(h, updated=now) for d, h in self._health.items()}
        await self._bump()

    async def _bump(self) -> None:
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    async def follow(self) -> AsyncIterator[tuple[DeviceHealth, ...]]:
        seen = -1
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._version != seen)  # noqa: B023 - evaluated at once
                seen = self._version
                snapshot = self.snapshot()
            yield snapshot


async def mirror(board: DeviceHealthBoard, keeper: HealthKeeper) -> None:
    """Keep the board equal to the keeper's device views."""
    async for snapshot in keeper.watch():
        await board.set_many(
            {
                name: ("HEALTHY", "") if view.healthy else ("UNHEALTHY", view.message)
                for name, view in snapshot.views.items()
            }
        )


async def keep_fresh(
    board: DeviceHealthBoard, alive: Callable[[], bool], every: float = HEARTBEAT_SECONDS
) -> None:
    """Resend the list every `every` seconds while `alive()` (the monitor's loop turns)."""
    while True:
        await asyncio.sleep(every)
        if alive():
            await board.refresh()


def claims_using(read: Callable[[], Iterable[ClaimUse]]) -> Callable[[], Awaitable[list[ClaimUse]]]:
    """An async lookup of the prepared claims, reading the checkpoint off the event loop."""

    async def lookup() -> list[ClaimUse]:
        return list(await asyncio.to_thread(lambda: list(read())))

    return lookup
