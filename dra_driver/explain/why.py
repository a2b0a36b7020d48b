"""Why a pod is pending: per node, whether its claims fit (the allocator's search) and, per
request and subrequest, what matches the class and selectors and why each match is out
(held by which claim and pod, not linked, tainted, blocked by counters that held MIG slices or
shares take, short of capacity), the free devices, the largest free set a matchAttribute
constraint allows, and one specific line per node. Each request's finding is
`dra_driver.explain.request_report`'s; this module judges nodes and the pod from them.
What the scheduler reads is what it counts: DeviceTaintRules taint the devices they select,
a claim allocated with adminAccess holds nothing. Nodes come closest first: fitting, then by
how much of each request is free, then by how much matches at all.

Pure: the pod, its claims (or their templates' specs), nodes, slices, DeviceTaintRules,
classes and every allocated claim in; a `PodReport` out. It must NOT read the API server.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dra_driver.explain.allocator import (
    ClaimPlan,
    Matcher,
    Refused,
    Search,
    Undecided,
    plan_claim,
)
from dra_driver.explain.request_report import (
    RequestReport,
    bytes_text,
    request_line,
    request_report,
    short_list,
)
from dra_driver.explain.state import (
    Held,
    held,
    node_selector_matches,
    pools,
    with_taint_rules,
)
from dra_driver.jsontypes import JSON


@dataclass(frozen=True)
class NodeReport:
    node: str
    verdict: str  # fits | full | excluded | refused | undecided
    summary: str
    allocation: tuple[str, ...] = ()  # "gpus/layer1: gpu-2" of the allocation the search found
    requests: tuple[RequestReport, ...] = ()
    closeness: float = 0.0  # per request, the share of the devices asked that are free
    matching: float = 0.0  # per request, the share of the devices asked that match at all
    reason: str = ""  # why it is not considered (excluded)

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

# --------------------------------------------------------------------------- per node


def _closeness(reports: Sequence[RequestReport]) -> float:
    if not reports:
        return 0.0
    return sum(min(1.0, r.available / r.count) if r.count else float(r.enough) for r in reports) / len(
        reports
    )


def _matching(reports: Sequence[RequestReport]) -> float:
    if not reports:
        return 0.0
    return sum(min(1.0, r.matched / r.count) if r.count else float(r.matched > 0) for r in reports) / len(
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
        return NodeReport(name, "excluded", f"{name}: not considered: {excluded}", reason=excluded)
    node_pools = pools(slices, node)
    per_request: list[RequestReport] = []
    best: list[RequestReport] = []
    try:
        for plan in plans:
            for alternatives in plan.requests:
                reports = [request_report(a, plan, node_pools, state, matcher) for a in alternatives]
                per_request.extend(reports)
                # a firstAvailable request is as close as its best subrequest
                best.append(max(reports, key=lambda r: (r.enough, r.available, r.matched)))
    except Refused as e:
        return NodeReport(name, "refused", f"{name}: {e}")
    closeness, matching = _closeness(best), _matching(best)
    try:
        found = Search(plans, node_pools, state, matcher).run()
    except Refused as e:
        return NodeReport(
            name, "refused", f"{name}: the scheduler stops here: {e}", requests=tuple(per_request),
            closeness=closeness, matching=matching,
        )
    except Undecided as e:
        return NodeReport(
            name,
            "undecided",
            f"{name}: {e}; see the detail",
            requests=tuple(per_request),
            closeness=closeness,
            matching=matching,
        )
    if found is not None:
        allocation = tuple(
            f"{req}: {d.name}"
            + (f" ({', '.join(f'{bytes_text(v)} {k}' for k, v in c.items())})" if c else "")
            for results in found.results
            for req, d, c in results
        )
        by_request: dict[str, list[str]] = defaultdict(list)
        for results in found.results:
            for req, d, _ in results:
                by_request[req].append(d.name)
        text = "; ".join(f"{req} gets {', '.join(names)}" for req, names in by_request.items())
        return NodeReport(name, "fits", f"{name}: fits: {text}", allocation, tuple(per_request), 2.0, 2.0)
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
    return NodeReport(
        name, "full", f"{name}: {line}", requests=tuple(per_request), closeness=closeness, matching=matching
    )


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
    taint_rules: Sequence[JSON] = (),
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
    slices = with_taint_rules(slices, taint_rules)
    reports = []
    for node in nodes:
        node_name = node["metadata"]["name"]
        elsewhere = (
            f"claim {pinned_claim} is allocated on {pinned}" if pinned and pinned != node_name else None
        )
        reports.append(node_report(node, pod, plans, slices, state, matcher, elsewhere))
    order = {"fits": 0, "full": 1, "undecided": 1, "refused": 2, "excluded": 3}
    reports.sort(key=lambda r: (order[r.verdict], -r.closeness, -r.matching, r.node))
    fitting = [r.node for r in reports if r.fits]
    considered = [r for r in reports if r.verdict != "excluded"]
    if fitting:
        headline = (
            f"pod {name}: its claims fit on {len(fitting)} of {len(reports)} nodes "
            f"({short_list(fitting, 4)}); the scheduler should place it (if it still waits, "
            "the reason is outside its claims: kubectl describe pod)"
        )
    elif not considered:
        reasons = Counter(r.reason for r in reports)
        why = "; ".join(f"{reason} ({n} node{'s' if n > 1 else ''})" for reason, n in reasons.most_common(3))
        more = f"; and {len(reasons) - 3} more reasons" if len(reasons) > 3 else ""
        headline = f"pod {name}: no node is considered for it: {why}{more}" if reports else (
            f"pod {name}: the cluster has no nodes")
    elif errors := sorted({e for n in considered for r in n.requests for e in r.errors}):
        erring = sum(1 for n in considered if any(r.errors for r in n.requests))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        headline = (f"pod {name}: its claims fit on none of {len(considered)} nodes considered; a selector "
                    f"fails to evaluate on {erring} of them, where the scheduler stops: {errors[0]}{more}")
    else:
        headline = f"pod {name}: its claims fit on none of {len(considered)} nodes considered"
        names = {r.request for r in considered[0].requests if r.matched == 0}
        for n in considered[1:]:
            names &= {r.request for r in n.requests if r.matched == 0}
        if names:
            headline += (f"; no node has a device that matches request {', '.join(sorted(names))} "
                         "(its class and selectors)")
    return PodReport(name, None, headline, tuple(claims), tuple(reports))

