"""Keeps each pool's ResourceSlices as desired: `SliceController`, the loop that
`controller.publisher.slice_controller` returns.

One list + watch of the driver's slices feeds a cache, indexed by pool; a worker
compares each pool's desired slices with that pool's cached slices (`controller.plan`) and
writes only the differences (a create for a slice it does not hold, server-side apply with
our field manager for one it does; a replace where someone else's fields must go; deletes
with uid/resourceVersion preconditions). Anything
that changes our slices behind our back (the kubelet wiping them at start, a `kubectl
edit`, a delete) comes back through the watch and is repaired within a second; the echo of
our own write (the object at the resourceVersion we already hold) changes nothing and
wakes no reconcile. The work per watch event and per reconcile is bounded by one pool's
slices, never by the cluster's: a fleet controller (`--simulate-fleet`) holds thousands
of pools. When the API server is unreachable the loop backs off (capped) and catches up
when it returns. A write the server refuses as invalid (422) is logged whole, once, and
that pool is not written again until its desired slices change or RETRY_REFUSED_SECONDS
pass; a slice the server stores without some of our fields (a gate the probe missed) is
adopted as it is after one replace, with a warning, instead of being rewritten forever.

It must NOT decide what to write (that is the pure plan) nor crash on API errors: every
failure ends in a retry. Which features to publish and the pools' first desired slices are
decided before it starts (`controller.publisher`), and again when the server's features
change under it (`set_features`, from `controller.publisher.follow_server`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import structlog

from controller.capabilities import FeatureOff
from controller.plan import SLICES, PoolSpec, plan_pool, up_to_date
from controller.slices import SliceFeatures, desired_slices
from dra_driver import kube, metrics
from dra_driver.gpu.model import Inventory
from dra_driver.health.effects import DeviceTaint
from dra_driver.jsontypes import JSON
from dra_driver.kube import ApiClient, ApiException

if TYPE_CHECKING:
    from dra_driver.probes import Heartbeat

__all__ = ["ReconcileStats", "SliceController"]

log = structlog.get_logger(__name__)

# After an outage the slices must come back soon (the kubelet may have wiped them), so the
# retry interval stays short; jitter only ever shortens it.
MAX_BACKOFF_SECONDS = 10.0
# A pool whose write the server refused as invalid is tried again after this long (or at
# once when its desired slices change): a refusal does not go away by itself.
RETRY_REFUSED_SECONDS = 300.0


@dataclass
class ReconcileStats:
    """Counters for tests and benchmarks (writes are what the 'no change, no write' rule is about)."""

    creates: int = 0
    updates: int = 0
    deletes: int = 0
    lists: int = 0
    errors: int = 0
    reconciles: int = 0
    # slice objects looked at by reconciles (plan input): the work per reconcile, one pool's
    # slices, not the whole cache's
    slices_examined: int = 0
    echoes: int = 0  # watch events that were our own write coming back: no reconcile
    rewatches: int = 0  # watches the server ended, followed on from the last version seen
    refused: int = 0  # writes the server refused as invalid (422): not retried in a loop
    adopted: int = 0  # slices the server stored without some of our fields: kept as stored

    @property
    def writes(self) -> int:
        return self.creates + self.updates + self.deletes


@dataclass
class SliceController:
    """Publishes and repairs the slices of `pools` for `driver`; run with `await run()`."""

    api: ApiClient
    driver: str
    pools: dict[str, PoolSpec]
    field_manager: str = ""
    node_selector: str | None = None  # watch only this node's slices (single-node mode)
    # Pools written at once: enough for the API server to use every core of a small control
    # plane on a fleet's first publication (one node's plugin has one pool).
    concurrency: int = 64
    stats: ReconcileStats = field(default_factory=ReconcileStats)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    _cache: dict[str, JSON] = field(default_factory=dict)  # slice name -> object
    _by_pool: dict[str, dict[str, JSON]] = field(default_factory=dict)  # pool -> its slices by name
    _dirty: set[str] = field(default_factory=set)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _owners: dict[str, JSON] = field(default_factory=dict)
    heartbeat: Heartbeat | None = None  # busy while a reconcile pass runs (the liveness probe)
    # what the pools were built from, so that health taints can be added later (set_taints)
    inventories: dict[str, Inventory] = field(default_factory=dict)
    features: SliceFeatures = field(default_factory=SliceFeatures)
    features_off: tuple[FeatureOff, ...] = ()  # asked for, but the server drops their fields
    asked: SliceFeatures = field(default_factory=SliceFeatures)  # what `features` is decided from
    _taints: dict[str, Mapping[str, Sequence[DeviceTaint]]] = field(default_factory=dict)  # per pool
    # pool -> (the desired slices the server refused, when to try them again)
    _refused: dict[str, tuple[tuple[JSON, ...], float]] = field(default_factory=dict)
    # slice name -> (the spec we wrote, the spec the server stored without some of its fields)
    _adopted: dict[str, tuple[JSON, JSON]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.field_manager = self.field_manager or self.driver

    def set_taints(self, pool: str, taints: Mapping[str, Sequence[DeviceTaint]]) -> bool:
        """Publish `taints` (device name -> health taints) in `pool`; marks the pool for a write
        only when its slices change, so repeating the same taints writes nothing."""
        self._taints[pool] = taints
        return self._rebuild(pool)

    def set_features(self, features: SliceFeatures, off: Sequence[FeatureOff]) -> list[str]:
        """Publish with `features` from now on (the server's features changed under us); returns
        the pools whose slices change, each marked for a write."""
        self.features, self.features_off = features, tuple(off)
        return [pool for pool in self.inventories if self._rebuild(pool)]

    def _rebuild(self, pool: str) -> bool:
        taints = self._taints.get(pool)
        specs = desired_slices(self.inventories[pool], pool, self.driver, self.features, taints)
        if specs == self.pools[pool].slice_specs:
            return False
        self.pools[pool] = replace(self.pools[pool], slice_specs=specs)
        self._mark(pool)
        return True

    def _selector(self) -> str:
        sel = f"spec.driver={self.driver}"
        return sel + (f",spec.nodeName={self.node_selector}" if self.node_selector else "")

    def _mark(self, pool: str) -> None:
        self._dirty.add(pool)
        self._wake.set()

    async def run(self) -> None:
        backoff = 0.5
        outage = False
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                resource_version = await self._list()
                if outage:
                    log.info("API server reachable again; catching up")
                    outage = False
                await _first_failure(self._watch(resource_version), self._work())
            except kube.TRANSIENT_ERRORS as error:
                # The backoff starts over after a while without failures, not after each list:
                # a write that fails every time must not be retried twice a second.
                if loop.time() - started > 30:
                    backoff = 0.5
                self.stats.errors += 1
                metrics.api_error("publisher", error)
                if isinstance(error, ApiException) and error.status == 409:
                    metrics.slice_conflicts.inc()
                self.synced.clear()
                if isinstance(error, ApiException) and error.status == 410:
                    log.info("watch expired; listing again")
                    continue
                if not outage:
                    log.warning(
                        "API server unreachable or failing; retrying with backoff", error=str(error)[:300]
                    )
                    outage = True
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _put(self, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        self._drop(name)
        self._cache[name] = obj
        self._by_pool.setdefault(_pool_of(obj), {})[name] = obj

    def _drop(self, name: str) -> None:
        old = self._cache.pop(name, None)
        if old is not None:
            pool = _pool_of(old)
            slices = self._by_pool.get(pool, {})
            slices.pop(name, None)
            if not slices:
                self._by_pool.pop(pool, None)

    async def _list(self) -> str:
        self.stats.lists += 1
        listing, version = await kube.list_all(self.api, SLICES, {"fieldSelector": self._selector()})
        self._cache, self._by_pool = {}, {}
        for obj in listing:
            self._put(obj)
        await self._refresh_owners()
        for pool in self.pools:
            self._mark(pool)
        return version

    async def _refresh_owners(self) -> None:
        wanted = {p.node_name for p in self.pools.values() if p.node_name}
        if not wanted or wanted.issubset(self._owners):
            return
        if len(wanted) == 1:
            (name,) = wanted
            nodes = [await kube.request(self.api, "GET", f"/api/v1/nodes/{name}")]
        else:
            nodes, _ = await kube.list_all(self.api, "/api/v1/nodes")
        for node in nodes:
            meta = node["metadata"]
            self._owners[meta["name"]] = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": meta["name"],
                "uid": meta["uid"],
                "controller": True,
            }

    async def _watch(self, resource_version: str) -> None:
        """Follow the watch from `resource_version` for good. When the server ends a watch (its
        timeout, or it drops a watcher that fell behind: a fleet's first publication sends
        thousands of events at once) the next one starts from the last version seen; a new
        list (all the driver's slices) only when that version is too old (410, from run).
        A new list would also cancel the writes in flight, and repeat those the server had
        already made."""
        version, query = resource_version, {"fieldSelector": self._selector()}
        while True:
            started, events = asyncio.get_running_loop().time(), 0
            async for kind, obj in kube.watch(self.api, SLICES, version, query=query):
                events += 1
                version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                self._event(kind, obj)
            self.stats.rewatches += 1
            if not events and asyncio.get_running_loop().time() - started < 1.0:
                await asyncio.sleep(1.0)  # a server that ends every watch at once: do not spin

    def _event(self, kind: str, obj: JSON) -> None:
        if kind == "BOOKMARK":
            return
        name = obj["metadata"]["name"]
        held = self._cache.get(name)
        if kind == "DELETED":
            if held is None:  # we deleted it ourselves (or never held it): nothing changed
                self.stats.echoes += 1
                return
            self._drop(name)
        elif held is not None and _version(held) == _version(obj):
            # Our own write coming back: the cache holds this very version already,
            # and the pool was reconciled against it.
            self.stats.echoes += 1
            return
        else:
            self._put(obj)
        pool = _pool_of(obj)
        if pool in self.pools:
            self._mark(pool)

    async def _work(self) -> None:
        limit = asyncio.Semaphore(self.concurrency)

        async def one(pool: str) -> None:
            async with limit:
                await self._reconcile(pool)

        while True:
            await self._wake.wait()
            self._wake.clear()
            # Let a burst of watch events (our own writes echoing back) settle first.
            await asyncio.sleep(0.05)
            dirty, self._dirty = self._dirty, set()
            if self.heartbeat is not None:
                self.heartbeat.busy()
            try:
                await asyncio.gather(*(one(p) for p in sorted(dirty)))
            finally:
                if self.heartbeat is not None:
                    self.heartbeat.idle()
            if not self._dirty:
                self.synced.set()

    def _existing(self, pool: str) -> list[JSON]:
        existing = [self._as_written(s) for s in self._by_pool.get(pool, {}).values()]
        self.stats.slices_examined += len(existing)
        return existing

    def _as_written(self, obj: JSON) -> JSON:
        """A slice the server stored without some of our fields, as we wrote it: the plan then
        sees it up to date and does not write it again (it would come back the same)."""
        adopted = self._adopted.get(obj["metadata"]["name"])
        if adopted is not None and obj.get("spec") == adopted[1]:
            return {**obj, "spec": adopted[0]}
        return obj

    async def _reconcile(self, pool_name: str) -> None:
        pool = self.pools[pool_name]
        self.stats.reconciles += 1
        refused = self._refused.get(pool_name)
        if refused is not None:
            if refused[0] == pool.slice_specs and time.monotonic() < refused[1]:
                return
            del self._refused[pool_name]
        try:
            await self._write_pool(pool_name, pool)
        except ApiException as e:
            if e.status != 422:
                raise
            self._refuse(pool_name, pool, e)

    def _refuse(self, pool_name: str, pool: PoolSpec, error: ApiException) -> None:
        self.stats.errors += 1
        self.stats.refused += 1
        metrics.api_error("publisher", error)
        self._refused[pool_name] = (pool.slice_specs, time.monotonic() + RETRY_REFUSED_SECONDS)
        log.error(
            "the API server refused this pool's ResourceSlices as invalid; not writing them again "
            f"until they change or for {RETRY_REFUSED_SECONDS:.0f} s",
            pool=pool_name, status=error.status, error=_server_message(error.body),
        )

    async def _write_pool(self, pool_name: str, pool: PoolSpec) -> None:
        if pool.node_name and pool.node_name not in self._owners:
            await self._refresh_owners()
        owner = self._owners.get(pool.node_name) if pool.node_name else None
        plan = plan_pool(self.driver, pool, self._existing(pool_name), owner)
        published = sum(len(spec.get("devices", [])) for spec in pool.slice_specs)
        if not (plan.apply or plan.delete):
            metrics.devices_published.labels(pool=pool_name).set(published)
            return
        log.info(
            "publishing pool",
            pool=pool_name,
            generation=plan.generation,
            apply=[o["metadata"]["name"] for o in plan.apply],
            delete=[o["metadata"]["name"] for o in plan.delete],
        )
        for old in plan.delete:
            await self._delete(old)
        for obj in plan.apply:
            await self._apply(obj)
        metrics.devices_published.labels(pool=pool_name).set(published)

    async def _delete(self, obj: JSON) -> None:
        meta = obj["metadata"]
        body = {"preconditions": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]}}
        self.stats.deletes += 1
        metrics.slice_writes.labels(operation="delete").inc()
        try:
            await kube.request(self.api, "DELETE", f"{SLICES}/{meta['name']}", body=body)
        except ApiException as e:
            if e.status == 409:
                metrics.slice_conflicts.inc()
            if e.status not in (404, 409):
                raise
        self._drop(meta["name"])

    async def _apply(self, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        existed = name in self._cache
        self.stats.updates += existed
        self.stats.creates += not existed
        metrics.slice_writes.labels(operation="update" if existed else "create").inc()
        result = None if existed else await self._create(obj)
        if result is None:
            result = await kube.request(
                self.api,
                "PATCH",
                f"{SLICES}/{name}",
                body=obj,
                query={"fieldManager": self.field_manager, "force": "true"},
                content_type="application/apply-patch+yaml",
            )
        self._adopted.pop(name, None)
        if not up_to_date(obj, result):
            # Fields owned by another manager (a hand edit) survive an apply: replace
            # the object so that the slice says exactly what the hardware says.
            self.stats.updates += 1
            metrics.slice_writes.labels(operation="update").inc()
            replacement = {
                **obj,
                "metadata": {**obj["metadata"], "resourceVersion": result["metadata"]["resourceVersion"]},
            }
            result = await kube.request(
                self.api,
                "PUT",
                f"{SLICES}/{name}",
                body=replacement,
                query={"fieldManager": self.field_manager},
            )
            if not up_to_date(obj, result) and result.get("spec") != obj["spec"]:
                self._adopt(obj, result)
        self._put(result)

    def _adopt(self, written: JSON, stored: JSON) -> None:
        """The server stored the slice without some of our fields even on a replace: a feature
        gate is off that the start-up probe did not catch. Keep what it stored."""
        self.stats.adopted += 1
        self._adopted[written["metadata"]["name"]] = (written["spec"], stored["spec"])
        log.warning(
            "the API server drops fields of this ResourceSlice (a feature gate is off); keeping "
            "the slice as the server stores it rather than writing it again",
            slice=written["metadata"]["name"], dropped=_dropped_paths(written["spec"], stored["spec"])[:20],
        )

    async def _create(self, obj: JSON) -> JSON | None:
        """POST a slice we do not hold; None when it exists after all (apply it then).

        A create costs the API server a third less CPU than an apply that creates (no YAML
        decoding, no merge): 5,000 nodes' first publication is almost all creates. Later
        applies by the same field manager still replace what it created (`devices` is an
        atomic list); a field that an apply cannot take away is caught by the up_to_date
        check after it, as a hand edit is."""
        try:
            result: JSON = await kube.request(
                self.api, "POST", SLICES, body=obj, query={"fieldManager": self.field_manager}
            )
        except ApiException as e:
            if e.status != 409:
                raise
            return None
        return result


def _server_message(body: str) -> str:
    """The whole message of an API error (its Status `message`, else the body as it came)."""
    try:
        return str(json.loads(body).get("message") or body)
    except (ValueError, AttributeError):
        return body


def _dropped_paths(written: Any, stored: Any, path: str = "spec") -> list[str]:
    """Where `stored` lacks or differs from what `written` had (for the log)."""
    if isinstance(written, dict) and isinstance(stored, dict):
        return [p for k, v in written.items()
                for p in (_dropped_paths(v, stored[k], f"{path}.{k}") if k in stored else [f"{path}.{k}"])]
    if isinstance(written, list) and isinstance(stored, list) and len(written) == len(stored):
        return [p for i, (w, s) in enumerate(zip(written, stored, strict=True))
                for p in _dropped_paths(w, s, f"{path}[{i}]")]
    return [] if written == stored else [path]


def _pool_of(obj: JSON) -> str:
    return str(obj.get("spec", {}).get("pool", {}).get("name", ""))


def _version(obj: JSON) -> str | None:
    version = obj.get("metadata", {}).get("resourceVersion")
    return str(version) if version is not None else None


async def _first_failure(*coroutines: Coroutine[Any, Any, None]) -> None:
    """Run the coroutines together until one fails; cancel the others and re-raise."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
