"""The desired ResourceSlices of one node: a pure function of its inventory.

`desired_slices(inventory, node_name, driver, features)` returns the `spec` of every
ResourceSlice of the node's one pool (pool name = node name), as plain JSON-ready dicts
in the `resource.k8s.io/v1` shape. Devices are named by `dra_driver.devices` (the
plugin resolves allocations with the same names) and described by
`controller.device_entries`. The reconcile loop owns what changes between writes: it adds
`pool.generation` and `pool.resourceSliceCount` and talks to the API server; nothing
here does I/O.

Every API limit is respected here rather than discovered as a rejected write: devices
are split over several slices (in the packing order of `packing_rank`, then MIG placement, so the
split is deterministic) and each device stays within the per-device limits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from controller import partitions
from controller.attributes import NVLINK_LAYERS, DeviceAttributes, NvlinkFacts, device_attributes
from controller.capacity import MAX_COUNTER_SETS_PER_SLICE, with_memory_shares
from controller.consumable import with_consumable_shares
from controller.device_entries import device_json, dynamic_mig_entries
from dra_driver.devices import NodeDevice, node_devices
from dra_driver.gpu.model import Inventory
from dra_driver.gpu.packing import packing_order
from dra_driver.gpu.topology import NvlinkTopology, nvlink_topology
from dra_driver.health.effects import DeviceTaint
from dra_driver.imex.channels import channel_device_json, node_clique
from dra_driver.jsontypes import JSON
from dra_driver.names import is_dns_label, is_dns_subdomain
from dra_driver.sharing.consumable import ConsumableShares

# resource.k8s.io/v1 limits (reference/dra-protocol.md §1.3, §1.7).
MAX_DEVICES_PER_SLICE = 128
# When any device of a slice uses taints, consumesCounters or (1.36+) list-type attributes.
MAX_DEVICES_PER_SLICE_RESTRICTED = 64
MAX_DRIVER_NAME_LENGTH = 63
MAX_POOL_NAME_LENGTH = 253
MAX_DEVICE_NAME_LENGTH = 63


@dataclass(frozen=True)
class SliceFeatures:
    """What the API server supports, decided once at start."""

    list_attributes: bool = False  # DRAListTypeAttributes: ints/strings/... attribute values
    # --memory-shares: each whole GPU also as a share view (controller.capacity)
    memory_shares: bool = False
    # --memory-shares-only: each whole GPU as its share view alone, without counters
    shares_only: bool = False
    # --consumable-shares: NVIDIA's consumable shares, every whole GPU for several claims
    consumable_shares: ConsumableShares | None = None
    # --dynamic-mig: MIG-mode GPUs as partitionable devices (controller.partitions)
    dynamic_mig: bool = False
    # --legacy-attributes: also controller.attributes.LEGACY_ATTRIBUTES (nvlinkGroup<N>, numaNode)
    legacy_attributes: bool = False
    # --topology-detail-attributes: also controller.attributes.TOPOLOGY_DETAIL_ATTRIBUTES
    # (nvlinkPeers, nvlinkPeerCount, nvlinkIsland)
    topology_detail_attributes: bool = False
    # 1.34 wants each counter set in the slice of the devices that consume it; 1.35+ apart
    counters_with_devices: bool = False
    # DRADeviceTaints: health taints on devices (off: the server would drop them)
    taints: bool = True
    # --compute-domains: the node's IMEX channel, where its GPUs are in one fabric clique
    compute_domains: bool = False


def _device_order(rank: Mapping[int, int]) -> Callable[[NodeDevice], tuple[int, int, int]]:
    """MIG-mode GPUs' devices first (no whole-GPU claim takes them), then the whole GPUs in the
    packing order (dra_driver.gpu.packing: the scheduler takes the first free set in slice
    order); MIG devices by placement within their GPU."""
    return lambda d: (rank.get(d.gpu.index, -1), d.gpu.index, d.mig.placement_start if d.mig else -1)


# Kept per inventory (both are immutable): a fleet controller builds thousands of pools from
# a few inventories, and the clique search was most of the time it took.
@functools.lru_cache(maxsize=32)
def published_topology(inventory: Inventory) -> NvlinkTopology:
    """The NVLink topology as the slices publish it: with as many clique layers as they hold."""
    return nvlink_topology(inventory, max_layers=NVLINK_LAYERS)


@functools.lru_cache(maxsize=32)
def packing_rank(inventory: Inventory) -> dict[int, int]:
    """Each whole GPU's place in the slices (dra_driver.gpu.packing.packing_order)."""
    topology = published_topology(inventory)
    return {n: r for r, n in enumerate(packing_order(topology.adjacency, topology.clique_layers))}


def nvlink_facts(inventory: Inventory) -> dict[int, NvlinkFacts]:
    """The NVLink facts of every GPU, by index."""
    topology = published_topology(inventory)
    return {
        g.index: NvlinkFacts(peers=g.peers, island=g.island, groups=g.groups_by_size, cliques=g.cliques,
                             layers=dict(g.layers), domain=g.domain,
                             clique_size=max((len(c) for c in topology.cliques if g.index in c), default=1))
        for g in topology.gpus
    }


def taint_json(taint: DeviceTaint) -> JSON:
    """A device taint as the API holds it; `timeAdded` is ours (when the condition began), in
    whole seconds as the server keeps it, so an unchanged taint reads back equal: no rewrite."""
    added = datetime.fromtimestamp(taint.time_added, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"key": taint.key, "value": taint.value, "effect": taint.effect, "timeAdded": added}


def desired_slices(
    inventory: Inventory,
    node_name: str,
    driver: str,
    features: SliceFeatures,
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
) -> tuple[JSON, ...]:
    """The specs of the node's ResourceSlices, in order; at least one ("driver up, no devices").
    `taints` (device name -> its health taints, from dra_driver.health) go on those devices.

    Raises ValueError for a driver or node name the API server would reject.
    """
    if not is_dns_subdomain(driver, MAX_DRIVER_NAME_LENGTH):
        raise ValueError(
            f"driver name {driver!r} is not a DNS subdomain of at most {MAX_DRIVER_NAME_LENGTH} characters"
        )
    if not is_dns_subdomain(node_name, MAX_POOL_NAME_LENGTH):
        raise ValueError(f"node name {node_name!r} cannot name a pool: not a DNS subdomain")

    facts = nvlink_facts(inventory)
    carved = {g.index for g in inventory.gpus if features.dynamic_mig and partitions.dynamic(g)}
    devices, described = _described(inventory, features)

    restricted = any(a.uses_list_attributes for a in described)
    entries = [device_json(d.name, a) for d, a in zip(devices, described, strict=True)]
    counter_sets: list[JSON] = []
    if features.consumable_shares is not None:
        entries = with_consumable_shares(devices, entries, features.consumable_shares)
    if features.memory_shares:
        entries, counter_sets = with_memory_shares(devices, entries, only=features.shares_only)
        restricted = restricted or bool(counter_sets)
    withheld: frozenset[str] = frozenset()
    if not features.taints:  # the server would drop taints: a sick device is left out instead
        withheld, taints = withheld_devices(taints or {}), None
        entries = [e for e in entries if not _is_withheld(e["name"], withheld)]
    if taints and any(taints.values()):
        entries = [{**e, "taints": [taint_json(t) for t in taints[e["name"]]]} if taints.get(e["name"]) else e
                   for e in entries]
        restricted = True
    clique = node_clique(inventory) if features.compute_domains else None
    if clique is not None:
        entries.append(channel_device_json(clique))
    per_slice = MAX_DEVICES_PER_SLICE_RESTRICTED if restricted else MAX_DEVICES_PER_SLICE
    chunks = [entries[i : i + per_slice] for i in range(0, len(entries), per_slice)] or [[]]
    # One slice per MIG-mode GPU: its devices all consume its counter set
    for gpu in (g for g in inventory.gpus if g.index in carved):
        mig_entries = [e for e in dynamic_mig_entries(gpu, inventory, facts.get(gpu.index),
                                                      features.list_attributes)
                       if not _is_withheld(e["name"], withheld)]
        # a condition of the whole GPU (named by gpu-<i>) holds for every slice carved from it
        whole_gpu = list((taints or {}).get(f"gpu-{gpu.index}", ()))
        for e in mig_entries:
            if not is_dns_label(e["name"], MAX_DEVICE_NAME_LENGTH):
                raise ValueError(f"device name {e['name']!r} is not a DNS label")
            own = list((taints or {}).get(e["name"], ())) if e["name"] != f"gpu-{gpu.index}" else []
            if own or whole_gpu:
                e["taints"] = [taint_json(t) for t in dict.fromkeys([*whole_gpu, *own])]
        chunks = [c for c in chunks if c] + [mig_entries]
        counter_sets.append(partitions.counter_set(gpu))
    if features.counters_with_devices:
        return tuple(_with_counters(_spec(driver, node_name, chunk), counter_sets) for chunk in chunks)
    # Since 1.35 a slice holds devices or shared counters, never both: counters go last.
    counters = [
        {**_spec(driver, node_name, []), "sharedCounters": counter_sets[i : i + MAX_COUNTER_SETS_PER_SLICE]}
        for i in range(0, len(counter_sets), MAX_COUNTER_SETS_PER_SLICE)
    ]
    return tuple(_spec(driver, node_name, chunk) for chunk in chunks) + tuple(counters)


# Per inventory, as published_topology: the attribute maps do not depend on the node's name.
# The maps are shared by every pool built from one inventory; nothing changes them after this.
@functools.lru_cache(maxsize=32)
def _described(
    inventory: Inventory, features: SliceFeatures
) -> tuple[tuple[NodeDevice, ...], tuple[DeviceAttributes, ...]]:
    """The node's devices in slice order (MIG-mode GPUs carved by dynamic MIG left out) and
    what each publishes. Raises ValueError for a device name the API server would reject."""
    facts = nvlink_facts(inventory)
    carved = {g.index for g in inventory.gpus if features.dynamic_mig and partitions.dynamic(g)}
    kept = (d for d in node_devices(inventory).values() if d.gpu.index not in carved)
    devices = tuple(sorted(kept, key=_device_order(packing_rank(inventory))))
    for d in devices:
        if not is_dns_label(d.name, MAX_DEVICE_NAME_LENGTH):
            raise ValueError(f"device name {d.name!r} is not a DNS label")
    described = tuple(
        device_attributes(d, inventory, facts.get(d.gpu.index), list_attributes=features.list_attributes,
                          legacy=features.legacy_attributes,
                          topology_detail=features.topology_detail_attributes)
        for d in devices
    )
    return devices, described


def withheld_devices(taints: Mapping[str, Sequence[DeviceTaint]]) -> frozenset[str]:
    """The devices that a server without device taints must not offer at all: those whose health
    taints would keep new pods off them (NoSchedule, NoExecute)."""
    keeps_off = ("NoSchedule", "NoExecute")
    return frozenset(name for name, ts in taints.items() if any(t.effect in keeps_off for t in ts))


def _is_withheld(name: str, withheld: frozenset[str]) -> bool:
    """The device, or the whole GPU it is a part or a share of (`gpu-<i>`...), is withheld."""
    parts = name.split("-")
    return name in withheld or (len(parts) > 2 and parts[0] == "gpu" and f"gpu-{parts[1]}" in withheld)


def _with_counters(spec: JSON, counter_sets: Sequence[JSON]) -> JSON:
    """1.34: the slice with the counter sets its devices consume (a consumer must find its
    set in its own slice there; 1.35+ refuses both in one slice)."""
    used = {c["counterSet"] for d in spec.get("devices", []) for c in d.get("consumesCounters", [])}
    own = [c for c in counter_sets if c["name"] in used]
    return {**spec, "sharedCounters": own} if own else spec


def _spec(driver: str, node_name: str, devices: list[JSON]) -> JSON:
    spec: JSON = {"driver": driver, "nodeName": node_name, "pool": {"name": node_name}}
    # An empty list is left out: the API server omits it (omitempty since 1.35), and the
    # reconcile loop compares our spec with the server's.
    if devices:
        spec["devices"] = devices
    return spec
