"""`dra-driver cdi generate`: a static CDI spec of this node's GPUs for Docker and Podman.

The kubelet plugin writes one transient spec per claim by itself; this command is for
running GPU containers outside Kubernetes (`docker run --device gpu.dra-driver.dev/gpu=0`)
and for looking at what the driver would hand a container. It writes the same edits
that a claim gets. Errors become one message and a non-zero exit code.
"""

from __future__ import annotations

from pathlib import Path

import click

from dra_driver.cdi.builders import build_static_spec
from dra_driver.cdi.files import spec_to_json, write_spec_file
from dra_driver.cdi.spec import DEFAULT_VENDOR, CdiNameError, validate_vendor
from dra_driver.commands.options import driver_files_options
from dra_driver.driver_root import scan_driver_files


@click.group("cdi")
def cdi() -> None:
    """CDI specs of this node's GPUs."""


@cdi.command("generate")
@click.option(
    "--simulate", metavar="NAME|PATH", default=None, help="Use a simulated hardware profile instead of NVML."
)
@driver_files_options
@click.option(
    "--driver-name",
    default=DEFAULT_VENDOR,
    show_default=True,
    help="The DRA driver name; the CDI vendor (kind <driver-name>/gpu).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the spec to this file (atomically) instead of stdout, "
    "e.g. /etc/cdi/gpu.dra-driver.dev-gpu.json.",
)
def generate(
    simulate: str | None,
    driver_root: Path | None,
    host_driver_root: Path | None,
    dev_root: Path,
    driver_name: str,
    output: Path | None,
) -> None:
    """Write a CDI spec with one device per GPU by index and by UUID, and `all`."""
    # Imported here: GPU discovery loads NVML bindings, which `--help` does not need.
    from dra_driver.gpu import GpuDiscoveryError, discover

    try:
        validate_vendor(driver_name)
    except CdiNameError as err:
        raise click.BadParameter(str(err), param_hint="--driver-name") from err
    try:
        inventory = discover(simulate)
    except GpuDiscoveryError as err:
        raise click.ClickException(str(err)) from err
    simulated = simulate is not None
    files = scan_driver_files(
        driver_root,
        dev_root,
        simulated,
        host_driver_root=host_driver_root,
        gpu_minors=[g.minor for g in inventory.gpus],
    )
    try:
        spec = build_static_spec(inventory, files, driver_name)
    except ValueError as err:
        raise click.ClickException(str(err)) from err
    if output is None:
        click.echo(spec_to_json(spec), nl=False)
        return
    try:
        write_spec_file(output, spec)
    except OSError as err:
        raise click.ClickException(f"writing {output}: {err}") from err
    click.echo(f"wrote {output}: {len(spec.devices)} devices, cdiVersion {spec.cdi_version}", err=True)
