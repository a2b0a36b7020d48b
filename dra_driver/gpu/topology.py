"""NVLink topology of a node, derived (purely) from an `Inventory`.

`nvlink_topology(inventory) -> NvlinkTopology` answers, per GPU (`GpuTopology`):
- `peers`: GPUs it reaches directly over NVLink. A link whose far end is another GPU of
  the node connects the two. GPUs with active links to an NVSwitch are peers of every
  other NVSwitch-attached GPU of the node (unless both report different fabric
  clusters). Only when neither GPU of a pair has a resolved active link (e.g. NVML
  answered NotSupported for the link queries) does NVLink P2P status decide.
- `island`: id of its NVLink connected component ("island-<lowest index>"); every GPU
  has one, a GPU without NVLink is an island of its own.
- `groups`: for each size k in 2, 4, 8, ... up to the whole-GPU count, an id shared by
  exactly k GPUs that are all directly connected to each other (a clique), for
  `matchAttribute`. Groups of one size are disjoint; a GPU may have no group of a size.
  Chosen greedily: maximal cliques largest first (ties by lowest member indexes), each
  cut into consecutive runs of k not-yet-grouped members. Id: "nvl<k>-<members>",
  e.g. "nvl4-0-1-2-3".
  These fixed partitions fragment (a ring's pairs 1-2, 3-4... are in no group): they are
  kept for claims written against them; `layers` is what the documented claims use.
- `cliques`: ids ("0-1-2-3") of the maximal cliques (2+ GPUs) it belongs to, for
  list-type attributes (`matchAttribute` on a list = the chosen GPUs share one value).
- `layers`: (layer, group id) for each layer of `dra_driver.gpu.cliques.clique_layers`
  whose groups hold it: the groups of a layer are disjoint cliques, and together the
  layers hold every maximal clique (up to `max_layers`; `NvlinkTopology.coverage()` says
  what a shortfall leaves out). Group id: the members, "0-1-2".
- `domain`: its island's id when the whole GPUs of that island are all mutually linked
  (NVSwitch), else None.
Groups, cliques, layers and domains are formed among whole GPUs only: a GPU with MIG
enabled cannot be allocated whole, so it keeps its peers and island but has none of them.
`NvlinkTopology.links` gives the link count per connected pair (`NV#` in the matrix).
`compute_topology(indexes, edges)` is the same computation on a bare graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from dra_driver.gpu.cliques import (
    MAX_LAYERS,
    Adjacency,
    CliqueLayers,
    Coverage,
    clique_layers,
    coverage,
    maximal_cliques,
)
from dra_driver.gpu.model import GpuInfo, Inventory, LinkEndpointKind
from dra_driver.gpu.packing import packing_layers


class LinkVia(StrEnum):
    """Why two GPUs count as NVLink peers."""

    DIRECT = "direct"  # GPU-to-GPU links
    NVSWITCH = "nvswitch"  # both on NVSwitch
    P2P = "p2p"  # NVML P2P status says NVLink, links themselves unknown


@dataclass(frozen=True)
class PairLink:
    a: int  # a < b
    b: int
    links: int | None  # number of NVLink links; None when only P2P status is known
    via: LinkVia


@dataclass(frozen=True)
class GpuTopology:
    index: int
    peers: tuple[int, ...]
    island: str
    groups: tuple[tuple[int, str], ...]  # (size, group id), ascending size
    cliques: tuple[str, ...]
    layers: tuple[tuple[int, str], ...] = ()  # (layer, group id), ascending layer
    domain: str | None = None

    def group(self, size: int) -> str | None:
        return dict(self.groups).get(size)

    @property
    def groups_by_size(self) -> dict[int, str]:
        return dict(self.groups)


_NO_LAYERS = CliqueLayers(layers=(), complete=True)


@dataclass(frozen=True)
class NvlinkTopology:
    gpus: tuple[GpuTopology, ...]
    islands: tuple[tuple[int, ...], ...]
    cliques: tuple[tuple[int, ...], ...]  # maximal cliques of 2+ GPUs, largest first
    group_sizes: tuple[int, ...]
    links: tuple[PairLink, ...]
    clique_layers: CliqueLayers = _NO_LAYERS
    clique_graph: tuple[tuple[int, tuple[int, ...]], ...] = ()  # whole GPUs -> their whole peers
    domains: tuple[tuple[int, ...], ...] = ()  # islands whose whole GPUs are a clique of 2+

    def coverage(self) -> tuple[Coverage, ...]:
        """Per clique size 2..largest: the cliques, and how many the layers give."""
        return coverage(self.adjacency, self.clique_layers)

    @property
    def adjacency(self) -> Adjacency:
        return {n: frozenset(peers) for n, peers in self.clique_graph}

    def gpu(self, index: int) -> GpuTopology:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU with index {index}")

    def link(self, a: int, b: int) -> PairLink | None:
        lo, hi = min(a, b), max(a, b)
        return next((p for p in self.links if p.a == lo and p.b == hi), None)

    def groups(self, size: int) -> tuple[tuple[int, ...], ...]:
        """The member sets of every group of `size`."""
        members: dict[str, list[int]] = {}
        for g in self.gpus:
            gid = g.group(size)
            if gid is not None:
                members.setdefault(gid, []).append(g.index)
        return tuple(tuple(sorted(m)) for m in sorted(members.values()))


def _join(members: Iterable[int]) -> str:
    return "-".join(str(m) for m in sorted(members))


def nvlink_pairs(inventory: Inventory) -> tuple[PairLink, ...]:
    """Every pair of GPUs connected over NVLink, with how and by how many links."""
    by_bus = {g.pci_bus_id: g.index for g in inventory.gpus}
    direct: dict[tuple[int, int], int] = {}
    switch_links: dict[int, int] = {}
    resolved: set[int] = set()
    for g in inventory.gpus:
        for link in g.nvlinks:
            if not link.active:
                continue
            if link.remote_kind is LinkEndpointKind.NVSWITCH:
                switch_links[g.index] = switch_links.get(g.index, 0) + 1
                resolved.add(g.index)
                continue
            peer = by_bus.get(link.remote_pci_bus_id or "")
            if link.remote_kind is LinkEndpointKind.GPU or peer is not None:
                resolved.add(g.index)
            if peer is not None and peer != g.index:
                direct[(g.index, peer)] = direct.get((g.index, peer), 0) + 1

    pairs: dict[tuple[int, int], PairLink] = {}
    gpus = sorted(inventory.gpus, key=lambda g: g.index)
    for pos, a in enumerate(gpus):
        for b in gpus[pos + 1 :]:
            key = (a.index, b.index)
            count = max(direct.get(key, 0), direct.get((b.index, a.index), 0))
            if count:
                pairs[key] = PairLink(a.index, b.index, count, LinkVia.DIRECT)
            elif a.index in switch_links and b.index in switch_links and _same_fabric(a, b):
                count = min(switch_links[a.index], switch_links[b.index])
                pairs[key] = PairLink(a.index, b.index, count, LinkVia.NVSWITCH)
            elif a.index not in resolved and b.index not in resolved and _p2p_nvlink(a, b):
                pairs[key] = PairLink(a.index, b.index, None, LinkVia.P2P)
    return tuple(pairs[k] for k in sorted(pairs))


def _same_fabric(a: GpuInfo, b: GpuInfo) -> bool:
    if a.fabric_clique is None or b.fabric_clique is None:
        return True
    return a.fabric_clique == b.fabric_clique


def _p2p_nvlink(a: GpuInfo, b: GpuInfo) -> bool:
    ab, ba = a.path_to(b.index), b.path_to(a.index)
    return any(p is not None and p.nvlink_p2p is True for p in (ab, ba))


def nvlink_topology(inventory: Inventory, max_layers: int = MAX_LAYERS) -> NvlinkTopology:
    """Peers, islands, groups and maximal cliques of the inventory's NVLink graph.

    Groups and cliques are among whole GPUs only: a GPU in MIG mode cannot be allocated
    whole, so it keeps its peers and island but is in no group or clique.
    """
    pairs = nvlink_pairs(inventory)
    return compute_topology(
        [g.index for g in inventory.gpus],
        [(p.a, p.b) for p in pairs],
        pairs,
        groupable=[g.index for g in inventory.gpus if not g.mig_enabled],
        max_layers=max_layers,
    )


def compute_topology(
    indexes: Iterable[int],
    edges: Iterable[tuple[int, int]],
    links: tuple[PairLink, ...] = (),
    groupable: Iterable[int] | None = None,
    max_layers: int = MAX_LAYERS,
) -> NvlinkTopology:
    """The topology of an undirected graph given as GPU indexes and NVLink-connected pairs.

    Groups and cliques use only the `groupable` GPUs (default: all).
    """
    nodes = sorted(set(indexes))
    adjacency: dict[int, set[int]] = {n: set() for n in nodes}
    for a, b in edges:
        if a != b and a in adjacency and b in adjacency:
            adjacency[a].add(b)
            adjacency[b].add(a)
    frozen = {n: frozenset(adj) for n, adj in adjacency.items()}
    islands = connected_components(frozen)
    members = set(nodes) if groupable is None else set(groupable) & set(nodes)
    induced = {n: frozen[n] & members for n in sorted(members)}
    cliques = tuple(c for c in maximal_cliques(induced) if len(c) >= 2)
    sizes = group_sizes(len(members))
    groups = {size: assign_groups(cliques, size) for size in sizes}
    layered = packing_layers(induced, clique_layers(cliques, max_layers))
    domains = tuple(
        whole
        for island in islands
        if len(whole := tuple(m for m in island if m in members)) >= 2 and _is_clique(induced, whole)
    )
    domain_of = {m: f"island-{island[0]}" for island in islands for m in island
                 if any(m in d for d in domains)}

    island_of = {m: f"island-{island[0]}" for island in islands for m in island}
    gpus = []
    for n in nodes:
        gpu_groups = tuple(
            (size, f"nvl{size}-{_join(members)}")
            for size in sizes
            for members in groups[size]
            if n in members
        )
        gpus.append(
            GpuTopology(
                index=n,
                peers=tuple(sorted(frozen[n])),
                island=island_of[n],
                groups=gpu_groups,
                cliques=tuple(_join(c) for c in cliques if n in c),
                layers=tuple(
                    (number, _join(group))
                    for number, layer in enumerate(layered.layers)
                    for group in layer
                    if n in group
                ),
                domain=domain_of.get(n),
            )
        )
    return NvlinkTopology(
        gpus=tuple(gpus), islands=islands, cliques=cliques, group_sizes=sizes, links=links,
        clique_layers=layered, clique_graph=tuple((n, tuple(sorted(induced[n]))) for n in sorted(induced)),
        domains=domains,
    )


def _is_clique(adjacency: Adjacency, members: tuple[int, ...]) -> bool:
    return all(set(members) - {m} <= adjacency[m] for m in members)


def group_sizes(gpu_count: int) -> tuple[int, ...]:
    """2, 4, 8, ... up to `gpu_count`."""
    sizes = []
    size = 2
    while size <= gpu_count:
        sizes.append(size)
        size *= 2
    return tuple(sizes)


def connected_components(adjacency: Mapping[int, frozenset[int]]) -> tuple[tuple[int, ...], ...]:
    """Components as sorted member tuples, ordered by lowest member."""
    seen: set[int] = set()
    components = []
    for start in sorted(adjacency):
        if start in seen:
            continue
        stack, members = [start], set()
        while stack:
            n = stack.pop()
            if n in members:
                continue
            members.add(n)
            stack.extend(adjacency[n] - members)
        seen |= members
        components.append(tuple(sorted(members)))
    return tuple(components)


def assign_groups(cliques: Iterable[tuple[int, ...]], size: int) -> tuple[tuple[int, ...], ...]:
    """Disjoint groups of `size` mutually connected GPUs, greedily from the cliques in order."""
    taken: set[int] = set()
    groups = []
    for clique in cliques:
        free = [m for m in clique if m not in taken]
        while len(free) >= size:
            group, free = tuple(free[:size]), free[size:]
            groups.append(group)
            taken.update(group)
    return tuple(groups)
