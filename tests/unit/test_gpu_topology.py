"""Topology properties on random NVLink graphs (hypothesis), plus a few exact cases.

What is asserted, for any graph of n GPUs:
- every group of size k has exactly k members, all pairwise NVLink-connected (a clique);
- groups of one size are disjoint; a GPU's group id at size k is shared by exactly its group;
- group ids are derived from members only (same graph, any GPU order -> same ids);
- islands are exactly the connected components: no edge crosses two islands, and each
  island is connected using its own edges only;
- maximal cliques are cliques, maximal, and every edge lies in one of them;
- groups and cliques only hold "groupable" (whole, non-MIG) GPUs; peers and islands hold all;
- clique layers: per layer disjoint cliques of groupable GPUs, each GPU's (layer, id) pairs
  match them, a complete cover puts every maximal clique in a layer, and an island's whole
  GPUs are a domain exactly when they are all linked;
- on the complete graph, size k has exactly floor(n/k) groups for every power of two
  2 <= k <= n; so the largest power of two P <= n has floor(n/P) = 1 group, which holds
  every GPU when n is itself a power of two.
"""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dra_driver.gpu.cliques import MAX_LAYERS
from dra_driver.gpu.model import GpuInfo, Inventory, LinkEndpointKind, NvLink
from dra_driver.gpu.topology import NvlinkTopology, compute_topology, group_sizes, nvlink_topology

Graph = tuple[int, frozenset[tuple[int, int]]]


@st.composite
def graphs(draw: st.DrawFn, max_gpus: int = 12) -> Graph:
    n = draw(st.integers(min_value=1, max_value=max_gpus))
    pairs = list(itertools.combinations(range(n), 2))
    edges = draw(st.sets(st.sampled_from(pairs), max_size=len(pairs))) if pairs else set()
    return n, frozenset(edges)


def bus(i: int) -> str:
    return f"0000:{i + 16:02x}:00.0"


def inventory(n: int, edges: frozenset[tuple[int, int]], order: list[int] | None = None) -> Inventory:
    """GPUs whose NVLink links go to the other end of each edge (one link per edge)."""

    def links(i: int) -> tuple[NvLink, ...]:
        peers = sorted({b for a, b in edges if a == i} | {a for a, b in edges if b == i})
        return tuple(NvLink(k, True, LinkEndpointKind.GPU, bus(p)) for k, p in enumerate(peers))

    gpus = [
        GpuInfo(
            index=i, minor=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", product_name="X", brand="N",
            architecture="Hopper", cuda_compute_capability="9.0", memory_bytes=1, pci_bus_id=bus(i),
            pcie_root=None, numa_node=None, mig_enabled=False, nvlinks=links(i),
        )
        for i in range(n)
    ]  # fmt: skip
    return Inventory("1", "12.8", tuple(gpus[i] for i in (order or range(n))))


def connected(a: int, b: int, edges: frozenset[tuple[int, int]]) -> bool:
    return (min(a, b), max(a, b)) in edges


def check_invariants(
    n: int, edges: frozenset[tuple[int, int]], t: NvlinkTopology, groupable: frozenset[int] | None = None
) -> None:
    whole = frozenset(range(n)) if groupable is None else groupable
    assert t.group_sizes == group_sizes(len(whole))
    for g in t.gpus:
        assert set(g.peers) == {b for a, b in edges if a == g.index} | {a for a, b in edges if b == g.index}
    for size in t.group_sizes:
        groups = t.groups(size)
        members = [m for group in groups for m in group]
        assert len(members) == len(set(members)), f"groups of size {size} overlap: {groups}"
        for group in groups:
            assert len(group) == size and set(group) <= whole
            assert all(connected(a, b, edges) for a, b in itertools.combinations(group, 2))
            ids = {t.gpu(m).group(size) for m in group}
            assert len(ids) == 1 and ids != {None}
        assert sum(1 for g in t.gpus if g.group(size) is not None) == len(members)
    # islands = connected components
    island_of = {m: i for i, island in enumerate(t.islands) for m in island}
    assert sorted(island_of) == list(range(n))
    assert all(island_of[a] == island_of[b] for a, b in edges)
    for island in t.islands:
        reached, frontier = {island[0]}, [island[0]]
        while frontier:
            x = frontier.pop()
            for y in island:
                if y not in reached and connected(x, y, edges):
                    reached.add(y)
                    frontier.append(y)
        assert reached == set(island)
        assert {t.gpu(m).island for m in island} == {f"island-{island[0]}"}
    # maximal cliques
    for clique in t.cliques:
        assert len(clique) >= 2 and set(clique) <= whole
        assert all(connected(a, b, edges) for a, b in itertools.combinations(clique, 2))
        outside = whole - set(clique)
        assert not any(all(connected(o, m, edges) for m in clique) for o in outside), (
            f"{clique} is not maximal"
        )
    assert len(set(t.cliques)) == len(t.cliques)
    for a, b in edges:
        if a in whole and b in whole:
            assert any(a in c and b in c for c in t.cliques)


@settings(max_examples=300, deadline=None)
@given(graphs())
def test_invariants_on_random_graphs(graph: Graph) -> None:
    n, edges = graph
    check_invariants(n, edges, compute_topology(range(n), edges))


@settings(max_examples=200, deadline=None)
@given(graphs(), st.data())
def test_groups_only_among_groupable_gpus(graph: Graph, data: st.DataObject) -> None:
    """MIG-enabled GPUs (not groupable) keep peers and islands but join no group or clique."""
    n, edges = graph
    groupable = frozenset(data.draw(st.sets(st.integers(min_value=0, max_value=n - 1))))
    t = compute_topology(range(n), edges, groupable=groupable)
    check_invariants(n, edges, t, groupable)
    assert all(g.groups == () and g.cliques == () for g in t.gpus if g.index not in groupable)


@settings(max_examples=100, deadline=None)
@given(graphs(max_gpus=9), st.randoms(use_true_random=False))
def test_inventory_path_matches_graph_and_ignores_gpu_order(graph: Graph, rnd: random.Random) -> None:
    n, edges = graph
    order = list(range(n))
    rnd.shuffle(order)
    t = nvlink_topology(inventory(n, edges, order))
    check_invariants(n, edges, t)
    straight = nvlink_topology(inventory(n, edges))
    assert t.gpus == straight.gpus and t.islands == straight.islands and t.cliques == straight.cliques
    assert all(p.links == 1 for p in t.links) and len(t.links) == len(edges)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=20))
def test_complete_graph_groups(n: int) -> None:
    t = compute_topology(range(n), itertools.combinations(range(n), 2))
    for size in t.group_sizes:
        assert len(t.groups(size)) == n // size
    if t.group_sizes:
        largest = t.group_sizes[-1]
        assert largest <= n < 2 * largest
        assert len(t.groups(largest)) == 1
        if n == largest:
            assert t.groups(largest) == (tuple(range(n)),)
    assert t.islands == (tuple(range(n)),)
    assert t.cliques == ((tuple(range(n)),) if n > 1 else ())


def test_group_sizes() -> None:
    assert group_sizes(1) == ()
    assert group_sizes(2) == (2,)
    assert group_sizes(7) == (2, 4)
    assert group_sizes(8) == (2, 4, 8)
    assert group_sizes(16) == (2, 4, 8, 16)


def test_greedy_prefers_the_largest_clique() -> None:
    # A 4-clique {2,3,4,5} with a pendant pair 0-1 and 1-2: the 4-group must be the clique.
    edges = [(0, 1), (1, 2), *itertools.combinations((2, 3, 4, 5), 2)]
    t = compute_topology(range(6), edges)
    assert t.groups(4) == ((2, 3, 4, 5),)
    assert t.groups(2) == ((0, 1), (2, 3), (4, 5))
    assert t.gpu(2).group(4) == "nvl4-2-3-4-5" and t.gpu(0).group(4) is None
    assert t.gpu(1).cliques == ("0-1", "1-2")


def test_ids_are_deterministic_strings() -> None:
    edges = list(itertools.combinations(range(8), 2))
    a = compute_topology(range(8), edges)
    b = compute_topology(reversed(range(8)), reversed(edges))
    assert a == b
    assert a.gpu(5).groups == ((2, "nvl2-4-5"), (4, "nvl4-4-5-6-7"), (8, "nvl8-0-1-2-3-4-5-6-7"))
    assert a.gpu(5).groups_by_size == {2: "nvl2-4-5", 4: "nvl4-4-5-6-7", 8: "nvl8-0-1-2-3-4-5-6-7"}


def check_layers(n: int, edges: frozenset[tuple[int, int]], t: NvlinkTopology, whole: frozenset[int]) -> None:
    """Clique layers: disjoint cliques per layer; complete means every maximal clique is a group."""
    layers = t.clique_layers
    assert len(layers.layers) <= MAX_LAYERS
    for number, groups in enumerate(layers.layers):
        members = [m for g in groups for m in g]
        assert len(members) == len(set(members)), f"layer {number} overlaps: {groups}"
        for group in groups:
            assert len(group) >= 2 and set(group) <= whole
            assert all(connected(a, b, edges) for a, b in itertools.combinations(group, 2))
            assert {dict(t.gpu(m).layers)[number] for m in group} == {"-".join(map(str, group))}
    if layers.complete:
        assert all(layers.layer_of(c) is not None for c in t.cliques)
        assert all(c.covered == c.cliques for c in t.coverage())
    for g in t.gpus:
        numbers = [number for number, groups in enumerate(layers.layers) for grp in groups if g.index in grp]
        assert [number for number, _ in g.layers] == numbers
    for island in t.islands:
        members = tuple(m for m in island if m in whole)
        linked = all(connected(a, b, edges) for a, b in itertools.combinations(members, 2))
        is_domain = len(members) >= 2 and linked
        assert (members in t.domains) == is_domain
        assert {t.gpu(m).domain for m in members} <= ({f"island-{island[0]}"} if is_domain else {None})


@settings(max_examples=150, deadline=None)
@given(graphs(max_gpus=10), st.data())
def test_clique_layers_on_random_graphs(graph: Graph, data: st.DataObject) -> None:
    n, edges = graph
    drawn = data.draw(st.sets(st.integers(min_value=0, max_value=max(n - 1, 0))))
    groupable = frozenset(drawn) & frozenset(range(n))
    t = compute_topology(range(n), edges, groupable=groupable)
    check_layers(n, edges, t, groupable)


def test_ring_and_bridged_triangles_layers() -> None:
    ring = compute_topology(range(8), [(i, (i + 1) % 8) for i in range(8)])
    assert ring.clique_layers.layers == (((0, 1), (2, 3), (4, 5), (6, 7)), ((0, 7), (1, 2), (3, 4), (5, 6)))
    assert ring.gpu(1).layers == ((0, "0-1"), (1, "1-2")) and ring.domains == ()
    triangles = compute_topology(range(6), [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4), (3, 5), (4, 5)])
    assert triangles.clique_layers.layers == (((0, 1, 2), (3, 4, 5)), ((2, 3),))
    assert [(c.size, c.cliques, c.covered) for c in triangles.coverage()] == [(2, 7, 7), (3, 2, 2)]
    switch = compute_topology(range(8), itertools.combinations(range(8), 2))
    assert switch.clique_layers.layers == ((tuple(range(8)),),) and switch.domains == (tuple(range(8)),)
    assert switch.gpu(3).domain == "island-0"
    # Budget of one layer: the best cover holds the triangle 0-1-2 whole, the rest in parts.
    edges = [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4), (3, 5), (4, 5)]
    short = compute_topology(range(6), edges, max_layers=1)
    assert not short.clique_layers.complete
    assert short.clique_layers.layers == (((0, 1, 2), (3, 4, 5)),)
    assert [u for c in short.coverage() for u in c.uncovered] == [(2, 3)]
