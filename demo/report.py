"""The demo's report, as plain text a person reads at a glance (pure: data in, str out).

`demo.run` gathers what happened on the cluster into the frozen dataclasses below: per
pod what the scheduler allocated and, per container, what the kubelet reports and what
the container itself listed (`ls -l /dev/nvidia*`, read back from its log);
`render(report)` lays it out. Nothing here talks to the API server, a kubelet or the file
system, so the layout can be tested and changed on its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from dra_driver.sharing.config import quantity_value

_CDI_IDS_SHOWN = 2
_TITLE_WIDTH = 100
# busybox `ls -l`: "crw-rw-rw-    1 root     root      195,   4 Dec  3 06:37 /dev/nvidia4"
_LS_DEVICE = re.compile(r"^c\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s+(\d+)\s.*\s(/dev/nvidia\S*)$")
_GPU_NODE = re.compile(r"/dev/nvidia\d+")


@dataclass(frozen=True)
class NodeView:
    name: str
    profile: str
    gpus: int
    product: str
    description: str
    runtime: str = ""  # "kubelet v1.37.2, containerd://2.4.2", from the Node's status


@dataclass(frozen=True)
class DeviceView:
    """One allocated device, with what its ResourceSlice says about it."""

    request: str  # "gpu", or "gpus/layer0" for a prioritized list
    pool: str
    device: str
    product: str
    memory: str  # the published capacity, e.g. "143771Mi"
    index: int | None
    minor: int | None
    nvlink_cliques: tuple[str, ...]  # "nvlinkClique0=0-1-2-3", ... by layer
    nvlink_domain: str  # the nvlinkDomain value, "" where the GPU has none
    nvlink_peers: tuple[int, ...]
    admin_access: bool = False
    in_use_by: tuple[str, ...] = ()  # pods holding the device through an ordinary claim


@dataclass(frozen=True)
class ClaimView:
    name: str
    origin: str  # "template", "claim" or "extended resource"
    devices: tuple[DeviceView, ...]
    used_by: tuple[str, ...] = ()  # every pod the claim is reserved for


@dataclass(frozen=True)
class DeviceNode:
    path: str
    major: int
    minor: int


def listed_devices(listing: Iterable[str]) -> tuple[DeviceNode, ...]:
    """The device nodes in `ls -l` output lines."""
    found = []
    for line in listing:
        m = _LS_DEVICE.match(line.strip())
        if m:
            found.append(DeviceNode(m.group(3), int(m.group(1)), int(m.group(2))))
    return tuple(found)


@dataclass(frozen=True)
class ContainerView:
    name: str
    state: str  # "Running", else the kubelet's waiting/terminated reason and message
    allocated: tuple[DeviceView, ...]  # what the scheduler gave this container (its claim requests)
    cdi: tuple[tuple[str, str], ...] = ()  # (CDI id, health) from the kubelet's allocatedResourcesStatus
    listing: tuple[str, ...] = ()  # the container's own `ls -l /dev/nvidia*`, from its log
    log_error: str = ""

    @property
    def seen_minors(self) -> tuple[int, ...]:
        """Minors of the per-GPU nodes (/dev/nvidiaN) the container listed, not the control nodes."""
        return tuple(sorted(d.minor for d in listed_devices(self.listing) if _GPU_NODE.fullmatch(d.path)))

    @property
    def allocated_minors(self) -> tuple[int, ...] | None:
        minors = [d.minor for d in self.allocated]
        return None if any(m is None for m in minors) else tuple(sorted({m for m in minors if m is not None}))

    @property
    def sees_exactly_its_gpus(self) -> bool:
        return bool(self.listing) and self.seen_minors == self.allocated_minors


@dataclass(frozen=True)
class PodView:
    namespace: str
    name: str
    node: str | None
    phase: str
    containers: tuple[ContainerView, ...] = ()
    claims: tuple[ClaimView, ...] = ()
    pending_reason: str = ""  # the scheduler's, or the kubelet's newest warning

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def running(self) -> bool:
        return self.phase == "Running" and all(c.state == "Running" for c in self.containers)


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
    expected_pending: tuple[str, ...] = ()  # namespace/name of the pods meant to stay pending
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
    """Whether every pair of the devices is directly NVLink-linked; None if indexes are unknown.

    A pair is linked when one lists the other as a peer (the claim's status, or the slice's
    nvlinkPeers with --topology-detail-attributes) or both are in one group of a clique layer."""
    if any(d.index is None for d in devices):
        return None

    def linked(a: DeviceView, b: DeviceView) -> bool:
        return b.index in a.nvlink_peers or a.index in b.nvlink_peers or bool(
            set(a.nvlink_cliques) & set(b.nvlink_cliques))

    return all(linked(a, b) for a, b in combinations(devices, 2))


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


def first_sentence(text: str) -> str:
    return text.split(". ", 1)[0].rstrip(".")


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
    links = list(d.nvlink_cliques) + ([f"nvlinkDomain={d.nvlink_domain}"] if d.nvlink_domain else [])
    line = f"{d.device:<7} {d.product:<24} {gib(d.memory):>10}   {' '.join(links) or 'no NVLink'}"
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
    return lines


def _container_verdict(c: ContainerView) -> str:
    if c.sees_exactly_its_gpus:
        devices = " ".join(sorted({d.device for d in c.allocated}, key=lambda d: (len(d), d)))
        return f"= exactly the allocated GPUs, by minor number: {devices}"
    seen = " ".join(f"/dev/nvidia{m}" for m in c.seen_minors) or "no GPU"
    expected = c.allocated_minors
    wanted = "unknown minors" if expected is None else " ".join(f"/dev/nvidia{m}" for m in expected)
    return f"MISMATCH: allocated {wanted or 'no GPU'}, the container lists {seen}"


def _container_lines(c: ContainerView) -> list[str]:
    if c.state != "Running":
        return [f"container {c.name}: {c.state}"]
    health = "/".join(sorted({h for _, h in c.cdi}))
    # The kubelet's allocatedResourcesStatus: the CDI ids it passed to containerd, with the
    # health the plugin streams (it has none for an extended-resource claim).
    kubelet = f"; kubelet: {len(c.cdi)} CDI device(s), {health}" if c.cdi else ""
    lines = [f"container {c.name}: Running{kubelet}"]
    ids = [cdi for cdi, _ in c.cdi]
    shown = ids if len(ids) <= _CDI_IDS_SHOWN + 1 else ids[:_CDI_IDS_SHOWN]
    lines += [f"  CDI {cdi}" for cdi in shown]
    if len(shown) < len(ids):
        lines.append(f"  CDI ... and {len(ids) - len(shown)} more, one per device")
    if c.log_error:
        lines.append(f"  its log could not be read: {c.log_error}")
        return lines
    lines.append("  $ ls -l /dev/nvidia*        (run by the container itself; kubectl logs)")
    lines += [f"  {line}" for line in c.listing] or ["  (nothing listed)"]
    lines.append("  " + _container_verdict(c))
    return lines


def _pod_lines(pod: PodView) -> list[str]:
    if pod.node is None:
        return [f"{pod.ref}: {pod.phase}", f"  scheduler: {pod.pending_reason or '(no reason reported yet)'}"]
    lines = [f"{pod.ref} -> node {pod.node}: {pod.phase}"]
    if not pod.running and pod.pending_reason:
        lines.append(f"  {pod.pending_reason}")
    for claim in pod.claims:
        lines += ["  " + line for line in _claim_lines(claim, pod)]
    if not pod.claims:
        lines.append("  (no claims)")
    for container in pod.containers:
        lines += ["  " + line for line in _container_lines(container)]
    return lines


def _section(title: str) -> list[str]:
    return ["", title, "=" * min(len(title), _TITLE_WIDTH)]


@dataclass(frozen=True)
class Counts:
    pods: int
    running: tuple[PodView, ...]
    not_running: tuple[PodView, ...]
    claims_prepared: int  # distinct allocated claims of running pods: the kubelets had them prepared
    containers: int
    containers_exact: int
    problems: int  # rejected objects, pods not running that should, containers that see the wrong GPUs

    @property
    def ok(self) -> bool:
        return self.problems == 0


def counts(report: DemoReport) -> Counts:
    pods = [p for e in report.examples for p in e.pods]
    running = tuple(p for p in pods if p.running)
    not_running = tuple(p for p in pods if not p.running)
    claims = {c.name for p in running for c in p.claims if c.devices}
    containers = [c for p in running for c in p.containers if c.allocated]
    exact = sum(1 for c in containers if c.sees_exactly_its_gpus)
    unexpected = [p for p in not_running if p.ref not in report.expected_pending]
    rejected = sum(len(e.problems) for e in report.examples)
    return Counts(
        pods=len(pods),
        running=running,
        not_running=not_running,
        claims_prepared=len(claims),
        containers=len(containers),
        containers_exact=exact,
        problems=rejected + len(unexpected) + len(containers) - exact,
    )


def render(report: DemoReport) -> str:
    gpus = sum(n.gpus for n in report.nodes)
    lines = [
        f"GPU DRA driver demo: {len(report.nodes)} simulated nodes, {gpus} GPUs, real control plane "
        f"{report.kubernetes_version}, a real kubelet + containerd + runc per node"
    ]
    lines += _section("Nodes")
    width = max((len(n.name) for n in report.nodes), default=0)
    for n in report.nodes:
        lines.append(f"{n.name:<{width}}  {n.gpus}x {n.product:<24} {n.description}")
        if n.runtime:
            lines.append(f"{'':<{width}}  {n.runtime}")
    for example in report.examples:
        lines += _section(f"{example.file}: {example.summary}")
        for problem in example.problems:
            lines.append(f"PROBLEM: {problem}")
        for pod in example.pods:
            lines += _pod_lines(pod)
    if report.slice_excerpt:
        lines += _section(f"kubectl describe resourceslice {report.slice_excerpt_name} (excerpt)")
        lines += report.slice_excerpt.rstrip("\n").splitlines()
    c = counts(report)

    def listed(pods: Iterable[PodView]) -> str:
        return ", ".join(
            f"{p.ref} {p.phase}" + (f": {first_sentence(p.pending_reason)}" if p.pending_reason else "")
            for p in pods
        )

    expected = [p for p in c.not_running if p.ref in report.expected_pending]
    unexpected = [p for p in c.not_running if p.ref not in report.expected_pending]
    parts = [f"{c.pods} pods: {len(c.running)} Running"]
    if expected:
        parts[0] += f", {len(expected)} Pending on purpose ({listed(expected)})"
    if unexpected:
        parts[0] += f", {len(unexpected)} NOT Running ({listed(unexpected)})"
    parts += [
        f"{c.claims_prepared} claims prepared by the kubelets through the plugin "
        f"({report.cdi_spec_files} CDI spec files)",
        f"{c.containers_exact} of {c.containers} GPU containers list exactly their allocated GPUs",
        f"{c.problems} problems" if c.problems else "no problems",
        f"{report.elapsed_s:.1f}s",
    ]
    lines += _section("Summary")
    lines.append("; ".join(parts))
    lines += list(report.notes)
    return "\n".join(lines) + "\n"
