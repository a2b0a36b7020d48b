"""Why a pod is pending: per node, whether its claims fit (the allocator's search) and, per
request and subrequest, what matches the class and selectors and why each match is out
(held by which claim and pod, tainted, blocked by counters that held MIG slices or shares
take, short of capacity), the free devices, the largest free set a matchAttribute
constraint allows, and one specific line per node.

Pure: the pod, its claims (or their templates' specs), nodes, slices, classes and every
allocated claim in; a `PodReport` out. It must NOT read the API server.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from dra_driver.explain.allocator import (
    ClaimPlan,
    Matcher,
    Refused,
    Request,
    Search,
    Undecided,
    capacity_fits,
    consumed_capacity,
    plan_claim,
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
    held,
    node_selector_matches,
    pools,
)
from dra_driver.jsontypes import JSON

NOUNS = {"gpu": "GPU", "gpu-share": "memory share", "mig": "MIG slice"}
_PROFILE = re.compile(r"""profile\s*==\s*["']([^"']+)["']""")


@dataclass(frozen=True)
class RequestReport:
    request: str  # "gpus" or "gpus/layer1"
    asked: str  # "3 linked GPUs"
    count: int
    matched: int
    held: tuple[str, ...]  # "gpu-1 (ns/claim for ns/pod)"
    tainted: tuple[str, ...]
    counters: tuple[str, ...]  # blocked by counters, with who holds them
    capacity: tuple[str, ...]  # short of capacity, with what is left
    mig_mode: tuple[str, ...]  # matched whole GPUs that are in MIG mode
    free: tuple[str, ...]
    errors: tuple[str, ...]
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
            return self.matched > 0 and not (self.held or self.tainted or self.counters or self.capacity)
        return self.available >= self.count


@dataclass(frozen=True)
class NodeReport:
    node: str
    verdict: str  # fits | full | excluded | refused | undecided
    summary: str
    allocation: tuple[str, ...] = ()  # "gpus/layer1: gpu-2" of the allocation the search found
    requests: tuple[RequestReport, ...] = ()
    closeness: float = 0.0

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"


@dataclass(frozen=True)
class ClaimState:
    pod_claim: str  # the name in pod.spec.resourceClaims
    claim: str | None  # namespace/name; None: not created yet (from a template)
    state: str  # "allocated on n1: gpu-0 (gpus)", "not allocated", "not created yet"
    allocated: bool


@dataclass(frozen=True)
class PodReport:
    pod: str
    node: str | None  # where it is bound
    headline: str
    claims: tuple[ClaimState, ...]
    nodes: tuple[NodeReport, ...]  # fitting first, then the closest

    @property
    def fitting(self) -> tuple[str, ...]:
        return tuple(n.node for n in self.nodes if n.fits)


@dataclass(frozen=True)
class PodClaim:
    """A claim of the pod as the command read it."""

    pod_claim: str
    claim: JSON | None  # the ResourceClaim, if it exists
    template_spec: JSON | None = None  # the template's spec, for a claim not created yet


# --------------------------------------------------------------------------- node filters


def _tolerated(taint: JSON, tolerations: Sequence[JSON]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and not t.get("key"):
            return True
        if t.get("key") != taint.get("key"):
            continue
        if t.get("operator") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def node_excluded(pod: JSON, node: JSON) -> str | None:
    """Why the scheduler would not consider the node for the pod apart from its claims."""
    spec = pod.get("spec") or {}
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    if spec.get("nodeName") and spec["nodeName"] != meta.get("name"):
        return f"the pod names node {spec['nodeName']}"
    wrong = {k: v for k, v in (spec.get("nodeSelector") or {}).items() if labels.get(k) != v}
    if wrong:
        return "nodeSelector " + ", ".join(f"{k}={v}" for k, v in sorted(wrong.items())) + " does not match"
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required and not node_selector_matches(required, node):
        return "the pod's required node affinity does not match"
    if (node.get("spec") or {}).get("unschedulable"):
        return "node is cordoned (unschedulable)"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(
            taint, spec.get("tolerations") or []
        ):
            return (
                f"node taint {taint.get('key')}={taint.get('value', '')}:{taint['effect']} is not tolerated"
            )
    return None


# --------------------------------------------------------------------------- per request


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
    for p, d in devices:
        outcome = matcher.match(request, d)
        if outcome.error:
            errors.append(outcome.error)
        elif outcome.matches:
            matched.append((p, d))
        if not outcome.matches and request.selectors and matcher.class_match(request, d).matches:
            of_class.append(d)
    lefts = {p.name: counters_left(p, state) for p in node_pools}
    takers_of = {p.name: counter_takers(p, state) for p in node_pools}
    held_, tainted, counters, capacity, mig_mode, free = [], [], [], [], [], []
    free_devices: list[Device] = []
    most: tuple[Decimal, str] | None = None
    for p, d in matched:
        if d.plain("type") == "gpu" and d.plain("index") in mig_parents:
            mig_mode.append(d.name)
        if not request.admin and d.id in state.devices:
            held_.append(_who(state, d))
            continue
        taint = taint_blocks(d, request.tolerations)
        if taint is not None:
            tainted.append(f"{d.name} ({taint.get('key')}={taint.get('value', '')}:{taint.get('effect')})")
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
                by = (f"held by {_short_list(sorted(taking), 3)} ({len(claims)} "
                      f"claim{'s' if len(claims) != 1 else ''}: {_short_list(claims, 3)})")
            counters.append(f"{d.name} ({counted} of {short[0][0]} {by})")
            continue
        used = state.capacity.get(d.id, {})
        if d.multi:
            caps = d.capacity()
            for name in request.capacity or caps:
                if name in caps:
                    left = parse_quantity(caps[name].get("value", "0")) - used.get(name, Decimal(0))
                    if most is None or left > most[0]:
                        most = (left, f"{_bytes(left)} {name} left on {d.name}")
        if not capacity_fits(request, d, used):
            taken = consumed_capacity(request, d)
            why = (
                "asks for a capacity it does not have or its policy refuses"
                if taken is None
                else ", ".join(
                    f"{_bytes(parse_quantity(d.capacity()[n].get('value', '0')) - used.get(n, Decimal(0)))}"
                    f" {n} left"
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
        tainted=tuple(tainted),
        counters=tuple(counters),
        capacity=tuple(capacity),
        mig_mode=tuple(mig_mode),
        free=tuple(free),
        errors=tuple(sorted(set(errors))),
        group_attribute=group_attr,
        largest_group=largest,
        most_left=most[1] if most else None,
        class_only=len(of_class) if not matched else 0,
        selectors=request.selectors,
    )


def _bytes(value: Decimal) -> str:
    """A byte count the way a person reads it: 40Gi, 76.4Gi, 512Mi."""
    for unit, size in (("Ti", 2**40), ("Gi", 2**30)):
        if value >= size and value % size == 0:
            return f"{int(value // size)}{unit}"
    if value >= 2**30:
        return f"{value / 2**30:.1f}Gi"
    if value >= 2**20 and value % 2**20 == 0:
        return f"{int(value // 2**20)}Mi"
    return format_quantity(value)


def _short_list(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def request_line(r: RequestReport) -> str:
    """One request's finding, as it goes on a node's line."""
    parts = [f"{r.asked} asked"]
    if r.errors:
        parts.append(f"selector errors: {r.errors[0]}")
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
    parts.append(f"free {_short_list(r.free)}" if r.free else "none free")
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


# --------------------------------------------------------------------------- per node


def _closeness(reports: Sequence[RequestReport]) -> float:
    if not reports:
        return 0.0
    return sum(min(1.0, r.available / r.count) if r.count else float(r.enough) for r in reports) / len(
        reports
    )


def node_report(
    node: JSON,
    pod: JSON,
    plans: Sequence[ClaimPlan],
    slices: Sequence[JSON],
    state: Held,
    matcher: Matcher,
    allocated_elsewhere: str | None = None,
) -> NodeReport:
    name = node["metadata"]["name"]
    excluded = node_excluded(pod, node) or allocated_elsewhere
    if excluded:
        return NodeReport(name, "excluded", f"{name}: not considered: {excluded}")
    node_pools = pools(slices, node)
    per_request: list[RequestReport] = []
    best: list[RequestReport] = []
    try:
        for plan in plans:
            for alternatives in plan.requests:
                reports = [request_report(a, plan, node_pools, state, matcher) for a in alternatives]
                per_request.extend(reports)
                # a firstAvailable request is as close as its best subrequest
                best.append(max(reports, key=lambda r: (r.enough, r.available)))
    except Refused as e:
        return NodeReport(name, "refused", f"{name}: {e}")
    closeness = _closeness(best)
    try:
        found = Search(plans, node_pools, state, matcher).run()
    except Refused as e:
        return NodeReport(
            name, "refused", f"{name}: the scheduler stops here: {e}", requests=tuple(per_request)
        )
    except Undecided as e:
        return NodeReport(
            name,
            "undecided",
            f"{name}: {e}; see the detail",
            requests=tuple(per_request),
            closeness=closeness,
        )
    if found is not None:
        allocation = tuple(
            f"{req}: {d.name}" + (f" ({', '.join(f'{_bytes(v)} {k}' for k, v in c.items())})" if c else "")
            for results in found.results
            for req, d, c in results
        )
        by_request: dict[str, list[str]] = defaultdict(list)
        for results in found.results:
            for req, d, _ in results:
                by_request[req].append(d.name)
        text = "; ".join(f"{req} gets {', '.join(names)}" for req, names in by_request.items())
        return NodeReport(name, "fits", f"{name}: fits: {text}", allocation, tuple(per_request), 2.0)
    if not node_pools:
        return NodeReport(
            name, "full", f"{name}: no devices published for this node", requests=tuple(per_request)
        )
    failing = [r for r in best if not r.enough]
    if failing:
        line = "; ".join(request_line(r) for r in failing[:1])
        if len(failing) > 1:
            line += f" (and {len(failing) - 1} more request{'s' if len(failing) > 2 else ''} short)"
    else:
        line = "each request fits alone, not all together: " + "; ".join(request_line(r) for r in best)
    return NodeReport(name, "full", f"{name}: {line}", requests=tuple(per_request), closeness=closeness)


# --------------------------------------------------------------------------- per pod


def _allocation_text(claim: JSON) -> tuple[str, str | None]:
    """`allocated on NODE: dev (req), ...` and the node, from the claim's allocation."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    nodes = sorted(
        {
            v
            for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []
            for f in term.get("matchFields") or []
            for v in f.get("values") or []
        }
    )
    where = nodes[0] if len(nodes) == 1 else None
    devices = ", ".join(
        f"{r.get('device')} ({r.get('request')}"
        + (f", {r['consumedCapacity'].get('memory')} memory" if r.get("consumedCapacity") else "")
        + ")"
        for r in results
    )
    place = f"on {where}" if where else ("on any node" if not nodes else f"on one of {', '.join(nodes)}")
    return f"allocated {place}: {devices}", where


def _pod_name(pod: JSON) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def explain_pod(
    pod: JSON,
    pod_claims: Sequence[PodClaim],
    nodes: Sequence[JSON],
    slices: Sequence[JSON],
    classes: Mapping[str, JSON],
    all_claims: Sequence[JSON],
) -> PodReport:
    """Where the pod's claims are, or why they cannot be allocated on each node."""
    claims: list[ClaimState] = []
    plans: list[ClaimPlan] = []
    pinned: str | None = None  # a node an allocated claim binds the pod to
    pinned_claim = ""
    for pc in pod_claims:
        claim = pc.claim
        if claim is not None and (claim.get("status") or {}).get("allocation"):
            text, where = _allocation_text(claim)
            name = f"{claim['metadata']['namespace']}/{claim['metadata']['name']}"
            claims.append(ClaimState(pc.pod_claim, name, text, True))
            if where:
                pinned, pinned_claim = where, name
            continue
        if claim is not None:
            name = f"{claim['metadata']['namespace']}/{claim['metadata']['name']}"
            claims.append(ClaimState(pc.pod_claim, name, "not allocated", False))
            plans.append(plan_claim(len(plans), name, claim.get("spec") or {}))
        elif pc.template_spec is not None:
            claims.append(ClaimState(pc.pod_claim, None, "not created yet (from its template)", False))
            plans.append(plan_claim(len(plans), f"<{pc.pod_claim}>", pc.template_spec))
        else:
            claims.append(
                ClaimState(pc.pod_claim, None, "missing: neither the claim nor its template exists", False)
            )
    bound = (pod.get("spec") or {}).get("nodeName")
    name = _pod_name(pod)
    if bound:
        return PodReport(name, bound, f"pod {name} is bound to node {bound}; its claims:", tuple(claims), ())
    if any(c.state.startswith("missing") for c in claims):
        return PodReport(name, None, f"pod {name} waits for a claim that does not exist", tuple(claims), ())
    if not plans and pod_claims:
        where = f" on {pinned}" if pinned else ""
        return PodReport(
            name,
            None,
            f"pod {name}: every claim is allocated{where}; the pod waits for "
            "something else (node resources, affinity, volumes: kubectl describe pod)",
            tuple(claims),
            (),
        )
    if not pod_claims:
        return PodReport(name, None, f"pod {name} has no resource claims", (), ())
    state = held(all_claims)
    matcher = Matcher(classes)
    reports = []
    for node in nodes:
        node_name = node["metadata"]["name"]
        elsewhere = (
            f"claim {pinned_claim} is allocated on {pinned}" if pinned and pinned != node_name else None
        )
        reports.append(node_report(node, pod, plans, slices, state, matcher, elsewhere))
    order = {"fits": 0, "full": 1, "undecided": 1, "refused": 2, "excluded": 3}
    reports.sort(key=lambda r: (order[r.verdict], -r.closeness, r.node))
    fitting = [r.node for r in reports if r.fits]
    considered = [r for r in reports if r.verdict != "excluded"]
    if fitting:
        headline = (
            f"pod {name}: its claims fit on {len(fitting)} of {len(reports)} nodes "
            f"({_short_list(fitting, 4)}); the scheduler should place it (if it still waits, "
            "the reason is outside its claims: kubectl describe pod)"
        )
    elif not considered:
        headline = f"pod {name}: no node is considered for it (see why per node)"
    else:
        headline = f"pod {name}: its claims fit on none of {len(considered)} nodes considered"
        names = {r.request for r in considered[0].requests if r.matched == 0}
        for n in considered[1:]:
            names &= {r.request for r in n.requests if r.matched == 0}
        if names:
            headline += (f"; no node has a device that matches request {', '.join(sorted(names))} "
                         "(its class and selectors)")
    return PodReport(name, None, headline, tuple(claims), tuple(reports))
