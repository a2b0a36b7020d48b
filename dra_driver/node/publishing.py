"""This node's ResourceSlices, published by the one instance that holds the node's publisher
lease (during a rolling update the instance that comes second takes over when the first exits).

Imported after the kubelet registration: the slice controller and its API capability checks
are most of the daemon's import time, and the kubelet waits for none of it. Must not hold
logic of its own: the lease, the controller and the taint loop each keep theirs.
"""

from __future__ import annotations

import asyncio
from typing import Final

import structlog

from controller.capabilities import extended_resource_dropped
from controller.publisher import follow_server, report_features_off, slice_controller
from controller.taints import follow_taints
from dra_driver.gpu.model import Inventory
from dra_driver.health.keeper import HealthKeeper
from dra_driver.kube import ApiClient
from dra_driver.node.options import NodeOptions
from dra_driver.plugin.lock import Lease
from dra_driver.probes import Heartbeat

log = structlog.get_logger(__name__)

LEASE_POLL_SECONDS: Final = 1.0


async def publish(
    api: ApiClient,
    opts: NodeOptions,
    inventory: Inventory,
    lease: Lease,
    keeper: HealthKeeper | None,
    heartbeat: Heartbeat | None = None,
) -> None:
    """Publish this node's slices (and, with a keeper, its taints) while holding the lease."""
    await lease.wait_held(LEASE_POLL_SECONDS, lambda: log.info(
        "another instance publishes this node's slices; waiting to take over", lease=str(lease.path)))
    log.info("publishing this node's ResourceSlices", lease=str(lease.path))
    ctl = await slice_controller(
        api, opts.driver_name, {opts.node_name: inventory}, opts.list_attributes, memory_shares=opts.shares,
        shares_only=opts.memory_shares_only, dynamic_mig=opts.dynamic_mig,
        legacy_attributes=opts.legacy_attributes, topology_detail_attributes=opts.topology_detail_attributes,
        taints=keeper is not None, compute_domains=opts.compute_domains,
        consumable_shares=opts.consumable_shares,
    )
    ctl.heartbeat = heartbeat
    loops = [ctl.run()]
    if opts.extended_resource:  # beside the slices, not before them: a slow answer delays nothing
        loops.append(_say_if_extended_resource_dropped(api, opts))
    if keeper is not None:
        loops.append(follow_taints(ctl, keeper, opts.node_name))
    if opts.server_probe_interval > 0:
        loops.append(follow_server(ctl, opts.list_attributes, opts.server_probe_interval))
    await asyncio.gather(*loops)


async def _say_if_extended_resource_dropped(api: ApiClient, opts: NodeOptions) -> None:
    """Once: whether the server kept the extended resource's class as the chart wrote it."""
    assert opts.extended_resource is not None
    dropped = await extended_resource_dropped(api, opts.driver_name, opts.extended_resource)
    await report_features_off(api, opts.driver_name, (dropped,) if dropped else (), opts.node_name)
