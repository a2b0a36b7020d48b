"""Click options shared by the commands that run against a cluster."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from dra_driver import DEFAULT_DRIVER_NAME
from dra_driver.health.classify import Severity, parse_xid_severities
from dra_driver.sharing.consumable import ConsumableShares

F = TypeVar("F", bound=Callable[..., Any])


def cluster_options(f: F) -> F:
    for option in reversed(
        [
            click.option(
                "--driver-name",
                default=DEFAULT_DRIVER_NAME,
                show_default=True,
                help="The DRA driver name (a DNS subdomain); also the CDI vendor.",
            ),
            click.option(
                "--kubeconfig",
                type=click.Path(dir_okay=False),
                default=None,
                help="Kubeconfig file; default: in-cluster service account, then ~/.kube/config.",
            ),
            click.option(
                "--simulate",
                metavar="NAME|PATH",
                default=None,
                help="Simulated hardware profile instead of NVML (dra-driver inventory --list-profiles).",
            ),
            click.option(
                "--list-attributes",
                type=click.Choice(["auto", "on", "off"]),
                default="auto",
                show_default=True,
                help="Publish list-type attributes (DRAListTypeAttributes); auto detects.",
            ),
        ]
    ):
        f = option(f)
    return f


def driver_files_options(f: F) -> F:
    """Where the driver's user-space files and device nodes are, as this process and the host see them."""
    for option in reversed(
        [
            click.option(
                "--driver-root",
                type=click.Path(file_okay=False, path_type=Path),
                default=None,
                help="Where the NVIDIA driver's files are seen by this process: / on most hosts; "
                "/usr/local/nvidia, /run/nvidia/driver, /home/kubernetes/bin/nvidia on others "
                "[default: /; with --simulate: none, so specs mount no libraries].",
            ),
            click.option(
                "--host-driver-root",
                type=click.Path(file_okay=False, path_type=Path),
                default=None,
                help="The driver root as the host (the container runtime) sees it, written into CDI "
                "specs, when this process sees it elsewhere (a hostPath mount); default: --driver-root.",
            ),
            click.option(
                "--dev-root",
                type=click.Path(file_okay=False, path_type=Path),
                default=Path("/dev"),
                show_default=True,
                help="Where the host's device nodes are seen by this process.",
            ),
        ]
    ):
        f = option(f)
    return f


def memory_shares_option(f: F) -> F:
    """`--memory-shares`: publish each whole GPU also as a share view; `--memory-shares-only`:
    as its share view alone (docs/sharing.md)."""
    f = click.option(
        "--memory-shares-only/--no-memory-shares-only",
        envvar="MEMORY_SHARES_ONLY",
        default=False,
        show_default=True,
        help="Publish every whole GPU only for memory shares, not also whole (implies --memory-shares): no "
        "counters for the scheduler to check, which at fleet scale schedules shares up to 1.8x faster "
        "(docs/sharing.md).",
    )(f)
    return click.option(
        "--memory-shares/--no-memory-shares",
        envvar="MEMORY_SHARES",
        default=False,
        show_default=True,
        help="Also publish every whole GPU for memory shares (consumable capacity; each share enforced by "
        "its own MPS daemon). Needs DRAConsumableCapacity and DRAPartitionableDevices (beta, on in 1.36+).",
    )(f)


def consumable_shares_option(f: F) -> F:
    """`--consumable-shares`: NVIDIA's consumable shares of every whole GPU (docs/sharing.md)."""

    def parse(_ctx: click.Context, _param: click.Parameter, value: str) -> ConsumableShares | None:
        try:
            return ConsumableShares.parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return click.option(
        "--consumable-shares",
        envvar="CONSUMABLE_SHARES",
        default="disabled",
        show_default=True,
        callback=parse,
        help="NVIDIA's consumable shares: publish every whole GPU of the standard class for several claims. "
        "memory: a claim gets all of a GPU's memory unless it asks for less (capacity.requests.memory); "
        "unlimited: claims share unless they ask for memory; N: also a capacity `shares` of N, one per claim "
        "by default. A claim that asked for part of a GPU's memory gets an MPS daemon holding it to that "
        "much; the others are time-sliced. Needs DRAConsumableCapacity (beta, on in 1.36+).",
    )(f)


def legacy_attributes_option(f: F) -> F:
    """`--legacy-attributes`: also publish nvlinkGroup<N> and numaNode (docs/attributes.md)."""
    return click.option(
        "--legacy-attributes/--no-legacy-attributes",
        envvar="LEGACY_ATTRIBUTES",
        default=False,
        show_default=True,
        help="Also publish the legacy attributes nvlinkGroup<N> (fixed NVLink partitions, superseded by "
        "nvlinkClique<L>) and numaNode (repeats resource.kubernetes.io/numaNode), for claims written "
        "against them. Off: every attribute costs the scheduler CPU on every device it looks at "
        "(docs/attributes.md, \"Cost\").",
    )(f)


def topology_detail_attributes_option(f: F) -> F:
    """`--topology-detail-attributes`: also publish nvlinkPeers, nvlinkPeerCount, nvlinkIsland."""
    return click.option(
        "--topology-detail-attributes/--no-topology-detail-attributes",
        envvar="TOPOLOGY_DETAIL_ATTRIBUTES",
        default=False,
        show_default=True,
        help="Also publish the raw NVLink graph of each whole GPU: nvlinkPeers, nvlinkPeerCount and "
        "nvlinkIsland. No claim shape needs them (the clique layers, nvlinkCliques, nvlinkCliqueSize "
        "and nvlinkDomain do); for claims or tools of your own that read them. Off: every attribute "
        "costs the scheduler CPU on every device it looks at (docs/attributes.md, \"Cost\").",
    )(f)


def claim_identity_option(f: F) -> F:
    """`--claim-identity-metric`: serve gpu_dra_device_claim_info on the metrics port."""
    return click.option(
        "--claim-identity-metric/--no-claim-identity-metric",
        envvar="CLAIM_IDENTITY_METRIC",
        default=False,
        show_default=True,
        help="Serve gpu_dra_device_claim_info (each prepared device's claim namespace, name and UID, and its "
        "pods) on the metrics port, for joining DCGM's per-GPU series: anyone who reaches the port reads it, "
        "so turn it on where the port is fenced (the chart's metrics.networkPolicy).",
    )(f)


def dynamic_mig_option(f: F) -> F:
    """`--dynamic-mig`: carve MIG-mode GPUs on demand (docs/mig.md)."""
    return click.option(
        "--dynamic-mig/--no-dynamic-mig",
        envvar="DYNAMIC_MIG",
        default=False,
        show_default=True,
        help="Publish every GPU in MIG mode as partitionable devices (one per possible placement of every "
        "GPU-instance profile, with shared counters) and create each MIG instance when its claim is "
        "prepared, destroy it when unprepared. MIG mode itself is never changed. Needs "
        "DRAPartitionableDevices (beta, on in 1.36+).",
    )(f)


def _xid_severities(ctx: click.Context, param: click.Parameter, value: str) -> dict[int, Severity]:
    try:
        return parse_xid_severities(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def health_options(f: F) -> F:
    """Device health monitoring (docs/health.md): NVML events -> taints, health stream, Events."""
    for option in reversed(
        [
            click.option(
                "--health-monitor/--no-health-monitor",
                default=True,
                show_default=True,
                help="Watch NVML health events and taint sick devices (without it devices report Unknown).",
            ),
            click.option(
                "--health-taint-effect",
                type=click.Choice(["NoSchedule", "NoExecute"]),
                default="NoSchedule",
                show_default=True,
                help="The strongest taint effect written: NoExecute lets Kubernetes evict the pods of a GPU "
                "that needs a reset; NoSchedule only keeps new pods off it.",
            ),
            click.option(
                "--health-quiet-period",
                type=click.FloatRange(min=0),
                default=60.0,
                show_default=True,
                help="Seconds a device must check out well, with no new critical event, before its taint "
                "is removed.",
            ),
            click.option(
                "--health-xid-severity",
                metavar="XID=EFFECT,...",
                default="",
                callback=_xid_severities,
                help="Override the severity of XIDs, EFFECT one of None, NoSchedule, NoExecute "
                "(e.g. '13=NoSchedule,94=None').",
            ),
            click.option(
                "--simulate-health-events",
                type=click.Path(dir_okay=False, path_type=Path),
                default=None,
                help="With --simulate: the JSON-lines file the simulated NVML takes injected health events "
                "from; without it none is read. Created 0600 if missing; followed only while owned by the "
                "plugin's user with mode 0600 and at most 1 MiB.",
            ),
        ]
    ):
        f = option(f)
    return f
