"""The plugin's DRA gRPC server in a process of its own, for tests/unit/test_kubelet_grpc.py.

    python tests/unit/grpc_server_process.py SOCKET [DEFAULT_DEADLINE_SECONDS]

Serves the real DRA and health services (dra_driver.plugin.service) from the real
SocketServer on SOCKET, with a fake preparer: a claim named `slow` takes SLOW_SECONDS,
one named `bad` is refused, any other is prepared with no devices. Like the real one, each
Prepare opens a file (the real one opens its lock, checkpoint and CDI spec): a Prepare that
finds no descriptor left fails its claims with the error. Prints `ready PID`
once the socket serves and stops (grace 1 s) on SIGTERM or SIGINT. Like the daemon at
start, it first raises its soft open-files limit to the hard one. A process of its own
so that a test can measure the server's memory alone (/proc/PID/status) and so that a
test's client cannot share its event loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from dra_driver import log
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.server import DEFAULT_DEADLINE_SECONDS, SocketServer, raise_open_files_limit
from dra_driver.plugin.service import add_dra_services
from dra_driver.plugin.state import ClaimResult

SLOW_SECONDS = 2.0


class FakePreparer:
    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        if any(r.name == "slow" for r in refs):
            await asyncio.sleep(SLOW_SECONDS)
        try:
            with tempfile.TemporaryFile():
                pass
        except OSError as e:
            return {r.uid: ClaimResult(error=f"preparing failed: {e}") for r in refs}
        return {r.uid: ClaimResult(error="refused" if r.name == "bad" else None) for r in refs}

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        return {r.uid: ClaimResult() for r in refs}


class QuietBoard:
    """A health board that never changes (the health stream is not under test here)."""

    async def follow(self) -> AsyncIterator[tuple[()]]:
        yield ()
        await asyncio.Event().wait()


async def serve(socket: Path, deadline: float) -> None:
    server = SocketServer(
        "dra", lambda s: add_dra_services(s, FakePreparer(), QuietBoard()), deadline  # type: ignore[arg-type]
    )
    await server.start(socket)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    print(f"ready {os.getpid()}", flush=True)
    await stopping.wait()
    await server.stop(1)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(f"usage: {sys.argv[0]} SOCKET [DEFAULT_DEADLINE_SECONDS]")
    log.configure("info", "json")  # to stderr: stdout carries only the `ready` line
    raise_open_files_limit()
    deadline = float(sys.argv[2]) if len(sys.argv) == 3 else DEFAULT_DEADLINE_SECONDS
    asyncio.run(serve(Path(sys.argv[1]), deadline))
