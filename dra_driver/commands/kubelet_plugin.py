"""`dra-driver kubelet-plugin`: run the node daemon (kubelet plugin + slice controller)."""

from __future__ import annotations

from pathlib import Path

import click

from controller.publisher import ListAttributesMode
from dra_driver.commands.options import cluster_options, driver_files_options
from dra_driver.plugin.daemon import PluginOptions, run_plugin
from dra_driver.signals import run_until_signalled


@click.command("kubelet-plugin")
@cluster_options
@click.option("--node-name", envvar="NODE_NAME", required=True, help="This node's name (downward API).")
@click.option(
    "--kubelet-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/var/lib/kubelet"),
    show_default=True,
    help="The kubelet's root dir (plugins_registry/ and plugins/ live there).",
)
@click.option(
    "--cdi-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/var/run/cdi"),
    show_default=True,
    help="Where the per-claim CDI specs are written (a tmpfs on most hosts).",
)
@driver_files_options
@click.option(
    "--mps-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where per-claim MPS daemons keep pipes and logs: a short path, mounted from the host at the same "
    "path; default /run/<driver-name>/mps.",
)
@click.option(
    "--rolling-update-uid",
    envvar="POD_UID",
    default=None,
    help="Put this pod UID in the socket names, so that two instances can overlap during an update.",
)
@click.option(
    "--publish-slices/--no-publish-slices",
    default=True,
    show_default=True,
    help="Run the ResourceSlice controller in this process.",
)
def kubelet_plugin(
    driver_name: str,
    kubeconfig: str | None,
    simulate: str | None,
    list_attributes: ListAttributesMode,
    node_name: str,
    kubelet_dir: Path,
    cdi_dir: Path,
    driver_root: Path | None,
    host_driver_root: Path | None,
    dev_root: Path,
    mps_root: Path | None,
    rolling_update_uid: str | None,
    publish_slices: bool,
) -> None:
    """Serve the kubelet's DRA plugin API on this node and publish its ResourceSlices."""
    opts = PluginOptions(
        node_name=node_name,
        driver=driver_name,
        kubelet_dir=kubelet_dir,
        cdi_dir=cdi_dir,
        driver_root=driver_root,
        host_driver_root=host_driver_root,
        dev_root=dev_root,
        simulate=simulate,
        kubeconfig=kubeconfig,
        mps_root=mps_root,
        rolling_update_uid=rolling_update_uid,
        list_attributes=list_attributes,
        publish_slices=publish_slices,
    )
    run_until_signalled(run_plugin(opts))
