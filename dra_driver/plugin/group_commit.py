"""Group commit: the work of concurrent calls shares one locked transaction.

Every call queues its items and waits; one task runs the queue in batches, one batch at
a time. That task starts one turn of the event loop after the call that found it idle,
so the calls that arrive together (the kubelet's concurrent RPCs reach the plugin in one
read, claim reads answer in one poll) make one batch, and calls that arrive while a batch
runs (in a worker thread: it waits for the other instance's lock or for a sharing daemon)
make the next: 16 concurrent calls cost one to three checkpoint reads and writes instead
of sixteen, and no call waits for more than the batch in flight plus its own. Each caller
gets the results of its whole batch, keyed by claim UID, and picks its own; a caller that
gives up (a cancelled RPC) leaves the batch running for the others.

It must not know what the work is, nor run two batches at once (the file lock would
serialize them anyway; a second runner would only split the batch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class GroupCommit(Generic[Item, Result]):
    def __init__(self, run: Callable[[list[Item]], Awaitable[dict[str, Result]]]) -> None:
        self._run = run
        self._queue: list[tuple[list[Item], asyncio.Future[dict[str, Result]]]] = []
        self._runner: asyncio.Task[None] | None = None  # the loop keeps only a weak reference

    async def submit(self, items: Sequence[Item]) -> dict[str, Result]:
        """Run `items` in the next batch; the batch's results by claim UID."""
        future: asyncio.Future[dict[str, Result]] = asyncio.get_running_loop().create_future()
        self._queue.append((list(items), future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run_queue(), name="group-commit")
        return await future

    async def _run_queue(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                results = await self._run([item for items, _ in batch for item in items])
            except Exception as e:  # every caller of the batch gets the failure
                for _, future in batch:
                    if not future.done():  # a caller that gave up no longer listens
                        future.set_exception(e)
                continue
            for _, future in batch:
                if not future.done():
                    future.set_result(results)
