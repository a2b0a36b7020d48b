"""Run a daemon coroutine until SIGTERM or SIGINT, then let it clean up.

The signal cancels the main task; daemons do their shutdown in `finally` blocks, so a
pod deletion and a Ctrl-C take the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def run_until_signalled(main: Coroutine[Any, Any, None]) -> None:
    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()

        def stop(sig: signal.Signals) -> None:
            log.info("stopping", signal=sig.name)
            task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop, sig)
        with contextlib.suppress(asyncio.CancelledError):
            await main

    asyncio.run(runner())
