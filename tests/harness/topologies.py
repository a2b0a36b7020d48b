"""Seeded random 8-GPU NVLink topologies, as simulated-hardware profiles, and the brute-force truth.

`random_links(seed)` draws an NVLink graph on 8 GPUs (a density drawn from the seed, then
each pair linked with that probability); `random_profile(seed, directory)` writes it as a
profile file that `dra-driver ... --simulate <file>` and `dra_driver.gpu.discover` read (the
ring8-v100 profile with its links replaced: V100 SXM2, one link per linked pair), and
`free_cliques` / `is_linked` are the brute-force answers a test or the scheduler benchmark
compares the real scheduler with. Not hand-picked: the seed alone decides the graph.
`graph_inventory(n, edges)` is an inventory of n GPUs linked along any given graph.
Test plumbing only: nothing here talks to a cluster.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import yaml

from dra_driver.gpu.model import GpuInfo, Inventory, LinkEndpointKind, NvLink

GPUS = 8
Links = frozenset[frozenset[int]]


def random_links(seed: int, gpus: int = GPUS) -> Links:
    rnd = random.Random(seed)
    density = rnd.uniform(0.3, 0.9)
    return frozenset(frozenset(p) for p in itertools.combinations(range(gpus), 2) if rnd.random() < density)


def random_profile(seed: int, directory: Path) -> Path:
    """The profile file of `random_links(seed)` under `directory` (named random-<seed>.yaml)."""
    template = resources.files("dra_driver.gpu.sim").joinpath("profiles/ring8-v100.yaml").read_text()
    profile = yaml.safe_load(template)
    links = random_links(seed)
    profile["description"] = f"synthetic: 8x V100 SXM2, random NVLink graph, seed {seed}, {len(links)} links"
    profile["nvlink_pairs"] = [[*sorted(p), 1] for p in sorted(links, key=sorted)]
    profile["gpu_defaults"]["nvlink_max_links"] = GPUS - 1
    path = directory / f"random-{seed}.yaml"
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return path


def is_linked(members: Iterable[int], links: Links) -> bool:
    return all(frozenset(p) in links for p in itertools.combinations(sorted(members), 2))


def free_cliques(k: int, busy: Iterable[int], links: Links, gpus: int = GPUS) -> list[tuple[int, ...]]:
    """Every set of k free GPUs that are all linked with each other (brute force)."""
    free = sorted(set(range(gpus)) - set(busy))
    return [c for c in itertools.combinations(free, k) if is_linked(c, links)]


def largest_clique(links: Links, gpus: int = GPUS) -> int:
    return max((k for k in range(2, gpus + 1) if free_cliques(k, (), links, gpus)), default=1)


def bus(index: int) -> str:
    return f"0000:{0x10 + index:02x}:00.0"


def gpu(index: int, peers: Iterable[int]) -> GpuInfo:
    """An H100 SXM whose NVLinks go straight to the GPUs `peers` (one link each)."""
    return GpuInfo(
        index=index, minor=index, uuid=f"GPU-{index:08x}-0000-4000-8000-000000000000",
        product_name="NVIDIA H100 80GB HBM3", brand="Nvidia", architecture="Hopper",
        cuda_compute_capability="9.0", memory_bytes=81559 * 2**20, pci_bus_id=bus(index),
        pcie_root=f"pci0000:{index:02x}", numa_node=index // 4, mig_enabled=False,
        nvlinks=tuple(NvLink(n, True, LinkEndpointKind.GPU, bus(p)) for n, p in enumerate(sorted(peers))),
        multiprocessors=132,
    )  # fmt: skip


def graph_inventory(n: int, edges: Links) -> Inventory:
    """An inventory of n GPUs linked exactly along `edges` (pairs of indexes)."""
    peers = {i: [j for j in range(n) if frozenset((i, j)) in edges] for i in range(n)}
    return Inventory("570.195.03", "12.8", tuple(gpu(i, peers[i]) for i in range(n)), source="graph")
