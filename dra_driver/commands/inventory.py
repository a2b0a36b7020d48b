"""`dra-driver inventory`: show what the driver sees on this node (or in a simulated profile).

Output only: a table for people (`-o table`, with an `nvidia-smi topo -m` style matrix) or
the stable JSON document of docs/inventory.md (`-o json`). Errors become one message and
a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from controller.attributes import nvlink_layer_attribute
from controller.slices import published_topology
from dra_driver import DEFAULT_DRIVER_NAME
from dra_driver.devices import node_devices
from dra_driver.gpu import GpuDiscoveryError, NvmlUnavailableError, discover, list_profiles
from dra_driver.gpu.report import inventory_document, render_table
from dra_driver.health import history
from dra_driver.sharing.shares import ISOLATION_NOTE, shareable

NO_DRIVER_HINT = (
    "No NVIDIA driver found: {reason}.\n"
    "To see what the driver would publish on a GPU node, simulate one:\n"
    "  dra-driver inventory --simulate hgx-h200\n"
    "  dra-driver inventory --list-profiles      (all simulated profiles)"
)


@click.command("inventory")
@click.option("--simulate", metavar="NAME|PATH", help="Use a simulated hardware profile instead of NVML.")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option(
    "--list-profiles", "list_only", is_flag=True, help="List the simulated hardware profiles and exit."
)
@click.option(
    "--health-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("/var/lib/kubelet/plugins") / DEFAULT_DRIVER_NAME / history.FILE_NAME,
    show_default=True,
    help="The running plugin's device health history (shown when the file exists).",
)
def inventory(simulate: str | None, output: str, list_only: bool, health_file: Path) -> None:
    """Show the node's GPUs, MIG devices and NVLink topology, and the plugin's view of their health."""
    if list_only:
        _print_profiles(output)
        return
    try:
        inv = discover(simulate)
    except NvmlUnavailableError as err:
        raise click.ClickException(NO_DRIVER_HINT.format(reason=err)) from err
    except GpuDiscoveryError as err:
        raise click.ClickException(str(err)) from err
    # The topology as the slices publish it, so the layers shown are the published ones.
    topology = published_topology(inv)
    try:
        health = history.read(health_file)
    except (OSError, ValueError) as err:
        raise click.ClickException(str(err)) from err
    if output == "json":
        document = inventory_document(inv, topology, nvlink_layer_attribute)
        if health is not None:
            document["health"] = health
        click.echo(json.dumps(document, indent=2))
    else:
        click.echo(render_table(inv, topology, nvlink_layer_attribute))
        if any(shareable(d) for d in node_devices(inv).values()):
            click.echo("\n" + ISOLATION_NOTE)
        if health is not None:
            click.echo("\n" + history.render(health))


def _print_profiles(output: str) -> None:
    try:
        profiles = list_profiles()
    except GpuDiscoveryError as err:
        raise click.ClickException(str(err)) from err
    if output == "json":
        click.echo(
            json.dumps(
                [
                    {"name": p.name, "gpus": p.gpus, "product": p.product, "description": p.description}
                    for p in profiles
                ],
                indent=2,
            )
        )
        return
    width = max(len(p.name) for p in profiles)
    for p in profiles:
        click.echo(f"{p.name.ljust(width)}  {p.description}")
