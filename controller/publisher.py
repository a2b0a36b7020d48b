"""Publishes each node's ResourceSlices and keeps them so: what `dra-driver controller` and the plugin run.

`slice_controller` learns once what the API server keeps (`controller.capabilities`), turns
off with one Warning (log, metric `gpu_dra_features_off`, an Event on the Node) each asked
feature whose fields the server would drop, turns each node's inventory into its pool's
desired slices with the pure builder (`controller.slices`) and returns a
`controller.reconciler.SliceController` to run until cancelled: that loop keeps the slices
as desired. `follow_server`, run beside it, asks the server again every few minutes and
republishes with what it keeps when a gate was turned on or off under the running process.

It must NOT write slices itself (the loop does) nor decide what a slice holds (the pure
builder does).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import structlog

from controller.capabilities import FeatureOff, ListAttributesMode, decide, probe_server
from controller.plan import PoolSpec
from controller.reconciler import SliceController
from controller.slices import SliceFeatures, desired_slices, published_topology
from dra_driver import kube, metrics
from dra_driver.gpu.model import Inventory
from dra_driver.kube import ApiClient, ApiException
from dra_driver.kube.events import event_body
from dra_driver.sharing.consumable import ConsumableShares

__all__ = ["follow_server", "pools_for", "slice_controller"]

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
        inventories=dict(inventories), features=features, features_off=off, asked=asked,
    )


async def follow_server(ctl: SliceController, list_attributes: ListAttributesMode, interval: float) -> None:
    """Ask the server again, every `interval` seconds (jittered), what it keeps, and publish
    with what follows: a gate turned on under a running plugin is used without a restart, one
    turned off stops the fields the server now drops (a node whose slices the server strips is
    unschedulable). Each change is said once: a log line, the metric and one Event on the Node.
    The probes are dry-run creates: nothing is stored. Runs until cancelled."""
    node = ctl.node_selector
    while True:
        await asyncio.sleep(interval * random.uniform(0.8, 1.2))
        try:
            server = await probe_server(ctl.api, ctl.driver)
        except kube.TRANSIENT_ERRORS as e:
            log.info("could not ask the API server what it keeps; asking again later", error=str(e))
            continue
        asked = ctl.asked
        if list_attributes == "auto":
            asked = replace(asked, list_attributes=server.list_attributes)
        features, off = decide(asked, server)
        if features == ctl.features:
            continue
        change = feature_change(ctl.features, ctl.features_off, features, off)
        pools = ctl.set_features(features, off)
        ctl.asked = asked
        for feature in ctl.features_off:
            metrics.features_off.labels(feature=feature.feature).set(1)
        for name in change.turned_on:
            metrics.features_off.labels(feature=name).set(0)
        log.warning("the API server's features changed; publishing with what it keeps now",
                    change=change.message, pools_rewritten=len(pools), node=node)
        if node is not None:
            await _post_node_event(ctl.api, ctl.driver, node, "DRAFeaturesChanged", change.message,
                                   warning=bool(change.turned_off))


@dataclass(frozen=True)
class FeatureChange:
    turned_on: tuple[str, ...]
    turned_off: tuple[FeatureOff, ...]
    other: tuple[str, ...]  # what changed without being asked for (list-type attributes in auto)

    @property
    def message(self) -> str:
        parts = [f"{name} is on again: the API server keeps its fields now" for name in self.turned_on]
        parts += [f.message() for f in self.turned_off]
        parts += list(self.other)
        return "; ".join(parts) or "the API server's features changed; publishing with what it keeps now"


def feature_change(
    before: SliceFeatures, before_off: Sequence[FeatureOff],
    after: SliceFeatures, after_off: Sequence[FeatureOff],
) -> FeatureChange:
    """Pure: what changed between two decisions, in an operator's words."""
    was, now = {f.feature for f in before_off}, {f.feature: f for f in after_off}
    other: tuple[str, ...] = ()
    if before.list_attributes != after.list_attributes:
        now_kept = after.list_attributes
        other = (f"list-type attributes are {'published' if now_kept else 'no longer published'} "
                 f"(the API server {'keeps' if now_kept else 'drops'} them now)",)
    return FeatureChange(turned_on=tuple(sorted(was - set(now))),
                         turned_off=tuple(f for name, f in now.items() if name not in was), other=other)


async def report_features_off(
    api: ApiClient, driver: str, off: Sequence[FeatureOff], node: str | None
) -> None:
    """Say once, where an operator looks, which asked features this node runs without: a
    structlog warning, the `gpu_dra_features_off` metric, and a Warning Event on the Node."""
    for feature in off:
        metrics.features_off.labels(feature=feature.feature).set(1)
        log.warning("feature turned off: the API server would drop its fields", feature=feature.feature,
                    reason=feature.reason, node=node)
        if node is not None:
            await _post_node_event(api, driver, node, "DRAFeatureOff", feature.message(), warning=True)


async def _post_node_event(api: ApiClient, driver: str, node: str, reason: str, message: str,
                           warning: bool) -> None:
    """One Event on the Node, named after its reason and message, so that a restarted plugin
    saying the same again is told it exists (409) while the first is kept (an hour, the API
    server's Event TTL), without the right to list Events."""
    involved = {"apiVersion": "v1", "kind": "Node", "name": node, "namespace": "default"}
    digest = hashlib.sha256(f"{driver}\n{message}".encode()).hexdigest()[:12]
    try:
        nodes = await kube.request(api, "GET", f"/api/v1/nodes/{node}")
        involved["uid"] = nodes["metadata"]["uid"]
        body = event_body(involved, reason, message, warning, driver, node)
        name = f"{node[:200].rstrip('.-')}.{reason.lower()}-{digest}"  # within 253, a DNS subdomain
        body["metadata"] = {"name": name, "namespace": "default"}
        await kube.request(api, "POST", "/api/v1/namespaces/default/events", body=body)
    except ApiException as e:
        if e.status != 409:
            log.info("could not post an Event on the Node", reason=reason, error=str(e))
    except kube.TRANSIENT_ERRORS as e:
        log.info("could not post an Event on the Node", reason=reason, error=str(e))
