"""ComputeDomains: what one domain asks of the cluster, worked out from the domain alone (pure).

A ComputeDomain (`<driver>/v1beta1`, the fields of NVIDIA's `resource.nvidia.com/v1beta1`)
names the ResourceClaimTemplate its workload pods use. `workload_template` is that template:
in the domain's namespace, owned by the domain (the garbage collector deletes it with the
domain), one request for an IMEX channel of the class `compute-domain-default-channel.<driver>`,
configured with the domain's UID and allocation mode. `domain_status` is the domain's
`status.status` from the nodes that joined it (`status.nodes`, one entry per node, written by
the node that prepares a channel): Ready once at least `numNodes` nodes joined and every one is
ready, as NVIDIA's controller says it.

It must not read or write the API server (compute_domain_controller.py does) nor know how a
node joins (the kubelet plugin does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from dra_driver.imex.channels import config_driver, is_channel
from dra_driver.imex.domain import NOT_READY, READY, domain_status, nodes_of, not_ready_nodes
from dra_driver.jsontypes import JSON

VERSION: Final = "v1beta1"
KIND: Final = "ComputeDomain"
CHANNEL_REQUEST: Final = "channel"
CHANNEL_CONFIG_KIND: Final = "ComputeDomainChannelConfig"
SINGLE: Final = "Single"


def channel_driver(driver: str) -> str:
    """The `opaque.driver` of the channel's config (NVIDIA: compute-domain.nvidia.com); the
    channel devices themselves are this driver's (`dra_driver.imex.channels`)."""
    return config_driver(driver)


def channel_class(driver: str) -> str:
    """The DeviceClass of a workload's channel (NVIDIA: compute-domain-default-channel.nvidia.com)."""
    return f"compute-domain-default-channel.{driver}"


def domain_label(driver: str) -> str:
    """The label that ties an object to its domain, valued with the domain's UID."""
    return f"{driver}/computeDomain"


def api_version(driver: str) -> str:
    return f"{driver}/{VERSION}"


def _spec(domain: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = domain.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def template_name(domain: Mapping[str, Any]) -> str:
    channel = _spec(domain).get("channel") or {}
    return str((channel.get("resourceClaimTemplate") or {}).get("name", ""))


def allocation_mode(domain: Mapping[str, Any]) -> str:
    return str((_spec(domain).get("channel") or {}).get("allocationMode") or SINGLE)


def workload_template(domain: Mapping[str, Any], driver: str) -> JSON:
    """The ResourceClaimTemplate that the domain's workload pods name."""
    meta = domain["metadata"]
    parameters = {
        "apiVersion": api_version(driver),
        "kind": CHANNEL_CONFIG_KIND,
        "domainID": meta["uid"],
        "allocationMode": allocation_mode(domain),
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": template_name(domain),
            "namespace": meta["namespace"],
            "labels": {domain_label(driver): meta["uid"]},
            "ownerReferences": [owner_reference(domain, driver)],
        },
        "spec": {
            # copied onto each claim made from it: the controller finds the domain's claims by it
            "metadata": {"labels": {domain_label(driver): meta["uid"]}},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": CHANNEL_REQUEST, "exactly": {"deviceClassName": channel_class(driver)}}
                    ],
                    "config": [
                        {
                            "requests": [CHANNEL_REQUEST],
                            "opaque": {"driver": channel_driver(driver), "parameters": parameters},
                        }
                    ],
                }
            }
        },
    }


def owner_reference(domain: Mapping[str, Any], driver: str) -> JSON:
    meta = domain["metadata"]
    return {
        "apiVersion": api_version(driver),
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_by(obj: Mapping[str, Any], domain: Mapping[str, Any]) -> bool:
    """Whether `obj` is the domain's own (its controller reference names the domain's UID)."""
    uid = domain["metadata"]["uid"]
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def claim_nodes(claims: Sequence[Mapping[str, Any]], driver: str) -> dict[str, frozenset[str]]:
    """Domain UID -> the nodes where a channel claim of the domain is allocated (the claims
    carry the domain's label, from its template; the pool of a channel is its node)."""
    out: dict[str, set[str]] = {}
    for claim in claims:
        uid = ((claim.get("metadata") or {}).get("labels") or {}).get(domain_label(driver))
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if uid and result.get("driver") == driver and is_channel(str(result.get("device", ""))):
                out.setdefault(str(uid), set()).add(str(result.get("pool")))
    return {uid: frozenset(nodes) for uid, nodes in out.items()}


def down_nodes(nodes: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The nodes whose Ready condition is there and not True (the node lifecycle controller
    says so once a kubelet stops reporting)."""
    down = set()
    for node in nodes:
        for condition in (node.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "Ready" and condition.get("status") != "True":
                down.add(str((node.get("metadata") or {}).get("name")))
    return frozenset(down)


@dataclass(frozen=True)
class Membership:
    """What the domain's entries should become: `stale` entries (their node holds no channel
    claim of the domain any more: its pod went while the node could not unprepare) are
    removed; `down` entries (their node stopped reporting) read NotReady."""

    stale: tuple[str, ...]
    down: tuple[str, ...]


def membership(domain: Mapping[str, Any], holding: frozenset[str], down: frozenset[str]) -> Membership:
    entries = [n for n in nodes_of(domain)]
    names = [str(n.get("name")) for n in entries]
    stale = tuple(n for n in names if n not in holding)
    down_ready = tuple(str(n.get("name")) for n in entries
                       if n.get("name") in down and n.get("name") in holding and n.get("status") != NOT_READY)
    return Membership(stale, down_ready)


__all__ = [
    "CHANNEL_REQUEST",
    "KIND",
    "NOT_READY",
    "READY",
    "Membership",
    "allocation_mode",
    "api_version",
    "channel_class",
    "channel_driver",
    "claim_nodes",
    "domain_label",
    "domain_status",
    "down_nodes",
    "membership",
    "nodes_of",
    "not_ready_nodes",
    "owned_by",
    "owner_reference",
    "template_name",
    "workload_template",
]
