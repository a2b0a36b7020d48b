"""A ComputeDomain as one node sees it: whether it is ready, and this node's entry in its
`status.nodes`. Pure: the domain comes in as the API server's JSON.

A domain is Ready once at least `spec.numNodes` nodes joined and every joined node is ready
(NVIDIA's rule). Each node writes its own entry (`name`, `ipAddress`, `cliqueID`, `index`,
`status`); `index` is the lowest free one in the node's clique and keeps the node's daemon
name stable while the node stays in the domain. A domain never spans two cliques: NVLink
does not reach across them.

It must not read or write the API server (the plugin's channel gate does), nor decide when a
daemon starts (`daemons` does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from dra_driver.jsontypes import JSON

READY: Final = "Ready"
NOT_READY: Final = "NotReady"


def nodes_of(domain: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    nodes = (domain.get("status") or {}).get("nodes") or []
    return [n for n in nodes if isinstance(n, Mapping)]


def num_nodes(domain: Mapping[str, Any]) -> int:
    spec = domain.get("spec") or {}
    return int(spec.get("numNodes") or 0) if isinstance(spec, Mapping) else 0


def domain_status(domain: Mapping[str, Any]) -> str:
    """Ready once at least numNodes nodes joined and each of them is ready; else NotReady."""
    nodes = nodes_of(domain)
    if len(nodes) < num_nodes(domain) or any(n.get("status") != READY for n in nodes):
        return NOT_READY
    return READY


def not_ready_nodes(domain: Mapping[str, Any]) -> list[str]:
    """The nodes of the domain that are not ready, by name: what a NotReady domain waits for."""
    return sorted(str(n.get("name")) for n in nodes_of(domain) if n.get("status") != READY)


def waiting_for(domain: Mapping[str, Any]) -> str | None:
    """What a workload pod of the domain still waits for, in words; None once the domain is Ready."""
    if domain_status(domain) == READY:
        return None
    nodes = nodes_of(domain)
    parts = []
    if len(nodes) < num_nodes(domain):
        parts.append(f"{len(nodes)} of spec.numNodes {num_nodes(domain)} nodes have joined")
    pending = not_ready_nodes(domain)
    if pending:
        parts.append("the IMEX daemon is not ready on " + ", ".join(pending[:5])
                     + (f" and {len(pending) - 5} more" if len(pending) > 5 else ""))
    return "; ".join(parts)


@dataclass(frozen=True)
class NodeEntry:
    """One node's entry in `status.nodes`."""

    name: str
    ip_address: str
    clique_id: str
    index: int
    status: str

    def to_json(self) -> JSON:
        return {"name": self.name, "ipAddress": self.ip_address, "cliqueID": self.clique_id,
                "index": self.index, "status": self.status}


def entry_of(domain: Mapping[str, Any], node: str) -> Mapping[str, Any] | None:
    return next((n for n in nodes_of(domain) if n.get("name") == node), None)


def clique_refusal(domain: Mapping[str, Any], node: str, clique: str) -> str | None:
    """Why `node` (in `clique`) cannot join the domain: it has nodes of another clique."""
    others = sorted({str(n.get("cliqueID")) for n in nodes_of(domain)
                     if n.get("name") != node and n.get("cliqueID") != clique})
    if not others:
        return None
    holders = sorted(str(n.get("name")) for n in nodes_of(domain) if n.get("cliqueID") == others[0])
    return (f"node {node} is in NVLink clique {clique}, but the domain's nodes {', '.join(holders[:3])} "
            f"are in clique {others[0]}: a ComputeDomain cannot span two cliques (NVLink does not reach "
            "across them); keep the job's pods on one clique, e.g. with a matchAttribute on cliqueID "
            "across the job's GPU claims")


def own_entry(domain: Mapping[str, Any], node: str, ip: str, clique: str, ready: bool) -> NodeEntry:
    """This node's entry: its index kept if it has one, else the lowest free one of its clique."""
    found = entry_of(domain, node)
    if found is not None and isinstance(found.get("index"), int):
        index = int(found["index"])
    else:
        taken = {n.get("index") for n in nodes_of(domain) if n.get("cliqueID") == clique}
        index = next(i for i in range(len(taken) + 1) if i not in taken)
    return NodeEntry(node, ip, clique, index, READY if ready else NOT_READY)


def with_entry(domain: Mapping[str, Any], entry: NodeEntry) -> JSON:
    """The domain as it reads once `entry` is written (to judge readiness without a re-read)."""
    nodes = [dict(n) for n in nodes_of(domain) if n.get("name") != entry.name] + [entry.to_json()]
    return {**domain, "status": {**(domain.get("status") or {}), "nodes": nodes}}


def peer_addresses(domain: Mapping[str, Any], clique: str) -> list[str]:
    """The IMEX peers of a node of `clique`: every joined node's address there, by index."""
    same = [n for n in nodes_of(domain) if n.get("cliqueID") == clique and n.get("ipAddress")]
    return [str(n["ipAddress"]) for n in sorted(same, key=lambda n: int(n.get("index") or 0))]


def find_domain(domains: Sequence[Mapping[str, Any]], uid: str) -> Mapping[str, Any] | None:
    return next((d for d in domains if (d.get("metadata") or {}).get("uid") == uid), None)


__all__ = [
    "NOT_READY",
    "READY",
    "NodeEntry",
    "clique_refusal",
    "domain_status",
    "entry_of",
    "find_domain",
    "not_ready_nodes",
    "own_entry",
    "peer_addresses",
    "waiting_for",
    "with_entry",
]
