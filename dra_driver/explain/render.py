"""A `PodReport` as a person reads it in a terminal: the headline, the pod's claims, one
line per node (the closest few unless every node is asked for; where no node is considered,
the first few that say why), and with `verbose` the detail of every request and subrequest
on the nodes shown.

Pure: it must NOT compute verdicts (why.py does) or read anything.
"""

from __future__ import annotations

from dra_driver.explain.request_report import RequestReport
from dra_driver.explain.why import NodeReport, PodReport

DEFAULT_NODES = 5


def _detail(r: RequestReport) -> list[str]:
    lines = [f"    {r.request}: {r.asked} asked; {r.matched} match the class and selectors"]
    for label, items in (
        (f"selector errors (on {r.error_devices} device{'s' * (r.error_devices != 1)})", r.errors),
        ("held", r.held),
        ("without the attribute constrained", r.lacking),
        ("tainted", r.tainted),
        ("blocked by counters", r.counters),
        ("short of capacity", r.capacity),
        ("in MIG mode", r.mig_mode),
        ("free", r.free),
    ):
        if items:
            lines.append(f"      {label}: {'; '.join(items)}")
    if r.group_attribute:
        lines.append(
            f"      largest free set with one {r.group_attribute}: "
            f"{', '.join(r.largest_group) or 'none'} ({len(r.largest_group)} of {r.count} asked)"
        )
    if r.most_left:
        lines.append(f"      most left: {r.most_left}")
    return lines


def _node(n: NodeReport, verbose: bool) -> list[str]:
    lines = [f"  {n.summary}"]
    if verbose:
        if n.allocation:
            lines.append(f"    the scheduler's search finds: {', '.join(n.allocation)}")
        for r in n.requests:
            lines.extend(_detail(r))
    return lines


def render(
    report: PodReport, verbose: bool = False, all_nodes: bool = False, limit: int = DEFAULT_NODES
) -> str:
    lines = [report.headline]
    if report.claims:
        lines.append("Claims:")
        for c in report.claims:
            name = f" ({c.claim})" if c.claim else ""
            lines.append(f"  {c.pod_claim}{name}: {c.state}")
    if report.node is not None or not report.nodes:
        return "\n".join(lines)
    considered = [n for n in report.nodes if n.verdict != "excluded"]
    shown = list(report.nodes) if all_nodes else (considered or list(report.nodes))[:limit]
    if all_nodes:
        lines.append("Nodes:")
    else:
        lines.append("Nodes, closest first:" if considered else "Nodes, none considered:")
    for n in shown:
        lines.extend(_node(n, verbose))
    rest = len(report.nodes) - len(shown)
    if rest > 0:
        excluded = sum(1 for n in report.nodes if n.verdict == "excluded" and n not in shown)
        note = f" ({excluded} not considered for the pod)" if excluded else ""
        lines.append(f"  ... {rest} more node{'s' if rest > 1 else ''}{note}; --all lists every node")
    if not verbose:
        lines.append("(-v: every request and subrequest per node)")
    return "\n".join(lines)
