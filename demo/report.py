"""The demo's report, as plain text a person reads at a glance (pure: data in, str out).

`demo.run` gathers what happened on the cluster into the frozen dataclasses
below; `render(report)` lays it out. Nothing here talks to the API server, the plugin
or the file system, so the layout can be tested and changed on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from dra_driver.sharing.config import quantity_value

_CDI_IDS_SHOWN = 2
_TITLE_WIDTH = 100


@dataclass(frozen=True)
class NodeView:
    name: str
    profile: str
    gpus: int
    product: str
    description: str


@dataclass(frozen=True)
class DeviceView:
    """One allocated device, with what its ResourceSlice says about it."""

    request: str  # "gpu", or "gpu/h200" for a prioritized list
    pool: str
    device: str
    product: str
    memory: str  # the published capacity, e.g. "143771Mi"
    index: int | None
    nvlink_groups: tuple[str, ...]  # values of nvlinkGroup2, nvlinkGroup4, ... ascending size
    nvlink_peers: tuple[int, ...]
    admin_access: bool = False
    in_use_by: tuple[str, ...] = ()  # pods holding the device through an ordinary claim


@dataclass(frozen=True)
class ClaimView:
    name: str
    origin: str  # "template", "claim" or "extended resource"
    devices: tuple[DeviceView, ...]
    cdi_ids: tuple[str, ...] = ()
    prepared_for: str = ""  # the pod whose preparation prepared it (a shared claim: the first one)
    prepare_error: str = ""
    used_by: tuple[str, ...] = ()  # every pod the claim is reserved for


@dataclass(frozen=True)
class PodView:
    namespace: str
    name: str
    node: str | None
    containers: tuple[str, ...]
    claims: tuple[ClaimView, ...] = ()
    pending_reason: str = ""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class ExampleView:
    file: str
    summary: str  # the file's first comment line
    pods: tuple[PodView, ...] = ()
    problems: tuple[str, ...] = ()  # what went wrong applying it, in words


@dataclass(frozen=True)
class DemoReport:
    kubernetes_version: str
    nodes: tuple[NodeView, ...]
    examples: tuple[ExampleView, ...]
    slice_excerpt: str = ""
    slice_excerpt_name: str = ""
    cdi_spec_files: int = 0
    elapsed_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)


def quantity_bytes(quantity: str) -> int | None:
    """Bytes in a Kubernetes quantity string ("80Gi", "143771Mi", "40G"); None if unreadable."""
    value = quantity_value(quantity)
    return None if value is None else int(value)


def gib(quantity: str) -> str:
    """A memory capacity as GiB with one decimal ("143771Mi" -> "140.4 GiB")."""
    n = quantity_bytes(quantity)
    return quantity if n is None else f"{n / 2**30:.1f} GiB"


def all_linked(devices: Sequence[DeviceView]) -> bool | None:
    """Whether every pair of the devices is directly NVLink-linked; None if indexes are unknown."""
    if any(d.index is None for d in devices):
        return None
    peers = {d.index: set(d.nvlink_peers) for d in devices}
    return all(b in peers[a] for a, b in combinations(peers, 2))


def describe_excerpt(text: str, devices_shown: int = 1) -> str:
    """`kubectl describe resourceslice` without its metadata and cut after the first device(s)."""
    lines = text.splitlines()
    spec = next((i for i, line in enumerate(lines) if line.startswith("Spec:")), len(lines))
    tail = next((i for i, line in enumerate(lines) if line.startswith("  Driver:")), len(lines))
    total = sum(1 for line in lines[spec:tail] if line.startswith("    Name:"))
    out: list[str] = []
    section = "head"
    shown = 0
    for line in lines:
        if line.startswith("Metadata:"):
            section = "metadata"
        elif line.startswith("Spec:"):
            section = "spec"
        elif line.startswith("  Driver:"):
            section = "tail"
        if section in ("metadata", "skip"):
            continue
        out.append(line.rstrip())
        if section == "spec" and line.startswith("    Name:"):
            shown += 1
            if shown == devices_shown and total > shown:
                out.append(f"    ... ({total - shown} more devices)")
                section = "skip"
    return "\n".join(out)


def _nvlink_verdict(devices: Sequence[DeviceView]) -> str:
    if len(devices) < 2 or len({d.pool for d in devices}) != 1:
        return ""
    linked = all_linked(devices)
    if linked is None:
        return ""
    indexes = ",".join(str(d.index) for d in devices)
    if linked:
        return f"NVLink: GPUs {indexes} are all directly linked with each other (per their nvlinkPeers)"
    return f"NVLink: GPUs {indexes} are NOT all directly linked with each other"


def _device_line(d: DeviceView) -> str:
    groups = " ".join(d.nvlink_groups) if d.nvlink_groups else "no NVLink group"
    line = f"{d.device:<7} {d.product:<24} {gib(d.memory):>10}   {groups}"
    if d.request and "/" in d.request:
        line += f"   [picked {d.request}]"
    if d.admin_access:
        line += "   [admin access" + (f"; in use by {', '.join(d.in_use_by)}]" if d.in_use_by else "; free]")
    return line


def _claim_lines(claim: ClaimView, pod: PodView) -> list[str]:
    head = f"claim {claim.name} ({claim.origin})"
    others = [p for p in claim.used_by if p != pod.ref]
    if others:
        head += f", shared with {', '.join(others)}"
    lines = [head]
    lines += ["  " + _device_line(d) for d in claim.devices]
    # An admin-access claim takes whatever is there; its NVLink layout means nothing.
    verdict = "" if any(d.admin_access for d in claim.devices) else _nvlink_verdict(claim.devices)
    if verdict:
        lines.append("  " + verdict)
    if claim.prepare_error:
        lines.append(f"  prepare FAILED: {claim.prepare_error}")
    elif claim.cdi_ids:
        if claim.prepared_for and claim.prepared_for != pod.ref:
            lines.append(f"  already prepared for {claim.prepared_for}: the kubelet reuses it, same CDI ids")
        shown = claim.cdi_ids if len(claim.cdi_ids) <= _CDI_IDS_SHOWN + 1 else claim.cdi_ids[:_CDI_IDS_SHOWN]
        lines += [f"  CDI {cdi}" for cdi in shown]
        if len(shown) < len(claim.cdi_ids):
            lines.append(f"  CDI ... and {len(claim.cdi_ids) - len(shown)} more, one per device")
    return lines


def _pod_lines(pod: PodView) -> list[str]:
    if pod.node is None:
        return [f"{pod.ref}: PENDING", f"  scheduler: {pod.pending_reason or '(no reason reported yet)'}"]
    containers = f"containers {', '.join(pod.containers)}" if len(pod.containers) > 1 else ""
    lines = [f"{pod.ref} -> node {pod.node}" + (f"   ({containers})" if containers else "")]
    for claim in pod.claims:
        lines += ["  " + line for line in _claim_lines(claim, pod)]
    if not pod.claims:
        lines.append("  (no claims)")
    return lines


def _section(title: str) -> list[str]:
    return ["", title, "=" * min(len(title), _TITLE_WIDTH)]


def _counts(examples: Iterable[ExampleView]) -> tuple[int, int, int, int]:
    pods = [p for e in examples for p in e.pods]
    bound = sum(1 for p in pods if p.node is not None)
    claims = {c.name: c for p in pods for c in p.claims}
    prepared = sum(1 for c in claims.values() if c.cdi_ids and not c.prepare_error)
    failed = sum(1 for c in claims.values() if c.prepare_error)
    return bound, len(pods) - bound, prepared, failed


def render(report: DemoReport) -> str:
    gpus = sum(n.gpus for n in report.nodes)
    lines = [
        f"GPU DRA driver demo: {len(report.nodes)} simulated nodes, {gpus} GPUs, "
        f"real control plane {report.kubernetes_version} (no kubelets: the demo calls the plugin "
        "as the kubelet would)"
    ]
    lines += _section("Nodes")
    width = max((len(n.name) for n in report.nodes), default=0)
    lines += [f"{n.name:<{width}}  {n.gpus}x {n.product:<24} {n.description}" for n in report.nodes]
    for example in report.examples:
        lines += _section(f"{example.file}: {example.summary}")
        for problem in example.problems:
            lines.append(f"PROBLEM: {problem}")
        for pod in example.pods:
            lines += _pod_lines(pod)
    if report.slice_excerpt:
        lines += _section(f"kubectl describe resourceslice {report.slice_excerpt_name} (excerpt)")
        lines += report.slice_excerpt.rstrip("\n").splitlines()
    bound, pending, prepared, failed = _counts(report.examples)
    pending_pods = [p.ref for e in report.examples for p in e.pods if p.node is None]
    problems = sum(len(e.problems) for e in report.examples)
    lines += _section("Summary")
    lines.append(
        f"{bound} pods bound, {pending} pending"
        + (f" ({', '.join(pending_pods)})" if pending_pods else "")
        + f"; {prepared} claims prepared through the plugin"
        + (f", {failed} failed" if failed else "")
        + f"; {report.cdi_spec_files} CDI spec files written; "
        + (f"{problems} problems" if problems else "no problems")
        + f"; {report.elapsed_s:.1f}s"
    )
    lines += list(report.notes)
    return "\n".join(lines) + "\n"
