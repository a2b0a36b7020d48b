"""Group commit: the work of concurrent calls shares one locked transaction.

Calls that arrive together (the kubelet's concurrent RPCs reach the plugin in one read,
claim reads answer in one poll) and calls that arrive while a transaction runs (in a
worker thread: it waits for the other instance's lock or for a sharing daemon) queue up,
and the next transaction takes them all at once: 16 concurrent calls cost one to three
checkpoint reads and writes instead of sixteen, and no call waits for more than the one
transaction in flight plus its own. A call that finds nothing in flight waits one turn
of the event loop for company, then runs the batch in its own task. Each caller gets the
results of the whole batch, keyed by claim UID, and picks its own.

It must not know what the work is, nor run two batches at once (the file lock would
serialize them anyway; a second worker would only split the batch).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class GroupCommit(Generic[Item, Result]):
    def __init__(self, run: Callable[[list[Item]], Awaitable[dict[str, Result]]]) -> None:
        self._run = run
        self._queue: list[tuple[list[Item], asyncio.Future[dict[str, Result]] | None]] = []
        self._busy = False
        # The drain task or shielded batch in flight: the loop keeps only a weak reference.
        self._worker: asyncio.Future[Any] | None = None

    async def submit(self, items: Sequence[Item]) -> dict[str, Result]:
        """Run `items` in the next batch; the batch's results by claim UID. With nothing in
        flight, the caller runs the batch itself, in its own task, after one turn of the
        event loop in which the calls that arrived with it join (no task to hand it over:
        most calls find the node idle)."""
        if self._busy:
            future: asyncio.Future[dict[str, Result]] = asyncio.get_running_loop().create_future()
            self._queue.append((list(items), future))
            return await future
        self._busy = True
        try:
            await asyncio.sleep(0)
        except BaseException:
            self._batch_done()
            raise
        joined, self._queue = self._queue, []
        batch = [(list(items), None), *joined]
        if not joined:
            try:
                return await self._run_batch(batch)
            finally:
                self._batch_done()
        # Others wait on this batch: it must finish even if this caller is cancelled (the
        # kubelet gave up on its RPC) while a worker thread runs it.
        runner = self._worker = asyncio.ensure_future(self._run_batch(batch))
        runner.add_done_callback(self._batch_done)
        return await asyncio.shield(runner)

    def _batch_done(self, runner: asyncio.Future[dict[str, Result]] | None = None) -> None:
        if runner is not None and not runner.cancelled():
            runner.exception()  # retrieved: its callers got it, or the one caller left
        self._busy = False
        self._start_draining()

    def _start_draining(self) -> None:
        if self._queue and not self._busy:
            self._busy = True
            self._worker = asyncio.create_task(self._drain(), name="group-commit")

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                with contextlib.suppress(Exception):  # each caller of the batch got the failure
                    await self._run_batch(batch)
        finally:
            self._busy = False

    async def _run_batch(
        self, batch: list[tuple[list[Item], asyncio.Future[dict[str, Result]] | None]]
    ) -> dict[str, Result]:
        """Run the batch's items at once and answer every waiting caller (None: the caller
        running the batch, who gets the results or the failure as the return value)."""
        try:
            results = await self._run([item for items, _ in batch for item in items])
        except Exception as e:
            for _, future in batch:
                if future is not None and not future.done():  # a cancelled RPC no longer listens
                    future.set_exception(e)
            raise
        for _, future in batch:
            if future is not None and not future.done():
                future.set_result(results)
        return results
