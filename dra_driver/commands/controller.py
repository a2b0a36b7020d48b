"""`dra-driver controller`: publish ResourceSlices without the kubelet plugin.

For one node (`--node-name`), or for a fleet of simulated nodes (`--simulate-fleet N`)
in scale tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import dataclasses

import click
import structlog

from controller.capabilities import ListAttributesMode
from controller.publisher import follow_server, slice_controller
from dra_driver import kube
from dra_driver.commands.options import cluster_options
from dra_driver.gpu import discover
from dra_driver.gpu.model import Inventory
from dra_driver.kube import ApiClient
from dra_driver.node.options import SERVER_PROBE_SECONDS
from dra_driver.signals import run_until_signalled

log = structlog.get_logger(__name__)


@click.command()
@cluster_options
@click.option("--node-name", envvar="NODE_NAME", help="The node whose GPUs this process publishes.")
@click.option(
    "--simulate-fleet",
    type=int,
    default=0,
    metavar="N",
    help="Publish slices for N simulated nodes named <fleet-prefix>-0000...; needs --simulate.",
)
@click.option("--fleet-prefix", default="fleet-node", show_default=True)
@click.option("--create-nodes", is_flag=True, help="Create the fleet's Node objects if missing.")
def controller(
    driver_name: str,
    kubeconfig: str | None,
    simulate: str | None,
    list_attributes: ListAttributesMode,
    node_name: str | None,
    simulate_fleet: int,
    fleet_prefix: str,
    create_nodes: bool,
) -> None:
    """Publish and repair this node's (or a simulated fleet's) ResourceSlices."""
    if simulate_fleet and not simulate:
        raise click.UsageError("--simulate-fleet needs --simulate PROFILE")
    if not simulate_fleet and not node_name:
        raise click.UsageError("--node-name (or $NODE_NAME) is required")
    inventory = discover(simulate)
    if simulate_fleet:
        inventories = {f"{fleet_prefix}-{i:04d}": inventory for i in range(simulate_fleet)}
    else:
        assert node_name is not None
        inventories = {node_name: inventory}
    run_until_signalled(_run(driver_name, kubeconfig, list_attributes, inventories, create_nodes))


async def _run(
    driver: str,
    kubeconfig: str | None,
    list_attributes: ListAttributesMode,
    inventories: dict[str, Inventory],
    create_nodes: bool,
) -> None:
    api = await kube.load_client(kubeconfig)
    try:
        if create_nodes:
            await _create_nodes(api, list(inventories))
        ctl = await slice_controller(api, driver, inventories, list_attributes)
        log.info("publishing slices", driver=driver, pools=len(inventories))
        try:
            await asyncio.gather(ctl.run(), follow_server(ctl, list_attributes, SERVER_PROBE_SECONDS))
        finally:
            log.warning("controller stopping", **dataclasses.asdict(ctl.stats))
    finally:
        await api.close()


async def _create_nodes(api: ApiClient, names: list[str]) -> None:
    limit = asyncio.Semaphore(16)

    async def one(name: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        }
        async with limit:
            try:
                await kube.request(api, "POST", "/api/v1/nodes", body=body)
            except kube.ApiException as e:
                if e.status != 409:
                    raise

    await asyncio.gather(*(one(n) for n in names))
    log.info("fleet nodes present", count=len(names))
