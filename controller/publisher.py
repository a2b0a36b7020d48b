"""Publishes each node's ResourceSlices and keeps them so: what `dra-driver controller` and the plugin run.

`slice_controller` learns once what the API server keeps (`controller.capabilities`), turns
off with one Warning (log, metric `gpu_dra_features_off`, an Event on the Node) each asked
feature whose fields the server would drop, turns each node's inventory into its pool's
desired slices with the pure builder (`controller.slices`) and returns a
`controller.reconciler.SliceController` to run until cancelled: that loop keeps the slices
as desired.

It must NOT write slices itself (the loop does) nor decide what a slice holds (the pure
builder does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import structlog

from controller.capabilities import FeatureOff, ListAttributesMode, decide, probe_server
from controller.plan import PoolSpec
from controller.reconciler import SliceController
from controller.slices import SliceFeatures, desired_slices, published_topology
from dra_driver import kube, metrics
from dra_driver.gpu.model import Inventory
from dra_driver.kube import ApiClient
from dra_driver.kube.events import event_body
from dra_driver.sharing.consumable import ConsumableShares

# SliceController is named here too for dra_driver.commands.kubelet_plugin's import.
__all__ = ["ListAttributesMode", "SliceController", "pools_for", "slice_controller"]

log = structlog.get_logger(__name__)


def pools_for(
    inventories: Mapping[str, Inventory], driver: str, features: SliceFeatures
) -> dict[str, PoolSpec]:
    """One pool per node, named after the node."""
    for node, inv in inventories.items():
        warn_uncovered_cliques(node, inv)
    return {
        node: PoolSpec(name=node, node_name=node, slice_specs=desired_slices(inv, node, driver, features))
        for node, inv in inventories.items()
    }


def warn_uncovered_cliques(node: str, inventory: Inventory) -> None:
    """Say in the log which NVLink-linked sets the published layers cannot give (GA claim shape)."""
    topology = published_topology(inventory)
    if topology.clique_layers.complete:
        return
    left_out = {
        str(c.size): ["-".join(map(str, u)) for u in c.uncovered] for c in topology.coverage() if c.uncovered
    }
    log.warning(
        "NVLink topology has more cliques than the clique layers can hold; publishing the best cover. "
        "Claims using the GA shape (firstAvailable over nvlinkClique<L>) cannot get the sets left out; "
        "nvlinkCliques (list-type attributes) still gives them",
        node=node, layers=len(topology.clique_layers.layers), left_out=left_out,
    )


async def slice_controller(
    api: ApiClient,
    driver: str,
    inventories: Mapping[str, Inventory],
    list_attributes: ListAttributesMode = "auto",
    memory_shares: bool = False,
    dynamic_mig: bool = False,
    shares_only: bool = False,
    legacy_attributes: bool = False,
    taints: bool = True,
    topology_detail_attributes: bool = False,
    compute_domains: bool = False,
    consumable_shares: ConsumableShares | None = None,
) -> SliceController:
    """`taints`: health taints will be published (the plugin's health monitor runs)."""
    server = await probe_server(api, driver)
    asked = SliceFeatures(
        list_attributes=server.list_attributes if list_attributes == "auto" else list_attributes == "on",
        memory_shares=memory_shares,
        shares_only=shares_only,
        dynamic_mig=dynamic_mig,
        legacy_attributes=legacy_attributes,
        topology_detail_attributes=topology_detail_attributes,
        taints=taints,
        compute_domains=compute_domains,
        consumable_shares=consumable_shares,
    )
    features, off = decide(asked, server)
    single = next(iter(inventories)) if len(inventories) == 1 else None
    await report_features_off(api, driver, off, single)
    return SliceController(
        api=api, driver=driver, pools=pools_for(inventories, driver, features), node_selector=single,
        inventories=dict(inventories), features=features, features_off=off,
    )


async def report_features_off(
    api: ApiClient, driver: str, off: Sequence[FeatureOff], node: str | None
) -> None:
    """Say once, where an operator looks, which asked features this node runs without: a
    structlog warning, the `gpu_dra_features_off` metric, and a Warning Event on the Node."""
    for feature in off:
        metrics.features_off.labels(feature=feature.feature).set(1)
        log.warning("feature turned off: the API server would drop its fields", feature=feature.feature,
                    reason=feature.reason, node=node)
        if node is None:
            continue
        involved = {"apiVersion": "v1", "kind": "Node", "name": node, "namespace": "default"}
        try:
            nodes = await kube.request(api, "GET", f"/api/v1/nodes/{node}")
            involved["uid"] = nodes["metadata"]["uid"]
            body = event_body(involved, "DRAFeatureOff", feature.message(), True, driver, node)
            await kube.request(api, "POST", "/api/v1/namespaces/default/events", body=body)
        except kube.TRANSIENT_ERRORS as e:
            log.info("could not post the Event about a feature turned off", feature=feature.feature,
                     error=str(e))
