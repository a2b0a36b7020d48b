"""The order of a node's GPUs in its slices, and of its clique layers, so the first find packs well.

The scheduler's allocator gives a claim the first set of devices it finds in slice order (for a
linked claim: the first k free GPUs, in that order, that share a clique value; for a one-GPU
claim: the first free GPU). It does not look for the set that leaves the most room. The order is
the one lever the driver has over that choice, so `packing_order` puts first the GPUs that are
the least use to linked sets, and last those that most sets need:
- a GPU's **flexibility** is how many linked sets (cliques of 2, 3 and 4 GPUs, the sizes
  claims ask for) it is in, smallest size first; GPUs with fewer come first;
- then the order is improved by a bounded local search: moving one GPU to another place is kept
  when the first-found fill it leads to binds more sets (`packed`: from the empty node and from
  every node with one GPU taken, for each size 2-4, sets found one at a time, the first k-clique
  in slice order each time, as the list form and, through `layers`, the layer form find it).

A one-GPU claim then takes a GPU no linked set needs before one that linked sets share, and a
linked claim takes, within a group, first the members that no other set needs (a bridge GPU is
used by the set across the bridge, not stranded by a quad's lowest pair). `packing_layers`
renumbers the clique layers (the groups stay as `cliques.clique_layers` coloured them) so that
the GA form, which tries layer 0 first, packs best with that order (`packed` from every node
with up to two GPUs taken: a layer tried first serves every claim of every size, so its choice
weighs more than one GPU's place); a tie keeps the numbering.
Both change only which set is found first: a set is still found whenever one is free (the search
is exhaustive and the layers hold the same groups).

Pure functions on plain graphs (GPU index -> frozenset of linked indexes). Must NOT know
attribute names, Kubernetes or inventories, and must not do I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from dra_driver.gpu.cliques import Adjacency, CliqueLayers

SIZES = (2, 3, 4)  # the sizes linked claims ask for, scored in this order
# Nodes up to this many GPUs get the clique counts and the search; larger ones (a whole NVSwitch
# fabric seen as one node), whose cliques are too many to list, are ordered by link count alone.
SEARCHED_GPUS = 16
# Rounds of the local search over all moves: each round either improves the score or stops.
_ROUNDS = 3
# How far one move may take a GPU: every place on 8 GPUs, nearby places on larger nodes, which
# keeps the search to a fraction of a second there.
_REACH = 7


def _cliques(adjacency: Adjacency, k: int) -> list[frozenset[int]]:
    nodes = sorted(adjacency)
    return [frozenset(c) for c in itertools.combinations(nodes, k)
            if all(b in adjacency[a] for a, b in itertools.combinations(c, 2))]


def flexibility_order(adjacency: Adjacency) -> tuple[int, ...]:
    """GPUs by how many 2-, 3- and 4-cliques they are in (fewest first), then by index; on nodes
    of more than `SEARCHED_GPUS`, by how many GPUs they are linked with."""
    if len(adjacency) > SEARCHED_GPUS:
        return tuple(sorted(adjacency, key=lambda n: (len(adjacency[n]), n)))
    counts = {n: [0] * len(SIZES) for n in adjacency}
    for i, k in enumerate(SIZES):
        for c in _cliques(adjacency, k):
            for n in c:
                counts[n][i] += 1
    return tuple(sorted(adjacency, key=lambda n: (*counts[n], n)))


@dataclass(frozen=True)
class _Sets:
    """The k-cliques of one size as bit masks (bit = the GPU's place in `nodes`), and for each
    the first layer whose groups hold it (the GA form tries the layers in turn)."""

    masks: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]  # bit numbers of each mask
    tier: tuple[int, ...]


def _sets(adjacency: Adjacency, layers: CliqueLayers | None) -> list[_Sets]:
    nodes = sorted(adjacency)
    bit = {n: i for i, n in enumerate(nodes)}
    out = []
    for k in SIZES:
        cliques = _cliques(adjacency, k)
        if not cliques:
            continue
        tiers = []
        numbered = layers.layers if layers else ()
        for c in cliques:
            tiers.append(next((t for t, layer in enumerate(numbered) if any(c <= set(g) for g in layer)),
                              len(numbered)))
        members = tuple(tuple(sorted(bit[n] for n in c)) for c in cliques)
        out.append(_Sets(tuple(sum(1 << b for b in m) for m in members), members, tuple(tiers)))
    return out


def _weights(order: Sequence[int]) -> list[int]:
    """Per bit (a GPU's place in sorted order), a weight such that a set's sorted places compare as
    its weight does, reversed: the first place where two sets of one size differ outweighs all
    later ones."""
    nodes = sorted(order)
    weight = [0] * len(nodes)
    for p, n in enumerate(order):
        weight[nodes.index(n)] = 1 << (len(nodes) - p)
    return weight


def _ranked(s: _Sets, weight: Sequence[int], layered: bool) -> list[int]:
    """The k-cliques in the order the allocator finds them: by layer (the GA form), then in slice
    order."""
    keys = [((s.tier[i] if layered else 0), -sum(weight[b] for b in m)) for i, m in enumerate(s.members)]
    return [s.masks[i] for i in sorted(range(len(keys)), key=keys.__getitem__)]


def packed(order: Sequence[int], sets: Sequence[_Sets], layered: bool, taken: int = 1) -> int:
    """Sets bound by first-found fills with the GPUs in `order`: per size, from the empty node and
    from every node with up to `taken` GPUs taken. `layered`: through the layers in turn (the GA
    form), else the first clique in slice order (the list form)."""
    nodes = sorted(order)
    weight = _weights(order)
    starts = [sum(1 << b for b in busy) for r in range(taken + 1)
              for busy in itertools.combinations(range(len(nodes)), r)]
    total = 0
    for s in sets:
        ranked = _ranked(s, weight, layered)
        for busy in starts:
            # the ranking is fixed and busy only grows: each find comes after the one before
            for c in ranked:
                if not c & busy:
                    busy |= c
                    total += 1
    return total


def packing_order(adjacency: Adjacency, layers: CliqueLayers | None = None) -> tuple[int, ...]:
    """The whole GPUs in the order the slices should list them (see the module's docstring)."""
    order = list(flexibility_order(adjacency))
    # every GPU linked with every other (an NVSwitch board): all orders pack alike
    if len(order) > SEARCHED_GPUS or all(len(adjacency[n]) == len(order) - 1 for n in order):
        return tuple(order)
    sets = _sets(adjacency, layers)
    if not sets:
        return tuple(order)

    def score(o: Sequence[int]) -> int:
        return packed(o, sets, False) + (packed(o, sets, True) if layers else 0)

    best = score(order)
    for _ in range(_ROUNDS):
        improved = False
        for i, j in itertools.permutations(range(len(order)), 2):
            if abs(i - j) > _REACH:
                continue
            candidate = order[:i] + order[i + 1:]
            candidate.insert(j, order[i])
            s = score(candidate)
            if s > best:
                order, best, improved = candidate, s, True
        if not improved:
            break
    return tuple(order)


def packing_layers(adjacency: Adjacency, layers: CliqueLayers) -> CliqueLayers:
    """The same layers, renumbered so that the GA form (which tries the layers in turn) packs best
    with the GPUs in `flexibility_order`; the layer holding the largest clique stays first where
    that packs as well."""
    if len(layers.layers) <= 1 or len(adjacency) > SEARCHED_GPUS:
        return layers
    order = flexibility_order(adjacency)

    def score(numbered: Sequence[tuple[tuple[int, ...], ...]]) -> int:
        sets = _sets(adjacency, CliqueLayers(tuple(numbered), layers.complete))
        return packed(order, sets, True, taken=2)

    chosen: list[tuple[tuple[int, ...], ...]] = []
    rest = list(layers.layers)
    while rest:  # greedy: the next layer is the one that packs best after those chosen
        best = max(range(len(rest)), key=lambda i: (score([*chosen, rest[i], *rest[:i], *rest[i + 1:]]), -i))
        chosen.append(rest.pop(best))
    return CliqueLayers(tuple(chosen), layers.complete)
