"""Whether a pod's unallocated claims fit on one node, searched as kube-scheduler's DRA
allocator searches (k8s.io/dynamic-resource-allocation structured, v0.37 "experimental").

Claims in order, requests in order, for `firstAvailable` each subrequest in order; for each
device wanted, the node's pools' devices in order, each combination once; a device is taken
when it is not held (unless the request has adminAccess), matches its class's and the
request's CEL selectors, has the capacity asked (consumable capacity, rounded up by the
device's request policy), its counters are left in its pool (no counter of the pool may go
below what the claims being allocated consume), every NoSchedule/NoExecute taint is
tolerated, and the claim's matchAttribute/distinctAttribute constraints still hold (list
attributes by set intersection); the search backtracks until a full allocation is found or
every combination failed. The first allocation found is returned, as the scheduler's is.

Pure, and bounded: a search longer than `budget` steps answers "undecided" rather than
hanging a command. It must NOT read the API server; selectors go through `celenv`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from dra_driver.explain.celenv import (
    CelError,
    Outcome,
    compile_selector,
    device_variable,
    evaluate,
    parse_quantity,
)
from dra_driver.explain.state import Device, DeviceId, Held, Pool, counters_left
from dra_driver.jsontypes import JSON

DEFAULT_BUDGET = 200_000


class Undecided(Exception):
    """The search took more steps than its budget."""


class Refused(Exception):
    """The scheduler would stop on this node with an error (a selector's runtime error...)."""


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: a cache key
class Request:
    """One request, or one subrequest of a firstAvailable request, of one claim."""

    claim: int
    base: str  # the request's name
    sub: str | None  # the subrequest's name
    class_name: str
    selectors: tuple[str, ...]
    count: int
    all_devices: bool
    admin: bool
    tolerations: tuple[JSON, ...]
    capacity: Mapping[str, str]

    @property
    def name(self) -> str:
        return f"{self.base}/{self.sub}" if self.sub else self.base


@dataclass(frozen=True)
class Constraint:
    requests: frozenset[str]  # empty: every request of the claim
    attribute: str
    distinct: bool

    def applies(self, request: Request) -> bool:
        return not self.requests or request.base in self.requests or request.name in self.requests


@dataclass(frozen=True)
class ClaimPlan:
    """A claim to allocate: per request its alternatives (one unless firstAvailable)."""

    name: str  # namespace/name
    requests: tuple[tuple[Request, ...], ...]
    constraints: tuple[Constraint, ...]


def _request(claim: int, base: str, sub: str | None, body: JSON, admin: bool) -> Request:
    mode = body.get("allocationMode") or "ExactCount"
    return Request(
        claim=claim,
        base=base,
        sub=sub,
        class_name=body.get("deviceClassName", ""),
        selectors=tuple(s["cel"]["expression"] for s in body.get("selectors") or [] if s.get("cel")),
        count=int(body.get("count") or 1),
        all_devices=mode == "All",
        admin=admin,
        tolerations=tuple(body.get("tolerations") or ()),
        capacity={k: str(v) for k, v in ((body.get("capacity") or {}).get("requests") or {}).items()},
    )


def plan_claim(index: int, name: str, spec: JSON) -> ClaimPlan:
    """The claim's `spec` (ResourceClaimSpec JSON) as requests and constraints."""
    devices = spec.get("devices") or {}
    requests: list[tuple[Request, ...]] = []
    for r in devices.get("requests") or []:
        if r.get("exactly"):
            exactly = r["exactly"]
            requests.append((_request(index, r["name"], None, exactly, bool(exactly.get("adminAccess"))),))
        else:
            requests.append(
                tuple(_request(index, r["name"], s["name"], s, False) for s in r.get("firstAvailable") or [])
            )
    constraints = []
    for c in devices.get("constraints") or []:
        attribute = c.get("matchAttribute") or c.get("distinctAttribute")
        if attribute:
            constraints.append(
                Constraint(
                    frozenset(c.get("requests") or ()), attribute, distinct=bool(c.get("distinctAttribute"))
                )
            )
    return ClaimPlan(name, tuple(requests), tuple(constraints))


# --------------------------------------------------------------------------- per-device checks


class Matcher:
    """Class and request selectors per (request, device), cached as the scheduler caches them."""

    def __init__(self, classes: Mapping[str, JSON]) -> None:
        self.classes = classes
        self._cache: dict[tuple[Request, DeviceId], Outcome] = {}
        self._variables: dict[DeviceId, JSON] = {}

    def class_selectors(self, name: str) -> tuple[str, ...]:
        if name not in self.classes:
            raise Refused(f"DeviceClass {name!r} does not exist: create it or fix deviceClassName")
        spec = self.classes[name].get("spec") or {}
        return tuple(s["cel"]["expression"] for s in spec.get("selectors") or [] if s.get("cel"))

    def match(self, request: Request, device: Device) -> Outcome:
        key = (request, device.id)
        found = self._cache.get(key)
        if found is None:
            found = self._match(request, device)
            self._cache[key] = found
        return found

    def class_match(self, request: Request, device: Device) -> Outcome:
        """The class's selectors alone (what a claim's own selectors narrow down)."""
        return self._match(request, device, claim_selectors=False)

    def _match(self, request: Request, device: Device, claim_selectors: bool = True) -> Outcome:
        variable = self._variables.get(device.id)
        if variable is None:
            variable = self._variables[device.id] = device_variable(device.driver, device.raw)
        for where, expressions in (
            ("class " + request.class_name, self.class_selectors(request.class_name)),
            ("claim", request.selectors if claim_selectors else ()),
        ):
            for expression in expressions:
                try:
                    outcome = evaluate(compile_selector(expression), variable)
                except CelError as e:
                    return Outcome(False, f"{where}: {e}")
                if outcome.error:  # one text for every device it fails on: it is reported once
                    return Outcome(False, f"{where}: {outcome.error}")
                if not outcome.matches:
                    return outcome
        return Outcome(True)


def taint_blocks(device: Device, tolerations: Sequence[JSON]) -> JSON | None:
    """The first NoSchedule/NoExecute taint of the device that no toleration tolerates."""
    for taint in device.taints():
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(_tolerates(t, taint) for t in tolerations):
            return taint
    return None


def _tolerates(toleration: JSON, taint: JSON) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return True
    return bool(toleration.get("value", "") == taint.get("value", ""))


def _policy_consumed(requested: str | None, capacity: JSON) -> Decimal:
    """What a request consumes of one capacity (the allocator's calculateConsumedCapacity)."""
    policy = capacity.get("requestPolicy")
    if requested is None:
        if policy and policy.get("default") is not None:
            return parse_quantity(policy["default"])
        return parse_quantity(capacity.get("value", "0"))
    value = parse_quantity(requested)
    if not policy:
        return value
    valid_range = policy.get("validRange")
    if valid_range and valid_range.get("min") is not None:
        low = parse_quantity(valid_range["min"])
        if value < low:
            return low
        if valid_range.get("step") is None:
            return value
        step = parse_quantity(valid_range["step"])
        n, mod = divmod(value - low, step)
        return low + step * (n + (1 if mod else 0))
    for valid in policy.get("validValues") or []:
        if value <= parse_quantity(valid):
            return parse_quantity(valid)
    return value


def _violates(consumed: Decimal, capacity: JSON) -> bool:
    policy = capacity.get("requestPolicy")
    if not policy:
        return False
    if policy.get("default") is not None and consumed == parse_quantity(policy["default"]):
        return False
    valid_range = policy.get("validRange")
    if valid_range:
        if valid_range.get("max") is not None and consumed > parse_quantity(valid_range["max"]):
            return True
        if valid_range.get("step") is not None:
            step = parse_quantity(valid_range["step"])
            return (consumed - parse_quantity(valid_range.get("min", "0"))) % step != 0
        return False
    valid = policy.get("validValues") or []
    return bool(valid) and all(consumed != parse_quantity(v) for v in valid)


def consumed_capacity(request: Request, device: Device) -> dict[str, Decimal] | None:
    """What the request takes of each of the device's capacities; None: it asks for a
    capacity the device does not have, or one its request policy does not allow."""
    capacities = device.capacity()
    if any(name not in capacities for name in request.capacity):
        return None
    taken = {}
    for name, capacity in capacities.items():
        value = _policy_consumed(request.capacity.get(name), capacity)
        if _violates(value, capacity):
            return None
        taken[name] = value
    return taken


def capacity_fits(request: Request, device: Device, used: Mapping[str, Decimal]) -> bool:
    """The allocator's CmpRequestOverCapacity: every capacity, with what is used, stays within it."""
    taken = consumed_capacity(request, device)
    if taken is None:
        return False
    capacities = device.capacity()
    return all(
        used.get(n, Decimal(0)) + v <= parse_quantity(capacities[n].get("value", "0"))
        for n, v in taken.items()
    )


_KIND = {
    "string": "s",
    "strings": "s",
    "int": "i",
    "ints": "i",
    "bool": "b",
    "bools": "b",
    "version": "v",
    "versions": "v",
}


def value_set(value: tuple[str, Any] | None) -> frozenset[tuple[str, Any]] | None:
    """An attribute's value as the set matchAttribute intersects (a scalar is a set of one)."""
    if value is None or value[0] not in _KIND:
        return None
    kind, item = value
    items = item if isinstance(item, tuple) else (item,)
    return frozenset((_KIND[kind], i) for i in items) or None


# --------------------------------------------------------------------------- the search


@dataclass
class Allocation:
    """What the search found: per claim, (request name, device, consumed capacity)."""

    results: list[list[tuple[str, Device, dict[str, Decimal]]]] = field(default_factory=list)


def _drop(items: list[Any]) -> None:
    items.pop()


class Search:
    def __init__(
        self,
        claims: Sequence[ClaimPlan],
        pools: Sequence[Pool],
        held: Held,
        matcher: Matcher,
        budget: int = DEFAULT_BUDGET,
    ) -> None:
        self.claims = claims
        self.held = held
        self.matcher = matcher
        self.budget = budget
        self.steps = 0
        self.devices: list[tuple[Pool, Device]] = [(p, d) for p in pools if p.complete for d in p.devices]
        self.left = {p.name + "\0" + p.driver: counters_left(p, held) for p in pools}
        self.consuming: dict[str, dict[str, dict[str, Decimal]]] = {}
        self.taking: dict[DeviceId, set[int]] = {}  # device -> the claims taking it
        self.sharing: dict[DeviceId, dict[str, Decimal]] = {}
        # per claim, per constraint: the value sets of the devices added so far
        self.constraint_sets: list[list[list[frozenset[tuple[str, Any]]]]] = [
            [[] for _ in c.constraints] for c in claims
        ]
        self.found = Allocation([[] for _ in claims])
        self.incomplete = [p for p in pools if not p.complete]

    # -- one device

    def _used_capacity(self, device: Device) -> dict[str, Decimal]:
        used = dict(self.held.capacity.get(device.id, {}))
        for name, value in self.sharing.get(device.id, {}).items():
            used[name] = used.get(name, Decimal(0)) + value
        return used

    def _counters(self, pool: Pool, device: Device, sign: int) -> None:
        consuming = self.consuming.setdefault(pool.name + "\0" + pool.driver, {})
        for consumption in device.consumes():
            counter_set = consuming.setdefault(consumption.get("counterSet", ""), {})
            for name, c in (consumption.get("counters") or {}).items():
                counter_set[name] = counter_set.get(name, Decimal(0)) + sign * parse_quantity(
                    c.get("value", "0")
                )

    def _counters_fit(self, pool: Pool) -> bool:
        key = pool.name + "\0" + pool.driver
        consuming = self.consuming.get(key, {})
        for set_name, counters in self.left[key].items():
            taken = consuming.get(set_name, {})
            if any(value < taken.get(name, Decimal(0)) for name, value in counters.items()):
                return False
        return True

    def in_use(self, request: Request, device: Device) -> bool:
        """As the allocator: adminAccess may take what others hold, not twice in one claim."""
        if request.admin:
            return request.claim in self.taking.get(device.id, ())
        return device.id in self.held.devices or bool(self.taking.get(device.id))

    def try_device(self, request: Request, pool: Pool, device: Device) -> Callable[[], None] | None:
        """Take the device for the request; the undo, or None when it cannot be taken."""
        if self.in_use(request, device):
            return None
        multi = device.multi
        undo: list[Callable[[], None]] = []

        def rollback() -> None:
            for step in reversed(undo):
                step()

        skip_counters = multi and (device.id in self.held.capacity or device.id in self.sharing)
        if device.consumes() and not skip_counters:
            self._counters(pool, device, +1)
            undo.append(lambda: self._counters(pool, device, -1))
            if not self._counters_fit(pool):
                rollback()
                return None
        if taint_blocks(device, request.tolerations) is not None:
            rollback()
            return None
        claim = self.claims[request.claim]
        for i, constraint in enumerate(claim.constraints):
            if not constraint.applies(request):
                continue
            values = value_set(device.attribute(constraint.attribute))
            stack = self.constraint_sets[request.claim][i]
            if values is None:
                rollback()
                return None
            if constraint.distinct:
                if any(values & other for other in stack):
                    rollback()
                    return None
                stack.append(values)
            else:
                narrowed = values & stack[-1] if stack else values
                if not narrowed:
                    rollback()
                    return None
                stack.append(narrowed)
            undo.append(functools.partial(_drop, stack))
        if not multi:
            claims = self.taking.setdefault(device.id, set())
            claims.add(request.claim)
            undo.append(lambda: claims.discard(request.claim))
        if not capacity_fits(request, device, self._used_capacity(device)):
            rollback()
            return None
        consumed: dict[str, Decimal] = {}
        if multi:
            consumed = consumed_capacity(request, device) or {}
            share = self.sharing.setdefault(device.id, {})
            for name, value in consumed.items():
                share[name] = share.get(name, Decimal(0)) + value

            def unshare() -> None:
                for name, value in consumed.items():
                    share[name] -= value
                if not any(share.values()):
                    self.sharing.pop(device.id, None)

            undo.append(unshare)
        results = self.found.results[request.claim]
        results.append((request.name, device, consumed))
        undo.append(lambda: _drop(results))
        return rollback

    def selectable(self, request: Request, device: Device) -> bool:
        outcome = self.matcher.match(request, device)
        if outcome.error:
            raise Refused(f"{outcome.error} (device {device.name})")
        return outcome.matches

    # -- the recursion

    def run(self) -> Allocation | None:
        return self.found if self._claim(0) else None

    def _claim(self, c: int) -> bool:
        if c >= len(self.claims):
            return True
        return self._request(c, 0)

    def _request(self, c: int, r: int) -> bool:
        if r >= len(self.claims[c].requests):
            return self._claim(c + 1)
        return any(self._alternative(c, r, alt) for alt in self.claims[c].requests[r])

    def _alternative(self, c: int, r: int, request: Request) -> bool:
        if request.all_devices:
            if self.incomplete:
                raise Refused(
                    f"request {request.name} asks for all devices, but pool "
                    f"{self.incomplete[0].name} is being updated"
                )
            wanted = [(p, d) for p, d in self.devices if self.selectable(request, d)]
            if not wanted:
                return False
            return self._all(c, r, request, wanted, 0)
        return self._device(c, r, request, 0, 0)

    def _all(self, c: int, r: int, request: Request, wanted: list[tuple[Pool, Device]], i: int) -> bool:
        if i >= len(wanted):
            return self._request(c, r + 1)
        pool, device = wanted[i]
        undo = self.try_device(request, pool, device)
        if undo is None:
            return False
        if self._all(c, r, request, wanted, i + 1):
            return True
        undo()
        return False

    def _device(self, c: int, r: int, request: Request, k: int, start: int) -> bool:
        if k >= request.count:
            return self._request(c, r + 1)
        for i in range(start, len(self.devices)):
            self.steps += 1
            if self.steps > self.budget:
                raise Undecided(f"gave up after {self.budget} steps")
            pool, device = self.devices[i]
            if self.in_use(request, device) or not self.selectable(request, device):
                continue
            if not capacity_fits(request, device, self._used_capacity(device)):
                continue
            undo = self.try_device(request, pool, device)
            if undo is None:
                continue
            if self._device(c, r, request, k + 1, i + 1):
                return True
            undo()
        return False
