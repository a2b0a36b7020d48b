"""The cluster's devices as the scheduler's allocator sees them, from plain API objects.

ResourceSlices become pools (per driver and pool name, only the newest generation, complete
or not) of devices with their counters; allocated ResourceClaims become what is held: whole
devices, consumed capacity of shareable devices, and the counters their devices consume,
each with the claim and pods that hold it (a result with adminAccess holds nothing, as in the
scheduler). Node selection of slices follows the allocator (nodeName, allNodes, nodeSelector).
DeviceTaintRules add their taint to the devices they select, as the scheduler's slice tracker
adds them (`with_taint_rules`).

Pure: JSON in, frozen dataclasses out. It must NOT read the API server or evaluate CEL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from dra_driver.explain.celenv import parse_quantity
from dra_driver.jsontypes import JSON

DeviceId = tuple[str, str, str]  # driver, pool, device


@dataclass(frozen=True)
class Device:
    driver: str
    pool: str
    name: str
    raw: JSON  # the slice's device entry
    multi: bool  # allowMultipleAllocations

    @property
    def id(self) -> DeviceId:
        return self.driver, self.pool, self.name

    def attribute(self, qualified: str) -> Any:
        """A fully qualified attribute's value, as the allocator looks it up; None: absent."""
        attributes = self.raw.get("attributes") or {}
        value = attributes.get(qualified)
        if value is None:
            domain, _, ident = qualified.rpartition("/")
            if domain == self.driver:
                value = attributes.get(ident)
        if not value:
            return None
        kind, item = next(iter(value.items()))
        return (kind, tuple(item) if isinstance(item, list) else item)

    def plain(self, name: str) -> Any:
        """An attribute of the driver's own domain, its bare value (for display)."""
        value = self.attribute(f"{self.driver}/{name}")
        return None if value is None else value[1]

    def capacity(self) -> dict[str, JSON]:
        return dict(self.raw.get("capacity") or {})

    def consumes(self) -> list[JSON]:
        return list(self.raw.get("consumesCounters") or [])

    def taints(self) -> list[JSON]:
        return list(self.raw.get("taints") or [])


@dataclass(frozen=True)
class Pool:
    driver: str
    name: str
    devices: tuple[Device, ...]
    counters: Mapping[str, Mapping[str, Decimal]]  # counter set -> counter -> value
    complete: bool


@dataclass(frozen=True)
class Holder:
    claim: str  # namespace/name
    pods: tuple[str, ...]  # namespace/name of the pods it is reserved for
    request: str
    share_id: str | None = None
    consumed: Mapping[str, str] = field(default_factory=dict)  # capacity of a share


@dataclass(frozen=True)
class Held:
    """What allocated claims hold: whole devices, shares of devices, their holders."""

    devices: frozenset[DeviceId]  # allocated whole (not shareable, not admin access)
    capacity: Mapping[DeviceId, Mapping[str, Decimal]]  # consumed capacity of shared devices
    holders: Mapping[DeviceId, tuple[Holder, ...]]

    def allocated(self, device: DeviceId) -> bool:
        """The allocator's IsDeviceAllocated: held whole or holding any share."""
        return device in self.devices or device in self.capacity


def with_taint_rules(slices: Sequence[JSON], rules: Sequence[JSON]) -> list[JSON]:
    """The slices with each DeviceTaintRule's taint added to the devices it selects, as the
    scheduler's slice tracker adds them: by driver, pool and device name, each optional; a rule
    without a selector selects nothing. The taint added names its rule under `rule`. (A 1.34
    v1alpha3 rule's deviceClassName and CEL selectors, dropped since 1.35, are not evaluated.)"""
    active = [r for r in rules if (r.get("spec") or {}).get("deviceSelector") is not None]
    if not active:
        return list(slices)
    out = []
    for s in slices:
        spec = s.get("spec") or {}
        pool = (spec.get("pool") or {}).get("name")
        mine = [
            r for r in active
            if r["spec"]["deviceSelector"].get("driver") in (None, spec.get("driver"))
            and r["spec"]["deviceSelector"].get("pool") in (None, pool)
        ]
        if not mine:
            out.append(s)
            continue
        devices = []
        for d in spec.get("devices") or []:
            added = [
                {**(r["spec"].get("taint") or {}), "rule": (r.get("metadata") or {}).get("name", "")}
                for r in mine
                if r["spec"]["deviceSelector"].get("device") in (None, d.get("name"))
            ]
            devices.append({**d, "taints": [*(d.get("taints") or []), *added]} if added else d)
        out.append({**s, "spec": {**spec, "devices": devices}})
    return out


def node_selector_matches(selector: JSON, node: JSON) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    name = (node.get("metadata") or {}).get("name")
    for term in selector.get("nodeSelectorTerms") or []:
        ok = True
        for req in term.get("matchExpressions") or []:
            ok = ok and _requirement(req, labels.get(req["key"]), req["key"] in labels)
        for req in term.get("matchFields") or []:
            ok = ok and req.get("key") == "metadata.name" and _requirement(req, name, True)
        if ok:
            return True
    return False


def _requirement(req: JSON, value: Any, present: bool) -> bool:
    op, values = req.get("operator"), req.get("values") or []
    if op == "In":
        return present and value in values
    if op == "NotIn":
        return not present or value not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and values:
        try:
            a, b = int(value), int(values[0])
        except ValueError:
            return False
        return a > b if op == "Gt" else a < b
    return False


def slice_targets(spec: JSON, node: JSON) -> bool:
    """Whether a slice's devices may be allocated on the node."""
    name = (node.get("metadata") or {}).get("name")
    if spec.get("nodeName"):
        return bool(spec["nodeName"] == name)
    if spec.get("allNodes"):
        return True
    if spec.get("nodeSelector"):
        return node_selector_matches(spec["nodeSelector"], node)
    if spec.get("perDeviceNodeSelection"):
        return any(
            d.get("nodeName") == name
            or d.get("allNodes")
            or (d.get("nodeSelector") and node_selector_matches(d["nodeSelector"], node))
            for d in spec.get("devices") or []
        )
    return False


def pools(slices: Sequence[JSON], node: JSON) -> list[Pool]:
    """The pools with devices for the node, sorted by driver and name as the allocator does.

    Counter sets come from every slice of the pool, devices only from slices for the node."""
    by_pool: dict[tuple[str, str], list[JSON]] = defaultdict(list)
    for s in slices:
        spec = s.get("spec") or {}
        by_pool[(spec.get("driver", ""), (spec.get("pool") or {}).get("name", ""))].append(s)
    found = []
    for (driver, pool), members in sorted(by_pool.items()):
        generation = max(int(s["spec"]["pool"].get("generation", 0)) for s in members)
        current = sorted(
            (s for s in members if int(s["spec"]["pool"].get("generation", 0)) == generation),
            key=lambda s: s["metadata"].get("name", ""),
        )
        mine = [s for s in current if slice_targets(s["spec"], node)]
        if not mine:
            continue
        expected = int(current[0]["spec"]["pool"].get("resourceSliceCount", 1))
        counters: dict[str, dict[str, Decimal]] = {}
        for s in current:
            for counter_set in s["spec"].get("sharedCounters") or []:
                counters[counter_set["name"]] = {
                    n: parse_quantity(c.get("value", "0"))
                    for n, c in (counter_set.get("counters") or {}).items()
                }
        devices = tuple(
            Device(driver, pool, d["name"], d, bool(d.get("allowMultipleAllocations")))
            for s in mine
            for d in s["spec"].get("devices") or []
            if not s["spec"].get("perDeviceNodeSelection")
            or d.get("nodeName") == node["metadata"]["name"]
            or d.get("allNodes")
        )
        found.append(Pool(driver, pool, devices, counters, len(current) == expected))
    return found


def _reserved_pods(claim: JSON) -> tuple[str, ...]:
    namespace = claim["metadata"].get("namespace", "")
    return tuple(
        f"{namespace}/{r['name']}"
        for r in (claim.get("status") or {}).get("reservedFor") or []
        if r.get("resource") == "pods"
    )


def held(claims: Iterable[JSON], skip: Iterable[str] = ()) -> Held:
    """What the allocated claims hold (a claim's uid in `skip` is left out)."""
    skipped = set(skip)
    devices: set[DeviceId] = set()
    capacity: dict[DeviceId, dict[str, Decimal]] = {}
    holders: dict[DeviceId, list[Holder]] = defaultdict(list)
    for claim in claims:
        meta = claim.get("metadata") or {}
        if meta.get("uid") in skipped:
            continue
        allocation = (claim.get("status") or {}).get("allocation") or {}
        who = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        pods = _reserved_pods(claim)
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("adminAccess"):
                continue
            key = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
            consumed = result.get("consumedCapacity") or {}
            if result.get("shareID"):
                used = capacity.setdefault(key, {})
                for name, value in consumed.items():
                    used[name] = used.get(name, Decimal(0)) + parse_quantity(value)
            else:
                devices.add(key)
            holders[key].append(
                Holder(
                    who,
                    pods,
                    result.get("request", ""),
                    result.get("shareID"),
                    {k: str(v) for k, v in consumed.items()},
                )
            )
    return Held(frozenset(devices), capacity, {k: tuple(v) for k, v in holders.items()})


def counters_left(pool: Pool, state: Held) -> dict[str, dict[str, Decimal]]:
    """The pool's counters less what its allocated devices consume (may go below zero)."""
    left = {name: dict(values) for name, values in pool.counters.items()}
    for device in pool.devices:
        if not state.allocated(device.id):
            continue
        for consumption in device.consumes():
            counter_set = left.get(consumption.get("counterSet", ""))
            if counter_set is None:
                continue
            for name, c in (consumption.get("counters") or {}).items():
                if name in counter_set:
                    counter_set[name] -= parse_quantity(c.get("value", "0"))
    return left


def counters_short(device: Device, left: Mapping[str, Mapping[str, Decimal]]) -> list[tuple[str, str]]:
    """(counter set, counter) of the pool that the device alone would overdraw. A counter
    already overdrawn blocks every device of the pool that consumes counters, as in the
    allocator (it checks every counter of the pool, not only the device's)."""
    want: dict[str, dict[str, Decimal]] = defaultdict(dict)
    for c in device.consumes():
        for name, v in (c.get("counters") or {}).items():
            want[c.get("counterSet", "")][name] = parse_quantity(v.get("value", "0"))
    return sorted((s, n) for s, counters in left.items() for n, value in counters.items()
                  if value < want.get(s, {}).get(n, Decimal(0)))


def counter_takers(pool: Pool, state: Held) -> dict[tuple[str, str], list[Device]]:
    """Per (counter set, counter), the allocated devices of the pool that consume it."""
    found: dict[tuple[str, str], list[Device]] = defaultdict(list)
    for d in pool.devices:
        if state.allocated(d.id):
            for c in d.consumes():
                for name in c.get("counters") or {}:
                    found[(c.get("counterSet", ""), name)].append(d)
    return found
