"""The pure plan of the ResourceSlice publisher: which objects a pool needs, and which writes get there.

`desired_objects` turns a pool's slice specs (from `controller.slices`) into complete
ResourceSlice objects at a generation; `plan_pool` compares them with what the server
has and returns the writes (`Plan`). Generation rule (as the upstream Go helper): keep
the pool generation when at most one existing slice changes and none is added; otherwise
bump it and rewrite all slices, so the scheduler never mixes two generations.

It must NOT talk to the API server, sleep, log or keep state between calls: the loop in
`controller.publisher` does all of that and asks this module only what to write.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dra_driver.jsontypes import JSON

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
POOL_LABEL = "gpu.dra-driver.dev/pool"


@dataclass(frozen=True)
class PoolSpec:
    """What one pool should look like: its node and the slice specs (without pool bookkeeping)."""

    name: str
    node_name: str | None
    slice_specs: tuple[JSON, ...]


def slice_name(driver: str, pool: str, index: int) -> str:
    """Deterministic names; sorting by name keeps slice order (the allocator's priority)."""
    return f"{pool}-{driver}-{index:03d}"


def desired_objects(driver: str, pool: PoolSpec, generation: int, owner: JSON | None) -> dict[str, JSON]:
    """The complete ResourceSlice objects of `pool` at `generation`, by name (pure)."""
    count = max(len(pool.slice_specs), 1)
    specs = pool.slice_specs or ({"driver": driver, "devices": []},)
    objects: dict[str, JSON] = {}
    for i, spec in enumerate(specs):
        name = slice_name(driver, pool.name, i)
        metadata: JSON = {"name": name, "labels": {MANAGED_BY_LABEL: driver, POOL_LABEL: pool.name}}
        if owner:
            metadata["ownerReferences"] = [owner]
        full_spec = {
            **spec,
            "driver": driver,
            "pool": {"name": pool.name, "generation": generation, "resourceSliceCount": count},
        }
        if pool.node_name:
            full_spec["nodeName"] = pool.node_name
        objects[name] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": full_spec,
        }
    return objects


def up_to_date(desired: JSON, actual: JSON) -> bool:
    """True when `actual` (from the server) has exactly our spec, labels and owner."""
    meta, want_meta = actual.get("metadata", {}), desired["metadata"]
    if any(meta.get("labels", {}).get(k) != v for k, v in want_meta["labels"].items()):
        return False
    if want_meta.get("ownerReferences") and [
        (o.get("uid"), o.get("name")) for o in meta.get("ownerReferences", [])
    ] != [(o["uid"], o["name"]) for o in want_meta["ownerReferences"]]:
        return False
    return bool(actual.get("spec") == desired["spec"])


@dataclass(frozen=True)
class Plan:
    """The writes that bring one pool to its desired state."""

    generation: int
    apply: tuple[JSON, ...]
    delete: tuple[JSON, ...]


def plan_pool(driver: str, pool: PoolSpec, existing: Iterable[JSON], owner: JSON | None) -> Plan:
    """Pure: compare the pool's existing slices with its desired ones; decide what to write."""
    existing_by_name = {s["metadata"]["name"]: s for s in existing}
    current_gen = max((s["spec"]["pool"].get("generation", 0) for s in existing_by_name.values()), default=0)
    at_current = desired_objects(driver, pool, max(current_gen, 1), owner)
    stale_gen = any(s["spec"]["pool"].get("generation", 0) != current_gen for s in existing_by_name.values())
    extra = [s for n, s in existing_by_name.items() if n not in at_current]
    missing = [n for n in at_current if n not in existing_by_name]
    changed = [
        n
        for n, obj in at_current.items()
        if n in existing_by_name and not up_to_date(obj, existing_by_name[n])
    ]
    if not (extra or missing or changed or stale_gen):
        return Plan(current_gen, (), ())
    # One changed slice and nothing else: a single update is atomic, keep the generation
    # so that the scheduler never sees a pool with mixed generations.
    if current_gen and not (extra or missing or stale_gen) and len(changed) == 1:
        return Plan(current_gen, (at_current[changed[0]],), ())
    generation = current_gen + 1
    return Plan(generation, tuple(desired_objects(driver, pool, generation, owner).values()), tuple(extra))
