"""Cliques of an NVLink graph, and the layers that let a scheduler hand out every one of them.

A set of GPUs is "NVLink-connected" here when every two of them are directly linked: a
clique of the graph. The scheduler can only compare attribute values (`matchAttribute`:
all devices of a request share one value), and a device has one value per attribute, so
one attribute can describe only one family of disjoint groups. `clique_layers` therefore
spreads the maximal cliques over several such families, the layers: within a layer the
groups are disjoint, across layers they may overlap. A set of k GPUs inside any group of
any layer is a k-clique, and a k-clique is obtainable through the layers exactly when it
lies inside some group ("covered"); when every maximal clique is a group of some layer,
every clique of every size is covered. The conflict between two maximal cliques that
share a GPU makes this a graph colouring: solved exactly when `max_layers` colours
suffice (searching up to a step limit), else a greedy best cover that also places the
unplaced cliques' largest free parts, and `coverage` says what is left out.

Pure functions on plain graphs (GPU index -> frozenset of linked indexes). Must NOT know
attribute names, Kubernetes or inventories, and must not do I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

Adjacency = Mapping[int, frozenset[int]]
Clique = tuple[int, ...]

# firstAvailable holds at most 8 subrequests (resource.k8s.io/v1 DeviceRequest): one claim
# can try at most 8 layers.
MAX_LAYERS = 8
# Backtracking steps spent on an exact colouring before falling back to the greedy cover;
# the graphs of one node (<= 8 GPUs, <= 18 maximal cliques) need far fewer.
_SEARCH_STEPS = 200_000


def maximal_cliques(adjacency: Adjacency) -> tuple[Clique, ...]:
    """Every maximal clique (Bron-Kerbosch with pivoting), largest first, then by members."""
    found: list[Clique] = []

    def expand(r: frozenset[int], p: frozenset[int], x: frozenset[int]) -> None:
        if not p and not x:
            found.append(tuple(sorted(r)))
            return
        pivot = max(p | x, key=lambda n: (len(adjacency[n] & p), -n))
        for v in sorted(p - adjacency[pivot]):
            expand(r | {v}, p & adjacency[v], x & adjacency[v])
            p = p - {v}
            x = x | {v}

    expand(frozenset(), frozenset(adjacency), frozenset())
    return tuple(sorted(found, key=lambda c: (-len(c), c)))


def _complete(adjacency: Adjacency, nodes: frozenset[int]) -> bool:
    return all(nodes - {n} <= adjacency[n] for n in nodes)


def count_cliques(adjacency: Adjacency, size: int) -> int:
    """How many cliques of exactly `size` GPUs the graph has."""

    def count(candidates: frozenset[int], k: int) -> int:
        if k == 0:
            return 1
        if len(candidates) < k:
            return 0
        # NVSwitch boards are complete graphs: count them without enumerating.
        if _complete(adjacency, candidates):
            return math.comb(len(candidates), k)
        total = 0
        rest = set(candidates)
        for v in sorted(candidates):
            rest.discard(v)
            total += count(frozenset(rest) & adjacency[v], k - 1)
        return total

    return count(frozenset(adjacency), size) if size > 0 else 0


def cliques_of_size(adjacency: Adjacency, size: int) -> Iterator[Clique]:
    """Every clique of exactly `size` GPUs, in lexicographic order of members."""

    def walk(prefix: Clique, candidates: frozenset[int]) -> Iterator[Clique]:
        if len(prefix) == size:
            yield prefix
            return
        for v in sorted(candidates):
            if len(prefix) + 1 + sum(1 for c in candidates if c > v) < size:
                break
            yield from walk((*prefix, v), frozenset(c for c in candidates if c > v) & adjacency[v])

    if size > 0:
        yield from walk((), frozenset(adjacency))


@dataclass(frozen=True)
class CliqueLayers:
    """Groups of mutually linked GPUs, in layers; the groups of one layer are disjoint."""

    layers: tuple[tuple[Clique, ...], ...]
    complete: bool  # every maximal clique is a group of some layer: every clique is covered

    def layer_of(self, clique: Iterable[int]) -> int | None:
        """The first layer with a group holding all of `clique`, or None (not covered)."""
        members = set(clique)
        for number, groups in enumerate(self.layers):
            if any(members <= set(g) for g in groups):
                return number
        return None


def clique_layers(maximal: Sequence[Clique], max_layers: int = MAX_LAYERS) -> CliqueLayers:
    """The fewest layers (at most `max_layers`) whose groups are the maximal cliques, or the best cover.

    `maximal` are the maximal cliques of 2+ GPUs, largest first. The largest clique is in
    layer 0, so on an NVSwitch board layer 0 is the whole board.
    """
    cliques = list(maximal)
    if not cliques or max_layers <= 0:
        return CliqueLayers(layers=(), complete=not cliques)
    colours = _exact_colouring(cliques, max_layers)
    if colours is not None:
        used = max(colours) + 1
        layers = tuple(
            tuple(sorted(c for c, colour in zip(cliques, colours, strict=True) if colour == layer))
            for layer in range(used)
        )
        return CliqueLayers(layers=layers, complete=True)
    return CliqueLayers(layers=_greedy_cover(cliques, max_layers), complete=False)


def _conflicts(cliques: Sequence[Clique]) -> list[set[int]]:
    sets = [set(c) for c in cliques]
    return [{j for j, other in enumerate(sets) if j != i and s & other} for i, s in enumerate(sets)]


def _exact_colouring(cliques: Sequence[Clique], max_layers: int) -> list[int] | None:
    """A colouring with the fewest colours <= max_layers, or None if none is found in the step limit."""
    conflicts = _conflicts(cliques)
    per_gpu: dict[int, int] = {}
    for c in cliques:
        for m in c:
            per_gpu[m] = per_gpu.get(m, 0) + 1
    lower = max(per_gpu.values())
    steps = [0]

    def solve(colours: int) -> list[int] | None:
        assigned = [-1] * len(cliques)

        def place(i: int, highest: int) -> bool:
            if i == len(cliques):
                return True
            steps[0] += 1
            if steps[0] > _SEARCH_STEPS:
                return False
            taken = {assigned[j] for j in conflicts[i]}
            # A new colour only as the next unused one: colourings differing by a
            # renaming of colours are the same layering.
            for colour in range(min(colours, highest + 2)):
                if colour not in taken:
                    assigned[i] = colour
                    if place(i + 1, max(highest, colour)):
                        return True
                    assigned[i] = -1
            return False

        return assigned if place(0, -1) else None

    for colours in range(lower, min(max_layers, len(cliques)) + 1):
        found = solve(colours)
        if found is not None:
            return found
        if steps[0] > _SEARCH_STEPS:
            return None
    return None


def _gain(part: Clique, groups: Sequence[set[int]]) -> tuple[int, ...]:
    """Per size from 2 up: how many cliques inside `part` no group holds yet.

    Compared smallest size first: a linked pair is what most claims ask for. Parts of
    more than 12 GPUs are counted up to size 4 only, to stay cheap on large fabrics.
    """
    top = len(part) if len(part) <= 12 else 4
    return tuple(
        sum(1 for sub in itertools.combinations(part, size) if not any(set(sub) <= g for g in groups))
        for size in range(2, top + 1)
    )


def _greedy_cover(cliques: Sequence[Clique], max_layers: int) -> tuple[tuple[Clique, ...], ...]:
    """Best effort when the maximal cliques need more than `max_layers` layers.

    Repeatedly place, in the layer where it fits, the maximal clique, or the part of one
    that is free in that layer, that covers the most cliques not covered yet.
    """
    layers: list[list[Clique]] = [[] for _ in range(max_layers)]
    used: list[set[int]] = [set() for _ in range(max_layers)]
    groups: list[set[int]] = []
    while True:
        best: tuple[tuple[tuple[int, ...], bool, int], int, Clique] | None = None
        for clique in cliques:
            for n in range(max_layers):
                part = tuple(m for m in clique if m not in used[n])
                if len(part) < 2:
                    continue
                gain = _gain(part, groups)
                key = (gain, len(part) == len(clique), -n)
                if any(gain) and (best is None or key > best[0]):
                    best = (key, n, part)
        if best is None:
            break
        _, n, part = best
        layers[n].append(part)
        used[n] |= set(part)
        groups.append(set(part))
    return tuple(tuple(sorted(layer)) for layer in layers if layer)


@dataclass(frozen=True)
class Coverage:
    """For one size k: how many k-cliques the graph has and how many the layers cover."""

    size: int
    cliques: int
    covered: int
    uncovered: tuple[Clique, ...]  # the k-cliques no layer gives (all of them, ascending)


def coverage(adjacency: Adjacency, layers: CliqueLayers) -> tuple[Coverage, ...]:
    """Coverage for every size from 2 to the largest clique."""
    maximal = maximal_cliques(adjacency)
    largest = max((len(c) for c in maximal), default=0)
    out = []
    for size in range(2, largest + 1):
        total = count_cliques(adjacency, size)
        if layers.complete:
            out.append(Coverage(size, total, total, ()))
            continue
        missing = tuple(c for c in cliques_of_size(adjacency, size) if layers.layer_of(c) is None)
        out.append(Coverage(size, total, total - len(missing), missing))
    return tuple(out)
