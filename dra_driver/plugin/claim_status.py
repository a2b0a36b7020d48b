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
entries of a deallocated claim by itself).

It must NOT fail or delay a Prepare: every write runs in a task of its own after the
kubelet got its answer, is retried with backoff, and an error is logged with the claim's
identity and counted (`gpu_dra_api_errors{component="claim-status"}`), never raised. It
reads the claim once per write (its `reservedFor` names the pods of the info series and its
allocation the memory of a share) and never touches the checkpoint or node state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, astuple, dataclass
from datetime import UTC, datetime
from typing import Final, Protocol

import structlog

from dra_driver import kube, metrics
from dra_driver.devices import NodeDevice, gpu_device_name
from dra_driver.gpu.model import Inventory
from dra_driver.gpu.topology import nvlink_topology
from dra_driver.health.effects import DeviceView
from dra_driver.health.keeper import HealthKeeper
from dra_driver.jsontypes import JSON
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.prepared import PreparedDevice
from dra_driver.plugin.state import ClaimResult

log = structlog.get_logger(__name__)

CLAIM: Final = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
COMPONENT: Final = "claim-status"  # the api_errors label of this writer
ATTEMPTS: Final = 5
FIRST_BACKOFF_SECONDS: Final = 1.0
# Answers that another attempt cannot change: the claim is gone or was re-created (the
# uid precondition), or its allocation no longer has the device (it was deallocated).
FINAL_STATUSES: Final = frozenset({404, 409, 422})
MAX_FIELD_MANAGER: Final = 128  # the API server's limit
READY: Final = "Ready"


class ClaimPreparer(Protocol):
    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]: ...

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]: ...


@dataclass(frozen=True)
class Holder:
    """A pod a claim is reserved for."""

    namespace: str
    name: str


@dataclass(frozen=True)
class InfoLabels:
    """One `gpu_dra_device_claim_info` series."""

    device: str
    uuid: str
    pci_bus_id: str
    claim_namespace: str
    claim_name: str
    claim_uid: str
    pod_namespace: str
    pod_name: str


# --------------------------------------------------------------------------- pure


def field_manager(driver: str, node: str) -> str:
    """One manager per driver and node; a name over the API server's 128 characters is
    shortened with a hash of the whole, so that two long node names stay apart."""
    name = f"{driver}/{node}"
    if len(name) <= MAX_FIELD_MANAGER:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{name[: MAX_FIELD_MANAGER - 13]}-{digest}"


def nvlink_peers(inventory: Inventory, devices: Mapping[str, NodeDevice]) -> dict[str, list[JSON]]:
    """Each device's NVLink peers (those of its physical GPU), as `{gpu, uuid}`: the name the
    slices use and the UUID nvidia-smi and DCGM show."""
    topology = nvlink_topology(inventory)
    by_index = {g.index: g for g in inventory.gpus}
    peers: dict[str, list[JSON]] = {}
    for name, device in devices.items():
        indices = topology.gpu(device.gpu.index).peers
        peers[name] = [{"gpu": gpu_device_name(by_index[i]), "uuid": by_index[i].uuid} for i in indices]
    return peers


def holders(claim: JSON) -> tuple[Holder, ...]:
    """The pods in the claim's `reservedFor` (the kubelet prepares only for those)."""
    namespace = claim.get("metadata", {}).get("namespace", "")
    return tuple(
        Holder(namespace, c["name"])
        for c in (claim.get("status") or {}).get("reservedFor") or []
        if c.get("resource") == "pods" and not c.get("apiGroup") and c.get("name")
    )


def _consumed(claim: JSON, driver: str, pool: str, device: str, share_id: str | None) -> JSON:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    for r in (allocation.get("devices") or {}).get("results") or []:
        if (r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID")) == (
            driver, pool, device, share_id
        ):
            consumed: JSON = r.get("consumedCapacity") or {}
            return consumed
    return {}


def device_data(
    node_device: NodeDevice, prepared: PreparedDevice, peers: Sequence[JSON], consumed: JSON
) -> JSON:
    """The `data` of one entry: what nvidia-smi and DCGM call this device."""
    gpu = node_device.gpu
    data: JSON = {
        "uuid": node_device.uuid,
        "pciBusID": gpu.pci_bus_id,
        "minor": gpu.minor,
        "product": gpu.product_name,
        "memoryBytes": gpu.memory_bytes,
        "nvlinkPeers": list(peers),
    }
    if node_device.mig is not None:
        mig = node_device.mig
        data["mig"] = {
            "profile": mig.profile,
            "parentUUID": gpu.uuid,
            "gpuInstanceID": mig.gpu_instance_id,
            "computeInstanceID": mig.compute_instance_id,
            "memoryBytes": mig.memory_bytes,
            "multiprocessors": mig.multiprocessors,
        }
    if prepared.share_id is not None:
        data["share"] = {"shareID": prepared.share_id, "consumedCapacity": consumed}
    return data


def ready_condition(view: DeviceView | None, since: datetime) -> JSON:
    """`Ready` True (prepared and healthy), or False with the health monitor's reason."""
    stamp = since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if view is None or view.healthy:
        return {"type": READY, "status": "True", "reason": "Prepared", "lastTransitionTime": stamp,
                "message": "prepared on this node; CDI devices handed to the kubelet"}
    return {"type": READY, "status": "False", "reason": "DeviceUnhealthy", "lastTransitionTime": stamp,
            "message": (view.message or "the health monitor reports this device unhealthy")[:32768]}


def apply_body(ref: ClaimRef, devices: Sequence[JSON]) -> JSON:
    """The server-side apply configuration of the claim's status; the uid is a precondition,
    so a claim re-created under the same name is never written with the old one's devices."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {"devices": list(devices)},
    }


def info_labels(
    ref: ClaimRef, node_device: NodeDevice, prepared: PreparedDevice, pods: Iterable[Holder]
) -> list[InfoLabels]:
    """One series per (device, pod); a claim with no pod reserved yet still gets one."""
    found = list(pods) or [Holder("", "")]
    return [
        InfoLabels(prepared.device, node_device.uuid, node_device.gpu.pci_bus_id, ref.namespace, ref.name,
                   ref.uid, pod.namespace, pod.name)
        for pod in found
    ]


# --------------------------------------------------------------------------- I/O


class ClaimStatus:
    """Writes and releases the `status.devices` entries and the info series of this node's claims."""

    def __init__(
        self,
        api: kube.ApiClient,
        driver: str,
        node: str,
        devices: Mapping[str, NodeDevice],
        peers: Mapping[str, Sequence[JSON]],
        first_backoff: float = FIRST_BACKOFF_SECONDS,
    ) -> None:
        self.api = api
        self.driver = driver
        self.node = node
        self.devices = devices
        self.peers = peers
        self.manager = field_manager(driver, node)
        self.first_backoff = first_backoff
        self.views: dict[str, DeviceView] = {}
        self._prepared: dict[str, tuple[ClaimRef, tuple[PreparedDevice, ...]]] = {}
        self._since: dict[tuple[str, str], tuple[bool, datetime]] = {}
        self._series: dict[str, list[InfoLabels]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # -- what the plugin tells it ---------------------------------------------------------------

    def prepared(self, ref: ClaimRef, devices: Sequence[PreparedDevice]) -> None:
        mine = tuple(d for d in devices if d.pool == self.node and d.device in self.devices)
        if mine:
            self._prepared[ref.uid] = (ref, mine)
            self._schedule(ref.uid, self._write(ref, mine))

    def unprepared(self, ref: ClaimRef) -> None:
        self._prepared.pop(ref.uid, None)
        self._drop_series(ref.uid)
        for key in [k for k in self._since if k[0] == ref.uid]:
            del self._since[key]
        # released even if this process did not write it: the other instance of a rolling
        # update may have, under the same field manager
        self._schedule(ref.uid, self._release(ref))

    def health(self, views: Mapping[str, DeviceView]) -> None:
        """New device views: rewrite the claims holding a device whose view changed."""
        changed = {n for n, v in views.items() if self.views.get(n) != v}
        self.views = dict(views)
        for ref, devices in list(self._prepared.values()):
            if any(d.device in changed for d in devices):
                self._schedule(ref.uid, self._write(ref, devices))

    async def follow(self, keeper: HealthKeeper) -> None:
        async for snapshot in keeper.watch():
            self.health(snapshot.views)

    async def settled(self) -> None:
        """Wait until every write scheduled so far has ended (tests, and stop)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)
        for uid in list(self._series):
            self._drop_series(uid)

    # -- the writes -------------------------------------------------------------------------------

    def _schedule(self, uid: str, work: Awaitable[None]) -> None:
        """The latest wanted state of a claim wins: an older write still in flight is cancelled."""
        old = self._tasks.get(uid)
        if old is not None:
            old.cancel()

        async def run() -> None:
            if old is not None:
                await asyncio.gather(old, return_exceptions=True)
            try:
                await work
            finally:
                if self._tasks.get(uid) is task:
                    del self._tasks[uid]

        task = asyncio.get_running_loop().create_task(run(), name=f"claim-status-{uid}")
        self._tasks[uid] = task

    async def _write(self, ref: ClaimRef, devices: tuple[PreparedDevice, ...]) -> None:
        with structlog.contextvars.bound_contextvars(**ref.log_fields()):
            claim = await self._attempts(ref, "read", lambda: kube.request(
                self.api, "GET", CLAIM.format(namespace=ref.namespace, name=ref.name)))
            if claim is None:
                return
            if claim.get("metadata", {}).get("uid") != ref.uid:
                log.info("claim was re-created; its status is not written")
                return
            pods = holders(claim)
            self._set_series(ref, devices, pods)
            entries = [self._entry(ref, claim, d) for d in devices]
            written = await self._attempts(ref, "write", lambda: self._apply(ref, entries))
            if written is not None:
                log.info("claim device status written", devices=[d.device for d in devices],
                         ready=[e["conditions"][0]["status"] for e in entries])

    async def _release(self, ref: ClaimRef) -> None:
        with structlog.contextvars.bound_contextvars(**ref.log_fields()):
            if await self._attempts(ref, "release", lambda: self._apply(ref, [])) is not None:
                log.info("claim device status released")

    def _apply(self, ref: ClaimRef, entries: list[JSON]) -> Awaitable[JSON]:
        return kube.request(
            self.api, "PATCH", CLAIM.format(namespace=ref.namespace, name=ref.name) + "/status",
            body=apply_body(ref, entries), query={"fieldManager": self.manager, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    async def _attempts(self, ref: ClaimRef, what: str, call: Callable[[], Awaitable[JSON]]) -> JSON | None:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return await call()
            except kube.TRANSIENT_ERRORS as e:
                metrics.api_error(COMPONENT, e)
                status = getattr(e, "status", None)
                final = status in FINAL_STATUSES or attempt == ATTEMPTS
                log.warning(f"claim device status {what} failed", error=str(e)[:300], status=status,
                            attempt=attempt, retrying=not final)
                if final:
                    return None
            await asyncio.sleep(self.first_backoff * 2.0 ** (attempt - 1) * random.uniform(0.5, 1.0))
        return None

    def _entry(self, ref: ClaimRef, claim: JSON, prepared: PreparedDevice) -> JSON:
        node_device = self.devices[prepared.device]
        view = self.views.get(prepared.device)
        healthy = view is None or view.healthy
        key = (ref.uid, prepared.device)
        was = self._since.get(key)
        if was is None or was[0] != healthy:
            was = self._since[key] = (healthy, datetime.now(UTC))
        consumed = _consumed(claim, self.driver, prepared.pool, prepared.device, prepared.share_id)
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
            metrics.device_claim_info.labels(**asdict(s)).set(1)
        self._series[ref.uid] = series

    def _drop_series(self, uid: str) -> None:
        for s in self._series.pop(uid, []):
            with contextlib.suppress(KeyError):
                metrics.device_claim_info.remove(*astuple(s))


class ReportingPreparer:
    """A `ClaimPreparer` that tells `ClaimStatus` what it prepared and unprepared, after the
    kubelet's answer is decided (the writes run in tasks of their own)."""

    def __init__(self, inner: ClaimPreparer, status: ClaimStatus) -> None:
        self.inner = inner
        self.status = status

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        results = await self.inner.prepare(refs)
        for ref in refs:
            result = results.get(ref.uid)
            if result is not None and result.error is None:
                self.status.prepared(ref, result.devices)
        return results

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, ClaimResult]:
        results = await self.inner.unprepare(refs)
        for ref in refs:
            result = results.get(ref.uid)
            if result is not None and result.error is None:
                self.status.unprepared(ref)
        return results
