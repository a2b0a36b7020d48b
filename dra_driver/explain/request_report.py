"""One request's finding on one node, for `dra_driver.explain.why`: what matches the class and
selectors, why each match is out (held by which claim and pod, without the attribute a
constraint on the request needs (not linked), tainted by the driver or a DeviceTaintRule,
blocked by counters that held MIG slices or shares take, short of capacity), the free devices,
the largest free set a matchAttribute constraint allows; and the request's part of the node's
line. A selector that fails to evaluate is one error, however many devices it failed on.

Pure, as the rest of explain: it must NOT read the API server, nor judge a whole node or pod
(`why` does).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from dra_driver.explain.allocator import (
    ClaimPlan,
    Matcher,
    Request,
    capacity_fits,
    consumed_capacity,
    taint_blocks,
    value_set,
)
from dra_driver.explain.celenv import format_quantity, parse_quantity
from dra_driver.explain.state import (
    Device,
    Held,
    Pool,
    counter_takers,
    counters_left,
    counters_short,
)

NOUNS = {"gpu": "GPU", "gpu-share": "memory share", "mig": "MIG slice"}
_PROFILE = re.compile(r"""profile\s*==\s*["']([^"']+)["']""")


@dataclass(frozen=True)
class RequestReport:
    request: str  # "gpus" or "gpus/layer1"
    asked: str  # "3 linked GPUs"
    count: int
    matched: int
    held: tuple[str, ...]  # "gpu-1 (ns/claim for ns/pod)"
    lacking: tuple[str, ...]  # without the attribute a constraint on the request needs
    tainted: tuple[str, ...]
    counters: tuple[str, ...]  # blocked by counters, with who holds them
    capacity: tuple[str, ...]  # short of capacity, with what is left
    mig_mode: tuple[str, ...]  # matched whole GPUs that are in MIG mode
    free: tuple[str, ...]
    errors: tuple[str, ...]  # each selector error once
    error_devices: int = 0  # on how many devices they failed
    group_attribute: str | None = None  # the matchAttribute constraint on the request
    largest_group: tuple[str, ...] = ()  # the largest set of free devices it allows
    most_left: str | None = None  # for shares: the most capacity left, and where
    class_only: int = 0  # when none matches: how many the class alone matches
    selectors: tuple[str, ...] = ()  # the claim's own selectors

    @property
    def available(self) -> int:
        return len(self.largest_group) if self.group_attribute else len(self.free)

    @property
    def enough(self) -> bool:
        if self.count <= 0:  # allocationMode All
            return self.matched > 0 and not (
                self.held or self.lacking or self.tainted or self.counters or self.capacity
            )
        return self.available >= self.count


def _who(state: Held, device: Device) -> str:
    holders = state.holders.get(device.id, ())
    if not holders:
        return device.name
    h = holders[0]
    pods = f" for {', '.join(h.pods)}" if h.pods else ""
    more = f" and {len(holders) - 1} more" if len(holders) > 1 else ""
    return f"{device.name} ({h.claim}{pods}{more})"


def _mig_parents(devices: Sequence[Device]) -> set[int]:
    return {
        int(d.plain("parentIndex"))
        for d in devices
        if d.plain("type") == "mig" and isinstance(d.plain("parentIndex"), int)
    }


def _asked(request: Request, nouns: Sequence[str], linked: bool) -> str:
    noun = Counter(nouns).most_common(1)[0][0] if nouns else f"device of class {request.class_name}"
    count = request.count
    profile = next((m[1] for s in request.selectors for m in [_PROFILE.search(s)] if m), None)
    words = ["all" if request.all_devices else str(count)]
    if linked:
        words.append("linked")
    words.append(noun + ("s" if (count != 1 or request.all_devices) and not noun.endswith("s") else ""))
    if profile:
        words.append(profile)
    if request.capacity:
        words.append(
            "of " + ", ".join(f"{v} {k.rpartition('/')[2]}" for k, v in sorted(request.capacity.items()))
        )
    return " ".join(words)


def request_report(
    request: Request, plan: ClaimPlan, node_pools: Sequence[Pool], state: Held, matcher: Matcher
) -> RequestReport:
    """What the request alone finds on the node (other requests and claims not counted)."""
    devices = [(p, d) for p in node_pools for d in p.devices]
    mig_parents = _mig_parents([d for _, d in devices])
    matched: list[tuple[Pool, Device]] = []
    of_class: list[Device] = []
    errors: list[str] = []
    error_devices = 0
    for p, d in devices:
        outcome = matcher.match(request, d)
        if outcome.error:
            errors.append(outcome.error)
            error_devices += 1
        elif outcome.matches:
            matched.append((p, d))
        if not outcome.matches and request.selectors and matcher.class_match(request, d).matches:
            of_class.append(d)
    lefts = {p.name: counters_left(p, state) for p in node_pools}
    takers_of = {p.name: counter_takers(p, state) for p in node_pools}
    held_, lacking, tainted, counters, capacity, mig_mode, free = [], [], [], [], [], [], []
    constrained = [c.attribute for c in plan.constraints if c.applies(request)]
    free_devices: list[Device] = []
    most: tuple[Decimal, str] | None = None
    for p, d in matched:
        if d.plain("type") == "gpu" and d.plain("index") in mig_parents:
            mig_mode.append(d.name)
        if not request.admin and d.id in state.devices:
            held_.append(_who(state, d))
            continue
        missing = [a for a in constrained if value_set(d.attribute(a)) is None]
        if missing:  # the allocator never takes it for this request
            lacking.append(f"{d.name} (no {', '.join(a.rpartition('/')[2] for a in missing)})")
            continue
        taint = taint_blocks(d, request.tolerations)
        if taint is not None:
            rule = f", DeviceTaintRule {taint['rule']}" if taint.get("rule") else ""
            tainted.append(
                f"{d.name} ({taint.get('key')}={taint.get('value', '')}:{taint.get('effect')}{rule})"
            )
            continue
        skip = d.multi and d.id in state.capacity
        short = [] if skip or not d.consumes() else counters_short(d, lefts[p.name])
        if short:
            taking = {h.name: h for pair in short for h in takers_of[p.name].get(pair, [])}
            claims = sorted({h.claim for t in taking.values() for h in state.holders.get(t.id, ())})
            # the memory slices first: they say which placements overlap
            names = sorted((n for _, n in short), key=lambda n: (not n.startswith("memory-slice"), n))
            counted = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            by = "overdrawn, and nothing allocated takes them"
            if taking:
                by = (f"held by {short_list(sorted(taking), 3)} ({len(claims)} "
                      f"claim{'s' if len(claims) != 1 else ''}: {short_list(claims, 3)})")
            counters.append(f"{d.name} ({counted} of {short[0][0]} {by})")
            continue
        used = state.capacity.get(d.id, {})
        if d.multi:
            caps = d.capacity()
            for name in request.capacity or caps:
                if name in caps:
                    left = parse_quantity(caps[name].get("value", "0")) - used.get(name, Decimal(0))
                    if most is None or left > most[0]:
                        most = (left, f"{bytes_text(left)} {name} left on {d.name}")
        if not capacity_fits(request, d, used):
            taken = consumed_capacity(request, d)
            why = (
                "asks for a capacity it does not have or its policy refuses"
                if taken is None
                else ", ".join(
                    bytes_text(parse_quantity(d.capacity()[n].get("value", "0")) - used.get(n, Decimal(0)))
                    + f" {n} left"
                    for n in sorted(taken)
                )
            )
            capacity.append(f"{d.name} ({why})")
            continue
        free.append(d.name)
        free_devices.append(d)
    group_attr = next((c.attribute for c in plan.constraints if not c.distinct and c.applies(request)), None)
    largest: tuple[str, ...] = ()
    if group_attr:
        groups: defaultdict[Any, list[str]] = defaultdict(list)
        for d in free_devices:
            for v in value_set(d.attribute(group_attr)) or ():
                groups[v].append(d.name)
        for members in groups.values():
            if len(members) > len(largest):
                largest = tuple(members)
    linked = bool(group_attr and "nvlink" in group_attr.lower())
    typed = [d for _, d in matched] or of_class
    nouns = [NOUNS.get(str(d.plain("type")), str(d.plain("type"))) for d in typed if d.plain("type")]
    return RequestReport(
        request=request.name,
        asked=_asked(request, nouns, linked),
        count=0 if request.all_devices else request.count,
        matched=len(matched),
        held=tuple(held_),
        lacking=tuple(lacking),
        tainted=tuple(tainted),
        counters=tuple(counters),
        capacity=tuple(capacity),
        mig_mode=tuple(mig_mode),
        free=tuple(free),
        errors=tuple(sorted(set(errors))),
        error_devices=error_devices,
        group_attribute=group_attr,
        largest_group=largest,
        most_left=most[1] if most else None,
        class_only=len(of_class) if not matched else 0,
        selectors=request.selectors,
    )


def bytes_text(value: Decimal) -> str:
    """A byte count the way a person reads it: 40Gi, 76.4Gi, 512Mi."""
    for unit, size in (("Ti", 2**40), ("Gi", 2**30)):
        if value >= size and value % size == 0:
            return f"{int(value // size)}{unit}"
    if value >= 2**30:
        return f"{value / 2**30:.1f}Gi"
    if value >= 2**20 and value % 2**20 == 0:
        return f"{int(value // 2**20)}Mi"
    return format_quantity(value)


def short_list(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def request_line(r: RequestReport) -> str:
    """One request's finding, as it goes on a node's line."""
    parts = [f"{r.asked} asked"]
    if r.errors:
        more = f" (and {len(r.errors) - 1} more)" if len(r.errors) > 1 else ""
        on = f"{r.error_devices} device{'s' if r.error_devices != 1 else ''}"
        parts.append(f"a selector fails to evaluate on {on}: {r.errors[0]}{more}")
        return "; ".join(parts)
    if not r.matched and r.class_only:
        selectors = " && ".join(r.selectors)
        parts.append(f"{r.class_only} of the class, none passes the claim's selector {selectors}")
        return "; ".join(parts)
    if not r.matched:
        parts.append("no device of this node matches the class")
        return "; ".join(parts)
    out = []
    if r.held:
        claims = sorted({h.split(" (", 1)[1].rstrip(")") for h in r.held if " (" in h})
        by = f" by {claims[0]}" if len(claims) == 1 else f" by {len(claims)} claims" if claims else ""
        out.append(f"{len(r.held)} held{by}")
    if r.lacking:
        linked = r.group_attribute and "nvlink" in r.group_attribute.lower()
        why = "in no linked set" if linked else "without the attribute constrained"
        out.append(f"{len(r.lacking)} {why}")
    if r.counters:
        mig = any("memory-slice" in c or "counter-set" in c for c in r.counters)
        out.append(
            f"{len(r.counters)} blocked by " + ("held MIG slices" if mig else "held shares or whole GPUs")
        )
    if r.capacity:
        out.append(f"{len(r.capacity)} short of capacity")
    if r.tainted:
        out.append(f"{len(r.tainted)} tainted")
    if r.mig_mode:
        out.append(f"{len(r.mig_mode)} in MIG mode")
    parts.append(f"{r.matched} match" + (f" ({', '.join(out)})" if out else ""))
    parts.append(f"free {short_list(r.free)}" if r.free else "none free")
    if r.group_attribute:
        word = (
            "linked"
            if "nvlink" in r.group_attribute.lower()
            else f"same-{r.group_attribute.rpartition('/')[2]}"
        )
        parts.append(f"largest {word} free set {len(r.largest_group)}")
    if r.most_left and not r.free:
        parts.append(f"most left: {r.most_left}")
    return "; ".join(parts)
