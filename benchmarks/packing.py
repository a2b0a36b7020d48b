"""How well the scheduler packs linked GPUs: sets bound against the most that fit (brute force).

The scheduler's allocator takes the first linked set it finds in slice order
(tests/harness/first_found.py, read in upstream's allocator); `dra_driver.gpu.packing` orders
the devices and numbers the clique layers so that this first set is a good packing choice. This
benchmark measures it, per graph family, on the slices `controller.slices.desired_slices`
publishes and the claim `dra-driver claim --linked K` prints for the node (`controller.claim_fit`,
on a server with list-type attributes and on a GA one), against the slices as published before
(devices in GPU index order, layers as coloured: `--before`'s variant).

Per graph and trial (seeded): the node is first partly filled, one claim at a time, with a
random mix of one-GPU claims, pairs, triples and quads (sizes up to the graph's largest linked
set; trial 0 starts empty); then, for each size k in use, from that state, claims for k linked
GPUs with a one-GPU claim in between at random (a quarter of the claims) until a k-claim finds
nothing. `bound` is the k-sets it got; `best` the most disjoint k-cliques of the GPUs free at
the start of that phase (brute force over the raw links), less what the one-GPU claims bound
in the phase took: min(max disjoint k-cliques, (free - singles) // k). Packing efficiency =
sum(bound) / sum(best), per family, with the worst graph.

Families: `random-8-p<d>` and `random-16-p<d>`: GPUs linked pairwise with probability d/10,
seeds 0..N-1 (not hand-picked); `profiles`: every shipped simulated profile with a linked pair;
`issue`: the topologies issue 52 reported. Pure computation: no cluster (the real scheduler's
check of this model is `python -m benchmarks.scheduler --shape packing...`, docs/performance.md).

    python -m benchmarks.packing [--trials 12] [--out packing]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks import report
from controller import slices
from controller.claim_fit import fit_linked_claim
from controller.slices import SliceFeatures, desired_slices
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver import log
from dra_driver.gpu import discover, profile_names, topology
from dra_driver.gpu.model import Inventory
from dra_driver.gpu.topology import nvlink_pairs
from tests.harness.first_found import Device, FastModel, class_devices, first_free
from tests.harness.topologies import Links, graph_inventory

SIZES = (2, 3, 4)
SINGLE_SHARE = 0.25  # of the claims of a fill phase, one-GPU claims
DENSITIES = (3, 5, 7, 9)


def links(n: int, density: int, seed: int) -> Links:
    rnd = random.Random(f"packing-{n}-{density}-{seed}")
    return frozenset(frozenset(p) for p in itertools.combinations(range(n), 2) if rnd.random() < density / 10)


def complete(members: Sequence[int]) -> Links:
    return frozenset(frozenset(p) for p in itertools.combinations(members, 2))


# The issue's two reports, as graphs: two quads bridged through a ninth GPU (first-found pairs
# from a quad strand the bridge), and the random-8 graph of this benchmark where the first triple
# on an empty node left no second one although two disjoint triples exist.
ISSUE: dict[str, tuple[int, Links]] = {
    "two-quads-and-a-bridge": (9, complete((0, 1, 2, 3)) | complete((5, 6, 7, 8))
                               | frozenset({frozenset((3, 4)), frozenset((4, 5))})),
    "overlapping-cliques": (8, complete((0, 1, 2, 3)) | complete((0, 4, 5)) | complete((1, 6, 7))
                            | frozenset({frozenset((2, 4)), frozenset((3, 6))})),
}


def raw_links(inv: Inventory) -> Links:
    """The linked pairs of whole GPUs, as `dra_driver.gpu.topology` reads the inventory's links."""
    whole = {g.index for g in inv.gpus if not g.mig_enabled}
    return frozenset(frozenset((p.a, p.b)) for p in nvlink_pairs(inv) if {p.a, p.b} <= whole)


def cliques(n: int, edges: Links, k: int) -> tuple[int, ...]:
    """Every k-clique as a bit mask."""
    return tuple(sum(1 << m for m in c) for c in itertools.combinations(range(n), k)
                 if all(frozenset(p) in edges for p in itertools.combinations(c, 2)))


def max_disjoint(masks: tuple[int, ...], free: int) -> int:
    """The most disjoint cliques among `masks` inside the GPUs of `free` (brute force, memoized)."""
    by_low: dict[int, list[int]] = {}
    for m in masks:
        by_low.setdefault((m & -m).bit_length() - 1, []).append(m)

    @functools.cache
    def best(mask: int) -> int:
        if not mask:
            return 0
        low = (mask & -mask).bit_length() - 1
        rest = mask & ~(1 << low)
        return max([best(rest)] + [1 + best(mask & ~c) for c in by_low.get(low, ()) if c & mask == c])

    return best(free)


@dataclass(frozen=True)
class Node:
    """One graph as the scheduler sees it: the class's devices in slice order and the claim per k."""

    devices: list[Device]
    models: dict[int, FastModel]

    def take(self, k: int, busy: frozenset[int]) -> tuple[int, ...] | None:
        if k == 1:
            one = first_free(self.devices, busy)
            return None if one is None else (one,)
        got = self.models[k].allocate(busy)
        return None if got is None else got[1]


@contextlib.contextmanager
def published_before(before: bool) -> Iterator[None]:
    """With `before`: the slices as published before dra_driver.gpu.packing (the layers as
    coloured, numbered largest clique first; the devices by GPU index, which `node` sorts)."""
    saved = topology.packing_layers
    if before:
        topology.packing_layers = lambda adjacency, layers: layers
    _forget()
    try:
        yield
    finally:
        topology.packing_layers = saved
        _forget()


def _forget() -> None:
    """Drop what the slice builder keeps per inventory (equal inventories share it)."""
    for cached in (slices.published_topology, slices.packing_rank, slices._described):
        cached.cache_clear()


def node(inv: Inventory, sizes: Sequence[int], lists: bool, before: bool) -> Node:
    features = SliceFeatures(list_attributes=lists)
    with published_before(before):
        specs = [{"spec": s} for s in desired_slices(inv, "node-1", DRIVER, features)]
    devices = class_devices([s["spec"] for s in specs])
    if before:
        devices = sorted(devices, key=lambda d: d.index)
    models = {k: FastModel.build(devices, fit_linked_claim(k, specs, DRIVER).devices, lists) for k in sizes}
    return Node(devices, models)


@dataclass(frozen=True)
class Outcome:
    bound: int
    best: int
    missed: bool  # the last k-claim found nothing although a free k-clique was left


def trial(n: int, masks: dict[int, tuple[int, ...]], model: Node, sizes: Sequence[int],
          rnd: random.Random, prefill: bool) -> list[tuple[int, Outcome]]:
    busy: frozenset[int] = frozenset()
    if prefill:
        for _ in range(rnd.randint(1, n // 2)):
            got = model.take(rnd.choice((1, *sizes)), busy)
            busy |= frozenset(got or ())
    out = []
    for k in sizes:
        taken, bound, singles = busy, 0, 0
        while True:
            if rnd.random() < SINGLE_SHARE:
                got = model.take(1, taken)
                if got is None:
                    break
                singles += 1
            else:
                got = model.take(k, taken)
                if got is None:
                    break
                bound += 1
            taken |= frozenset(got)
        free_mask = sum(1 << i for i in range(n) if i not in busy)
        best = min(max_disjoint(masks[k], free_mask), (n - len(busy) - singles) // k)
        left = sum(1 << i for i in range(n) if i not in taken)
        out.append((k, Outcome(bound, best, any(c & left == c for c in masks[k]))))
    return out


def graph_result(name: str, inv: Inventory, trials: int, lists: bool, before: bool) -> dict[str, Any]:
    n = len(inv.gpus)
    edges = raw_links(inv)
    masks = {k: cliques(n, edges, k) for k in SIZES}
    sizes = [k for k in SIZES if masks[k]]
    per_k = {k: [0, 0, 0] for k in sizes}
    if sizes:
        model = node(inv, sizes, lists, before)
        for t in range(trials):
            # the same claims for every variant: the seed is the graph's and the trial's
            rnd = random.Random(f"{name}-{t}")
            for k, o in trial(n, masks, model, sizes, rnd, prefill=t > 0):
                per_k[k][0] += o.bound
                per_k[k][1] += o.best
                per_k[k][2] += o.missed
    bound, best = sum(v[0] for v in per_k.values()), sum(v[1] for v in per_k.values())
    return {"graph": name, "gpus": n, "links": len(edges), "bound": bound, "best": best,
            "missed": sum(v[2] for v in per_k.values()),
            "per_k": {str(k): {"bound": v[0], "best": v[1], "missed": v[2]} for k, v in per_k.items()}}


@functools.cache
def _profile(name: str) -> Inventory:
    return discover(simulate=name)


def families(graphs8: int, graphs16: int) -> dict[str, list[tuple[str, Callable[[], Inventory]]]]:
    out: dict[str, list[tuple[str, Callable[[], Inventory]]]] = {}
    for n, count in ((8, graphs8), (16, graphs16)):
        for d in DENSITIES:
            make = [functools.partial(graph_inventory, n, links(n, d, s)) for s in range(count)]
            out[f"random-{n}-p{d}"] = [(f"random-{n}-p{d}-s{s}", m) for s, m in enumerate(make)]
    out["profiles"] = [(p, functools.partial(_profile, p)) for p in sorted(profile_names())]
    out["issue"] = [(name, functools.partial(graph_inventory, n, e)) for name, (n, e) in ISSUE.items()]
    return out


def run(trials: int, graphs8: int, graphs16: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    results: dict[str, Any] = {"trials": trials, "single_share": SINGLE_SHARE, "sizes": list(SIZES),
                               "families": {}}
    for family, graphs in families(graphs8, graphs16).items():
        fam: dict[str, Any] = {}
        for variant, lists, before in (("before-list", True, True), ("after-list", True, False),
                                       ("before-ga", False, True), ("after-ga", False, False)):
            rows = [graph_result(name, make(), trials, lists, before) for name, make in graphs]
            rows = [r for r in rows if r["best"]]
            bound, best = sum(r["bound"] for r in rows), sum(r["best"] for r in rows)
            worst = min(rows, key=lambda r: (r["bound"] / r["best"], r["graph"]), default=None)
            missed = sum(r["missed"] for r in rows)
            fam[variant] = {"graphs": len(rows), "bound": bound, "best": best, "missed": missed,
                            "efficiency": round(bound / best, 4) if best else None,
                            "worst": worst, "rows": rows}
            log(f"{family:16} {variant:12} {bound:6}/{best:<6} {fam[variant]['efficiency']} missed {missed} "
                f"worst {worst and worst['graph']} {worst and round(worst['bound'] / worst['best'], 3)}")
        results["families"][family] = fam
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--graphs-8", type=int, default=15, help="seeds per density, 8 GPUs")
    parser.add_argument("--graphs-16", type=int, default=6, help="seeds per density, 16 GPUs")
    parser.add_argument("--out", default="packing", help="results file name under benchmarks/results")
    args = parser.parse_args(argv)
    log.configure("warning")
    results = run(args.trials, args.graphs_8, args.graphs_16)
    report(args.out, results)


if __name__ == "__main__":
    main()
