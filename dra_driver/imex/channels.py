"""IMEX channel devices: how a node publishes them, what a channel claim asks for, and the
device nodes its containers get. Pure: no I/O (the majors come in as arguments).

A node whose GPUs are in one multi-node NVLink fabric clique publishes `channel-0`
(`type: channel`, `id: 0`, its `cliqueID`), as NVIDIA's driver does. A ComputeDomain's workload
template asks for it with the class `compute-domain-default-channel.<driver>` and carries a
`ComputeDomainChannelConfig` (`domainID`, `allocationMode`) addressed to `compute-domain.<driver>`,
NVIDIA's layout, so the GPU config checks never see it. `Single` gives the container
`/dev/nvidia-caps-imex-channels/channel0`; `All` every channel of the node (NVIDIA: 2048).

It must not start daemons or read the API server (`daemons` and the plugin's channel gate do).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from dra_driver.driver_root.device_nodes import DeviceNodeInfo
from dra_driver.jsontypes import JSON

CHANNEL_TYPE: Final = "channel"
CHANNEL_DEVICE: Final = "channel-0"
CONFIG_KIND: Final = "ComputeDomainChannelConfig"
NVIDIA_API_VERSION: Final = "resource.nvidia.com/v1beta1"
SINGLE: Final = "Single"
ALL: Final = "All"
# NVIDIA's driver (v0.5.0) injects this many with `All`; the kernel module's default count.
ALL_CHANNELS: Final = 2048
CONTAINER_DIR: Final = "/dev/nvidia-caps-imex-channels"

if TYPE_CHECKING:  # imported by `kubectl gpu`, which must not load discovery and NVML
    from dra_driver.gpu.model import Inventory

_CHANNEL_NAME = re.compile(r"channel-(\d{1,4})")
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")  # it names a directory


class ChannelConfigError(ValueError):
    """A channel claim's configuration that cannot be prepared; the message says what to fix."""


def config_driver(driver: str) -> str:
    """The `opaque.driver` of a channel's config (NVIDIA: compute-domain.nvidia.com)."""
    return f"compute-domain.{driver}"


def is_channel(device: str) -> bool:
    return _CHANNEL_NAME.fullmatch(device) is not None


@dataclass(frozen=True)
class ChannelRequest:
    """What one channel claim asks of this node: the domain it joins and which channels."""

    domain_uid: str
    allocation_mode: str  # SINGLE or ALL

    def to_json(self) -> JSON:
        return {"domainID": self.domain_uid, "allocationMode": self.allocation_mode}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ChannelRequest:
        return cls(str(data["domainID"]), str(data["allocationMode"]))


def channel_request(claim: Mapping[str, Any], driver: str) -> ChannelRequest:
    """The channel config of an allocated claim (claim over class entries, later over earlier,
    as for GPU configs). Raises ChannelConfigError."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    raw = (allocation.get("devices") or {}).get("config") or []
    chosen: tuple[int, Mapping[str, Any]] | None = None
    for source in ("FromClass", "FromClaim"):
        for i, item in enumerate(raw if isinstance(raw, list) else []):
            opaque = item.get("opaque") if isinstance(item, Mapping) else None
            if isinstance(opaque, Mapping) and opaque.get("driver") == config_driver(driver) \
                    and item.get("source", "FromClaim") == source:
                chosen = (i, opaque.get("parameters") or {})
    if chosen is None:
        raise ChannelConfigError(
            f"it carries no {CONFIG_KIND} for driver {config_driver(driver)}: a channel is asked for "
            "through the ResourceClaimTemplate a ComputeDomain makes "
            "(spec.channel.resourceClaimTemplate.name); "
            "name that template in the pod instead of writing the claim by hand"
        )
    return parse_channel_config(chosen[1], driver, f"config[{chosen[0]}].opaque.parameters")


def parse_channel_config(parameters: object, driver: str, where: str) -> ChannelRequest:
    """NVIDIA's ComputeDomainChannelConfig, strictly (unknown fields refused, as NVIDIA's
    Prepare decodes it). Raises ChannelConfigError."""
    if not isinstance(parameters, Mapping):
        raise ChannelConfigError(f"{where} must be an object")
    versions = (f"{driver}/v1beta1", NVIDIA_API_VERSION)
    unknown = sorted(set(parameters) - {"apiVersion", "kind", "domainID", "allocationMode"})
    if unknown:
        raise ChannelConfigError(f"{where}: unknown field {unknown[0]!r}; allowed: apiVersion, kind, "
                                 "domainID, allocationMode")
    if parameters.get("apiVersion") not in versions or parameters.get("kind") != CONFIG_KIND:
        raise ChannelConfigError(
            f"{where} must be apiVersion {versions[0]} (or {versions[1]}), kind {CONFIG_KIND}")
    uid = parameters.get("domainID")
    if not isinstance(uid, str) or not uid:
        raise ChannelConfigError(f"{where}.domainID cannot be empty: it is the ComputeDomain's UID")
    if not _UID.fullmatch(uid):
        raise ChannelConfigError(f"{where}.domainID {uid[:80]!r} is not a ComputeDomain UID")
    mode = parameters.get("allocationMode") or SINGLE
    if mode not in (SINGLE, ALL):
        raise ChannelConfigError(f"{where}.allocationMode must be Single or All, not {str(mode)[:40]!r}")
    return ChannelRequest(uid, str(mode))


def channel_minors(request: ChannelRequest) -> range:
    return range(ALL_CHANNELS) if request.allocation_mode == ALL else range(1)


def channel_nodes(request: ChannelRequest, major: int) -> tuple[DeviceNodeInfo, ...]:
    """The device nodes a container of the claim gets. The host may have none of them yet (the
    driver creates a channel node when first used): runc makes each from its numbers."""
    return tuple(
        DeviceNodeInfo(path=f"{CONTAINER_DIR}/channel{n}", host_path=f"{CONTAINER_DIR}/channel{n}",
                       major=major, minor=n, file_mode=0o666)
        for n in channel_minors(request)
    )


def node_clique(inventory: Inventory) -> str | None:
    """The node's fabric clique (`<clusterUUID>.<cliqueId>`) when every GPU is in the same one;
    None on a node without multi-node NVLink (it publishes no channel)."""
    cliques = {g.fabric_clique.id if g.fabric_clique is not None else None for g in inventory.gpus}
    return next(iter(cliques)) if len(cliques) == 1 else None


def channel_device_json(clique: str) -> JSON:
    """The slice entry of this node's channel (NVIDIA: type and id; here also the clique)."""
    return {
        "name": CHANNEL_DEVICE,
        "attributes": {
            "type": {"string": CHANNEL_TYPE},
            "id": {"int": 0},
            "cliqueID": {"string": clique},
        },
    }


__all__ = [
    "ALL",
    "CHANNEL_DEVICE",
    "CONFIG_KIND",
    "SINGLE",
    "ChannelConfigError",
    "ChannelRequest",
    "channel_device_json",
    "channel_nodes",
    "channel_request",
    "config_driver",
    "is_channel",
    "node_clique",
    "parse_channel_config",
]
