"""`dra-driver kubelet-plugin`: the node daemon, both halves in one process, and its wiring.

Start order matters to the kubelet: discover the hardware, recover the prepared-claim
state, serve the DRA socket, and only then create the registration socket (the kubelet
calls GetInfo and connects as soon as it appears). The slice publisher runs beside the
servers, in the one instance that holds the node's publisher lease (during a rolling
update the new pod takes over when the old one exits). On SIGTERM the registration socket
goes first (the kubelet stops sending calls), then the DRA server drains. Slices are left
in place: the kubelet removes them if no plugin comes back, and a restarting plugin must
not make the pool vanish.

This is the only place that joins the kubelet plugin (`dra_driver.plugin`) to the slice
publisher (`controller`); it holds wiring, not logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, cast

import click
import structlog

from controller.publisher import ListAttributesMode, SliceController, slice_controller
from dra_driver import kube, metrics
from dra_driver.commands.options import (
    claim_identity_option,
    cluster_options,
    driver_files_options,
    dynamic_mig_option,
    health_options,
    legacy_attributes_option,
    memory_shares_option,
)
from dra_driver.devices import NodeDevice, node_devices
from dra_driver.driver_root import scan_driver_files
from dra_driver.gpu import discover, load_profile
from dra_driver.gpu.compute_mode import ComputeModes
from dra_driver.gpu.mig import MigApi, MigInstances
from dra_driver.gpu.model import Inventory
from dra_driver.health import history
from dra_driver.health.classify import HealthPolicy, Severity, TaintEffect
from dra_driver.health.keeper import HealthKeeper
from dra_driver.health.monitor import HealthMonitorError
from dra_driver.health.node import NodeHealth, nvml_for, start_node_health
from dra_driver.health.notify import ClaimEvents, ClaimUse
from dra_driver.kube import ApiClient
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.claim_source import DEFAULT_TIMEOUT_SECONDS, ClaimReader
from dra_driver.plugin.claim_status import ClaimStatus, nvlink_peers
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.health import NOT_MONITORED, DeviceHealthBoard, claims_using, keep_fresh, mirror
from dra_driver.plugin.lock import Lease
from dra_driver.plugin.mig_steps import CreatedDevices, dynamic_devices, without_own
from dra_driver.plugin.prepared import MigRecord
from dra_driver.plugin.recovery import StartPaths, asked_once, instances_at_start
from dra_driver.plugin.registration import RegistrationService, add_registration
from dra_driver.plugin.server import SocketServer, raise_open_files_limit
from dra_driver.plugin.service import add_dra_services
from dra_driver.plugin.sockets import PluginPaths, plugin_paths
from dra_driver.plugin.state import NodePreparer
from dra_driver.probes import Heartbeat, plugin_probes
from dra_driver.sharing.mps import MpsControl, MpsRootRefused
from dra_driver.sharing.mps import default_root as mps_default_root
from dra_driver.sharing.policy import Sharing
from dra_driver.sharing.shares import share_views
from dra_driver.signals import run_until_signalled

log = structlog.get_logger(__name__)

PUBLISHER_LEASE: Final = "publisher.lock"
LEASE_POLL_SECONDS: Final = 1.0
# A reconcile pass of one node's slices takes well under a second; minutes mean a hung call.
PUBLISHER_STUCK_SECONDS: Final = 180.0
TAINT_WRITE_INTERVAL: Final = 1.0  # health taint changes within this interval coalesce into one write


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
@dynamic_mig_option
@legacy_attributes_option
@health_options
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
    mps_host_cgroup: bool,
    mps_exclusive_compute_mode: bool,
    state_dir: Path | None,
    rolling_update_uid: str | None,
    claim_read_timeout: float,
    publish_slices: bool,
    metrics_port: int,
    metrics_bind_address: str,
    claim_identity_metric: bool,
    memory_shares: bool,
    memory_shares_only: bool,
    dynamic_mig: bool,
    legacy_attributes: bool,
    health_monitor: bool,
    health_taint_effect: TaintEffect,
    health_quiet_period: float,
    health_xid_severity: dict[int, Severity],
    simulate_health_events: Path | None,
) -> None:
    """Serve the kubelet's DRA plugin API on this node and publish its ResourceSlices."""
    if simulate_health_events is not None and simulate is None:
        raise click.BadParameter("only with --simulate (real GPUs report their own events)",
                                 param_hint="--simulate-health-events")
    policy = HealthPolicy(health_xid_severity, health_taint_effect, health_quiet_period)
    health = policy if health_monitor else None
    metrics.serve_claim_identity(claim_identity_metric)
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
        mps_host_cgroup=mps_host_cgroup,
        mps_exclusive_compute_mode=mps_exclusive_compute_mode,
        state_dir=state_dir or default_state_dir(driver_name),
        rolling_update_uid=rolling_update_uid,
        claim_read_timeout=claim_read_timeout,
        list_attributes=list_attributes,
        publish_slices=publish_slices,
        memory_shares=memory_shares or memory_shares_only,
        shares_only=memory_shares_only,
        dynamic_mig=dynamic_mig,
        legacy_attributes=legacy_attributes,
        metrics_port=metrics_port,
        metrics_bind_address=metrics_bind_address,
        health=health,
        simulate_health_events=simulate_health_events,
    )
    try:
        run_until_signalled(run_plugin(opts))
    except (ckpt.CheckpointRefused, MpsRootRefused) as e:
        log.error("refusing to start", error=str(e))
        raise click.ClickException(str(e)) from None


def compute_modes(simulate: str | None) -> ComputeModes:
    """NVML for compute modes: the host's, or the simulated GPUs' own (FakeNvml keeps them)."""
    if simulate is None:
        import pynvml

        return ComputeModes(pynvml)
    from dra_driver.gpu.simulated import FakeNvml

    return ComputeModes(FakeNvml(load_profile(simulate)))


def default_state_dir(driver: str) -> Path:
    return Path("/run") / driver / "state"


SIMULATED_MIG_STATE: Final = "simulated-mig.json"


def simulated_mig_state(opts: PluginOptions) -> Path | None:
    """Where simulated GPUs keep their MIG instances with --dynamic-mig, so that they outlive
    the plugin as on a GPU (and, like on a GPU, end with the boot: the state dir is a tmpfs)."""
    return opts.state_dir / SIMULATED_MIG_STATE if opts.simulate is not None and opts.dynamic_mig else None


def mig_api(opts: PluginOptions) -> MigApi:
    """NVML for creating MIG instances: the host's, or the simulated GPUs' (FakeNvml)."""
    if opts.simulate is None:
        import pynvml

        return cast(MigApi, pynvml)
    from dra_driver.gpu.simulated import FakeNvml

    return FakeNvml(load_profile(opts.simulate), mig_state_file=simulated_mig_state(opts))


class RecordedInstances:
    """The dynamic MIG instances the checkpoint records now, re-read only when the file
    changed (it is replaced by a rename on every save: a new inode)."""

    def __init__(self, preparer: NodePreparer) -> None:
        self.preparer = preparer
        self._seen: tuple[int, int, int] | None = None
        self._records: list[MigRecord] = []

    def __call__(self) -> list[MigRecord]:
        try:
            st = self.preparer.steps.checkpoint_path.stat()
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key != self._seen:
                cp = self.preparer.read_checkpoint()
                self._records = [r for e in cp.claims.values() for r in e.mig]
                self._seen = key
        except (OSError, ckpt.CheckpointUnreadable, ckpt.CheckpointRefused):
            return []
        return self._records


@dataclass(frozen=True)
class PluginOptions:
    node_name: str
    driver: str
    kubelet_dir: Path
    cdi_dir: Path
    driver_root: Path | None  # None: / on a GPU node, no driver files for simulated GPUs
    dev_root: Path
    host_driver_root: Path | None
    simulate: str | None
    kubeconfig: str | None
    state_dir: Path
    mps_root: Path | None = None
    mps_host_cgroup: bool = False
    mps_exclusive_compute_mode: bool = False
    rolling_update_uid: str | None = None
    claim_read_timeout: float = DEFAULT_TIMEOUT_SECONDS
    list_attributes: Literal["auto", "on", "off"] = "auto"
    publish_slices: bool = True
    memory_shares: bool = False
    shares_only: bool = False  # each whole GPU as its share view alone (controller.capacity)
    dynamic_mig: bool = False  # MIG-mode GPUs carved by claims (docs/mig.md)
    legacy_attributes: bool = False  # also nvlinkGroup<N>, numaNode (controller.attributes.LEGACY_ATTRIBUTES)
    metrics_port: int = 0  # 0: no metrics or probe port
    metrics_bind_address: str = "0.0.0.0"
    health: HealthPolicy | None = field(default_factory=HealthPolicy)  # None: --no-health-monitor
    simulate_health_events: Path | None = None


async def run_plugin(opts: PluginOptions) -> None:
    raise_open_files_limit()
    inventory = await asyncio.to_thread(discover, opts.simulate, simulated_mig_state(opts))
    api = await kube.load_client(opts.kubeconfig)
    claims = ClaimReader(api, timeout=opts.claim_read_timeout)
    allocated = asked_once(lambda: claims.allocated_here(opts.driver, opts.node_name))
    # The instances this plugin made for claims are no static MIG: published as placements.
    # With an unreadable checkpoint they come from the claims recovery adopts (same answer).
    at_start = StartPaths(ckpt.checkpoint_path(opts.state_dir), ckpt.read_boot_id(), opts.driver,
                          opts.node_name, opts.cdi_dir)
    own = await instances_at_start(inventory, at_start, allocated, ask_api=opts.dynamic_mig)
    inventory = without_own(inventory, own)
    # Share views resolve whether or not they are published now: claims allocated while
    # --memory-shares was on must still prepare and recover after it is turned off.
    devices = node_devices(inventory)
    devices.update(share_views(devices))
    placements, carved = dynamic_devices(inventory) if opts.dynamic_mig else ({}, {})
    devices.update(carved)
    driver_files = await asyncio.to_thread(
        functools.partial(
            scan_driver_files,
            opts.driver_root,
            opts.dev_root,
            opts.simulate is not None,
            host_driver_root=opts.host_driver_root,
            gpu_minors=[g.minor for g in inventory.gpus],
        )
    )
    log.info(
        "hardware discovered", gpus=len(inventory.gpus), devices=sorted(devices), source=inventory.source
    )
    paths: PluginPaths = plugin_paths(opts.kubelet_dir, opts.driver, opts.rolling_update_uid)
    paths.data_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    opts.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    mps = MpsControl(
        opts.mps_root or mps_default_root(opts.driver),
        opts.driver_root or Path("/"),
        host_cgroup=opts.mps_host_cgroup,
        compute=compute_modes(opts.simulate) if opts.mps_exclusive_compute_mode else None,
    )
    preparer = NodePreparer(
        driver=opts.driver,
        pool=opts.node_name,
        devices=devices,
        claims=claims,
        driver_files=driver_files,
        cdi_dir=opts.cdi_dir,
        state_dir=opts.state_dir,
        sharing=Sharing(opts.driver, opts.node_name, mps),
        mig=MigInstances(mig_api(opts)) if opts.dynamic_mig else None,
        placements=placements,
    )
    # Another driver's state dir is refused first (its message names --state-dir, the usual
    # mistake), then another driver's MPS root, both before recovery touches anything.
    with contextlib.suppress(ckpt.CheckpointUnreadable):  # recovery quarantines it, keeping what pods use
        preparer.read_checkpoint()
    mps.claim_root(opts.driver)
    described = CreatedDevices(devices, placements, RecordedInstances(preparer)) if placements else devices
    claim_status = ClaimStatus(api, opts.driver, opts.node_name, described, nvlink_peers(inventory, devices))
    lease = Lease(paths.data_dir / PUBLISHER_LEASE)
    heartbeat = Heartbeat("slice-publisher", stuck_after=PUBLISHER_STUCK_SECONDS)
    probes = plugin_probes(
        paths.dra_socket, paths.registration_socket, heartbeat if opts.publish_slices else None
    )
    metrics.prepared_claims.set_function(lambda: len(preparer.read_checkpoint().claims))
    if opts.metrics_port:
        await probes.start(opts.metrics_bind_address, opts.metrics_port)

    tasks: list[asyncio.Task[None]] = []
    dra_server: SocketServer | None = None
    reg_server: SocketServer | None = None
    health: NodeHealth | None = None
    try:
        await preparer.recover(allocated)
        # a restarted plugin reports again what it holds (the kubelet does not prepare again)
        for entry in preparer.read_checkpoint().claims.values():
            if entry.phase is ckpt.ClaimPhase.COMPLETED:
                claim_status.prepared(ClaimRef(entry.namespace, entry.name, entry.uid), entry.devices)
        health = await _start_health(opts, inventory, described, paths.data_dir)
        if health is None:
            board = DeviceHealthBoard(opts.node_name, devices, "UNKNOWN", NOT_MONITORED)
            tasks.append(asyncio.create_task(keep_fresh(board, lambda: True), name="health-heartbeat"))
        else:
            board = DeviceHealthBoard(opts.node_name, devices)
            tasks += _health_tasks(api, opts, health, board, preparer, paths.data_dir)
            tasks.append(asyncio.create_task(claim_status.follow(health.keeper), name="claim-status-health"))
        dra_server = SocketServer("dra", lambda s: add_dra_services(s, preparer, board, claim_status))
        await dra_server.start(paths.dra_socket)
        registration = RegistrationService(opts.driver, str(paths.dra_socket))
        reg_server = SocketServer("registration", lambda s: add_registration(s, registration))
        await reg_server.start(paths.registration_socket)
        if opts.publish_slices:
            keeper = health.keeper if health else None
            publisher = _publish(api, opts, inventory, lease, keeper, heartbeat)
            tasks.append(asyncio.create_task(publisher, name="slice-publisher"))
            tasks[-1].add_done_callback(heartbeat.task_ended)
        await asyncio.Event().wait()
    finally:
        await probes.stop()
        if reg_server is not None:
            await reg_server.stop(grace=None)
        if dra_server is not None:
            await dra_server.stop(grace=5)
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await claim_status.stop()
        if health is not None:
            await health.stop()
        lease.release()
        await api.close()
        log.info("stopped")


async def _start_health(
    opts: PluginOptions, inventory: Inventory, devices: Mapping[str, NodeDevice], data_dir: Path
) -> NodeHealth | None:
    if opts.health is None:
        log.info("device health is not monitored (--no-health-monitor)")
        return None
    events_file = opts.simulate_health_events  # only when named: a writer of it can taint every GPU
    try:
        return await start_node_health(
            inventory, devices, opts.driver, opts.health, nvml_for(opts.simulate, events_file), count=_count
        )
    except HealthMonitorError as e:
        log.error("device health monitor not started; devices report Unknown", error=str(e))
        return None


def _count(kind: str, n: int) -> None:
    metrics.health_events.labels(kind=kind).inc(n)


def _health_tasks(
    api: ApiClient,
    opts: PluginOptions,
    health: NodeHealth,
    board: DeviceHealthBoard,
    preparer: NodePreparer,
    data_dir: Path,
) -> list[asyncio.Task[None]]:
    def uses() -> list[ClaimUse]:
        pool = opts.node_name
        return [
            ClaimUse(e.namespace, e.name, e.uid, tuple(d.device for d in e.devices if d.pool == pool))
            for e in preparer.read_checkpoint().claims.values()
        ]

    keeper = health.keeper
    events = ClaimEvents(api, opts.driver, opts.node_name, claims_using(uses))
    return [
        asyncio.create_task(keeper.settle_forever(), name="health-settle"),
        asyncio.create_task(mirror(board, keeper), name="health-stream"),
        asyncio.create_task(keep_fresh(board, health.alive), name="health-heartbeat"),
        asyncio.create_task(history.keep_file(keeper, data_dir / history.FILE_NAME), name="health-history"),
        asyncio.create_task(events.follow(keeper), name="health-events"),
    ]


async def _follow_taints(ctl: SliceController, keeper: HealthKeeper, pool: str) -> None:
    """The keeper's taints into the pool's slices; changes within TAINT_WRITE_INTERVAL coalesce."""
    async for snapshot in keeper.watch():
        taints = snapshot.taints()
        if ctl.set_taints(pool, taints):
            log.info("publishing device taints", taints={d: [f"{t.key}={t.value}:{t.effect}" for t in ts]
                                                         for d, ts in taints.items()})
        await asyncio.sleep(TAINT_WRITE_INTERVAL)


async def _publish(
    api: ApiClient,
    opts: PluginOptions,
    inventory: Inventory,
    lease: Lease,
    keeper: HealthKeeper | None,
    heartbeat: Heartbeat | None = None,
) -> None:
    """Publish this node's slices while holding the lease; during a rolling update the
    instance that comes second waits until the first one exits, then takes over."""
    waiting_logged = False
    while not lease.try_acquire():
        if not waiting_logged:
            log.info(
                "another instance publishes this node's slices; waiting to take over", lease=str(lease.path)
            )
            waiting_logged = True
        await asyncio.sleep(LEASE_POLL_SECONDS)
    log.info("publishing this node's ResourceSlices", lease=str(lease.path))
    ctl = await slice_controller(
        api, opts.driver, {opts.node_name: inventory}, opts.list_attributes, memory_shares=opts.memory_shares,
        shares_only=opts.shares_only, dynamic_mig=opts.dynamic_mig, legacy_attributes=opts.legacy_attributes,
        taints=keeper is not None,
    )
    ctl.heartbeat = heartbeat
    if keeper is None:
        await ctl.run()
    else:
        await asyncio.gather(ctl.run(), _follow_taints(ctl, keeper, opts.node_name))
