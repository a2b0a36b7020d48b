"""Run a daemon coroutine until SIGTERM or SIGINT, then let it clean up.

The signal cancels the main task; daemons do their shutdown in `finally` blocks, so a
pod deletion and a Ctrl-C take the same path. The loop's thread pool (`asyncio.to_thread`)
is bounded to `IO_THREADS`: the daemons' blocking work is file I/O that a file lock
serializes anyway, and the default pool (up to 32 threads on a big node, each with its own
malloc arena) only costs memory.

SIGUSR2 writes the stack of every thread to stderr (`faulthandler`, from a C signal
handler, so it answers even when the event loop is stuck) and the daemon carries on: the
`kill -USR2` an operator of NVIDIA's driver sends for a goroutine dump works here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import signal
import sys
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import structlog

log = structlog.get_logger(__name__)

IO_THREADS: Final = 4


def run_until_signalled(main: Coroutine[Any, Any, None]) -> None:
    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(IO_THREADS, thread_name_prefix="io"))

        def stop(sig: signal.Signals) -> None:
            log.info("stopping", signal=sig.name)
            task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop, sig)
        with contextlib.suppress(asyncio.CancelledError):
            await main

    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
    try:
        asyncio.run(runner())
    finally:
        faulthandler.unregister(signal.SIGUSR2)
