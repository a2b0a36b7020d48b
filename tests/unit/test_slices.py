"""Inventory -> ResourceSlice specs: vocabulary, NVLink attributes, API limits, the JSON shape.

Expectations come from the reference (NVIDIA's attribute names and types, the v1 limits)
and from the raw NVLink links of each inventory, never from the topology module's own
output, so a wrong group or a missing NVIDIA attribute fails here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.client import V1ResourceSliceSpec

from controller import attribute_docs, quantities
from controller import attributes as A
from controller.slices import (
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_RESTRICTED,
    SliceFeatures,
    desired_slices,
)
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.devices import node_devices
from dra_driver.gpu import discover, profile_names
from dra_driver.gpu.model import (
    FabricClique,
    GpuInfo,
    Inventory,
    LinkEndpointKind,
    MigDevice,
    NvLink,
)
from dra_driver.names import is_dns_label, is_dns_subdomain
from dra_driver.sharing.config import quantity_value

NODE = "node-1"
# legacy and topology detail on: most tests here check those opt-in attributes too;
# test_default_* the default
OFF = SliceFeatures(list_attributes=False, legacy_attributes=True, topology_detail_attributes=True)
ON = SliceFeatures(list_attributes=True, legacy_attributes=True, topology_detail_attributes=True)
BOTH = pytest.mark.parametrize("features", [OFF, ON], ids=["ga", "list-attrs"])
REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- hand-made hardware


def bus(index: int) -> str:
    return f"0000:{0x10 + index:02x}:00.0"


def gpu(index: int, *, links: Iterable[int] = (), switch_links: int = 0, **kw: Any) -> GpuInfo:
    """An H100-like GPU; `links` lists one GPU index per NVLink link (repeat for NV2)."""
    nvlinks = [NvLink(n, True, LinkEndpointKind.GPU, bus(peer)) for n, peer in enumerate(links)]
    nvlinks += [NvLink(len(nvlinks) + n, True, LinkEndpointKind.NVSWITCH, None) for n in range(switch_links)]
    fields: dict[str, Any] = dict(
        index=index,
        minor=index,
        uuid=f"GPU-{index:08x}-0000-4000-8000-000000000000",
        product_name="NVIDIA H100 80GB HBM3",
        brand="Nvidia",
        architecture="Hopper",
        cuda_compute_capability="9.0",
        memory_bytes=81559 * 2**20,
        pci_bus_id=bus(index),
        pcie_root=f"pci0000:{index:02x}",
        numa_node=index // 4,
        mig_enabled=False,
        nvlinks=tuple(nvlinks),
        multiprocessors=132,
    )
    fields.update(kw)
    return GpuInfo(**fields)


def inventory(*gpus: GpuInfo) -> Inventory:
    return Inventory(driver_version="570.195.03", cuda_driver_version="12.8", gpus=tuple(gpus), source="test")


def mesh(groups: Iterable[Iterable[int]], count: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {i: [] for i in range(count)}
    for group in groups:
        for a, b in itertools.combinations(sorted(group), 2):
            out[a].append(b)
            out[b].append(a)
    return out


def hgx_h100() -> Inventory:
    return inventory(*(gpu(i, switch_links=18) for i in range(8)))


def a100_bridged() -> Inventory:
    peers = mesh([(0, 1), (2, 3)], 4)
    return inventory(*(gpu(i, links=peers[i] * 3, product_name="NVIDIA A100 80GB PCIe") for i in range(4)))


def dgx1_cube_mesh() -> Inventory:
    # Hybrid cube-mesh: two fully linked quads plus one link between i and i+4.
    peers = mesh([(0, 1, 2, 3), (4, 5, 6, 7), (0, 4), (1, 5), (2, 6), (3, 7)], 8)
    return inventory(*(gpu(i, links=peers[i], product_name="Tesla V100-SXM2-16GB",
                           architecture="Volta", cuda_compute_capability="7.0") for i in range(8)))


def mig_inventory() -> Inventory:
    migs = (
        MigDevice(0, "3g.40gb", 1, 0, 0, 4, "MIG-00000001-0000-4000-8000-000000000000", 40192 * 2**20, 60,
                  copy_engines=3, decoders=2, encoders=0, jpeg_engines=0, ofa_engines=0),
        MigDevice(0, "1g.10gb", 9, 0, 6, 1, "MIG-00000002-0000-4000-8000-000000000000", 9856 * 2**20, 16,
                  copy_engines=1, decoders=1, jpeg_engines=1, ofa_engines=1),
        MigDevice(0, "1g.10gb", 10, 0, 4, 1, "MIG-00000003-0000-4000-8000-000000000000", 9856 * 2**20, 16,
                  copy_engines=1, decoders=1, jpeg_engines=1, ofa_engines=1),
    )
    return inventory(gpu(0, mig_enabled=True, mig_devices=migs), gpu(1))


def raw_nvlink_graph(inv: Inventory) -> set[frozenset[int]]:
    """Pairs joined by an active GPU-to-GPU link, or both on NVSwitch: read from the links only."""
    by_bus = {g.pci_bus_id: g.index for g in inv.gpus}
    edges: set[frozenset[int]] = set()
    on_switch = set()
    for g in inv.gpus:
        for link in g.nvlinks:
            if not link.active:
                continue
            if link.remote_kind is LinkEndpointKind.NVSWITCH:
                on_switch.add(g.index)
            elif link.remote_pci_bus_id in by_bus and by_bus[link.remote_pci_bus_id] != g.index:
                edges.add(frozenset((g.index, by_bus[link.remote_pci_bus_id])))
    edges |= {frozenset(p) for p in itertools.combinations(sorted(on_switch), 2)}
    return edges


def with_p2p(inv: Inventory, edges: set[frozenset[int]]) -> set[frozenset[int]]:
    """Add pairs that NVML P2P status reports as NVLink-capable (where links are not readable)."""
    p2p = {frozenset((g.index, p.peer_index)) for g in inv.gpus for p in g.peer_paths if p.nvlink_p2p}
    return edges | p2p


# ---------------------------------------------------------------- helpers over specs


def devices_of(specs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [d for s in specs for d in s.get("devices", [])]


def by_name(specs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in devices_of(specs)}


def attr(device: dict[str, Any], name: str) -> Any:
    (value,) = device["attributes"][name].values()
    return value


def kind(device: dict[str, Any], name: str) -> str:
    (k,) = device["attributes"][name].keys()
    return str(k)


def groups(specs: tuple[dict[str, Any], ...], size: int) -> list[set[int]]:
    members: dict[str, set[int]] = {}
    for d in devices_of(specs):
        gid = d["attributes"].get(A.nvlink_group_attribute(size))
        if gid is not None:
            members.setdefault(gid["string"], set()).add(attr(d, "index"))
    return sorted(members.values(), key=min)


def profiles() -> list[str]:
    return list(profile_names())


def profile_inventory(name: str) -> Inventory:
    return discover(simulate=name)


# ---------------------------------------------------------------- NVIDIA vocabulary

NVIDIA_GPU = {
    "type": "string",
    "uuid": "string",
    "productName": "string",
    "brand": "string",
    "architecture": "string",
    "cudaComputeCapability": "version",
    "driverVersion": "version",
    "cudaDriverVersion": "version",
    "resource.kubernetes.io/pciBusID": "string",
    "resource.kubernetes.io/pcieRoot": "string",
}
NVIDIA_MIG = {**NVIDIA_GPU, "parentUUID": "string", "profile": "string"}
NVIDIA_MIG_CAPACITY = {"memory", "multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines",
                       "ofaEngines"}


def test_h100_device_has_nvidias_names_and_types() -> None:
    dev = by_name(desired_slices(hgx_h100(), NODE, DRIVER, OFF))["gpu-3"]
    assert {n: kind(dev, n) for n in NVIDIA_GPU} == NVIDIA_GPU
    assert attr(dev, "type") == "gpu"
    assert attr(dev, "uuid") == "GPU-00000003-0000-4000-8000-000000000000"
    assert attr(dev, "cudaComputeCapability") == "9.0.0"
    assert attr(dev, "driverVersion") == "570.195.3"  # NVIDIA's normalisation of 570.195.03
    assert attr(dev, "cudaDriverVersion") == "12.8.0"
    assert attr(dev, "resource.kubernetes.io/pciBusID") == "0000:13:00.0"
    assert attr(dev, "resource.kubernetes.io/pcieRoot") == "pci0000:03"
    assert dev["attributes"]["resource.kubernetes.io/numaNode"] == {"int": 0}
    assert dev["capacity"]["memory"] == {"value": "81559Mi"}
    assert (attr(dev, "index"), attr(dev, "minor"), attr(dev, "numaNode")) == (3, 3, 0)


@pytest.mark.parametrize("name", ["dgx-h100", "hgx-h200"])
def test_hopper_profiles_have_nvidias_names_and_types(name: str) -> None:
    inv = profile_inventory(name)
    for dev in devices_of(desired_slices(inv, NODE, DRIVER, OFF)):
        assert {n: kind(dev, n) for n in NVIDIA_GPU} == NVIDIA_GPU
        assert attr(dev, "type") == "gpu"
        assert attr(dev, "cudaComputeCapability") == "9.0.0"
        assert attr(dev, "architecture") == "Hopper"
        assert re.fullmatch(r"\d+(Mi|Gi|Ki)?", dev["capacity"]["memory"]["value"])


def test_mig_devices_replace_their_parent_and_carry_nvidias_mig_vocabulary() -> None:
    specs = desired_slices(mig_inventory(), NODE, DRIVER, OFF)
    names = [d["name"] for d in devices_of(specs)]
    # Sorted by GPU index, then placement; the MIG-enabled parent is not a device.
    assert names == ["gpu-0-mig-3g40gb-0", "gpu-0-mig-1g10gb-4", "gpu-0-mig-1g10gb-6", "gpu-1"]
    mig = by_name(specs)["gpu-0-mig-3g40gb-0"]
    assert {n: kind(mig, n) for n in NVIDIA_MIG} == NVIDIA_MIG
    assert attr(mig, "type") == "mig"
    assert attr(mig, "profile") == "3g.40gb"
    assert attr(mig, "parentUUID") == "GPU-00000000-0000-4000-8000-000000000000"
    assert attr(mig, "parentIndex") == 0
    assert set(mig["capacity"]) >= NVIDIA_MIG_CAPACITY
    assert mig["capacity"]["memory"] == {"value": "40192Mi"}
    assert mig["capacity"]["multiprocessors"] == {"value": "60"}
    assert mig["capacity"]["copyEngines"] == {"value": "3"}
    slices = {k for k in mig["capacity"] if k.startswith("memorySlice")}
    assert slices == {"memorySlice0", "memorySlice1", "memorySlice2", "memorySlice3"}
    # MIG instances cannot do NVLink P2P: no NVLink attributes on them.
    assert not [n for n in mig["attributes"] if n.startswith("nvlink")]


def test_mig_profile_devices() -> None:
    inv = profile_inventory("a100-mig")
    specs = desired_slices(inv, NODE, DRIVER, OFF)
    migs = [d for d in devices_of(specs) if attr(d, "type") == "mig"]
    assert migs, "the a100-mig profile has MIG devices"
    parents = {g.index for g in inv.gpus if g.mig_enabled}
    assert not any(d["name"] in {f"gpu-{p}" for p in parents} for d in devices_of(specs))
    for d in migs:
        assert {n: kind(d, n) for n in NVIDIA_MIG} == NVIDIA_MIG
        assert set(d["capacity"]) >= NVIDIA_MIG_CAPACITY


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("570.195.03", "570.195.3"), ("12.8", "12.8.0"), ("9.0", "9.0.0"), ("535.104.05", "535.104.5"),
     ("13", "13.0.0"), ("580.65.06", "580.65.6"), ("r570", None), ("1.2.3.4", None), ("", None)],
)
def test_versions_normalise_like_nvidia(raw: str, expected: str | None) -> None:
    assert A.semver(raw) == expected


def test_unparseable_version_is_left_out_not_sent() -> None:
    inv = dataclasses.replace(hgx_h100(), driver_version="r570-custom")
    for dev in devices_of(desired_slices(inv, NODE, DRIVER, OFF)):
        assert "driverVersion" not in dev["attributes"]
        assert attr(dev, "cudaDriverVersion") == "12.8.0"


# ---------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("n", "text"),
    [(81559 * 2**20, "81559Mi"), (80 * 2**30, "80Gi"), (150754820096, "143771Mi"), (0, "0"), (1000, "1k"),
     (1023, "1023"), (1024, "1Ki"), (1500, "1500"), (2**60, "1Ei"), (3 * 2**70, "3072Ei")],
)
def test_binary_quantity_is_the_servers_canonical_form(n: int, text: str) -> None:
    assert quantities.binary_quantity(n) == text


def parse_quantity(text: str) -> int:
    """The value of a quantity in canonical form (digits and at most a suffix, as the server writes it)."""
    assert re.fullmatch(r"\d+([kMGTPE]i?|Ki)?", text), text
    value = quantity_value(text)
    assert value is not None and value == int(value), text
    return int(value)


@given(st.integers(min_value=0, max_value=2**62))
def test_quantities_keep_their_value(n: int) -> None:
    assert parse_quantity(quantities.binary_quantity(n)) == n
    assert parse_quantity(quantities.decimal_quantity(n)) == n


def test_memory_compares_right_with_cel_quantities() -> None:
    # An "80GB" H100 has 81559 MiB: less than 80Gi, more than 79Gi and 80G.
    dev = by_name(desired_slices(hgx_h100(), NODE, DRIVER, OFF))["gpu-0"]
    memory = parse_quantity(dev["capacity"]["memory"]["value"])
    assert 79 * 2**30 < memory < 80 * 2**30
    assert memory > 80 * 10**9


# ---------------------------------------------------------------- NVLink


def test_bridged_a100_pairs_0_1_and_2_3_and_has_no_group_of_four() -> None:
    specs = desired_slices(a100_bridged(), NODE, DRIVER, OFF)
    assert groups(specs, 2) == [{0, 1}, {2, 3}]
    assert groups(specs, 4) == []
    devs = by_name(specs)
    assert attr(devs["gpu-0"], "nvlinkPeers") == "1"
    assert attr(devs["gpu-0"], "nvlinkPeerCount") == 1
    assert attr(devs["gpu-0"], "nvlinkIsland") == attr(devs["gpu-1"], "nvlinkIsland")
    assert attr(devs["gpu-0"], "nvlinkIsland") != attr(devs["gpu-2"], "nvlinkIsland")


def test_bridged_a100_profile() -> None:
    inv = profile_inventory("a100-pcie-bridged")
    raw = raw_nvlink_graph(inv)
    specs = desired_slices(inv, NODE, DRIVER, OFF)
    pairs = groups(specs, 2)
    assert pairs == [{0, 1}, {2, 3}]
    assert all(frozenset(p) in raw for p in pairs)
    assert groups(specs, 4) == []


@pytest.mark.parametrize("name", ["hand-made", "dgx1-v100"])
def test_dgx1_cube_mesh_groups_of_four_are_mutually_linked(name: str) -> None:
    inv = dgx1_cube_mesh() if name == "hand-made" else profile_inventory(name)
    raw = raw_nvlink_graph(inv)
    specs = desired_slices(inv, NODE, DRIVER, OFF)
    quads = groups(specs, 4)
    assert len(quads) == 2 and set().union(*quads) == set(range(8))
    for size in (2, 4):
        for members in groups(specs, size):
            assert len(members) == size
            assert all(frozenset(p) in raw for p in itertools.combinations(members, 2)), (size, members)
    assert groups(specs, 8) == []  # 0 and 5 are not linked
    for dev in devices_of(specs):
        i = attr(dev, "index")
        expected = sorted(j for j in range(8) if frozenset((i, j)) in raw)
        assert attr(dev, "nvlinkPeers") == ",".join(map(str, expected))
        assert attr(dev, "nvlinkPeerCount") == len(expected)


@pytest.mark.parametrize("name", ["hand-made", "dgx-h100", "hgx-h200"])
def test_nvswitch_box_puts_all_eight_in_one_group_of_eight(name: str) -> None:
    inv = hgx_h100() if name == "hand-made" else profile_inventory(name)
    specs = desired_slices(inv, NODE, DRIVER, OFF)
    assert groups(specs, 8) == [set(range(8))]
    assert len(groups(specs, 4)) == 2 and len(groups(specs, 2)) == 4
    for dev in devices_of(specs):
        assert attr(dev, "nvlinkPeerCount") == 7


def test_gpus_without_nvlink_have_no_groups_and_no_peer_list() -> None:
    inv = inventory(gpu(0), gpu(1))
    for dev in devices_of(desired_slices(inv, NODE, DRIVER, ON)):
        assert attr(dev, "nvlinkPeerCount") == 0
        assert not {"nvlinkPeers", "nvlinkCliques", "nvlinkGroup2"} & set(dev["attributes"])


@pytest.mark.parametrize("name", profiles())
def test_every_profiles_groups_are_cliques_of_the_raw_graph(name: str) -> None:
    inv = profile_inventory(name)
    raw = with_p2p(inv, raw_nvlink_graph(inv))
    specs = desired_slices(inv, NODE, DRIVER, OFF)
    for size in A.NVLINK_GROUP_SIZES:
        for members in groups(specs, size):
            assert len(members) == size
            assert all(frozenset(p) in raw for p in itertools.combinations(members, 2)), (size, members)


@st.composite
def nvlink_graphs(draw: st.DrawFn) -> tuple[int, set[frozenset[int]]]:
    count = draw(st.integers(min_value=0, max_value=12))
    pairs = list(itertools.combinations(range(count), 2))
    chosen = draw(st.sets(st.sampled_from(pairs), max_size=len(pairs))) if pairs else set()
    return count, {frozenset(p) for p in chosen}


@settings(max_examples=60, deadline=None)
@given(nvlink_graphs(), st.booleans())
def test_any_nvlink_graph_gives_groups_that_are_cliques_and_keeps_the_limits(
    graph: tuple[int, set[frozenset[int]]], list_attributes: bool
) -> None:
    count, edges = graph
    peers = {i: sorted(j for j in range(count) if frozenset((i, j)) in edges) for i in range(count)}
    inv = inventory(*(gpu(i, links=peers[i]) for i in range(count)))
    assert raw_nvlink_graph(inv) == edges
    features = SliceFeatures(list_attributes=list_attributes, topology_detail_attributes=True)
    specs = desired_slices(inv, NODE, DRIVER, features)
    check_limits(specs, features)
    for size in A.NVLINK_GROUP_SIZES:
        member_sets = groups(specs, size)
        assert all(len(m) == size for m in member_sets)
        assert all(frozenset(p) in edges for m in member_sets for p in itertools.combinations(m, 2))
        assert sum(map(len, member_sets)) == len(set().union(*member_sets)), "disjoint groups"
    for dev in devices_of(specs):
        i = attr(dev, "index")
        assert attr(dev, "nvlinkPeerCount") == len(peers[i])
        expected: Any = (peers[i] if list_attributes else ",".join(map(str, peers[i]))) if peers[i] else None
        assert (attr(dev, "nvlinkPeers") if "nvlinkPeers" in dev["attributes"] else None) == expected


def test_fabric_clique_id_is_nvidias_form_and_only_when_in_a_fabric() -> None:
    clique = FabricClique("8c1f6a52-0000-4000-8000-000000000000", 7)
    inv = inventory(gpu(0, fabric_clique=clique), gpu(1))
    devs = by_name(desired_slices(inv, NODE, DRIVER, OFF))
    assert attr(devs["gpu-0"], "cliqueId") == "8c1f6a52-0000-4000-8000-000000000000.7"
    assert "cliqueId" not in devs["gpu-1"]["attributes"]


def test_unknown_values_are_not_published() -> None:
    inv = inventory(gpu(0, numa_node=None, pcie_root=None, multiprocessors=None), gpu(1, numa_node=-1))
    for dev in devices_of(desired_slices(inv, NODE, DRIVER, ON)):
        assert not {"numaNode", "resource.kubernetes.io/numaNode"} & set(dev["attributes"])
        for value in dev["attributes"].values():
            assert None not in value.values()
    dev0 = by_name(desired_slices(inv, NODE, DRIVER, OFF))["gpu-0"]
    assert "resource.kubernetes.io/pcieRoot" not in dev0["attributes"]
    assert "multiprocessors" not in dev0["capacity"]


# ---------------------------------------------------------------- list-type attributes


def list_kinds(specs: tuple[dict[str, Any], ...]) -> set[str]:
    return {n for d in devices_of(specs) for n, v in d["attributes"].items()
            if set(v) & {"ints", "strings", "bools", "versions"}}


def test_list_attributes_only_when_enabled() -> None:
    inv = dgx1_cube_mesh()
    assert list_kinds(desired_slices(inv, NODE, DRIVER, OFF)) == set()
    on = desired_slices(inv, NODE, DRIVER, ON)
    assert list_kinds(on) == {"nvlinkPeers", "nvlinkCliques"}
    dev = by_name(on)["gpu-0"]
    assert dev["attributes"]["nvlinkPeers"] == {"ints": [1, 2, 3, 4]}
    assert dev["attributes"]["nvlinkCliques"] == {"strings": ["0-1-2-3", "0-4"]}
    # NVIDIA's default form, so a claim's `numaNode == 0` matches with list attributes served too
    assert dev["attributes"]["resource.kubernetes.io/numaNode"] == {"int": 0}
    assert dev["attributes"]["numaNode"] == {"int": 0}


@pytest.mark.parametrize("name", profiles())
def test_no_list_attribute_in_any_profile_without_the_feature(name: str) -> None:
    assert list_kinds(desired_slices(profile_inventory(name), NODE, DRIVER, OFF)) == set()


# ---------------------------------------------------------------- JSON shape and API limits

_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")


def check_qualified_name(name: str) -> None:
    assert len(name) <= 96, name
    domain, _, ident = name.rpartition("/")
    assert _C_IDENTIFIER.match(ident) and len(ident) <= 32, name
    if domain:
        assert is_dns_subdomain(domain, 63), name


def check_limits(specs: tuple[dict[str, Any], ...], features: SliceFeatures) -> None:
    assert specs, "at least one slice"
    names = [d["name"] for d in devices_of(specs)]
    assert len(names) == len(set(names)), "device names are unique in the pool"
    for spec in specs:
        devices = spec.get("devices", [])
        restricted = any(list_kinds((spec,)))
        assert len(devices) <= (MAX_DEVICES_PER_SLICE_RESTRICTED if restricted else MAX_DEVICES_PER_SLICE)
        for dev in devices:
            assert is_dns_label(dev["name"]), dev["name"]
            attrs, caps = dev.get("attributes", {}), dev.get("capacity", {})
            assert len(attrs) + len(caps) <= 32, (dev["name"], len(attrs) + len(caps))
            values = sum(len(v) if isinstance(v, list) else 1 for a in attrs.values() for v in a.values())
            assert values + len(caps) <= 48, dev["name"]
            for name, value in attrs.items():
                check_qualified_name(name)
                (k, v), = value.items()
                if k in {"string", "version"}:
                    assert isinstance(v, str) and len(v) <= 64, (name, v)
                if k == "version":
                    assert _SEMVER.match(v), (name, v)
                if k in {"strings", "ints"}:
                    assert features.list_attributes and v and all(len(str(x)) <= 64 for x in v), name
            for name, cap in caps.items():
                check_qualified_name(name)
                assert set(cap) == {"value"} and isinstance(cap["value"], str), name


def round_trip(spec: dict[str, Any]) -> None:
    # The reconcile loop fills in the pool's bookkeeping before writing.
    full = {**spec, "pool": {**spec["pool"], "generation": 1, "resourceSliceCount": 1}}
    model = V1ResourceSliceSpec.from_dict(full)
    assert model is not None
    assert json.loads(model.to_json()) == full


@BOTH
@pytest.mark.parametrize("name", profiles())
def test_every_profile_keeps_the_api_limits_and_the_client_model(name: str, features: SliceFeatures) -> None:
    inv = profile_inventory(name)
    specs = desired_slices(inv, NODE, DRIVER, features)
    check_limits(specs, features)
    assert len(devices_of(specs)) == len(node_devices(inv))
    for spec in specs:
        assert spec["driver"] == DRIVER and spec["nodeName"] == NODE and spec["pool"] == {"name": NODE}
        round_trip(spec)


@BOTH
@pytest.mark.parametrize("make", [hgx_h100, a100_bridged, dgx1_cube_mesh, mig_inventory])
def test_hand_made_nodes_respect_the_limits_and_round_trip(make: Any, features: SliceFeatures) -> None:
    specs = desired_slices(make(), NODE, DRIVER, features)
    check_limits(specs, features)
    for spec in specs:
        round_trip(spec)


def test_the_client_model_rejects_a_bare_capacity_so_the_round_trip_can_fail() -> None:
    spec = desired_slices(hgx_h100(), NODE, DRIVER, OFF)[0]
    bad = json.loads(json.dumps(spec))
    bad["devices"][0]["capacity"]["memory"] = "80Gi"
    with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError or the generator's TypeError
        round_trip(bad)
    bad = json.loads(json.dumps(spec))
    bad["devices"][0]["capacity"]["memory"] = {"value": 85520809984}
    with pytest.raises(Exception):  # noqa: B017
        round_trip(bad)


def test_empty_inventory_is_one_slice_without_devices() -> None:
    specs = desired_slices(inventory(), NODE, DRIVER, OFF)
    assert specs == ({"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE}},)
    round_trip(specs[0])


def many_gpus(count: int, nvlink_pairs: bool) -> Inventory:
    gpus = [gpu(i, links=[i ^ 1] if nvlink_pairs else ()) for i in range(count)]
    random.Random(7).shuffle(gpus)  # the order of discovery must not matter
    return inventory(*gpus)


def test_200_gpus_split_over_slices_in_index_order() -> None:
    specs = desired_slices(many_gpus(200, nvlink_pairs=False), NODE, DRIVER, OFF)
    assert [len(s["devices"]) for s in specs] == [128, 72]
    assert [d["name"] for d in devices_of(specs)] == [f"gpu-{i}" for i in range(200)]
    check_limits(specs, OFF)
    for spec in specs:
        round_trip(spec)


def test_list_attributes_halve_the_slice_size() -> None:
    inv = many_gpus(200, nvlink_pairs=True)
    on = desired_slices(inv, NODE, DRIVER, ON)
    assert [len(s["devices"]) for s in on] == [64, 64, 64, 8]
    check_limits(on, ON)
    devs = by_name(on)
    assert devs["gpu-0"]["attributes"]["nvlinkGroup2"] == devs["gpu-1"]["attributes"]["nvlinkGroup2"]
    off = desired_slices(inv, NODE, DRIVER, OFF)
    assert [len(s["devices"]) for s in off] == [128, 72]
    assert desired_slices(inv, NODE, DRIVER, ON) == on  # deterministic


def test_a_large_full_mesh_still_fits_every_device_limit() -> None:
    # 64 GPUs on one NVSwitch fabric: 63 peers overflow the 48 values of a list-attribute
    # device and a 64-char string; both forms must degrade, never break a limit.
    inv = inventory(*(gpu(i, switch_links=18, fabric_clique=FabricClique("c" * 36, 1)) for i in range(64)))
    for features in (OFF, ON):
        specs = desired_slices(inv, NODE, DRIVER, features)
        check_limits(specs, features)
        dev = by_name(specs)["gpu-5"]
        assert attr(dev, "nvlinkPeerCount") == 63
        assert attr(dev, "nvlinkGroup8") == attr(by_name(specs)["gpu-0"], "nvlinkGroup8")
        assert len({attr(d, "nvlinkGroup64") for d in devices_of(specs)}) == 1
    ga = by_name(desired_slices(inv, NODE, DRIVER, OFF))
    assert attr(ga["gpu-5"], "nvlinkPeers") == "0-4,6-63"


def test_a_mig_instance_on_every_memory_slice_fits() -> None:
    mig = MigDevice(0, "7g.80gb", 0, 0, 0, 8, "MIG-00000009-0000-4000-8000-000000000000", 80 * 2**30, 132,
                    copy_engines=7, decoders=7, encoders=0, jpeg_engines=1, ofa_engines=1)
    specs = desired_slices(inventory(gpu(0, mig_enabled=True, mig_devices=(mig,))), NODE, DRIVER, ON)
    check_limits(specs, ON)
    dev = devices_of(specs)[0]
    assert {f"memorySlice{i}" for i in range(8)} <= set(dev["capacity"])


@pytest.mark.parametrize("driver", ["GPU.example.com", "-bad.example", "a" * 64, ""])
def test_invalid_driver_name_is_refused(driver: str) -> None:
    with pytest.raises(ValueError, match="driver name"):
        desired_slices(hgx_h100(), NODE, driver, OFF)


def test_invalid_node_name_is_refused() -> None:
    with pytest.raises(ValueError, match="node name"):
        desired_slices(hgx_h100(), "Node_1", DRIVER, OFF)


def test_long_free_text_is_shortened_and_long_ids_left_out() -> None:
    inv = inventory(gpu(0, product_name="X" * 80, uuid="GPU-" + "0" * 70))
    dev = devices_of(desired_slices(inv, NODE, DRIVER, OFF))[0]
    assert attr(dev, "productName") == "X" * 64
    assert "uuid" not in dev["attributes"]


# ---------------------------------------------------------------- docs


def test_docs_table_is_the_vocabulary() -> None:
    doc = (REPO / "docs" / "attributes.md").read_text()
    assert attribute_docs.markdown_table() in doc


def test_every_published_name_is_in_the_vocabulary() -> None:
    documented = {a.name for a in attribute_docs.VOCABULARY} | {c.name for c in attribute_docs.CAPACITIES}
    patterns = [re.compile("^" + re.sub(r"<[NiL]>", r"\\d+", re.escape(n)) + "$") for n in documented]
    invs = [hgx_h100(), dgx1_cube_mesh(), mig_inventory(),
            inventory(gpu(0, fabric_clique=FabricClique("x", 1), links=[1]), gpu(1, links=[0]))]
    for inv, features in itertools.product(invs, (OFF, ON)):
        for dev in devices_of(desired_slices(inv, NODE, DRIVER, features)):
            for name in [*dev["attributes"], *dev.get("capacity", {})]:
                assert any(p.match(name) for p in patterns), name


# ---------------------------------------------------------------- clique layers


def test_ring_profile_publishes_two_layers_that_hold_every_linked_pair() -> None:
    inv = profile_inventory("ring8-v100")
    raw = raw_nvlink_graph(inv)
    for features in (OFF, ON):
        devs = by_name(desired_slices(inv, NODE, DRIVER, features))
        layer_sets: set[frozenset[int]] = set()
        for layer in range(A.NVLINK_LAYERS):
            members: dict[str, set[int]] = {}
            for d in devs.values():
                value = d["attributes"].get(A.nvlink_layer_attribute(layer))
                if value is not None:
                    members.setdefault(value["string"], set()).add(attr(d, "index"))
            layer_sets |= {frozenset(m) for m in members.values()}
        assert layer_sets == raw  # every linked pair is exactly one group of some layer
        assert attr(devs["gpu-1"], "nvlinkClique0") == "0-1" and attr(devs["gpu-1"], "nvlinkClique1") == "1-2"
        assert not {"nvlinkClique2", "nvlinkDomain"} & set(devs["gpu-1"]["attributes"])


def test_over_the_limit_the_legacy_groups_go_before_any_layer() -> None:
    clique = FabricClique("c" * 36, 1)
    inv = inventory(gpu(0, fabric_clique=clique), gpu(1))
    facts = A.NvlinkFacts(
        peers=(1,), island="island-0", groups={size: f"nvl{size}-x" for size in A.NVLINK_GROUP_SIZES},
        cliques=("0-1",), layers={n: f"0-{n + 1}" for n in range(A.NVLINK_LAYERS)}, domain="island-0",
        clique_size=2,
    )
    device = A.device_attributes(node_devices(inv)["gpu-0"], inv, facts, list_attributes=True, legacy=True,
                                 topology_detail=True)
    assert device.count == A.MAX_ATTRIBUTES_AND_CAPACITIES
    names = set(device.attributes)
    assert {A.nvlink_layer_attribute(n) for n in range(A.NVLINK_LAYERS)} <= names
    assert {"nvlinkDomain", "nvlinkCliques", "nvlinkIsland", "nvlinkCliqueSize"} <= names
    assert [s for s in A.NVLINK_GROUP_SIZES if A.nvlink_group_attribute(s) in names] == [2]


# ---------------------------------------------------------------- default set, clique size


@pytest.mark.parametrize(
    "opt_in", [A.LEGACY_ATTRIBUTES, A.TOPOLOGY_DETAIL_ATTRIBUTES], ids=["legacy", "detail"])
@pytest.mark.parametrize("list_attributes", [False, True], ids=["ga", "list-attrs"])
def test_default_publishes_no_opt_in_attribute(list_attributes: bool, opt_in: frozenset[str]) -> None:
    assert {"nvlinkPeers", "nvlinkPeerCount", "nvlinkIsland"} == A.TOPOLOGY_DETAIL_ATTRIBUTES
    for name in profiles():
        features = SliceFeatures(list_attributes=list_attributes)
        specs = desired_slices(profile_inventory(name), NODE, DRIVER, features)
        for dev in devices_of(specs):
            assert not opt_in & set(dev.get("attributes", {})), (name, dev["name"])


@pytest.mark.parametrize("list_attributes", [False, True], ids=["ga", "list-attrs"])
def test_the_topology_detail_flag_brings_them_back_and_nothing_else(list_attributes: bool) -> None:
    inv = profile_inventory("dgx1-v100")
    plain = devices_of(desired_slices(inv, NODE, DRIVER, SliceFeatures(list_attributes=list_attributes)))
    detail = devices_of(desired_slices(inv, NODE, DRIVER, SliceFeatures(
        list_attributes=list_attributes, topology_detail_attributes=True)))
    assert [d["name"] for d in plain] == [d["name"] for d in detail]
    for p, d in zip(plain, detail, strict=True):
        if attr(d, "type") != "gpu":
            continue
        assert set(d["attributes"]) - set(p["attributes"]) == A.TOPOLOGY_DETAIL_ATTRIBUTES, d["name"]
        assert {k: v for k, v in d["attributes"].items() if k in p["attributes"]} == p["attributes"]
        assert attr(d, "nvlinkPeerCount") == 4  # DGX-1: every V100 has 4 NVLink peers


def test_default_entries_per_whole_gpu() -> None:
    # what CEL copies per device and evaluation (docs/attributes.md, "Cost"), list attributes on
    features = SliceFeatures(list_attributes=True)
    for name, entries in (("hgx-h200", 18), ("dgx1-v100", 18)):
        for dev in devices_of(desired_slices(profile_inventory(name), NODE, DRIVER, features)):
            if attr(dev, "type") == "gpu":
                assert len(dev["attributes"]) + len(dev.get("capacity", {})) == entries, (name, dev["name"])


@pytest.mark.parametrize(("name", "sizes"), [
    ("hgx-h200", [8] * 8), ("dgx1-v100", [4] * 8), ("ring8-v100", [2] * 8),
    ("bridged-triangles-v100", [3] * 6), ("a100-pcie-bridged", [2] * 4), ("l4x4", [1] * 4),
])
def test_default_clique_size_is_the_largest_clique_of_each_gpu(name: str, sizes: list[int]) -> None:
    specs = desired_slices(profile_inventory(name), NODE, DRIVER, SliceFeatures())
    gpus = sorted((attr(d, "index"), attr(d, "nvlinkCliqueSize")) for d in devices_of(specs)
                  if attr(d, "type") == "gpu")
    assert [size for _, size in gpus] == sizes


def test_clique_size_is_per_gpu_where_cliques_differ() -> None:
    # a triangle 0-1-2 with a tail 2-3 and a lone GPU 4
    inv = inventory(gpu(0, links=[1, 2]), gpu(1, links=[0, 2]), gpu(2, links=[0, 1, 3]), gpu(3, links=[2]),
                    gpu(4))
    devs = by_name(desired_slices(inv, NODE, DRIVER, SliceFeatures()))
    assert [attr(devs[f"gpu-{i}"], "nvlinkCliqueSize") for i in range(5)] == [3, 3, 3, 2, 1]
