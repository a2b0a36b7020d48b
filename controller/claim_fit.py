"""The cheapest complete claim for k linked GPUs on a given fleet, from its published slices.

`fit_linked_claim(k, slices, driver)` reads what our ResourceSlices publish (per node, the
groups of each clique layer `nvlinkClique<L>`, and `nvlinkCliques` where the server keeps
list-type attributes) and picks, of the documented shapes in `controller.claim_shapes`, the
one with the fewest subrequests that still finds k linked GPUs wherever the fleet has them:
- the GA shape over the layers where some node has a group of k or more GPUs
  (`claim_shapes.layers_for`, as `fleet_layers` does from topologies), when that is fewer
  than `LIST_FORM_FROM_LAYERS` layers, or when the server keeps no list-type attributes;
- else the list shape (one request, `matchAttribute: nvlinkCliques`), which is complete on
  any node; it is also taken when some node's layers leave a maximal clique out (a
  topology with more cliques than 8 layers can hold), as the GA shape would miss it there.
The claim names the selector-free class `gpu-linked.<driver>` (claim_shapes.linked_class):
the constraint alone picks the GPUs, and the scheduler evaluates no CEL for it (a fail-fast
test in the class's selector would cost every claim, one no node can hold included, an
evaluation per device looked at; docs/nvlink.md, "Cost for the scheduler", has the figures).
With a class of the caller's (`device_class`), the test `nvlinkCliqueSize >= k` goes in as a
claim selector (`claim_shapes.fits_selector`) only where some node of the fleet has no set of k linked GPUs
and the claim has one subrequest: elsewhere it would cost one more evaluation per device
looked at and drop nothing. Every subrequest the scheduler cannot satisfy on a node is one
more search there, so fewer is cheaper (docs/nvlink.md, "Cost for the scheduler").

Pure: slices in, a claim out; reading the cluster is `dra_driver.commands.claim`'s.
It must NOT decide what a slice publishes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from controller.attributes import NVLINK_CLIQUE_SIZE, NVLINK_CLIQUES, NVLINK_LAYER_PREFIX, TYPE
from controller.claim_shapes import REQUEST, layers_for, linked_class, linked_gpus_ga, linked_gpus_list
from dra_driver import DEFAULT_DRIVER_NAME
from dra_driver.jsontypes import JSON

# A node's largest linked group from which the scheduler's search for k GPUs it cannot give
# there (every subset of the group: 2^g steps, upstream's allocator has no count bound) costs
# more than the fail-fast selector's one CEL evaluation per device: measured at 500 nodes, the
# search without the selector is cheap on groups of 2 and costs a multiple of a plain pod's
# attempt from groups of 4 on (docs/nvlink.md, "Cost for the scheduler", has the figures).
SEARCH_BOUND_GROUP = 4
# From this many fitted layers on, the list form costs the scheduler's search less than the
# layers (each a search of its own on a node where the earlier ones fail); below it, the list
# form's intersections cost more where cliques overlap (scheduler CPU per bound pod at 500
# nodes on random-4, random-5 and DGX-1 fleets: docs/nvlink.md, "Cost for the scheduler").
LIST_FORM_FROM_LAYERS = 3
_LAYER = re.compile(re.escape(NVLINK_LAYER_PREFIX) + r"(\d+)$")


@dataclass(frozen=True)
class NodeCliques:
    """What one node's slices say about its NVLink cliques."""

    layers: dict[int, list[int]]  # layer -> the size of each of its groups
    cliques: frozenset[str] | None  # nvlinkCliques ids of its GPUs; None: no list attributes
    layer_groups: frozenset[str]  # every nvlinkClique<L> value


@dataclass(frozen=True)
class FittedClaim:
    """The chosen `spec.devices`, and why."""

    devices: JSON
    form: str  # "layers" | "list"
    layers: tuple[int, ...]  # the GA shape's layers (for "list": those it would have needed)
    nodes: int  # nodes of the driver with whole GPUs
    nodes_that_fit: int  # of those, nodes with a group of k or more
    note: str


def _value(attributes: JSON, name: str) -> object:
    entry = attributes.get(name)
    if not isinstance(entry, dict) or len(entry) != 1:
        return None
    return next(iter(entry.values()))


def _linked(attributes: JSON) -> bool:
    size = _value(attributes, NVLINK_CLIQUE_SIZE)
    return isinstance(size, int) and size >= 2


def node_cliques(slices: Sequence[JSON], driver: str) -> dict[str, NodeCliques]:
    """Per pool (a node's pool is its name): the clique layers its whole GPUs publish."""
    members: dict[str, dict[tuple[int, str], int]] = {}
    cliques: dict[str, set[str] | None] = {}
    lacking: set[str] = set()
    for s in slices:
        spec = s.get("spec", s)
        if spec.get("driver") != driver:
            continue
        pool = str(spec.get("pool", {}).get("name", spec.get("nodeName", "")))
        groups = members.setdefault(pool, {})
        for device in spec.get("devices") or []:
            attrs = device.get("attributes") or {}
            if _value(attrs, TYPE) != "gpu":
                continue
            cliques.setdefault(pool, None)
            listed = _value(attrs, NVLINK_CLIQUES)
            if isinstance(listed, list):
                cliques[pool] = (cliques[pool] or set()) | {str(v) for v in listed}
            elif _linked(attrs):
                # a linked GPU whose list did not fit the device's limits: the list form
                # cannot give its sets, so the node counts as one without list attributes
                lacking.add(pool)
            for name in attrs:
                m = _LAYER.match(name)
                value = _value(attrs, name)
                if m and isinstance(value, str):
                    key = (int(m.group(1)), value)
                    groups[key] = groups.get(key, 0) + 1
    out: dict[str, NodeCliques] = {}
    for pool, groups in members.items():
        if pool not in cliques:
            continue  # no whole GPU
        layers: dict[int, list[int]] = {}
        for (layer, _), size in sorted(groups.items()):
            layers.setdefault(layer, []).append(size)
        listed = None if pool in lacking else cliques[pool]
        out[pool] = NodeCliques(layers, frozenset(listed) if listed is not None else None,
                                frozenset(v for _, v in groups))
    return out


def fit_linked_claim(
    k: int,
    slices: Sequence[JSON],
    driver: str = DEFAULT_DRIVER_NAME,
    device_class: str | None = None,
    selectors: Sequence[str] = (),
    request: str = REQUEST,
) -> FittedClaim:
    """The claim for k linked GPUs with the fewest subrequests that is complete for this fleet.
    `device_class` None: the shipped selector-free `gpu-linked.<driver>` class.
    Raises ValueError for k < 2."""
    if k < 2:
        raise ValueError(f"--linked {k}: ask for 2 or more GPUs (one GPU needs no NVLink constraint)")
    linked = linked_class(driver) if device_class is None else None
    device_class = linked or device_class
    nodes = node_cliques(slices, driver)
    layers = layers_for(k, (n.layers for n in nodes.values()))
    fit = sum(1 for n in nodes.values() if any(size >= k for sizes in n.layers.values() for size in sizes))
    lists = bool(nodes) and all(n.cliques is not None for n in nodes.values())
    # a maximal clique that no layer holds: the GA shape cannot give it on that node
    uncovered = lists and any(not (n.cliques or frozenset()) <= n.layer_groups for n in nodes.values())
    largest = [max((size for sizes in n.layers.values() for size in sizes), default=0)
               for n in nodes.values()]
    # the selector-free class: the search alone drops a node that cannot hold k, at 2^g steps
    # for its largest group of g, dearer than one CEL evaluation per device from g = 4 on
    dear = any(SEARCH_BOUND_GROUP <= g < k for g in largest)
    cannot = fit < len(nodes)
    fail_fast = (dear if linked else cannot) and len(layers) == 1
    ga = linked_gpus_ga(k, driver=driver, device_class=device_class, selectors=selectors, layers=layers,
                        request=request, fail_fast=fail_fast)
    if lists and (len(layers) >= LIST_FORM_FROM_LAYERS or uncovered):
        why = ("some node has more cliques than its layers hold" if uncovered
               else f"the layers would need {len(layers)} subrequests")
        devices = linked_gpus_list(k, driver=driver, device_class=device_class, selectors=selectors,
                                   request=request, fail_fast=dear if linked else cannot)
        return FittedClaim(devices, "list", layers, len(nodes), fit,
                           f"list form (one request): the server keeps list-type attributes and {why}")
    note = f"clique layers {', '.join(map(str, layers))} ({len(layers)} subrequest{'s' * (len(layers) > 1)})"
    if fail_fast:
        dear_why = f" but a linked group of {SEARCH_BOUND_GROUP} or more, which the scheduler would search"
        note += (f", with the selector nvlinkCliqueSize >= {k} "
                 f"(some nodes have no {k} linked GPUs{dear_why if linked else ''})")
    if linked:
        note += f", class {linked} (no selector: the constraint picks the GPUs)"
    if not fit:
        note += f"; NO node of the fleet has {k} linked GPUs: this claim stays Pending"
    elif not lists:
        note += "; the server keeps no list-type attributes, so a node whose cliques outnumber its layers " \
                "(`dra-driver inventory` says LEFT OUT) may miss some"
    return FittedClaim(ga, "layers", layers, len(nodes), fit, note)


def claim_template(name: str, fitted: FittedClaim, namespace: str | None = None) -> JSON:
    metadata: JSON = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": metadata,
            "spec": {"spec": {"devices": fitted.devices}}}
