"""Wires inventory to the reconcile loop: what `dra-driver controller` and the plugin run.

Decides the server's features once (list-type attributes), turns each node's
inventory into its pool's desired slices with the pure builder, and runs the
`SliceController` until cancelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import structlog
from kubernetes.aio import client

from controller.reconcile import PoolSpec, SliceController, detect_list_attributes
from controller.slices import SliceFeatures, desired_slices
from dra_driver.gpu.model import Inventory

log = structlog.get_logger(__name__)

ListAttributesMode = Literal["auto", "on", "off"]


async def resolve_features(
    api: client.ApiClient, driver: str, list_attributes: ListAttributesMode
) -> SliceFeatures:
    if list_attributes == "auto":
        enabled = await detect_list_attributes(api, driver)
        log.info("detected list-type attribute support", enabled=enabled)
    else:
        enabled = list_attributes == "on"
    return SliceFeatures(list_attributes=enabled)


def pools_for(
    inventories: Mapping[str, Inventory], driver: str, features: SliceFeatures
) -> dict[str, PoolSpec]:
    """One pool per node, named after the node."""
    return {
        node: PoolSpec(name=node, node_name=node, slice_specs=desired_slices(inv, node, driver, features))
        for node, inv in inventories.items()
    }


async def slice_controller(
    api: client.ApiClient,
    driver: str,
    inventories: Mapping[str, Inventory],
    list_attributes: ListAttributesMode = "auto",
) -> SliceController:
    features = await resolve_features(api, driver, list_attributes)
    single = next(iter(inventories)) if len(inventories) == 1 else None
    return SliceController(
        api=api, driver=driver, pools=pools_for(inventories, driver, features), node_selector=single
    )
