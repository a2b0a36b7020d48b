"""A model of the scheduler's allocator on our published slices: which GPUs a claim gets.

Read in k8s.io/dynamic-resource-allocation (`structured/internal/{stable,experimental}`,
`allocateOne`): for each `firstAvailable` subrequest in order, the constraints that name it
(`<request>/<subrequest>`) or its request apply; the search picks devices **in slice order**
and backtracks, so what it returns is the first `count`-subset in device order whose values of
every `matchAttribute` share a value (scalar: equal; list attributes: a common element, the set
semantics of DRAListTypeAttributes). A device without the attribute never satisfies it. A plain
one-GPU claim gets the first free whole GPU in slice order.

`allocate_brute` is that search by exhaustion over every k-subset; `FastModel` is the same answer
from the value groups of the one constraint per subrequest that the documented shapes have
(tests/unit/test_nvlink_model.py checks that they agree). Used by the NVLink model tests and by
benchmarks/packing.py. Test plumbing: no cluster, no I/O.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from controller import attributes as A
from controller.claim_shapes import fits_selector, linked_class
from dra_driver import DEFAULT_DRIVER_NAME as DRIVER


@dataclass(frozen=True)
class Device:
    name: str
    index: int
    attributes: dict[str, Any]


def class_devices(specs: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> list[Device]:
    """The devices the class `gpu.dra-driver.dev` selects (whole GPUs), in slice order."""
    out = []
    for spec in specs:
        for d in spec.get("devices", []):
            attrs = d.get("attributes", {})
            if attrs.get("type") == {"string": "gpu"}:
                out.append(Device(d["name"], attrs["index"]["int"], attrs))
    return out


def value_set(device: Device, qualified: str, list_semantics: bool) -> frozenset[Any] | None:
    domain, _, name = qualified.rpartition("/")
    assert domain == DRIVER, qualified
    value = device.attributes.get(name)
    if value is None:
        return None  # a device without the attribute never satisfies the constraint
    ((kind, inner),) = value.items()
    if kind in ("ints", "strings", "bools", "versions"):
        assert list_semantics, f"{name} is a list but the model's server has no list attributes"
        return frozenset(inner)
    return frozenset([inner])


def fits(device: Device, sub: dict[str, Any]) -> bool:
    """The subrequest's selectors on the device: the documented shapes carry fits_selector alone,
    evaluated as CEL's `.?nvlinkCliqueSize.orValue(k) >= k` does; the gpu-linked class has no
    selector (claim_shapes.linked_class): its constraint alone picks."""
    for selector in sub.get("selectors", []):
        assert selector["cel"]["expression"] == fits_selector(sub["count"], DRIVER), selector
    tests = [sub["count"] for _ in sub.get("selectors", [])]
    assert sub["deviceClassName"] in (DRIVER, linked_class(DRIVER)), sub
    size = device.attributes.get(A.NVLINK_CLIQUE_SIZE, {})
    return all(size.get("int", k) >= k for k in tests)


def alternatives(claim: dict[str, Any]) -> list[tuple[str, int, list[str], dict[str, Any]]]:
    """(full request name, count, matchAttribute names that apply, the subrequest), in the order the
    allocator tries them."""
    (request,) = claim["requests"]
    subs = ([(f"{request['name']}/{s['name']}", s) for s in request["firstAvailable"]]
            if "firstAvailable" in request else [(request["name"], request["exactly"])])
    out = []
    for full, sub in subs:
        assert sub.get("allocationMode", "ExactCount") == "ExactCount"
        names = [c["matchAttribute"] for c in claim.get("constraints", [])
                 if request["name"] in c["requests"] or full in c["requests"]]
        out.append((full, sub["count"], names, sub))
    return out


def allocate_brute(devices: list[Device], busy: frozenset[int], claim: dict[str, Any],
                   list_semantics: bool) -> tuple[str, tuple[int, ...]] | None:
    """The allocator by exhaustion: first k-subset in device order whose value sets intersect."""
    free = [d for d in devices if d.index not in busy]
    for full, count, names, sub in alternatives(claim):
        for chosen in itertools.combinations([d for d in free if fits(d, sub)], count):
            ok = True
            for name in names:
                sets = [value_set(d, name, list_semantics) for d in chosen]
                if any(s is None for s in sets) or not frozenset.intersection(*(s for s in sets if s)):
                    ok = False
                    break
            if ok:
                return full, tuple(d.index for d in chosen)
    return None


@dataclass(frozen=True)
class FastModel:
    """The same allocator, fast: per alternative, the value groups of its one matchAttribute, as
    positions in slice order."""

    alternatives: tuple[tuple[str, int, tuple[tuple[int, ...], ...]], ...]
    indexes: tuple[int, ...]  # GPU index at each position

    @classmethod
    def build(cls, devices: list[Device], claim: dict[str, Any], list_semantics: bool) -> FastModel:
        alts = []
        for full, count, names, sub in alternatives(claim):
            assert len(names) == 1, "the documented shapes have one constraint per alternative"
            groups: dict[Any, list[int]] = {}
            for position, d in enumerate(devices):
                if fits(d, sub):
                    for v in sorted(value_set(d, names[0], list_semantics) or (), key=str):
                        groups.setdefault(v, []).append(position)
            alts.append((full, count, tuple(tuple(g) for g in groups.values())))
        return cls(tuple(alts), tuple(d.index for d in devices))

    def allocate(self, busy: frozenset[int]) -> tuple[str, tuple[int, ...]] | None:
        for full, count, groups in self.alternatives:
            # The first k-subset in device order with a common value: among the groups
            # that still have k free members, the one whose free members come first.
            best: list[int] | None = None
            for group in groups:
                free = [p for p in group if self.indexes[p] not in busy][:count]
                if len(free) == count and (best is None or free < best):
                    best = free
            if best is not None:
                return full, tuple(self.indexes[p] for p in best)
        return None


def first_free(devices: list[Device], busy: frozenset[int]) -> int | None:
    """The GPU a plain one-GPU claim gets: the first free whole GPU in slice order."""
    return next((d.index for d in devices if d.index not in busy), None)
