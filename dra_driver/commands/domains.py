"""ComputeDomains as the read-only commands show them: for `kubectl gpu NODE`, the node's IMEX
channel (who holds it, for which domain) and the domains the node is in; for `kubectl gpu why
POD`, each channel claim of the pod, its domain and what the pod waits for (the domain's nodes
still to join or become ready, the domain deleted, the pod's node in another NVLink clique
than the domain's nodes, or no node publishing a channel).

A channel claim names its domain by UID in its `ComputeDomainChannelConfig` (`domainID`), in
the claim's namespace. `domains` is None where the API server does not serve ComputeDomains
(the CRD is not installed): nothing is said about domains then. Readiness and the waiting
text are `dra_driver.imex.domain`'s, the rules the channel Prepare holds a pod by.

Pure: API objects as JSON in, frozen dataclasses and text out. It must NOT read the API
server (status.py and why.py do), and must not judge GPU claims (dra_driver.explain does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from dra_driver.imex.domain import (
    NOT_READY,
    clique_refusal,
    domain_status,
    entry_of,
    find_domain,
    nodes_of,
    not_ready_nodes,
    num_nodes,
    waiting_for,
)
from dra_driver.jsontypes import JSON

if TYPE_CHECKING:
    from dra_driver.explain.why import PodClaim, PodReport

MISSING: Final = "missing"
UNKNOWN: Final = "unknown"  # ComputeDomains not served
NOT_JOINED: Final = "not joined"
# dra_driver.imex.channels' and controller.compute_domains' names, written again here because
# importing those modules loads the GPU discovery code (NVML bindings): a third of the CPU of
# a `why` run; tests/unit/test_domain_views.py checks that they agree.
CHANNEL_TYPE: Final = "channel"
CONFIG_KIND: Final = "ComputeDomainChannelConfig"
CONFIG_PREFIX: Final = "compute-domain."  # the channel config's driver: compute-domain.<driver>
VERSION: Final = "v1beta1"


def api_version(driver: str) -> str:
    return f"{driver}/{VERSION}"


@dataclass(frozen=True)
class DomainRef:
    """The domain a channel claim asks to join."""

    driver: str
    uid: str


def domain_ref(claim: Mapping[str, Any] | None, spec: Mapping[str, Any] | None = None) -> DomainRef | None:
    """The domain of a channel claim (its spec's config, or the allocation's where the class
    gave it), or of a claim not created yet from its template's `spec`; None: no channel claim."""
    sources: list[Any] = []
    if claim is not None:
        sources.append(((claim.get("spec") or {}).get("devices") or {}).get("config"))
        allocation = (claim.get("status") or {}).get("allocation") or {}
        sources.append((allocation.get("devices") or {}).get("config"))
    if spec is not None:
        sources.append((spec.get("devices") or {}).get("config"))
    for config in sources:
        for item in config if isinstance(config, list) else []:
            opaque = item.get("opaque") if isinstance(item, Mapping) else None
            if not isinstance(opaque, Mapping):
                continue
            driver = str(opaque.get("driver") or "")
            parameters = opaque.get("parameters")
            if (driver.startswith(CONFIG_PREFIX) and isinstance(parameters, Mapping)
                    and parameters.get("kind") == CONFIG_KIND and parameters.get("domainID")):
                return DomainRef(driver.removeprefix(CONFIG_PREFIX), str(parameters["domainID"]))
    return None


def domains_path(driver: str, namespace: str | None = None) -> str:
    """Where the API server serves the driver's ComputeDomains (all namespaces, or one)."""
    where = f"/namespaces/{namespace}" if namespace else ""
    return f"/apis/{api_version(driver)}{where}/computedomains"


def _attr(device: Mapping[str, Any], name: str) -> Any:
    value = (device.get("attributes") or {}).get(name) or {}
    return next((value[k] for k in ("string", "int") if k in value), None)


def channel_cliques(slices: Sequence[JSON], driver: str) -> dict[str, str]:
    """Node -> the NVLink clique of the IMEX channel it publishes (nodes without one left out)."""
    found: dict[str, str] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != driver or not spec.get("nodeName"):
            continue
        for device in spec.get("devices") or []:
            if _attr(device, "type") == CHANNEL_TYPE:
                found[str(spec["nodeName"])] = str(_attr(device, "cliqueID") or "")
    return found


def _name(domain: Mapping[str, Any]) -> str:
    meta = domain.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _joined(domain: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(f"{n.get('name')} ({n.get('status') or NOT_READY})"
                 for n in sorted(nodes_of(domain), key=lambda n: str(n.get("name"))))


def _entry_status(domain: Mapping[str, Any], node: str | None) -> str:
    entry = entry_of(domain, node) if node else None
    if entry is None:
        return NOT_JOINED if node else "-"
    return str(entry.get("status") or NOT_READY)


# --------------------------------------------------------------------------- kubectl gpu NODE


@dataclass(frozen=True)
class ChannelRow:
    """The node's IMEX channel and who holds it."""

    device: str
    clique: str
    claim: str | None = None  # namespace/name of the channel claim allocated here
    pods: tuple[str, ...] = ()  # "namespace/name" the claim is reserved for
    domain: str | None = None  # namespace/name; "UID <uid> (missing)"; None: not known


@dataclass(frozen=True)
class DomainRow:
    """A ComputeDomain that holds the node's channel or lists the node in status.nodes."""

    domain: str  # namespace/name
    uid: str
    status: str  # Ready | NotReady, by the rule the channel Prepare waits on
    num_nodes: int
    joined: int
    this_node: str  # this node's entry: Ready | NotReady | not joined
    waiting_for: str | None  # None once Ready


def node_channels(node: str, driver: str, slices: Sequence[JSON], claims: Sequence[JSON],
                  domains: Sequence[JSON] | None) -> tuple[tuple[ChannelRow, ...], tuple[DomainRow, ...]]:
    """The node's channels (from its slices) with their holders and domains, and the domains
    that hold a channel of the node or list the node; no domain at all where `domains` is None."""
    pools = {s["spec"]["pool"]["name"] for s in slices if s["spec"].get("driver") == driver}
    channels = {str(d["name"]): str(_attr(d, "cliqueID") or "-")
                for s in slices if s["spec"].get("driver") == driver
                for d in s["spec"].get("devices") or [] if _attr(d, "type") == CHANNEL_TYPE}
    rows: list[ChannelRow] = []
    held_by: set[str] = set()  # domain UIDs of the channels' claims
    holders: dict[str, list[JSON]] = {}
    if channels:
        for claim in claims:
            allocation = (claim.get("status") or {}).get("allocation") or {}
            for r in (allocation.get("devices") or {}).get("results") or []:
                if r.get("driver") == driver and r.get("pool") in pools and r.get("device") in channels:
                    holders.setdefault(str(r["device"]), []).append(claim)
    for device, clique in sorted(channels.items()):
        if not holders.get(device):
            rows.append(ChannelRow(device, clique))
        for claim in holders.get(device, []):
            meta = claim["metadata"]
            reserved = (claim.get("status") or {}).get("reservedFor") or []
            pods = tuple(f"{meta['namespace']}/{r.get('name')}" for r in reserved
                         if r.get("resource") == "pods")
            ref = domain_ref(claim)
            shown = None
            if ref is not None and domains is not None:
                held_by.add(ref.uid)
                found = find_domain(domains, ref.uid)
                shown = _name(found) if found is not None else f"UID {ref.uid} ({MISSING})"
            rows.append(ChannelRow(device, clique, f"{meta['namespace']}/{meta['name']}", pods, shown))
    mine = [d for d in domains or []
            if (d.get("metadata") or {}).get("uid") in held_by or entry_of(d, node) is not None]
    domain_rows = tuple(DomainRow(_name(d), str(d["metadata"].get("uid", "")), domain_status(d), num_nodes(d),
                                  len(nodes_of(d)), _entry_status(d, node), waiting_for(d))
                        for d in sorted(mine, key=_name))
    return tuple(rows), domain_rows


# --------------------------------------------------------------------------- kubectl gpu why POD


@dataclass(frozen=True)
class DomainReport:
    """One channel claim of a pod and its domain."""

    pod_claim: str  # the name in pod.spec.resourceClaims
    claim: str | None  # namespace/name; None: not created yet
    domain: str  # namespace/name; the UID where the domain is missing
    uid: str
    status: str  # Ready | NotReady | missing | unknown (ComputeDomains not served)
    num_nodes: int
    joined: tuple[str, ...]  # "node (Ready)", by name
    not_ready: tuple[str, ...]
    node: str | None  # the node of the pod (bound) or of its channel (allocated)
    node_entry: str  # that node's entry: Ready | NotReady | not joined; "-" without a node
    waits_for: str | None  # what keeps the pod from starting because of the domain; None: nothing


def _allocated_node(claim: Mapping[str, Any] | None) -> str | None:
    allocation = ((claim or {}).get("status") or {}).get("allocation") or {}
    values = {v for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []
              for f in term.get("matchFields") or [] for v in f.get("values") or []}
    return next(iter(values)) if len(values) == 1 else None


def _no_channel(driver: str) -> str:
    return ("no node publishes an IMEX channel, so the channel claim cannot be allocated: no node's GPUs "
            "are all in one multi-node NVLink clique, or the kubelet plugin runs without --compute-domains "
            f"(chart: computeDomains.enabled=true; driver {driver})")


def _report(pc: PodClaim, ref: DomainRef, namespace: str, pod_node: str | None,
            domains: Sequence[JSON] | None, cliques: Mapping[str, str]) -> DomainReport:
    claim = pc.claim
    name = f"{claim['metadata']['namespace']}/{claim['metadata']['name']}" if claim else None
    allocated = bool(((claim or {}).get("status") or {}).get("allocation"))
    node = pod_node or _allocated_node(claim)
    base = DomainReport(pc.pod_claim, name, f"UID {ref.uid}", ref.uid, UNKNOWN, 0, (), (), node, "-", None)
    if domains is None:
        return replace(base, waits_for=(
            f"ComputeDomains ({api_version(ref.driver)}) are not served by this cluster: the driver's "
            "ComputeDomain CRD is not installed (chart: computeDomains.enabled=true)"))
    domain = find_domain(domains, ref.uid)
    if domain is None:
        return replace(base, status=MISSING, waits_for=(
            f"its ComputeDomain (UID {ref.uid}) does not exist in namespace {namespace}: it was deleted, and "
            "its ResourceClaimTemplate with it; this pod can never start: delete it (and its job), or create "
            "the domain again and recreate the pod (a new domain has a new UID)"))
    report = replace(base, domain=_name(domain), status=domain_status(domain), num_nodes=num_nodes(domain),
                     joined=_joined(domain), not_ready=tuple(not_ready_nodes(domain)),
                     node_entry=_entry_status(domain, node))
    if not allocated and node is None:
        return replace(report, waits_for=None if cliques else _no_channel(ref.driver))
    clique = cliques.get(node or "")
    refusal = clique_refusal(domain, node, clique) if node and clique else None
    if refusal:
        return replace(report, waits_for=f"its node cannot join the domain: {refusal}")
    if node and not clique and not allocated:
        return replace(report, waits_for=f"node {node} publishes no IMEX channel: " + _no_channel(ref.driver))
    waiting = waiting_for(domain)
    if waiting and report.node_entry == NOT_JOINED:
        waiting += f"; node {node} has not joined yet (its kubelet plugin joins at the channel's Prepare)"
    return replace(report, waits_for=waiting)


def domain_reports(pod: JSON, pod_claims: Sequence[PodClaim], domains: Sequence[JSON] | None,
                   slices: Sequence[JSON]) -> tuple[DomainReport, ...]:
    """Each channel claim of the pod with its domain; `domains`: the pod's namespace's, None
    where ComputeDomains are not served."""
    namespace = str((pod.get("metadata") or {}).get("namespace", ""))
    pod_node = (pod.get("spec") or {}).get("nodeName")
    refs = [(pc, domain_ref(pc.claim, pc.template_spec)) for pc in pod_claims]
    found = [(pc, ref) for pc, ref in refs if ref is not None]
    if not found:
        return ()
    cliques = channel_cliques(slices, found[0][1].driver)
    return tuple(_report(pc, ref, namespace, pod_node, domains, cliques) for pc, ref in found)


def with_domains(report: PodReport, domains: Sequence[DomainReport]) -> PodReport:
    """The pod's headline says what it waits for when its domain is what holds it."""
    waiting = next((d for d in domains if d.waits_for), None)
    if waiting is None:
        return report
    where = f" is bound to node {report.node} and" if report.node else ""
    return replace(report, headline=f"pod {report.pod}{where} waits for ComputeDomain {waiting.domain}: "
                                    f"{waiting.waits_for}")


def render_why(domains: Sequence[DomainReport]) -> list[str]:
    lines: list[str] = []
    for d in domains:
        known = d.status not in (MISSING, UNKNOWN)
        lines.append(f"ComputeDomain {d.domain} (claim {d.pod_claim}): {d.status}"
                     + (f", numNodes {d.num_nodes}, {len(d.joined)} joined" if known else ""))
        if d.joined:
            lines.append(f"  joined: {', '.join(d.joined)}")
        if d.not_ready:
            lines.append(f"  not ready: {', '.join(d.not_ready)}")
        if d.node:
            lines.append(f"  the pod's node {d.node}: {d.node_entry}")
        if d.waits_for:
            lines.append(f"  waits for: {d.waits_for}")
    return lines


__all__ = [
    "ChannelRow",
    "DomainRef",
    "DomainReport",
    "DomainRow",
    "channel_cliques",
    "domain_ref",
    "domain_reports",
    "domains_path",
    "node_channels",
    "render_why",
    "with_domains",
]
