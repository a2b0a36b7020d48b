"""The slice publisher's loop at fleet size, against an in-memory API: one write per pool, the
echo of our own writes wakes no reconcile, and a reconcile looks at its own pool's slices only.

The API here keeps objects with resourceVersions and sends every write to the watch, as the
API server does; it stands in for `kube.request`/`kube.watch` only (the real API server is
tests/integration/test_slice_controller.py's). What is counted is work (reconciles, slice
objects handed to the plan), never time.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from controller.plan import SLICES, desired_objects, up_to_date
from controller.publisher import pools_for
from controller.reconciler import SliceController
from controller.slices import SliceFeatures
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver import kube
from dra_driver.gpu import discover
from dra_driver.jsontypes import JSON
from dra_driver.kube import ApiException
from dra_driver.probes import Heartbeat
from tests.harness.objects import wait_for_async

POOLS = 300


class MemoryApi:
    """ResourceSlices and Nodes in memory; each write gets a new resourceVersion and a watch event.
    A watch starts after the version it is given and, with `close_every`, ends after that many
    events, as the API server drops a watcher that falls behind. With `post_seconds` each
    create takes that long (a loaded API server): `_settle` must wait for it all the same."""

    def __init__(self, nodes: list[str], close_every: int = 0, post_seconds: float = 0.0) -> None:
        self.versions = itertools.count(100)
        self.slices: dict[str, JSON] = {}
        self.nodes = [{"metadata": {"name": n, "uid": f"uid-{n}"}} for n in nodes]
        self.log: list[tuple[int, str, JSON]] = []  # (version, type, object): the watch history
        self.changed = asyncio.Event()
        self.close_every = close_every
        self.watches = 0
        self.delivered = 0  # the version of the last event a watch handed out
        self.writes = 0
        self.methods: list[str] = []
        self.hidden: set[str] = set()  # left out of LIST answers (created after the list, say)
        self.post_seconds = post_seconds
        self.in_flight = 0  # requests begun and not yet answered

    def _event(self, kind: str, obj: JSON) -> None:
        self.log.append((int(obj["metadata"]["resourceVersion"]), kind, copy.deepcopy(obj)))
        self.changed.set()

    def _store(self, kind: str, obj: JSON) -> JSON:
        obj["metadata"]["resourceVersion"] = str(next(self.versions))
        self.slices[obj["metadata"]["name"]] = obj
        self._event(kind, obj)
        return copy.deepcopy(obj)

    def quiet(self) -> bool:
        """Every event so far has been handed to a watch."""
        return not self.log or self.delivered >= self.log[-1][0]

    async def _slow_post(self) -> None:
        if self.post_seconds:
            await asyncio.sleep(self.post_seconds)  # the server's time to answer a create

    async def request(self, _api: Any, method: str, path: str, body: Any = None, **_: Any) -> JSON:
        self.in_flight += 1
        try:
            return await self._request(method, path, body)
        finally:
            self.in_flight -= 1

    async def _request(self, method: str, path: str, body: Any) -> JSON:
        if path == "/api/v1/nodes":
            return {"items": self.nodes}
        if method == "GET" and path == SLICES:
            return {"metadata": {"resourceVersion": str(next(self.versions))},
                    "items": [copy.deepcopy(s) for n, s in self.slices.items() if n not in self.hidden]}
        self.writes += 1
        self.methods.append(method)
        if method == "POST":
            assert path == SLICES
            await self._slow_post()
            if body["metadata"]["name"] in self.slices:
                raise ApiException(409, "AlreadyExists")
            obj = copy.deepcopy(body)
            obj["metadata"]["uid"] = f"uid-{obj['metadata']['name']}"
            return self._store("ADDED", obj)
        name = path.rsplit("/", 1)[1]
        if method == "DELETE":
            gone = self.slices.pop(name)
            gone["metadata"]["resourceVersion"] = str(next(self.versions))
            self._event("DELETED", gone)
            return gone
        assert method in ("PATCH", "PUT"), method
        existed = name in self.slices
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = self.slices[name]["metadata"]["uid"] if existed else f"uid-{name}"
        return self._store("MODIFIED" if existed else "ADDED", obj)

    async def watch(self, _api: Any, _path: str, version: str, **_: Any) -> AsyncIterator[tuple[str, JSON]]:
        self.watches += 1
        after, sent = int(version), 0
        while True:
            pending = [e for e in self.log if e[0] > after]
            if not pending:
                self.changed.clear()
                await self.changed.wait()
                continue
            for at, kind, obj in pending:
                after, self.delivered = at, max(self.delivered, at)
                yield kind, copy.deepcopy(obj)
                sent += 1
                if self.close_every and sent >= self.close_every:
                    return

    def delete_behind_our_back(self, name: str) -> None:
        gone = self.slices.pop(name)
        gone["metadata"]["resourceVersion"] = str(next(self.versions))
        self._event("DELETED", gone)


@pytest.fixture(params=[0.0, 0.3], ids=["fast-api", "slow-create"])
def post_seconds(request: pytest.FixtureRequest) -> float:
    """Each scenario runs against an API that answers at once and one whose creates take 0.3 s:
    the checks must hold however long a write is in flight."""
    return float(request.param)


def _fleet(
    monkeypatch: pytest.MonkeyPatch, close_every: int = 0, post_seconds: float = 0.0
) -> tuple[MemoryApi, SliceController]:
    inventory = discover("hgx-h200")
    names = [f"node-{i:04d}" for i in range(POOLS)]
    memory = MemoryApi(names, close_every, post_seconds)
    monkeypatch.setattr(kube, "request", memory.request)
    monkeypatch.setattr(kube, "watch", memory.watch)
    pools = pools_for(dict.fromkeys(names, inventory), DRIVER, SliceFeatures(list_attributes=True))
    return memory, watched(SliceController(api=None, driver=DRIVER, pools=pools))  # type: ignore[arg-type]


def watched(ctl: SliceController) -> SliceController:
    """`ctl` with a heartbeat, busy from the moment a reconcile pass takes the marked pools to
    its last write: `settled` reads it. Give it before `run()`."""
    if ctl.heartbeat is None:
        ctl.heartbeat = Heartbeat("publisher", stuck_after=60)
    return ctl


def settled(memory: MemoryApi, ctl: SliceController) -> bool:
    """Nothing left to do and nothing under way: listed and caught up (`synced`), no pool marked,
    no reconcile pass running (so a pass whose create is still in flight counts), no request
    unanswered, and every watch event, our writes' echoes included, handed to the controller."""
    assert ctl.heartbeat is not None, "watched(ctl) before run()"
    return (
        ctl.synced.is_set()
        and not ctl._dirty
        and ctl.heartbeat.busy_since is None
        and memory.in_flight == 0
        and memory.quiet()
    )


async def settle(memory: MemoryApi, ctl: SliceController) -> None:
    """Until the publisher has `settled`; the loop runs on between polls."""
    await wait_for_async("the publisher to settle", lambda: settled(memory, ctl), timeout=60,
                         detail=lambda: (ctl.stats, sorted(ctl._dirty)[:5], memory.in_flight))


def test_a_fleet_is_published_with_one_write_and_one_reconcile_per_pool(
    monkeypatch: pytest.MonkeyPatch, post_seconds: float
) -> None:
    memory, ctl = _fleet(monkeypatch, post_seconds=post_seconds)

    async def scenario() -> None:
        task = asyncio.create_task(ctl.run())
        try:
            await settle(memory, ctl)
            first = copy.copy(ctl.stats)
            # Our writes come back through the watch: none of them may wake a reconcile.
            assert (first.writes, memory.writes) == (POOLS, POOLS)
            assert first.reconciles == POOLS, f"{first.reconciles} reconciles for {POOLS} pools"
            assert first.echoes == POOLS
            assert set(memory.methods) == {"POST"}, "slices the controller does not hold are created"
            # Each reconcile hands the plan its own pool's slices (none yet at the start), not the cache.
            assert first.slices_examined == 0

            # Someone deletes one node's slice: that pool, and only it, is reconciled and rewritten.
            victim = next(iter(memory.slices))
            memory.delete_behind_our_back(victim)
            await settle(memory, ctl)
            assert victim in memory.slices
            assert ctl.stats.writes - first.writes == 1
            assert ctl.stats.reconciles - first.reconciles == 1
            assert ctl.stats.slices_examined - first.slices_examined == 0  # its pool had no slice left

            # A hand edit of another: repaired, and the reconcile looked at that pool's one slice.
            second = copy.copy(ctl.stats)
            edited_name = sorted(memory.slices)[-1]
            edited = copy.deepcopy(memory.slices[edited_name])
            edited["spec"]["devices"][0]["attributes"]["handEdited"] = {"string": "yes"}
            memory._store("MODIFIED", edited)
            await settle(memory, ctl)
            assert "handEdited" not in memory.slices[edited_name]["spec"]["devices"][0]["attributes"]
            assert ctl.stats.reconciles - second.reconciles == 1
            assert ctl.stats.slices_examined - second.slices_examined == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_a_watch_the_server_ends_is_followed_on_without_a_new_list(
    monkeypatch: pytest.MonkeyPatch, post_seconds: float
) -> None:
    """The API server drops watchers that fall behind (a fleet's first publication is thousands
    of events at once): the publisher watches again from the last version it saw. A new list
    would cancel the writes in flight and write again what the server already had."""
    memory, ctl = _fleet(monkeypatch, close_every=7, post_seconds=post_seconds)

    async def scenario() -> None:
        task = asyncio.create_task(ctl.run())
        try:
            await settle(memory, ctl)
            victim = sorted(memory.slices)[3]
            memory.delete_behind_our_back(victim)  # still seen, on whichever watch is open
            await settle(memory, ctl)
            assert victim in memory.slices
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert memory.watches > POOLS // 7 and ctl.stats.rewatches == memory.watches - 1
    assert ctl.stats.lists == 1 and ctl.stats.errors == 0
    assert memory.writes == POOLS + 1, "one create per pool, one for the repair; nothing twice"


def test_a_slice_that_exists_after_all_is_applied_over(
    monkeypatch: pytest.MonkeyPatch, post_seconds: float
) -> None:
    """The create of a slice the cache does not hold meets 409 (it was made after our list): the
    publisher applies its content instead, with no error and no new list."""
    memory, ctl = _fleet(monkeypatch, post_seconds=post_seconds)
    pools = dict(itertools.islice(ctl.pools.items(), 2))
    ctl.pools = pools
    stale_pool = next(iter(pools))
    stale = desired_objects(DRIVER, pools[stale_pool], 1, None)
    name, obj = next(iter(stale.items()))
    obj["spec"]["devices"] = obj["spec"]["devices"][:1]  # someone's older, shorter version
    obj["metadata"]["uid"] = "uid-old"
    memory.slices[name] = obj
    memory.hidden.add(name)

    async def scenario() -> None:
        task = asyncio.create_task(ctl.run())
        try:
            await settle(memory, ctl)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert memory.methods.count("POST") == 2 and memory.methods.count("PATCH") == 1, memory.methods
    stored = memory.slices[name]
    want = desired_objects(DRIVER, pools[stale_pool], stored["spec"]["pool"]["generation"],
                           ctl._owners[stale_pool])[name]
    assert up_to_date(want, stored) and len(stored["spec"]["devices"]) == 8
    assert (ctl.stats.errors, ctl.stats.lists) == (0, 1)
