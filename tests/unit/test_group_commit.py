"""GroupCommit: calls that arrive together share one run; no caller is left waiting."""

from __future__ import annotations

import asyncio

import pytest

from dra_driver.plugin.group_commit import GroupCommit


class _Work:
    """A run that records its batches and, if `gate` is set, waits for it (a worker thread's section)."""

    def __init__(self, gate: asyncio.Event | None = None, fail: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.running = 0
        self.most_at_once = 0
        self.gate = gate
        self.fail = fail

    async def __call__(self, items: list[str]) -> dict[str, str]:
        self.batches.append(items)
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.fail:
                raise OSError("disk full")
            return {i: f"done {i}" for i in items}
        finally:
            self.running -= 1


def test_calls_that_arrive_together_share_one_run() -> None:
    async def main() -> None:
        work = _Work()
        commit: GroupCommit[str, str] = GroupCommit(work)
        results = await asyncio.gather(*(commit.submit([f"c{i}"]) for i in range(16)))
        assert [r[f"c{i}"] for i, r in enumerate(results)] == [f"done c{i}" for i in range(16)]
        assert len(work.batches) == 1 and sorted(work.batches[0]) == sorted(f"c{i}" for i in range(16))
        assert await commit.submit(["alone"]) == {"alone": "done alone"}
        assert work.batches[-1] == ["alone"]

    asyncio.run(main())


def test_calls_during_a_run_join_the_next_and_runs_never_overlap() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        work = _Work(gate)
        commit: GroupCommit[str, str] = GroupCommit(work)
        first = asyncio.create_task(commit.submit(["a"]))
        await asyncio.sleep(0.01)
        later = [asyncio.create_task(commit.submit([x])) for x in ("b", "c")]
        await asyncio.sleep(0.01)
        gate.set()
        assert (await first)["a"] == "done a"
        assert [(await t)[x] for t, x in zip(later, ("b", "c"), strict=True)] == ["done b", "done c"]
        assert work.batches == [["a"], ["b", "c"]] and work.most_at_once == 1

    asyncio.run(main())


def test_the_callers_who_joined_get_their_answers_when_the_first_caller_is_cancelled() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        work = _Work(gate)
        commit: GroupCommit[str, str] = GroupCommit(work)
        tasks = [asyncio.create_task(commit.submit([x])) for x in ("a", "b", "c")]
        await asyncio.sleep(0.01)  # one batch of three, waiting at the gate
        tasks[0].cancel()  # the kubelet gave up on the first RPC
        await asyncio.sleep(0.01)
        late = asyncio.create_task(commit.submit(["d"]))  # must wait: a batch is still running
        await asyncio.sleep(0.01)
        assert work.most_at_once == 1 and len(work.batches) == 1
        gate.set()
        assert [(await t)[x] for t, x in zip(tasks[1:], ("b", "c"), strict=True)] == ["done b", "done c"]
        assert (await asyncio.wait_for(late, 5))["d"] == "done d"
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        assert work.batches == [["a", "b", "c"], ["d"]] and work.most_at_once == 1

    asyncio.run(main())


def test_a_failed_run_reaches_every_caller_of_its_batch() -> None:
    async def main() -> None:
        commit: GroupCommit[str, str] = GroupCommit(_Work(fail=True))
        results = await asyncio.gather(*(commit.submit([x]) for x in ("a", "b")), return_exceptions=True)
        assert [str(r) for r in results] == ["disk full", "disk full"]

    asyncio.run(main())
