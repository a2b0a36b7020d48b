"""Who holds which GPU, told to the API server and to Prometheus: each prepared device's
entry in its claim's `status.devices` (KEP-4817) and one `gpu_dra_device_claim_info` series.

After a claim is prepared here, `ClaimStatus` writes one `status.devices` entry per device
of this node's pool in the claim: `driver`, `pool`, `device`, `shareID`, a `Ready`
condition and `data` (UUID, PCI bus id, minor, product, memory, the MIG instance or the
memory share, the NVLink peers) by server-side apply to the claim's status, with a field
manager per driver and node, so that the plugins of several nodes (and the two instances
of one node during a rolling update, which share the manager) never fight over the list.
A health change flips the devices' `Ready` to False with the reason, and back on recovery.
At Unprepare the entries are released by applying an empty list (the API server drops
entries of a deallocated claim by itself); a claim whose entries were never written is
not written at all.

A work queue, as dra-example-driver's status_updater.go: the DRA service hands it each
claim's new state (with what Prepare read of the claim: no second GET) and it writes after
the kubelet's answer, in the background: once per state change, coalesced per claim (the
latest wanted state wins; a claim is never written by two workers at once), at most
`CONCURRENCY` writes at a time, none started while a kubelet call is in flight or within
`QUIET_PERIOD` of the last one's end (for at most `QUIET_MAX_WAIT`: the kubelet's calls
come in bursts as pods start, and a burst's writes wait for its end; a claim prepared and
unprepared within it is never written), each failure retried with backoff by this queue
(ATTEMPTS in all; 404/409/422 end it: the claim is gone, re-created or deallocated; a 429's
Retry-After is waited out). The queue is the one retry layer: it asks `kube.request` for one
attempt each time (`attempts=1`), so a write meets the API server at most ATTEMPTS times. An
error is logged with the claim's identity and counted (`gpu_dra_api_errors{component=
"claim-status"}`); a 404 is not one: a claim made from a template goes with its pod, and its
release finds it gone (debug).

What an entry says is worked out in device_status.py (pure); this module is the queue and
its writes. It must NOT fail, delay or hold up a Prepare, raise to its caller, or touch
the checkpoint or node state. Only a claim reported without its object (the plugin restarted and reports
what its checkpoint holds) is read from the API server, by the queue's worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Literal

import structlog

from dra_driver import kube, metrics
from dra_driver.devices import NodeDevice
from dra_driver.health.effects import DeviceView
from dra_driver.health.keeper import HealthKeeper
from dra_driver.jsontypes import JSON
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.device_status import (
    MAX_FIELD_MANAGER,
    ClaimFacts,
    Holder,
    InfoLabels,
    apply_body,
    claim_facts,
    device_data,
    field_manager,
    info_labels,
    nvlink_peers,
    ready_condition,
)
from dra_driver.plugin.prepared import PreparedDevice

log = structlog.get_logger(__name__)

CLAIM: Final = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
COMPONENT: Final = "claim-status"  # the api_errors label of this writer
ATTEMPTS: Final = 5
FIRST_BACKOFF_SECONDS: Final = 1.0
CONCURRENCY: Final = 4  # writes in flight at once, for the whole node
# A write waits until no kubelet call was in flight for this long (a burst of pod starts
# is answered before its claims are written, so no write competes with a Prepare on the
# event loop), but no longer than QUIET_MAX_WAIT: a node that is never quiet still gets
# its status.
QUIET_PERIOD: Final = 0.2
QUIET_MAX_WAIT: Final = 1.0
WRITE_TIMEOUT_SECONDS: Final = 10.0  # one attempt of the queue: one request
# At stop (the kubelet sends no call any more) the writes wanted so far get this long; what
# is left then, a new start writes again from its checkpoint (releases: the API server drops
# a deallocated claim's entries by itself).
STOP_FLUSH_SECONDS: Final = 2.0
# Answers that another attempt cannot change: the claim is gone or was re-created (the
# uid precondition), or its allocation no longer has the device (it was deallocated).
FINAL_STATUSES: Final = frozenset({404, 409, 422})


# --------------------------------------------------------------------------- I/O


@dataclass(frozen=True)
class _Wanted:
    """A claim's latest wanted state: its devices (none: released) and what the claim said."""

    ref: ClaimRef
    devices: tuple[PreparedDevice, ...]
    facts: ClaimFacts | None  # None: read the claim first (reported from the checkpoint)
    generation: int


# done: written; final: another attempt cannot help (the claim is gone or re-created);
# retry: again after a backoff
Outcome = Literal["done", "final", "retry"]


class ClaimStatus:
    """The queue that writes and releases the `status.devices` entries and the info series
    of this node's claims."""

    def __init__(
        self,
        api: kube.ApiClient,
        driver: str,
        node: str,
        devices: Mapping[str, NodeDevice],
        peers: Mapping[str, Sequence[JSON]],
        first_backoff: float = FIRST_BACKOFF_SECONDS,
        concurrency: int = CONCURRENCY,
        quiet_max_wait: float = QUIET_MAX_WAIT,
        quiet_period: float = QUIET_PERIOD,
    ) -> None:
        self.api = api
        self.driver = driver
        self.node = node
        self.devices = devices
        self.peers = peers
        self.manager = field_manager(driver, node)
        self.first_backoff = first_backoff
        self.concurrency = concurrency
        self.quiet_max_wait = quiet_max_wait
        self.quiet_period = quiet_period
        self.views: dict[str, DeviceView] = {}
        # what this node holds now (for health rewrites), by claim uid
        self._held: dict[str, tuple[ClaimRef, tuple[PreparedDevice, ...], ClaimFacts | None]] = {}
        # claims whose entries this process knows are not on the server: freshly prepared,
        # not written yet; an Unprepare of one of them writes nothing
        self._unwritten: set[str] = set()
        self._since: dict[tuple[str, str], tuple[bool, datetime]] = {}
        self._series: dict[str, list[InfoLabels]] = {}
        self._wanted: dict[str, _Wanted] = {}
        self._generation = 0
        self._attempts: dict[str, int] = {}
        self._ready: deque[str] = deque()  # claims to write, each once
        self._queued: set[str] = set()
        self._active: set[str] = set()  # being written now
        self._retries: dict[str, asyncio.TimerHandle] = {}
        self._retry_after: dict[str, float] = {}  # a 429's Retry-After, for the next retry's delay
        self._workers: set[asyncio.Task[None]] = set()  # started on demand, end when nothing is ready
        self._working = 0
        self._busy = 0
        self._last_call_end = float("-inf")  # time.monotonic()
        # futures rather than asyncio.Events, which stay bound to the first loop that waits
        self._quiet_waiters: list[asyncio.Future[None]] = []
        self._idle_waiters: list[asyncio.Future[None]] = []

    # -- what the DRA service tells it -------------------------------------------------------------

    def call_started(self) -> None:
        """A kubelet call is in flight: no write starts until QUIET_PERIOD after it ended (or
        QUIET_MAX_WAIT)."""
        self._busy += 1

    def call_ended(self) -> None:
        """Its answer was sent (grpc calls this at the RPC's end)."""
        self._busy = max(0, self._busy - 1)
        self._last_call_end = time.monotonic()
        if not self._busy:
            _wake(self._quiet_waiters)

    def prepared(self, ref: ClaimRef, devices: Sequence[PreparedDevice], claim: JSON | None = None) -> None:
        """`ref` is prepared with `devices`; `claim` is the object Prepare read (None: the
        claim was prepared before, and is read when written)."""
        mine = tuple(d for d in devices if d.pool == self.node and d.device in self.devices)
        if not mine:
            return
        held = self._held.get(ref.uid)
        facts = claim_facts(claim, self.driver, mine) if claim is not None else None
        if held is not None and held[0] == ref and held[1] == mine:
            if facts is not None and held[2] is None:
                self._held[ref.uid] = (ref, mine, facts)
            return  # no change of state (a kubelet retry, or the other instance's Prepare)
        if held is None and claim is not None and ref.uid not in self._wanted:
            self._unwritten.add(ref.uid)  # fresh: nothing of ours can be on the claim yet
        self._held[ref.uid] = (ref, mine, facts)
        self._want(ref, mine, facts)

    def unprepared(self, ref: ClaimRef) -> None:
        held = self._held.pop(ref.uid, None)
        self._drop_series(ref.uid)
        for key in [k for k in self._since if k[0] == ref.uid]:
            del self._since[key]
        if ref.uid in self._unwritten:  # prepared and unprepared before its write began
            self._unwritten.discard(ref.uid)
            self._forget(ref.uid)
            return
        if held is None and ref.uid in self._wanted and not self._wanted[ref.uid].devices:
            return  # a release is queued already
        # released even if this process did not write it: the other instance of a rolling
        # update may have, under the same field manager
        self._want(ref, (), None)

    def health(self, views: Mapping[str, DeviceView]) -> None:
        """New device views: rewrite the claims holding a device whose view changed."""
        changed = {n for n, v in views.items() if self.views.get(n) != v}
        self.views = dict(views)
        for ref, devices, facts in list(self._held.values()):
            if any(d.device in changed for d in devices):
                self._want(ref, devices, facts)

    async def follow(self, keeper: HealthKeeper) -> None:
        async for snapshot in keeper.watch():
            self.health(snapshot.views)

    async def settled(self) -> None:
        """Wait until every write wanted so far has ended, retries included (tests, and stop)."""
        while self._wanted or self._active:
            waiter = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await waiter

    async def stop(self, flush: float = STOP_FLUSH_SECONDS) -> None:
        """Stop writing, once the writes wanted so far ended or `flush` seconds passed."""
        if self._wanted or self._active:
            try:
                async with asyncio.timeout(flush):
                    await self.settled()
            except TimeoutError:
                log.warning("claim device status writes left unmade at stop", claims=len(self._wanted),
                            flush_seconds=flush)
        for timer in self._retries.values():
            timer.cancel()
        self._retries.clear()
        workers = list(self._workers)
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        self._working = 0  # a task cancelled before it ran never reached its finally
        self._ready.clear()
        self._queued.clear()
        self._wanted.clear()
        _wake(self._idle_waiters)
        for uid in list(self._series):
            self._drop_series(uid)

    # -- the queue --------------------------------------------------------------------------------

    def _want(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...], facts: ClaimFacts | None) -> None:
        self._generation += 1
        self._wanted[ref.uid] = _Wanted(ref, devices, facts, self._generation)
        self._attempts.pop(ref.uid, None)  # a new state starts with a fresh backoff
        timer = self._retries.pop(ref.uid, None)
        if timer is not None:
            timer.cancel()
        self._enqueue(ref.uid)

    def _forget(self, uid: str) -> None:
        self._wanted.pop(uid, None)
        self._attempts.pop(uid, None)
        self._retry_after.pop(uid, None)
        timer = self._retries.pop(uid, None)
        if timer is not None:
            timer.cancel()
        self._check_idle()

    def _enqueue(self, uid: str) -> None:
        self._retries.pop(uid, None)
        if uid not in self._queued:
            self._queued.add(uid)
            self._ready.append(uid)
        if self._working < self.concurrency:
            self._working += 1  # counted until its loop ends, not until the task's callbacks ran
            task = asyncio.get_running_loop().create_task(self._work(), name="claim-status")
            self._workers.add(task)
            task.add_done_callback(self._workers.discard)

    def _check_idle(self) -> None:
        if not self._wanted and not self._active:
            _wake(self._idle_waiters)

    async def _work(self) -> None:
        try:
            await self._work_ready()
        finally:
            self._working -= 1

    async def _work_ready(self) -> None:
        while self._ready:
            uid = self._ready.popleft()
            self._queued.discard(uid)
            if uid in self._active:
                continue  # the worker writing it queues it again when done
            await self._quiet()
            wanted = self._wanted.get(uid)  # read after the wait: the latest state wins
            if wanted is None or uid in self._active:
                continue
            self._active.add(uid)
            self._unwritten.discard(uid)  # from now on the server may have it
            outcome: Outcome
            try:
                outcome = await self._attempt(wanted)
            except Exception:  # a bug of ours must not stop the queue
                log.exception("claim device status write failed", **wanted.ref.log_fields())
                outcome = "final"
            finally:
                self._active.discard(uid)
            self._settle(wanted, outcome)

    async def _quiet(self) -> None:
        """Until no kubelet call was in flight for `quiet_period`, or `quiet_max_wait` passed."""
        deadline = time.monotonic() + self.quiet_max_wait
        while (now := time.monotonic()) < deadline:
            if self._busy:
                waiter = asyncio.get_running_loop().create_future()
                self._quiet_waiters.append(waiter)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter, deadline - now)
            elif now - self._last_call_end < self.quiet_period:
                await asyncio.sleep(min(self._last_call_end + self.quiet_period, deadline) - now)
            else:
                return

    def _settle(self, done: _Wanted, outcome: Outcome) -> None:
        uid = done.ref.uid
        current = self._wanted.get(uid)
        if current is not None and current.generation != done.generation:
            self._enqueue(uid)  # a newer state came meanwhile
        elif current is not None and outcome == "retry":
            attempt = self._attempts[uid] = self._attempts.get(uid, 1) + 1
            if attempt > ATTEMPTS:
                log.error("claim device status not written; giving up", attempts=ATTEMPTS,
                          **done.ref.log_fields())
                self._forget(uid)
            else:
                delay = self.first_backoff * 2.0 ** (attempt - 2) * random.uniform(0.5, 1.0)
                delay = max(delay, self._retry_after.pop(uid, 0.0))
                self._retries[uid] = asyncio.get_running_loop().call_later(delay, self._enqueue, uid)
        elif current is not None:
            self._forget(uid)
        self._check_idle()

    # -- one attempt ------------------------------------------------------------------------------

    async def _attempt(self, wanted: _Wanted) -> Outcome:
        ref = wanted.ref
        with structlog.contextvars.bound_contextvars(**ref.log_fields()):
            try:
                if not wanted.devices:
                    await self._apply(ref, [])
                    # debug: the kubelet's call already logged `unprepared`; failures warn below
                    log.debug("claim device status released")
                    return "done"
                facts = wanted.facts or await self._read(ref, wanted.devices)
                if facts is None:
                    return "final"
                self._set_series(ref, wanted.devices, facts.pods)
                entries = [self._entry(ref, facts, d) for d in wanted.devices]
                await self._apply(ref, entries)
                log.debug("claim device status written", devices=[d.device for d in wanted.devices],
                         ready=[e["conditions"][0]["status"] for e in entries])
                return "done"
            except kube.TRANSIENT_ERRORS as e:
                status = getattr(e, "status", None)
                if status == 404:  # the claim is gone (its pod's deletion took it): the expected end
                    log.debug("claim gone; its device status needs no write")
                    return "final"
                metrics.api_error(COMPONENT, e)
                final = status in FINAL_STATUSES
                retry_after = getattr(e, "retry_after", None)
                if retry_after is not None:
                    self._retry_after[ref.uid] = float(retry_after)
                attempt = self._attempts.get(ref.uid, 1)
                log.warning("claim device status write failed", error=str(e)[:300], status=status,
                            attempt=attempt, retrying=not final and attempt < ATTEMPTS)
                return "final" if final else "retry"

    async def _read(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...]) -> ClaimFacts | None:
        """The facts of a claim reported without its object; None: it was re-created."""
        path = CLAIM.format(namespace=ref.namespace, name=ref.name)
        claim = await kube.request(self.api, "GET", path, timeout=WRITE_TIMEOUT_SECONDS, attempts=1)
        if claim.get("metadata", {}).get("uid") != ref.uid:
            log.info("claim was re-created; its status is not written")
            return None
        facts = claim_facts(claim, self.driver, devices)
        held = self._held.get(ref.uid)
        if held is not None and held[1] == devices:
            self._held[ref.uid] = (ref, devices, facts)  # read once, also for health rewrites
        return facts

    def _apply(self, ref: ClaimRef, entries: list[JSON]) -> Awaitable[JSON]:
        return kube.request(
            self.api, "PATCH", CLAIM.format(namespace=ref.namespace, name=ref.name) + "/status",
            body=apply_body(ref, entries), query={"fieldManager": self.manager, "force": "true"},
            content_type="application/apply-patch+yaml", timeout=WRITE_TIMEOUT_SECONDS, attempts=1,
        )

    def _entry(self, ref: ClaimRef, facts: ClaimFacts, prepared: PreparedDevice) -> JSON:
        node_device = self.devices[prepared.device]
        view = self.views.get(prepared.device)
        healthy = view is None or view.healthy
        key = (ref.uid, prepared.device)
        was = self._since.get(key)
        if was is None or was[0] != healthy:
            was = self._since[key] = (healthy, datetime.now(UTC))
        consumed = facts.consumed.get((prepared.pool, prepared.device, prepared.share_id), {})
        entry: JSON = {
            "driver": self.driver,
            "pool": prepared.pool,
            "device": prepared.device,
            "conditions": [ready_condition(view, was[1])],
            "data": device_data(node_device, prepared, self.peers.get(prepared.device, ()), consumed),
        }
        if prepared.share_id is not None:
            entry["shareID"] = prepared.share_id
        return entry

    # -- the info series --------------------------------------------------------------------------

    def _set_series(self, ref: ClaimRef, devices: Sequence[PreparedDevice], pods: Sequence[Holder]) -> None:
        self._drop_series(ref.uid)
        series = [s for d in devices for s in info_labels(ref, self.devices[d.device], d, pods)]
        for s in series:
            metrics.device_claim_info.labels(*s).set(1)
        self._series[ref.uid] = series

    def _drop_series(self, uid: str) -> None:
        for s in self._series.pop(uid, []):
            with contextlib.suppress(KeyError):
                metrics.device_claim_info.remove(*s)


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
    waiters.clear()


# the names the daemon's assembly and the tests take from here, beside the queue
__all__ = ["ATTEMPTS", "MAX_FIELD_MANAGER", "ClaimStatus", "field_manager", "nvlink_peers"]
