"""What the API server serves and keeps of a ResourceSlice, learnt once at start; and which of
the features asked for can therefore work.

Kubernetes 1.34 to 1.37 differ (reference/dra-protocol.md 1.3, 1.10): a server whose
DRAPartitionableDevices or DRAConsumableCapacity gate is off (the default on 1.34 and 1.35)
accepts a slice with shared counters or a multi-allocatable device and silently drops those
fields; DRADeviceTaints off drops device taints; 1.34 wants a counter set in the same slice as
the devices that consume it, 1.35+ in a slice of its own; the schedulers of 1.34 and 1.35 give
one GPU out both whole and as a memory share, which only the version (GET /version, readable by
every user through the bootstrap role system:public-info-viewer) tells apart. Publishing a
field the server drops makes the slice differ from what was read back after every write (a
rewrite loop), and worse, leaves the scheduler without the counters that keep two MIG
placements or a GPU and its memory share apart. So `probe_server` asks the server with dry-run
creates (nothing is stored) and its version what it keeps, and `decide` turns off, with a
reason, each asked feature whose fields would not survive or that its scheduler would misuse.

It must NOT write anything to the server (dry runs only), retry, or decide what a
slice contains beyond the `SliceFeatures` it returns: `controller.slices` builds the slices,
`controller.publisher` reports what was turned off.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

import structlog

from controller.plan import SLICES
from controller.slices import SliceFeatures
from dra_driver import kube
from dra_driver.jsontypes import JSON
from dra_driver.kube import ApiClient, ApiException

log = structlog.get_logger(__name__)

ListAttributesMode = Literal["auto", "on", "off"]

# Where the server wants shared counters: in slices of their own (1.35+), in the slice of the
# devices that consume them (1.34), or nowhere (the partitionable-devices gate is off).
CounterLayout = Literal["apart", "together", "none"]

_PROBE_POOL: Final = "capability-probe"


@dataclass(frozen=True)
class ServerCapabilities:
    """What the API server keeps of a ResourceSlice (each learnt by a dry-run create)."""

    resource_versions: tuple[str, ...] = ()  # resource.k8s.io versions used (v1: the driver's)
    list_attributes: bool = False  # DRAListTypeAttributes: ints/strings/... attribute values
    taints: bool = False  # DRADeviceTaints: devices[].taints
    consumable_capacity: bool = False  # DRAConsumableCapacity: allowMultipleAllocations, requestPolicy
    counters: CounterLayout = "none"  # DRAPartitionableDevices: sharedCounters, consumesCounters
    version: tuple[int, int] | None = None  # the binaries' (major, minor); None: not said

    @classmethod
    def everything(cls) -> ServerCapabilities:
        """A server that keeps every field (1.37 with its alpha gates on); for tests."""
        return cls(("v1",), True, True, True, "apart", (1, 37))

    @property
    def mixes_whole_gpus_and_shares(self) -> bool:
        """Whether this server's scheduler would give one GPU out both whole and as a share: 1.34
        (told apart also by its counter layout) and 1.35."""
        return self.counters == "together" or (self.version is not None and self.version < (1, 36))


@dataclass(frozen=True)
class FeatureOff:
    """A feature asked for that this server cannot carry, and why."""

    feature: str  # the flag: --memory-shares, --dynamic-mig, ...
    reason: str  # what the server lacks and how to give it that

    def message(self) -> str:
        return f"{self.feature} is off on this node: {self.reason}"


_COUNTER_GATE: Final = (
    "the API server drops shared counters (sharedCounters/consumesCounters): turn on the "
    "DRAPartitionableDevices feature gate on kube-apiserver, kube-scheduler and "
    "kube-controller-manager (beta and on by default from 1.36)"
)
_CAPACITY_GATE: Final = (
    "the API server drops consumable capacity (allowMultipleAllocations, capacity requestPolicy): "
    "turn on the DRAConsumableCapacity feature gate on kube-apiserver, kube-scheduler and "
    "kube-controller-manager (beta and on by default from 1.36)"
)
# Measured against real v1.34.4 and v1.35.4 control planes with both gates on (issue 54): share
# claims and whole-GPU claims created alternately were all allocated, GPUs given out both whole
# and as a share; 1.36+ (and 1.34/1.35 emulated on 1.37 binaries) keep them apart. The binaries'
# version says which scheduler runs, not the emulated one.
_ALLOCATOR_BEFORE_136: Final = (
    "the scheduler of Kubernetes {version} gives one GPU out both whole and as a memory share (it "
    "does not keep the whole GPU and its share views apart through their shared counter): upgrade "
    "the control plane to 1.36 or later, or use --memory-shares-only (Helm memoryShares.only), "
    "which publishes each GPU as its share view alone"
)
_TAINT_GATE: Final = (
    "the API server drops device taints, so a sick device is left out of the slice instead (no "
    "new pod gets it; a claim cannot tolerate its way onto it): turn on the DRADeviceTaints "
    "feature gate on kube-apiserver, kube-scheduler and kube-controller-manager (beta and on by "
    "default from 1.36)"
)


def decide(asked: SliceFeatures, server: ServerCapabilities) -> tuple[SliceFeatures, tuple[FeatureOff, ...]]:
    """Pure: the features to publish with (`asked` less what `server` cannot keep) and what was
    turned off. Nothing is half-published: a feature whose fields would be dropped is not
    published at all, so the scheduler can never allocate a device without its counters."""
    off: list[FeatureOff] = []
    memory_shares, shares_only, dynamic_mig = asked.memory_shares, asked.shares_only, asked.dynamic_mig
    if shares_only and not server.consumable_capacity:
        off.append(FeatureOff("--memory-shares-only", _CAPACITY_GATE))
        memory_shares = shares_only = False
    elif memory_shares and not shares_only:
        version = ".".join(map(str, server.version)) if server.version else "1.34"
        reasons = [r for ok, r in ((server.consumable_capacity, _CAPACITY_GATE),
                                   (server.counters != "none", _COUNTER_GATE),
                                   (not server.mixes_whole_gpus_and_shares,
                                    _ALLOCATOR_BEFORE_136.format(version=version))) if not ok]
        if reasons:
            off.append(FeatureOff("--memory-shares", "; and ".join(reasons)))
            memory_shares = False
    consumable_shares = asked.consumable_shares
    if consumable_shares is not None and not server.consumable_capacity:
        off.append(FeatureOff("--consumable-shares", _CAPACITY_GATE))
        consumable_shares = None
    if dynamic_mig and server.counters == "none":
        off.append(FeatureOff("--dynamic-mig", _COUNTER_GATE))
        dynamic_mig = False
    features = replace(
        asked,
        memory_shares=memory_shares,
        shares_only=shares_only,
        dynamic_mig=dynamic_mig,
        consumable_shares=consumable_shares,
        counters_with_devices=server.counters == "together",
        taints=asked.taints and server.taints,
    )
    if asked.taints and not server.taints:
        off.append(FeatureOff("device health taints", _TAINT_GATE))
    return features, tuple(off)


# -- probes (I/O) ----------------------------------------------------------------------------


def _probe_slice(driver: str, name: str, spec: JSON) -> JSON:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{name}-{driver}"[:253]},
        "spec": {
            "driver": driver,
            "allNodes": True,
            "pool": {"name": _PROBE_POOL, "generation": 1, "resourceSliceCount": 1},
            **spec,
        },
    }


async def _dry_run(api: ApiClient, obj: JSON) -> JSON | None:
    """The object as the server would store it; None when it refuses it (the message logged)."""
    try:
        result: JSON = await kube.request(api, "POST", SLICES, body=obj, query={"dryRun": "All"})
    except ApiException as e:
        if e.status in (400, 422):
            log.info("API server refused a capability probe", probe=obj["metadata"]["name"], error=e.body)
            return None
        raise
    return result


def _device(result: JSON | None) -> Mapping[str, Any]:
    devices = (result or {}).get("spec", {}).get("devices") or [{}]
    return dict(devices[0])


async def _list_attributes(api: ApiClient, driver: str) -> bool:
    probe = _probe_slice(driver, "probe-lists", {
        "devices": [{"name": "probe", "attributes": {"probe": {"strings": ["a", "b"]}}}]})
    return bool(_device(await _dry_run(api, probe)).get("attributes", {}).get("probe", {}).get("strings"))


async def _taints(api: ApiClient, driver: str) -> bool:
    taint = {"key": f"{driver}/probe", "value": "probe", "effect": "NoSchedule"}
    probe = _probe_slice(driver, "probe-taints", {"devices": [{"name": "probe", "taints": [taint]}]})
    return bool(_device(await _dry_run(api, probe)).get("taints"))


async def _consumable_capacity(api: ApiClient, driver: str) -> bool:
    capacity = {"memory": {"value": "2Gi", "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi"}}}}
    probe = _probe_slice(driver, "probe-capacity", {
        "devices": [{"name": "probe", "allowMultipleAllocations": True, "capacity": capacity}]})
    kept = _device(await _dry_run(api, probe))
    policy = kept.get("capacity", {}).get("memory", {}).get("requestPolicy")
    return bool(kept.get("allowMultipleAllocations")) and policy is not None


_COUNTERS: Final = {"probe": {"value": "1"}}


async def _counters(api: ApiClient, driver: str) -> CounterLayout:
    counter_set = {"name": "probe-set", "counters": _COUNTERS}
    consumer = {"name": "probe", "consumesCounters": [{"counterSet": "probe-set", "counters": _COUNTERS}]}
    # 1.35+: counters in a slice of their own, consumers in another
    alone = await _dry_run(api, _probe_slice(driver, "probe-counters", {"sharedCounters": [counter_set]}))
    consumers = await _dry_run(api, _probe_slice(driver, "probe-consumers", {"devices": [consumer]}))
    if alone and alone["spec"].get("sharedCounters") and _device(consumers).get("consumesCounters"):
        return "apart"
    # 1.34: both in one slice
    both = await _dry_run(api, _probe_slice(driver, "probe-together", {
        "sharedCounters": [counter_set], "devices": [consumer]}))
    if both and both["spec"].get("sharedCounters") and _device(both).get("consumesCounters"):
        return "together"
    return "none"


_EXTENDED_GATE: Final = (
    "the API server stored DeviceClass {cls} without extendedResourceName {name}, so pods asking "
    "`resources.limits: {name}` wait forever: turn on the DRAExtendedResource feature gate on "
    "kube-apiserver, kube-scheduler and kube-controller-manager, then `helm upgrade` to write the "
    "class again; or set extendedResource.enabled=false"
)


async def extended_resource_dropped(api: ApiClient, driver: str, name: str) -> FeatureOff | None:
    """Whether the server kept extendedResourceName on the chart's class `extended.<driver>`: a
    server without DRAExtendedResource stores the class without it, silently. None: kept, or
    the class is not there to read (it says nothing about the gate)."""
    cls = f"extended.{driver}"
    try:
        stored = await kube.request(api, "GET", f"/apis/resource.k8s.io/v1/deviceclasses/{cls}")
    except ApiException as e:
        log.info("could not read the extended resource's DeviceClass", device_class=cls, status=e.status)
        return None
    if stored.get("spec", {}).get("extendedResourceName") == name:
        return None
    return FeatureOff("extendedResource", _EXTENDED_GATE.format(cls=cls, name=name))


_VERSION: Final = re.compile(r"v?(\d+)\.(\d+)")


async def _version(api: ApiClient) -> tuple[int, int] | None:
    """The binaries' version from gitVersion (`v1.35.4`, `v1.35.4-gke.1`); None where the server
    does not say (an error, or an aggregator that hides it): then only the counter layout counts.
    Not `major`/`minor`: providers write `35+` there."""
    try:
        info = await kube.request(api, "GET", "/version")
    except ApiException as e:
        log.info("API server did not say its version", status=e.status)
        return None
    found = _VERSION.match(str(info.get("gitVersion", "")))
    return (int(found[1]), int(found[2])) if found else None


async def probe_server(api: ApiClient, driver: str) -> ServerCapabilities:
    """Ask the server what it keeps: a few dry-run creates, nothing stored. The driver speaks
    resource.k8s.io/v1 only (GA in 1.34): a server that does not serve it answers 404 and
    gets a clear error instead of a publisher that fails forever."""
    try:
        list_attributes = await _list_attributes(api, driver)
    except ApiException as e:
        if e.status != 404:
            raise
        raise RuntimeError(
            "the API server does not serve resource.k8s.io/v1 ResourceSlices (404): this driver "
            "needs Kubernetes 1.34 or newer"
        ) from e
    caps = ServerCapabilities(
        resource_versions=("v1",),
        list_attributes=list_attributes,
        taints=await _taints(api, driver),
        consumable_capacity=await _consumable_capacity(api, driver),
        counters=await _counters(api, driver),
        version=await _version(api),
    )
    log.info("API server capabilities", list_attributes=caps.list_attributes, device_taints=caps.taints,
             consumable_capacity=caps.consumable_capacity, shared_counters=caps.counters,
             version=".".join(map(str, caps.version)) if caps.version else None)
    return caps
