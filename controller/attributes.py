"""The attribute vocabulary of our ResourceSlice devices, and one device -> its attributes.

A superset of NVIDIA's GPU DRA driver (`gpu.nvidia.com`): every name and type that
driver publishes for a GPU or a MIG device is published here under the same name and
type, so a claim written for it works by changing the domain only. Our own additions
(index, NUMA, NVLink peers/islands/groups, fabric clique...) follow. The table of them
in `docs/attributes.md` comes from controller/attribute_docs.py.

Pure data and pure functions: no I/O, no API calls, no topology computation (the NVLink
facts of a GPU arrive ready-made as `NvlinkFacts`). Values the hardware did not report
(None) are never published; values that break an API limit are shortened (free text)
or left out (identifiers), never sent for the API server to reject.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from controller.quantities import binary_quantity, decimal_quantity
from dra_driver.devices import NodeDevice
from dra_driver.gpu.cliques import MAX_LAYERS
from dra_driver.gpu.model import GpuInfo, Inventory, MigDevice
from dra_driver.jsontypes import JSON

# --- API limits (resource.k8s.io/v1, see reference/dra-protocol.md §1.3 and §1.7) ---
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # per device, attributes + capacities together
MAX_ATTRIBUTE_VALUES = 48  # per device, scalar + list elements (DRAListTypeAttributes)
MAX_STRING_LENGTH = 64  # string and version values, and each element of a list
MAX_ID_LENGTH = 32  # C identifier part of a qualified name
MAX_DOMAIN_LENGTH = 63  # domain part of a qualified name
MAX_QUALIFIED_NAME_LENGTH = 96

# --- attribute names (unqualified ones live in the driver's domain) ---
TYPE = "type"
UUID = "uuid"
PRODUCT_NAME = "productName"
BRAND = "brand"
ARCHITECTURE = "architecture"
CUDA_COMPUTE_CAPABILITY = "cudaComputeCapability"
DRIVER_VERSION = "driverVersion"
CUDA_DRIVER_VERSION = "cudaDriverVersion"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
STANDARD_NUMA_NODE = "resource.kubernetes.io/numaNode"
ADDRESSING_MODE = "addressingMode"
PARENT_UUID = "parentUUID"
PROFILE = "profile"
INDEX = "index"
MINOR = "minor"
PARENT_INDEX = "parentIndex"
NUMA_NODE = "numaNode"
NVLINK_PEER_COUNT = "nvlinkPeerCount"
NVLINK_PEERS = "nvlinkPeers"
NVLINK_ISLAND = "nvlinkIsland"
NVLINK_GROUP_PREFIX = "nvlinkGroup"
NVLINK_CLIQUES = "nvlinkCliques"
NVLINK_LAYER_PREFIX = "nvlinkClique"
NVLINK_DOMAIN = "nvlinkDomain"
NVLINK_CLIQUE_SIZE = "nvlinkCliqueSize"
FABRIC_CLIQUE_ID = "cliqueId"
MIG_ENABLED = "migEnabled"  # whole GPUs: in MIG mode (NVIDIA's name and type, from its earlier releases)
ISOLATION = "isolation"  # share views only (dra_driver.sharing.shares.ISOLATION_ATTRIBUTE)

# Group sizes published as nvlinkGroup<N>; bounded so that a device stays under the
# 32 attributes+capacities limit whatever the topology module reports.
NVLINK_GROUP_SIZES = (2, 4, 8, 16, 32, 64)


DEVICE_TYPE_GPU = "gpu"
DEVICE_TYPE_MIG = "mig"


@dataclass(frozen=True)
class Fact:
    """One attribute read straight from the inventory (a GPU's fact, or the driver's): its name,
    its value (None: not published), and its row of docs/attributes.md. A MIG instance
    publishes its parent GPU's value where `devices` names "mig"."""

    name: str
    value: Callable[[GpuInfo, Inventory], JSON | None]
    type: str  # the DeviceAttribute field: string, int, bool, version
    example: str
    meaning: str
    nvidia: str  # whether/how NVIDIA's gpu.nvidia.com driver publishes it
    devices: str = "gpu, mig"


# A new attribute read from NVML is a row here (with its GpuInfo field and its reader in
# dra_driver/gpu/nvml.py); the device budget, the publishing and the docs table follow it.
FACTS: tuple[Fact, ...] = (
    Fact(PRODUCT_NAME, lambda g, _: _string(g.product_name, free_text=True), "string",
         '"NVIDIA H100 80GB HBM3"', "NVML product name (of the parent, for MIG)", "yes"),
    Fact(BRAND, lambda g, _: _string(g.brand, free_text=True), "string", '"Nvidia"', "NVML brand", "yes"),
    Fact(ARCHITECTURE, lambda g, _: _string(g.architecture, free_text=True), "string", '"Hopper"',
         "NVML architecture", "yes"),
    Fact(CUDA_COMPUTE_CAPABILITY, lambda g, _: _version(g.cuda_compute_capability), "version", '"9.0.0"',
         "CUDA compute capability, as semver", "yes"),
    Fact(DRIVER_VERSION, lambda _, inv: _version(inv.driver_version), "version", '"570.195.3"',
         "kernel driver version as semver (570.195.03 -> 570.195.3, as NVIDIA does)", "yes"),
    Fact(CUDA_DRIVER_VERSION, lambda _, inv: _version(inv.cuda_driver_version), "version", '"12.8.0"',
         "highest CUDA version the driver supports", "yes"),
    Fact(PCI_BUS_ID, lambda g, _: _string(g.pci_bus_id), "string", '"0000:3b:00.0"',
         "PCI address (of the parent, for MIG); standard name", "yes (v25.12+)"),
    Fact(PCIE_ROOT, lambda g, _: _string(g.pcie_root), "string", '"pci0000:3a"',
         "PCIe root complex; standard name, match it to co-locate with NICs", "yes"),
    # Scalar even where list-type attributes are served: NVIDIA's driver publishes the list
    # form only behind its own alpha DRAListTypeAttributes gate, and a claim's `numaNode == 0`
    # never matches a list.
    Fact(STANDARD_NUMA_NODE, lambda g, _: _int(_known_numa(g.numa_node)), "int", "0",
         "NUMA node of the PCI device, only when known; standard name; scalar even where "
         "list-type attributes are served, as NVIDIA publishes it by default", "yes"),
    Fact(ADDRESSING_MODE, lambda g, _: _string(g.addressing_mode), "string", '"ATS"',
         "how the GPU addresses CPU memory (NVML addressing mode, of the parent for MIG): "
         '"ATS" or "HMM" where the coherent-memory mode is active (ATS on GH200/GB200), '
         '"None" where NVML answers but none is (an x86 H100, driver 580); absent where NVML '
         "does not report it", "yes"),
)

# Everything a whole GPU may publish apart from the clique layers (the opt-in topology-detail
# ones included): the layers get what is left of the per-device budget. The opt-in legacy
# attributes (LEGACY_ATTRIBUTES) are dropped before the layers when a device would go over it.
WHOLE_GPU_BASE: tuple[str, ...] = (
    TYPE, UUID, *(f.name for f in FACTS if DEVICE_TYPE_GPU in f.devices.split(", ")), INDEX, MINOR,
    NVLINK_CLIQUE_SIZE,
    NVLINK_PEER_COUNT, NVLINK_PEERS, NVLINK_ISLAND, NVLINK_CLIQUES, NVLINK_DOMAIN, FABRIC_CLIQUE_ID,
    MIG_ENABLED, "memory", "multiprocessors",
)
# How many nvlinkClique<L> layers a node may publish: one claim tries them through
# firstAvailable (at most MAX_LAYERS subrequests), and they must fit the 32 entries of a
# device beside everything in WHOLE_GPU_BASE (its attributes and the two capacities; counted
# here, not in this comment, so that a new attribute cannot leave the sum stale).
NVLINK_LAYERS = min(MAX_LAYERS, MAX_ATTRIBUTES_AND_CAPACITIES - len(WHOLE_GPU_BASE))

# --- capacity names ---
MEMORY = "memory"
MULTIPROCESSORS = "multiprocessors"
COPY_ENGINES = "copyEngines"
DECODERS = "decoders"
ENCODERS = "encoders"
JPEG_ENGINES = "jpegEngines"
OFA_ENGINES = "ofaEngines"
MEMORY_SLICE_PREFIX = "memorySlice"



def nvlink_group_attribute(size: int) -> str:
    return f"{NVLINK_GROUP_PREFIX}{size}"


# Published only with `--legacy-attributes` (chart `legacyAttributes`): no claim or doc of
# this driver needs them, and every attribute a device carries costs the scheduler CPU on
# every CEL selector it evaluates on that device (docs/attributes.md, "Cost"). numaNode
# repeats resource.kubernetes.io/numaNode; nvlinkGroup<N> are fixed partitions that the
# clique layers supersede.
LEGACY_ATTRIBUTES: frozenset[str] = frozenset(
    {NUMA_NODE, *(nvlink_group_attribute(s) for s in NVLINK_GROUP_SIZES)}
)

# Published only with `--topology-detail-attributes` (chart `topologyDetailAttributes`): the
# raw NVLink graph. No claim shape, DeviceClass or doc example selects on them (the clique
# layers, nvlinkCliques, nvlinkCliqueSize and nvlinkDomain say what a claim needs; nvlinkIsland
# must never be used to ask for linked GPUs), and our tools get the links elsewhere: `kubectl
# gpu` from the clique layers (or nvlinkPeers where published), the demo from the claim's
# status (its `nvlinkPeers` data), `dra-driver inventory` from NVML. Each entry costs every CEL
# evaluation on the device (docs/attributes.md, "Cost", has the figure).
TOPOLOGY_DETAIL_ATTRIBUTES: frozenset[str] = frozenset({NVLINK_PEERS, NVLINK_PEER_COUNT, NVLINK_ISLAND})


def nvlink_layer_attribute(layer: int) -> str:
    """The attribute of clique layer `layer` (0-based): nvlinkClique0, nvlinkClique1, ..."""
    return f"{NVLINK_LAYER_PREFIX}{layer}"


# The attributes whose one shared value says "these whole GPUs are all linked with each other":
# what a linked claim's matchAttribute may name (the chart's linked-claims policy lists the same).
# Only whole GPUs not in MIG mode carry them, which is what lets the linked claims' DeviceClass
# have no selector (controller.claim_shapes); a share view of a GPU must not (controller.capacity).
LINKED_SET_ATTRIBUTES: frozenset[str] = frozenset({
    NVLINK_CLIQUES, NVLINK_DOMAIN, *(nvlink_layer_attribute(n) for n in range(NVLINK_LAYERS)),
})


def memory_slice_capacity(slice_index: int) -> str:
    return f"{MEMORY_SLICE_PREFIX}{slice_index}"


@dataclass(frozen=True)
class NvlinkFacts:
    """The NVLink facts of one whole GPU, as the topology module derives them."""

    peers: tuple[int, ...]  # indexes of directly linked GPUs, ascending
    island: str | None
    groups: Mapping[int, str]  # group size -> group id (members are mutually linked)
    cliques: tuple[str, ...] = ()  # ids of the maximal cliques this GPU is in
    layers: Mapping[int, str] = dataclasses.field(default_factory=dict)  # layer -> group id
    domain: str | None = None  # island id, where the island's whole GPUs are a clique
    clique_size: int | None = None  # the largest clique this GPU is in (1: none); None: not a whole GPU


@dataclass(frozen=True)
class DeviceAttributes:
    """What one device publishes: its `attributes` and `capacity` maps, JSON-ready."""

    attributes: JSON
    capacity: JSON

    @property
    def count(self) -> int:
        return len(self.attributes) + len(self.capacity)

    @property
    def value_count(self) -> int:
        """Scalar attributes count 1, list attributes their length (the 48-values limit)."""
        return sum(_values_in(v) for v in self.attributes.values()) + len(self.capacity)

    @property
    def uses_list_attributes(self) -> bool:
        return any(k in _LIST_KINDS for v in self.attributes.values() for k in v)


_LIST_KINDS = frozenset({"ints", "strings", "bools", "versions"})


def _values_in(value: JSON) -> int:
    (kind, inner), = value.items()
    return len(inner) if kind in _LIST_KINDS else 1


# --- values ---

_NUMERIC_VERSION = re.compile(r"^[vV]?([0-9]+)(?:\.([0-9]+))?(?:\.([0-9]+))?$")


def semver(raw: str) -> str | None:
    """NVIDIA's normalisation of "9.0", "12.8", "570.195.03" to semver; None if not numeric.

    Missing minor/patch become 0 and leading zeros go (570.195.03 -> 570.195.3), which is
    what Masterminds/semver's loose parse + String() does in NVIDIA's driver.
    """
    match = _NUMERIC_VERSION.match(raw.strip())
    if match is None:
        return None
    text = ".".join(str(int(part or "0")) for part in match.groups())
    return text if len(text) <= MAX_STRING_LENGTH else None


def _string(value: str | None, *, free_text: bool = False) -> JSON | None:
    if value is None:
        return None
    if len(value) > MAX_STRING_LENGTH:
        # Free text may be shortened; a shortened identifier would be a wrong one.
        if not free_text:
            return None
        value = value[:MAX_STRING_LENGTH]
    return {"string": value}


def _id(value: str | None) -> JSON | None:
    """One of our own ids (group, island, clique): kept unique when cut to the length limit."""
    if value is None or len(value) <= MAX_STRING_LENGTH:
        return _string(value)
    digest = hashlib.sha256(value.encode()).hexdigest()[:12]
    return {"string": f"{value[:MAX_STRING_LENGTH - 13]}~{digest}"}


def _int(value: int | None) -> JSON | None:
    return None if value is None else {"int": value}


def _version(raw: str | None) -> JSON | None:
    text = semver(raw) if raw is not None else None
    return None if text is None else {"version": text}


def _quantity(value: int | None, fmt: Callable[[int], str] = decimal_quantity) -> JSON | None:
    return None if value is None or value < 0 else {"value": fmt(value)}


def _known_numa(numa_node: int | None) -> int | None:
    # sysfs reports -1 for "no NUMA affinity".
    return numa_node if numa_node is not None and numa_node >= 0 else None


def _ranges(numbers: tuple[int, ...]) -> str:
    """1,2,3,5,7,8,9 -> "1-3,5,7-9": the short readable form when the plain list is too long."""
    out: list[str] = []
    start = prev = numbers[0]
    for n in (*numbers[1:], None):
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ",".join(out)


def _peer_string(peers: tuple[int, ...]) -> JSON | None:
    if not peers:
        return None
    plain = ",".join(str(p) for p in peers)
    if len(plain) <= MAX_STRING_LENGTH:
        return {"string": plain}
    return _string(_ranges(peers))


# --- devices ---

def _common(gpu: GpuInfo, inventory: Inventory, device: str) -> dict[str, JSON | None]:
    """The fact rows of a `device` ("gpu" or "mig"), and the legacy NUMA attribute."""
    return {
        **{f.name: f.value(gpu, inventory) for f in FACTS if device in f.devices.split(", ")},
        NUMA_NODE: _int(_known_numa(gpu.numa_node)),
    }


def _nvlink(facts: NvlinkFacts | None, gpu: GpuInfo, list_attributes: bool) -> dict[str, JSON | None]:
    attrs: dict[str, JSON | None] = {
        FABRIC_CLIQUE_ID: _string(gpu.fabric_clique.id if gpu.fabric_clique else None),
    }
    if facts is None:
        return attrs
    peers = tuple(sorted(facts.peers))
    attrs[NVLINK_PEER_COUNT] = _int(len(peers))
    if list_attributes:
        attrs[NVLINK_PEERS] = {"ints": list(peers)} if peers else None
    else:
        attrs[NVLINK_PEERS] = _peer_string(peers)
    attrs[NVLINK_ISLAND] = _id(facts.island)
    attrs[NVLINK_DOMAIN] = _id(facts.domain)
    attrs[NVLINK_CLIQUE_SIZE] = _int(facts.clique_size)
    for layer in range(NVLINK_LAYERS):
        attrs[nvlink_layer_attribute(layer)] = _id(facts.layers.get(layer))
    for size in NVLINK_GROUP_SIZES:
        attrs[nvlink_group_attribute(size)] = _id(facts.groups.get(size))
    if list_attributes:
        cliques = sorted(str(v["string"]) for c in facts.cliques if (v := _id(c)) is not None)
        attrs[NVLINK_CLIQUES] = {"strings": cliques} if cliques else None
    return attrs


def _gpu_device(gpu: GpuInfo, inventory: Inventory, facts: NvlinkFacts | None,
                list_attributes: bool) -> tuple[dict[str, JSON | None], dict[str, JSON | None]]:
    attrs: dict[str, JSON | None] = {
        TYPE: {"string": DEVICE_TYPE_GPU},
        UUID: _string(gpu.uuid),
        **_common(gpu, inventory, DEVICE_TYPE_GPU),
        INDEX: _int(gpu.index),
        MINOR: _int(gpu.minor),
        **_nvlink(facts, gpu, list_attributes),
        MIG_ENABLED: {"bool": True} if gpu.mig_enabled else None,  # absent: not in MIG mode
    }
    capacity: dict[str, JSON | None] = {
        MEMORY: _quantity(gpu.memory_bytes, binary_quantity),
        MULTIPROCESSORS: _quantity(gpu.multiprocessors),
    }
    return attrs, capacity


def _mig_device(gpu: GpuInfo, mig: MigDevice,
                inventory: Inventory) -> tuple[dict[str, JSON | None], dict[str, JSON | None]]:
    # No NVLink or fabric attributes: MIG instances cannot do NVLink peer-to-peer.
    attrs: dict[str, JSON | None] = {
        TYPE: {"string": DEVICE_TYPE_MIG},
        UUID: _string(mig.uuid),
        PARENT_UUID: _string(gpu.uuid),
        PROFILE: _string(mig.profile),
        **_common(gpu, inventory, DEVICE_TYPE_MIG),
        PARENT_INDEX: _int(gpu.index),
    }
    capacity: dict[str, JSON | None] = {
        MEMORY: _quantity(mig.memory_bytes, binary_quantity),
        MULTIPROCESSORS: _quantity(mig.multiprocessors),
        COPY_ENGINES: _quantity(mig.copy_engines),
        DECODERS: _quantity(mig.decoders),
        ENCODERS: _quantity(mig.encoders),
        JPEG_ENGINES: _quantity(mig.jpeg_engines),
        OFA_ENGINES: _quantity(mig.ofa_engines),
    }
    for i in range(mig.placement_start, mig.placement_start + mig.placement_size):
        capacity[memory_slice_capacity(i)] = {"value": "1"}
    return attrs, capacity


# What goes first when a device would break a per-device limit. Over the 48 values:
# the long lists. Over the 32 entries: the legacy fixed groups (largest first), then our
# other optional additions; the clique layers come late, as the budget above leaves room
# for them. NVIDIA's names never go, except memorySlice<i> as the very last resort (a MIG
# instance wider than any so far).
_VALUE_DROP_ORDER: tuple[str, ...] = (NVLINK_PEERS, NVLINK_CLIQUES)
_ATTRIBUTE_DROP_ORDER: tuple[str, ...] = (
    *(nvlink_group_attribute(s) for s in reversed(NVLINK_GROUP_SIZES)),
    NVLINK_PEERS,
    NVLINK_CLIQUES,
    NUMA_NODE,
    NVLINK_PEER_COUNT,
    PARENT_INDEX,
    MINOR,
    INDEX,
    NVLINK_ISLAND,
    FABRIC_CLIQUE_ID,
    NVLINK_DOMAIN,
    NVLINK_CLIQUE_SIZE,
    *(nvlink_layer_attribute(n) for n in reversed(range(NVLINK_LAYERS))),
)


def _fits(device: DeviceAttributes) -> bool:
    return device.count <= MAX_ATTRIBUTES_AND_CAPACITIES and device.value_count <= MAX_ATTRIBUTE_VALUES


def _fit(attrs: JSON, capacity: JSON, optional_capacity: tuple[str, ...]) -> DeviceAttributes:
    device = DeviceAttributes(attrs, capacity)
    for name in _VALUE_DROP_ORDER:
        if device.value_count <= MAX_ATTRIBUTE_VALUES:
            break
        device = DeviceAttributes(_without(device.attributes, name), device.capacity)
    drops = [(name, True) for name in _ATTRIBUTE_DROP_ORDER] + [(name, False) for name in optional_capacity]
    for name, is_attribute in drops:
        if _fits(device):
            break
        if is_attribute:
            device = DeviceAttributes(_without(device.attributes, name), device.capacity)
        else:
            device = DeviceAttributes(device.attributes, _without(device.capacity, name))
    return device


def _without(entries: JSON, name: str) -> JSON:
    return {k: v for k, v in entries.items() if k != name}


def device_attributes(device: NodeDevice, inventory: Inventory, nvlink: NvlinkFacts | None,
                      *, list_attributes: bool, legacy: bool = False,
                      topology_detail: bool = False) -> DeviceAttributes:
    """The attributes and capacities of one device (`nvlink` is ignored for MIG devices).

    `list_attributes`: the server keeps list-type attributes (DRAListTypeAttributes);
    without it only scalar attributes are published. `legacy`: LEGACY_ATTRIBUTES too.
    `topology_detail`: TOPOLOGY_DETAIL_ATTRIBUTES too.
    """
    if device.mig is None:
        attrs, capacity = _gpu_device(device.gpu, inventory, nvlink, list_attributes)
        optional_capacity: tuple[str, ...] = (MULTIPROCESSORS,)
    else:
        attrs, capacity = _mig_device(device.gpu, device.mig, inventory)
        optional_capacity = tuple(sorted((k for k in capacity if k.startswith(MEMORY_SLICE_PREFIX)),
                                         key=lambda k: -int(k[len(MEMORY_SLICE_PREFIX):])))
    left_out = (frozenset() if legacy else LEGACY_ATTRIBUTES) | (
        frozenset() if topology_detail else TOPOLOGY_DETAIL_ATTRIBUTES)
    return _fit({k: v for k, v in attrs.items() if v is not None and k not in left_out},
                {k: v for k, v in capacity.items() if v is not None}, optional_capacity)
