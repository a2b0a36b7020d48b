"""`dra-driver kubelet-plugin`: the node daemon's command line, parsed into `NodeOptions` and run.

Click fills the options object directly (each parameter is a field of
`dra_driver.node.options.NodeOptions`); `dra_driver.node.daemon` assembles and runs the
daemon. This module must hold no wiring and no logic beyond refusing option combinations
that make no sense.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import structlog

from dra_driver.commands.options import (
    claim_identity_option,
    cluster_options,
    consumable_shares_option,
    driver_files_options,
    dynamic_mig_option,
    health_options,
    legacy_attributes_option,
    memory_shares_option,
    topology_detail_attributes_option,
)
from dra_driver.node import daemon
from dra_driver.node.options import SERVER_PROBE_SECONDS, NodeOptions
from dra_driver.plugin.claim_source import DEFAULT_TIMEOUT_SECONDS
from dra_driver.signals import run_until_signalled

log = structlog.get_logger(__name__)


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
    "--mps-host-cgroup/--no-mps-host-cgroup",
    default=False,
    show_default=True,
    help="Start each claim's MPS daemon in the cgroups of PID 1, so that it outlives this plugin's container "
    "(upgrades, crashes, uninstall) and lives from its claim's Prepare to its Unprepare; needs the "
    "host's PID namespace (the chart sets hostPID).",
)
@click.option(
    "--mps-exclusive-compute-mode/--no-mps-exclusive-compute-mode",
    default=False,
    show_default=True,
    help="Set the GPUs of a whole-GPU MPS claim to exclusive-process compute mode before its daemon starts "
    "(so no process can use them around MPS) and restore the mode found when the claim is gone; a GPU "
    "whose mode cannot be set refuses the claim. Off: compute modes are never changed.",
)
@click.option(
    "--compute-domains/--no-compute-domains",
    default=False,
    show_default=True,
    help="Publish this node's IMEX channel (where its GPUs are in one multi-node NVLink clique) and run the "
    "IMEX daemons of the ComputeDomains whose pods it prepares (docs/compute-domains.md).",
)
@click.option(
    "--imex-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where each ComputeDomain's IMEX daemon keeps its config and log, mounted from the host at the same "
    "path; default /run/<driver-name>/imex.",
)
@click.option(
    "--compute-domain-wait",
    type=click.FloatRange(min=0.0, max=30.0),
    default=10.0,
    show_default=True,
    help="Seconds a channel Prepare waits inside the call for its ComputeDomain to be ready before it "
    "answers what it waits for (the kubelet calls again; it waits 45 s for an answer).",
)
@click.option(
    "--node-ip",
    envvar="NODE_IP",
    default=None,
    help="The address this node's IMEX daemons bind to and give their peers (downward API status.hostIP); "
    "default: the Node's InternalIP.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the record of prepared claims (checkpoint.json) and its lock live: a tmpfs, since "
    "everything it records (CDI specs, MPS daemons) ends with the boot; mounted from the host at one path "
    "for every instance on the node; default /run/<driver-name>/state.",
)
@click.option(
    "--rolling-update-uid",
    envvar="POD_UID",
    default=None,
    help="Put this pod UID in the socket names, so that two instances can overlap during an update.",
)
@click.option(
    "--claim-read-timeout",
    type=click.FloatRange(min=0.1, max=44.0),
    default=DEFAULT_TIMEOUT_SECONDS,
    show_default=True,
    help="Seconds a Prepare call waits for the API server to return its claims (the kubelet waits 45).",
)
@click.option(
    "--server-probe-interval",
    type=click.FloatRange(min=0.0),
    default=SERVER_PROBE_SECONDS,
    show_default=True,
    help="Seconds between asking the API server again what it keeps (dry-run creates), so that a DRA "
    "feature gate turned on or off under this plugin is followed without a restart; 0: only at start.",
)
@click.option(
    "--extended-resource",
    default=None,
    metavar="NAME",
    help="The extended resource name that DeviceClass extended.<driver> serves (Helm extendedResource): "
    "checked at start, with a Warning Event where the API server stored the class without it.",
)
@click.option(
    "--publish-slices/--no-publish-slices",
    default=True,
    show_default=True,
    help="Run the ResourceSlice controller in this process.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=0, max=65535),
    default=0,
    show_default=True,
    help="Serve Prometheus /metrics and the /livez and /readyz probes on this TCP port; 0: off.",
)
@click.option(
    "--metrics-bind-address", default="0.0.0.0", show_default=True, help="Where the metrics port listens."
)
@claim_identity_option
@memory_shares_option
@consumable_shares_option
@dynamic_mig_option
@legacy_attributes_option
@topology_detail_attributes_option
@health_options
def kubelet_plugin(**values: Any) -> None:
    """Serve the kubelet's DRA plugin API on this node and publish its ResourceSlices."""
    opts = NodeOptions(**values)
    if opts.simulate_health_events is not None and opts.simulate is None:
        raise click.BadParameter("only with --simulate (real GPUs report their own events)",
                                 param_hint="--simulate-health-events")
    try:
        run_until_signalled(daemon.run(opts))
    except daemon.REFUSALS as e:
        log.error("refusing to start", error=str(e))
        raise click.ClickException(str(e)) from None
