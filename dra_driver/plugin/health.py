"""Per-device health as the kubelet's health stream reports it.

A `DeviceHealthBoard` holds the current status of every device of the node and lets
any number of streams follow it: each follower first gets the complete list, then the
complete list again after every change (the protocol wants full lists, not deltas).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from typing import Literal

HealthStatus = Literal["UNKNOWN", "HEALTHY", "UNHEALTHY"]


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

    def __init__(self, pool: str, devices: Iterable[str]) -> None:
        now = time.time()
        self._health = {d: DeviceHealth(pool, d, "HEALTHY", now) for d in devices}
        self._changed = asyncio.Condition()
        self._version = 0

    def snapshot(self) -> tuple[DeviceHealth, ...]:
        return tuple(self._health[d] for d in sorted(self._health))

    async def set(self, device: str, status: HealthStatus, message: str = "") -> None:
        current = self._health[device]
        if (current.status, current.message) == (status, message):
            return
        self._health[device] = replace(current, status=status, message=message, updated=time.time())
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
