"""What a claim's `status.devices` entries and its `gpu_dra_device_claim_info` series say
about each device prepared here (KEP-4817): the facts taken from the claim object, the
entry's `data` and `Ready` condition, the server-side apply body, the field manager, the
series' labels.

Pure: the queue that writes them (claim_status.py) does the I/O. It must NOT call the API
server, touch metrics or keep state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, NamedTuple

from dra_driver.devices import NodeDevice, gpu_device_name
from dra_driver.gpu.model import Inventory
from dra_driver.gpu.topology import nvlink_topology
from dra_driver.health.effects import DeviceView
from dra_driver.jsontypes import JSON
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.prepared import PreparedDevice

MAX_FIELD_MANAGER: Final = 128  # the API server's limit
READY: Final = "Ready"


@dataclass(frozen=True)
class Holder:
    """A pod a claim is reserved for."""

    namespace: str
    name: str


@dataclass(frozen=True)
class ClaimFacts:
    """What a write needs from the claim object: the pods it is reserved for and, per
    memory share prepared here, the capacity it consumes (keyed by pool, device, share id)."""

    pods: tuple[Holder, ...]
    consumed: Mapping[tuple[str, str, str | None], JSON]


class InfoLabels(NamedTuple):
    """One `gpu_dra_device_claim_info` series: its label values, in the metric's label order."""

    device: str
    uuid: str
    pci_bus_id: str
    claim_namespace: str
    claim_name: str
    claim_uid: str
    pod_namespace: str
    pod_name: str


def field_manager(driver: str, node: str) -> str:
    """One manager per driver and node; a name over the API server's 128 characters is
    shortened with a hash of the whole, so that two long node names stay apart."""
    name = f"{driver}/{node}"
    if len(name) <= MAX_FIELD_MANAGER:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return f"{name[: MAX_FIELD_MANAGER - 13]}-{digest}"


def nvlink_peers(inventory: Inventory, devices: Mapping[str, NodeDevice]) -> dict[str, list[JSON]]:
    """Each device's NVLink peers (those of its physical GPU), as `{gpu, uuid}`: the name the
    slices use and the UUID nvidia-smi and DCGM show."""
    topology = nvlink_topology(inventory)
    by_index = {g.index: g for g in inventory.gpus}
    peers: dict[str, list[JSON]] = {}
    for name, device in devices.items():
        indices = topology.gpu(device.gpu.index).peers
        peers[name] = [{"gpu": gpu_device_name(by_index[i]), "uuid": by_index[i].uuid} for i in indices]
    return peers


def holders(claim: JSON) -> tuple[Holder, ...]:
    """The pods in the claim's `reservedFor` (the kubelet prepares only for those)."""
    namespace = claim.get("metadata", {}).get("namespace", "")
    return tuple(
        Holder(namespace, c["name"])
        for c in (claim.get("status") or {}).get("reservedFor") or []
        if c.get("resource") == "pods" and not c.get("apiGroup") and c.get("name")
    )


def _consumed(claim: JSON, driver: str, pool: str, device: str, share_id: str | None) -> JSON:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    for r in (allocation.get("devices") or {}).get("results") or []:
        if (r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID")) == (
            driver, pool, device, share_id
        ):
            consumed: JSON = r.get("consumedCapacity") or {}
            return consumed
    return {}


def claim_facts(claim: JSON, driver: str, devices: Sequence[PreparedDevice]) -> ClaimFacts:
    """The part of `claim` the writes use, so that the queue never holds a whole claim."""
    consumed: dict[tuple[str, str, str | None], JSON] = {}
    for d in devices:
        if d.share_id is not None:
            consumed[(d.pool, d.device, d.share_id)] = _consumed(claim, driver, d.pool, d.device, d.share_id)
    return ClaimFacts(holders(claim), consumed)


def device_data(
    node_device: NodeDevice, prepared: PreparedDevice, peers: Sequence[JSON], consumed: JSON
) -> JSON:
    """The `data` of one entry: what nvidia-smi and DCGM call this device."""
    gpu = node_device.gpu
    data: JSON = {
        "uuid": node_device.uuid,
        "pciBusID": gpu.pci_bus_id,
        "minor": gpu.minor,
        "product": gpu.product_name,
        "memoryBytes": gpu.memory_bytes,
        "nvlinkPeers": list(peers),
    }
    if node_device.mig is not None:
        mig = node_device.mig
        data["mig"] = {
            "profile": mig.profile,
            "parentUUID": gpu.uuid,
            "gpuInstanceID": mig.gpu_instance_id,
            "computeInstanceID": mig.compute_instance_id,
            "memoryBytes": mig.memory_bytes,
            "multiprocessors": mig.multiprocessors,
        }
    if prepared.share_id is not None:
        data["share"] = {"shareID": prepared.share_id, "consumedCapacity": consumed}
    return data


def ready_condition(view: DeviceView | None, since: datetime) -> JSON:
    """`Ready` True (prepared and healthy), or False with the health monitor's reason."""
    stamp = since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if view is None or view.healthy:
        return {"type": READY, "status": "True", "reason": "Prepared", "lastTransitionTime": stamp,
                "message": "prepared on this node; CDI devices handed to the kubelet"}
    return {"type": READY, "status": "False", "reason": "DeviceUnhealthy", "lastTransitionTime": stamp,
            "message": (view.message or "the health monitor reports this device unhealthy")[:32768]}


def apply_body(ref: ClaimRef, devices: Sequence[JSON]) -> JSON:
    """The server-side apply configuration of the claim's status; the uid is a precondition,
    so a claim re-created under the same name is never written with the old one's devices."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "status": {"devices": list(devices)},
    }


def info_labels(
    ref: ClaimRef, node_device: NodeDevice, prepared: PreparedDevice, pods: Iterable[Holder]
) -> list[InfoLabels]:
    """One series per (device, pod); a claim with no pod reserved yet still gets one."""
    found = list(pods) or [Holder("", "")]
    return [
        InfoLabels(prepared.device, node_device.uuid, node_device.gpu.pci_bus_id, ref.namespace, ref.name,
                   ref.uid, pod.namespace, pod.name)
        for pod in found
    ]
