"""Exhaustive check of the documented NVLink claim shapes against a model of the scheduler.

For every simulated profile and a family of generated graphs (rings, meshes, hypercubes,
bridged cliques, cube-mesh, complete graphs, random graphs by seed; up to 8 GPUs), for
every set of busy GPUs and every k from 2 to the GPU count:
- the published slices (the real `desired_slices`, GA and list-attribute forms) are read
  by a model of the scheduler's allocator running the documented claim
  (`controller.claim_shapes`): for each `firstAvailable` subrequest in order, the
  constraints that name it (`<request>/<subrequest>`) or its request, `count: k` free
  devices of the class (`type == "gpu"`) whose values of every matchAttribute share a
  value (scalar: equal; list attributes: a common element, the set semantics of
  DRAListTypeAttributes), first such set in device order, as the allocator's depth-first
  search returns it;
- the truth comes from the raw NVLink links of the inventory, never from the topology
  module: do the free GPUs hold k mutually linked ones?
Asserted: the model never returns a set that is not mutually linked; where the layers
cover every clique (`complete`) it finds one exactly when one exists; where they do not,
every miss is a free k-clique that the coverage report lists as uncovered. The fast
model (value groups) is checked against a brute-force search over all k-subsets first.
docs/nvlink.md holds the coverage tables that `coverage_markdown()` renders.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from controller import attributes as A
from controller.claim_fit import fit_linked_claim
from controller.claim_shapes import (
    linked_gpus_ga,
    linked_gpus_list,
)
from controller.publisher import warn_uncovered_cliques
from controller.slices import SliceFeatures, desired_slices, published_topology
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.gpu import discover, profile_names
from dra_driver.gpu.cliques import MAX_LAYERS, clique_layers, coverage, maximal_cliques
from dra_driver.gpu.model import Inventory, LinkEndpointKind
from dra_driver.gpu.report import inventory_document, render_table
from tests.harness.examples import DEMO_NODES
from tests.harness.first_found import FastModel, allocate_brute, class_devices
from tests.harness.topologies import graph_inventory

REPO = Path(__file__).resolve().parents[2]
OFF = SliceFeatures(list_attributes=False)
ON = SliceFeatures(list_attributes=True)
Edges = frozenset[frozenset[int]]

# ------------------------------------------------------------------ graphs


def E(*pairs: tuple[int, int]) -> Edges:
    return frozenset(frozenset(p) for p in pairs)


def complete(members: Iterable[int]) -> Edges:
    return E(*itertools.combinations(sorted(members), 2))


def ring(n: int) -> Edges:
    return E(*((i, (i + 1) % n) for i in range(n)))


def grid(rows: int, cols: int) -> Edges:
    pairs = [(r * cols + c, r * cols + c + 1) for r in range(rows) for c in range(cols - 1)]
    pairs += [(r * cols + c, (r + 1) * cols + c) for r in range(rows - 1) for c in range(cols)]
    return E(*pairs)


def hypercube(dim: int) -> Edges:
    return E(*((i, i ^ (1 << b)) for i in range(1 << dim) for b in range(dim) if i < i ^ (1 << b)))


def random_graph(n: int, density: float, seed: int) -> Edges:
    rnd = random.Random(seed)
    return E(*(p for p in itertools.combinations(range(n), 2) if rnd.random() < density))


GENERATED: dict[str, tuple[int, Edges]] = {
    "ring-3": (3, ring(3)),
    "ring-5": (5, ring(5)),
    "ring-6": (6, ring(6)),
    "ring-8": (8, ring(8)),
    "path-8": (8, E(*((i, i + 1) for i in range(7)))),
    "star-8": (8, E(*((0, i) for i in range(1, 8)))),
    "mesh-2x2": (4, grid(2, 2)),
    "mesh-2x3": (6, grid(2, 3)),
    "mesh-2x4": (8, grid(2, 4)),
    "torus-2x4": (8, grid(2, 4) | E((0, 3), (4, 7))),
    "hypercube-2": (4, hypercube(2)),
    "hypercube-3": (8, hypercube(3)),
    "complete-2": (2, complete(range(2))),
    "complete-5": (5, complete(range(5))),
    "complete-8": (8, complete(range(8))),
    "bridged-triangles": (6, complete((0, 1, 2)) | complete((3, 4, 5)) | E((2, 3))),
    "bridged-quads": (8, complete((0, 1, 2, 3)) | complete((4, 5, 6, 7)) | E((3, 4))),
    "triangle-bridge-quad": (7, complete((0, 1, 2)) | complete((3, 4, 5, 6)) | E((2, 3), (1, 3))),
    "three-triangles-chain": (8, complete((0, 1, 2)) | complete((2, 3, 4)) | complete((4, 5, 6)) | E((6, 7))),
    "cube-mesh-dgx1": (8, complete((0, 1, 2, 3)) | complete((4, 5, 6, 7))
                       | E((0, 4), (1, 5), (2, 6), (3, 7))),
    "wheel-8": (8, ring(7) | E(*((7, i) for i in range(7)))),
    "cocktail-party-8": (8, complete(range(8)) - E((0, 1), (2, 3), (4, 5), (6, 7))),
    "apex-over-K3,2,2": (8, E(*((7, i) for i in range(7)))
                         | E(*((a, b) for a, b in itertools.combinations(range(7), 2)
                               if {a, b} not in ({0, 1}, {0, 2}, {1, 2}, {3, 4}, {5, 6})))),
    "no-links-4": (4, E()),
    **{f"random-n{n}-p{int(p * 10)}-s{s}": (n, random_graph(n, p, 1000 * n + 10 * int(p * 10) + s))
       for n in (4, 5, 6, 7, 8) for p in (0.3, 0.5, 0.7, 0.9) for s in range(4)},
}


# ------------------------------------------------------------------ the truth: raw links


def raw_edges(inv: Inventory) -> Edges:
    """Pairs with an active GPU-to-GPU link, both on NVSwitch, or NVLink P2P: from the raw facts only."""
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
    edges |= {frozenset((g.index, p.peer_index)) for g in inv.gpus for p in g.peer_paths if p.nvlink_p2p}
    return frozenset(edges)


def is_clique(members: Iterable[int], edges: Edges) -> bool:
    return all(frozenset(p) in edges for p in itertools.combinations(sorted(members), 2))


def busy_sets(indexes: list[int]) -> Iterator[frozenset[int]]:
    for r in range(len(indexes) + 1):
        for busy in itertools.combinations(indexes, r):
            yield frozenset(busy)


# ------------------------------------------------------------------ the check


@dataclass(frozen=True)
class Checked:
    name: str
    gpus: int
    misses: tuple[tuple[int, frozenset[int]], ...]  # (k, busy) where a free k-clique was not found


def check(
    name: str, inv: Inventory, shape: Callable[[int], dict[str, Any]], features: SliceFeatures
) -> Checked:
    edges = raw_edges(inv)
    whole = sorted(g.index for g in inv.gpus if not g.mig_enabled)
    devices = class_devices(desired_slices(inv, "node-1", DRIVER, features))
    assert sorted(d.index for d in devices) == whole
    topology = published_topology(inv)
    uncovered = {(c.size, u) for c in topology.coverage() for u in c.uncovered}
    cliques = {k: [frozenset(c) for c in itertools.combinations(whole, k) if is_clique(c, edges)]
               for k in range(2, len(whole) + 1)}
    misses = []
    for k in range(2, len(whole) + 1):
        model = FastModel.build(devices, shape(k), features.list_attributes)
        for busy in busy_sets(whole):
            got = model.allocate(busy)
            free_cliques = [c for c in cliques[k] if not c & busy]
            if got is not None:
                _, members = got
                assert len(members) == k and not set(members) & busy, (name, k, busy, got)
                assert is_clique(members, edges), f"{name}: k={k}, busy={sorted(busy)}: {got} is not linked"
            elif free_cliques:
                misses.append((k, busy))
                left_out = [c for c in free_cliques if (k, tuple(sorted(c))) not in uncovered]
                assert not left_out, (
                    f"{name}: k={k}, busy={sorted(busy)}: free cliques {left_out} exist, the claim "
                    "found none, and the coverage report says they are covered"
                )
    if topology.clique_layers.complete or features.list_attributes:
        assert not misses, f"{name}: complete cover, yet misses {misses[:5]}"
    return Checked(name, len(whole), tuple(misses))


def ga(k: int) -> dict[str, Any]:
    return linked_gpus_ga(k)


def lists(k: int) -> dict[str, Any]:
    return linked_gpus_list(k)


@cache
def profile_inventory(name: str) -> Inventory:
    return discover(simulate=name)


@pytest.mark.parametrize("features", [OFF, ON], ids=["ga", "list-attrs"])
@pytest.mark.parametrize("name", sorted(profile_names()))
def test_profiles_every_busy_set_every_k_ga_shape(name: str, features: SliceFeatures) -> None:
    check(name, profile_inventory(name), ga, features)


@pytest.mark.parametrize("name", sorted(profile_names()))
def test_profiles_every_busy_set_every_k_list_shape(name: str) -> None:
    check(name, profile_inventory(name), lists, ON)


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_generated_graphs_every_busy_set_every_k(name: str) -> None:
    n, edges = GENERATED[name]
    inv = graph_inventory(n, edges)
    assert raw_edges(inv) == edges
    check(name, inv, ga, OFF)
    check(name, inv, lists, ON)


@pytest.mark.parametrize(
    "name",
    ["ring-5", "bridged-triangles", "mesh-2x3", "cocktail-party-8", "apex-over-K3,2,2", "random-n6-p7-s1"],
)
def test_fast_model_is_the_brute_force_allocator(name: str) -> None:
    n, edges = GENERATED[name]
    inv = graph_inventory(n, edges)
    for features, shape in ((OFF, ga), (ON, ga), (ON, lists)):
        devices = class_devices(desired_slices(inv, "node-1", DRIVER, features))
        for k in range(2, n + 1):
            claim = shape(k)
            fast = FastModel.build(devices, claim, features.list_attributes)
            for busy in busy_sets(list(range(n))):
                assert fast.allocate(busy) == allocate_brute(devices, busy, claim, features.list_attributes)


def test_the_issues_cases() -> None:
    """The three reports of the issue, on the published slices (GA) through the documented shape."""
    def allocate(inv: Inventory, busy: set[int], k: int) -> tuple[str, tuple[int, ...]] | None:
        devices = class_devices(desired_slices(inv, "node-1", DRIVER, OFF))
        got = FastModel.build(devices, ga(k), False).allocate(frozenset(busy))
        return None if got is None else (got[0], tuple(sorted(got[1])))  # the set, whatever the slice order

    ring8 = graph_inventory(*GENERATED["ring-8"])
    assert allocate(ring8, {0, 3}, 2) == ("gpus/layer0", (4, 5))
    assert allocate(ring8, {0, 3, 4, 5, 6, 7}, 2) == ("gpus/layer1", (1, 2))
    triangles = graph_inventory(*GENERATED["bridged-triangles"])
    assert allocate(triangles, set(), 3) == ("gpus/layer0", (0, 1, 2))
    assert allocate(triangles, {0, 4}, 2) == ("gpus/layer0", (1, 2))
    assert allocate(triangles, {0, 1, 4, 5}, 2) == ("gpus/layer1", (2, 3))
    assert allocate(triangles, {2}, 3) == ("gpus/layer0", (3, 4, 5))
    assert allocate(triangles, {2, 3}, 3) is None
    nvswitch = profile_inventory("hgx-h200")
    assert allocate(nvswitch, {0, 2, 4, 6}, 2) == ("gpus/layer0", (1, 3))
    assert allocate(nvswitch, {0, 2, 4, 6}, 4) == ("gpus/layer0", (1, 3, 5, 7))
    assert allocate(nvswitch, {0, 2, 4, 6}, 5) is None


def test_unit_cover_functions_agree_with_brute_force() -> None:
    for name, (n, edges) in GENERATED.items():
        adjacency = {i: frozenset(j for j in range(n) if frozenset((i, j)) in edges) for i in range(n)}
        maximal = tuple(c for c in maximal_cliques(adjacency) if len(c) >= 2)
        layers = clique_layers(maximal, MAX_LAYERS)
        assert len(layers.layers) <= MAX_LAYERS
        for layer in layers.layers:
            members = [m for g in layer for m in g]
            assert len(members) == len(set(members)), f"{name}: a layer's groups overlap"
            assert all(is_clique(g, edges) and len(g) >= 2 for g in layer)
        for c in coverage(adjacency, layers):
            truth = [s for s in itertools.combinations(range(n), c.size) if is_clique(s, edges)]
            assert c.cliques == len(truth), name
            assert set(c.uncovered) == {s for s in truth if layers.layer_of(s) is None}, name
            assert c.covered == c.cliques - len(c.uncovered)
        if layers.complete:
            lower = max((sum(1 for c in maximal if i in c) for i in range(n)), default=0)
            assert len(layers.layers) == lower or len(layers.layers) <= MAX_LAYERS


# ------------------------------------------------------------------ the figures of docs/nvlink.md


def attribute_counts(inv: Inventory) -> tuple[int, int]:
    """The most attributes + capacities on one device: GA, and with list attributes."""
    out = []
    for features in (OFF, ON):
        devices = [d for s in desired_slices(inv, "node-1", DRIVER, features) for d in s.get("devices", [])]
        counts = [len(d.get("attributes", {})) + len(d.get("capacity", {})) for d in devices]
        out.append(max(counts, default=0))
    return out[0], out[1]


def coverage_markdown() -> str:
    lines = [
        "| profile | GPUs | layers | max entries per device, GA / list | k | cliques | covered |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sorted(profile_names()):
        inv = profile_inventory(name)
        t = published_topology(inv)
        ga_count, list_count = attribute_counts(inv)
        rows = t.coverage() or ()
        head = f"| {name} | {len(inv.gpus)} | {len(t.clique_layers.layers)} | {ga_count} / {list_count} |"
        if not rows:
            lines.append(f"{head} - | 0 | - |")
        for i, c in enumerate(rows):
            prefix = head if i == 0 else "| | | | |"
            lines.append(f"{prefix} {c.size} | {c.cliques} | {c.covered} |")
    lines += ["", "| generated graph | GPUs | layers | k | cliques | covered | left out (GA shape) |",
              "|---|---|---|---|---|---|---|"]
    for name in sorted(GENERATED):
        n, edges = GENERATED[name]
        t = published_topology(graph_inventory(n, edges))
        if t.clique_layers.complete:
            continue
        for c in t.coverage():
            if c.uncovered:
                left = ", ".join("{" + ",".join(map(str, u)) + "}" for u in c.uncovered)
                lines.append(f"| {name} | {n} | {len(t.clique_layers.layers)} | {c.size} | {c.cliques} | "
                             f"{c.covered} | {left} |")
    complete_count = sum(
        1 for n, e in GENERATED.values() if published_topology(graph_inventory(n, e)).clique_layers.complete
    )
    lines += ["", f"Every clique of every size is covered on every profile and on {complete_count} of the "
              f"{len(GENERATED)} generated graphs; the rows above are all that the others leave out."]
    return "\n".join(lines) + "\n"


def test_docs_hold_the_coverage_tables() -> None:
    expected = coverage_markdown()
    doc = (REPO / "docs" / "nvlink.md").read_text()
    assert expected in doc, "docs/nvlink.md is out of date; the tables are:\n" + expected


def test_layer_budget_fits_the_device_limit() -> None:
    assert A.NVLINK_LAYERS == MAX_LAYERS == 8
    assert len(A.WHOLE_GPU_BASE) + A.NVLINK_LAYERS <= A.MAX_ATTRIBUTES_AND_CAPACITIES
    for name in profile_names():
        inv = profile_inventory(name)
        t = published_topology(inv)
        for features in (OFF, ON):
            for d in class_devices(desired_slices(inv, "node-1", DRIVER, features)):
                published = {n for n in d.attributes if re.fullmatch(A.NVLINK_LAYER_PREFIX + r"\d+", n)}
                assert published == {A.nvlink_layer_attribute(n) for n, _ in t.gpu(d.index).layers}


def test_examples_are_the_documented_shapes() -> None:
    def devices(example: str) -> dict[str, Any]:
        docs = list(yaml.safe_load_all((REPO / "deploy" / "examples" / example).read_text()))
        template = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")
        return dict(template["spec"]["spec"]["devices"])

    v100 = ['device.attributes["gpu.dra-driver.dev"].productName.startsWith("Tesla V100")']
    # 05 and 06 are what `dra-driver claim` prints for the demo's boxes, on either kind of server
    for features in (OFF, ON):
        fleet = [{"spec": s} for node in DEMO_NODES
                 for s in desired_slices(profile_inventory(node.profile), node.name, DRIVER, features)]
        assert devices("05-nvlink-pair.yaml") == fit_linked_claim(2, fleet, DRIVER).devices
        quad = fit_linked_claim(4, fleet, DRIVER, selectors=v100)
        assert devices("06-nvlink-quad-cube-mesh.yaml") == quad.devices
    assert devices("05-nvlink-pair.yaml") == linked_gpus_ga(2, layers=(0, 1))
    assert devices("06-nvlink-quad-cube-mesh.yaml") == linked_gpus_ga(4, selectors=v100, layers=(0,))
    assert devices("11-nvlink-three-gpus-list-attributes.yaml") == linked_gpus_list(3)
    shape = linked_gpus_ga(3)
    assert len(shape["requests"][0]["firstAvailable"]) == MAX_LAYERS  # the API's limit
    assert [c["requests"] for c in shape["constraints"]] == [[f"gpus/layer{n}"] for n in range(MAX_LAYERS)]


def test_a_shortfall_is_said_in_the_log_and_in_the_inventory() -> None:
    inv = graph_inventory(*GENERATED["apex-over-K3,2,2"])
    with structlog.testing.capture_logs() as logs:
        warn_uncovered_cliques("node-x", inv)
    (entry,) = [e for e in logs if e["log_level"] == "warning"]
    assert entry["node"] == "node-x" and entry["layers"] == MAX_LAYERS
    assert entry["left_out"] == {"4": ["1-3-6-7", "1-4-5-7", "2-3-5-7", "2-4-6-7"]}
    table = render_table(inv, published_topology(inv), A.nvlink_layer_attribute)
    assert "WARNING: 8 layers cannot hold every clique" in table
    assert "{2,4,6,7}" in table and "NOT whole" in table
    doc = inventory_document(inv, published_topology(inv), A.nvlink_layer_attribute)
    layers = doc["nvlink"]["cliqueLayers"]
    assert layers["complete"] is False and len(layers["layers"]) == MAX_LAYERS
    size4 = layers["coverage"][2]
    assert (size4["size"], size4["cliques"], size4["covered"]) == (4, 12, 8)
    with structlog.testing.capture_logs() as logs:
        warn_uncovered_cliques("ring", graph_inventory(*GENERATED["ring-8"]))
    assert not logs


def test_inventory_names_the_attribute_of_every_clique() -> None:
    inv = profile_inventory("ring8-v100")
    doc = inventory_document(inv, published_topology(inv), A.nvlink_layer_attribute)
    exposed = {tuple(e["clique"]): e["attribute"] for e in doc["nvlink"]["cliqueLayers"]["exposedBy"]}
    assert exposed[(0, 1)] == "nvlinkClique0" and exposed[(1, 2)] == "nvlinkClique1"
    assert len(exposed) == 8 and None not in exposed.values()
    assert doc["gpus"][1]["nvlinkLayers"] == {"0": "0-1", "1": "1-2"}
    h200 = profile_inventory("hgx-h200")
    doc = inventory_document(h200, published_topology(h200), A.nvlink_layer_attribute)
    assert doc["nvlink"]["cliqueLayers"]["domains"] == [list(range(8))]
    assert {g["nvlinkDomain"] for g in doc["gpus"]} == {"island-0"}


# ------------------------------------------------------------------ the generated claim (dra-driver claim)


def fitted(inv: Inventory, features: SliceFeatures) -> Callable[[int], dict[str, Any]]:
    """`dra-driver claim --linked k` on a fleet of this one node, as the model reads it."""
    specs = [{"spec": s} for s in desired_slices(inv, "node-1", DRIVER, features)]
    return lambda k: fit_linked_claim(k, specs, DRIVER).devices


@pytest.mark.parametrize("features", [OFF, ON], ids=["ga", "list-attrs"])
@pytest.mark.parametrize("name", sorted(profile_names()))
def test_generated_claim_is_complete_on_every_profile(name: str, features: SliceFeatures) -> None:
    inv = profile_inventory(name)
    check(name, inv, fitted(inv, features), features)


@pytest.mark.parametrize("features", [OFF, ON], ids=["ga", "list-attrs"])
@pytest.mark.parametrize("name", [n for n in sorted(GENERATED) if n.startswith(("random", "apex", "ring"))])
def test_generated_claim_is_complete_on_generated_graphs(name: str, features: SliceFeatures) -> None:
    n, edges = GENERATED[name]
    inv = graph_inventory(n, edges)
    checked = check(name, inv, fitted(inv, features), features)
    if features.list_attributes:
        assert not checked.misses  # the generator falls back on the list form where layers leave some out
