"""The node daemon, assembled in one place: `build(options)` gathers the node's hardware,
state and API client into a `PluginNode`; `start()` serves the kubelet; `stop()` undoes it.

Start order matters to the kubelet: discover the hardware, recover the prepared-claim state,
serve the DRA socket, and only then create the registration socket (the kubelet calls GetInfo
and connects as soon as it appears). What the kubelet does not wait for starts after that:
the probe port and the slice publisher (imported then: most of the daemon's import time is
theirs). On stop the registration socket goes first (the kubelet stops sending calls), then
the DRA server drains. Slices are left in place: the kubelet removes them if no plugin comes
back, and a restarting plugin must not make the pool vanish.

Wiring only: every loop lives beside what it keeps. Must not parse options (`commands` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog

from dra_driver import kube, metrics
from dra_driver.devices import NodeDevice, node_devices
from dra_driver.driver_root import scan_driver_files
from dra_driver.gpu import GpuBackend, choose_backend, read_inventory
from dra_driver.gpu.compute_mode import ComputeModes
from dra_driver.gpu.mig import MigInstances
from dra_driver.gpu.model import Inventory
from dra_driver.health.effects import DeviceTaint
from dra_driver.health.keeper import HealthKeeper
from dra_driver.health.node import NodeHealth
from dra_driver.imex.channels import node_clique
from dra_driver.imex.daemons import ImexDaemons
from dra_driver.kube import ApiClient
from dra_driver.node.options import NodeOptions
from dra_driver.plugin import checkpoint as ckpt
from dra_driver.plugin.channel_gate import ChannelGate
from dra_driver.plugin.claim_source import ClaimReader
from dra_driver.plugin.claim_status import ClaimStatus, nvlink_peers
from dra_driver.plugin.claims import ClaimRef
from dra_driver.plugin.health import NOT_MONITORED, DeviceHealthBoard, keep_fresh
from dra_driver.plugin.lock import Lease
from dra_driver.plugin.mig_steps import CreatedDevices, dynamic_devices, without_own
from dra_driver.plugin.node_health import health_tasks, start_health
from dra_driver.plugin.recorded import RecordedInstances
from dra_driver.plugin.recovery import ListAllocated, StartPaths, asked_once, instances_at_start
from dra_driver.plugin.registration import RegistrationService, add_registration
from dra_driver.plugin.server import SocketServer, raise_open_files_limit
from dra_driver.plugin.service import add_dra_services
from dra_driver.plugin.sick_devices import TaintsOf
from dra_driver.plugin.sockets import PluginPaths, plugin_paths
from dra_driver.plugin.state import NodePreparer
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.errors import MpsRootRefused
from dra_driver.sharing.mps.layout import default_root as mps_default_root
from dra_driver.sharing.policy import Sharing
from dra_driver.sharing.shares import share_views

if TYPE_CHECKING:
    from dra_driver.probes import ProbeServer

log = structlog.get_logger(__name__)

PUBLISHER_LEASE: Final = "publisher.lock"
# A reconcile pass of one node's slices takes well under a second; minutes mean a hung call.
PUBLISHER_STUCK_SECONDS: Final = 180.0
# The node's API connections over HTTP/1.1 (a near API server, or one without HTTP/2; to a far
# one all requests are streams of one HTTP/2 connection): the claim reads of a Prepare burst,
# the claim status writes and the slice publisher's watch share them. Each TLS connection holds
# asyncio's 256 KiB SSL read buffer and OpenSSL's state while it is kept alive: 8 instead of the
# client's 64 lowered the RSS after 16 Prepares at once, without slowing that burst
# (benchmarks.prepare --baseline-ref).
API_CONNECTIONS: Final = 8
# What refuses a start (another driver's state dir or MPS root): said once, no traceback.
REFUSALS: Final = (ckpt.CheckpointRefused, MpsRootRefused)


@dataclass
class PluginNode:
    """One node's daemon, built and not yet serving."""

    opts: NodeOptions
    api: ApiClient
    gpus: GpuBackend  # the process's one NVML: discovery, compute modes, MIG, health
    inventory: Inventory
    devices: dict[str, NodeDevice]
    described: Mapping[str, NodeDevice]  # devices, and the MIG instances claims created
    paths: PluginPaths
    preparer: NodePreparer
    claim_status: ClaimStatus
    allocated: ListAllocated
    lease: Lease
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    health: NodeHealth | None = None
    probes: ProbeServer | None = None
    dra: SocketServer | None = None
    registration: SocketServer | None = None

    async def start(self) -> None:
        """Recover, serve the DRA socket, register with the kubelet; then the probes and publisher."""
        opts, preparer = self.opts, self.preparer
        await preparer.recover(self.allocated)
        # a restarted plugin reports again what it holds (the kubelet does not prepare again)
        for entry in preparer.read_checkpoint().claims.values():
            if entry.phase is ckpt.ClaimPhase.COMPLETED:
                self.claim_status.prepared(ClaimRef(entry.namespace, entry.name, entry.uid), entry.devices)
        self.health = await start_health(self.inventory, self.described, opts.driver_name, opts.health,
                                         self.gpus.nvml)
        if self.health is None:
            board = DeviceHealthBoard(opts.node_name, self.devices, "UNKNOWN", NOT_MONITORED)
            self._task(keep_fresh(board, lambda: True), "health-heartbeat")
        else:
            board = DeviceHealthBoard(opts.node_name, self.devices)
            preparer.taints_of = device_taints(self.health.keeper)
            self.tasks += health_tasks(self.api, opts.driver_name, opts.node_name, self.health, board,
                                       preparer, self.paths.data_dir)
            self._task(self.claim_status.follow(self.health.keeper), "claim-status-health")
        self.dra = SocketServer("dra", lambda s: add_dra_services(s, preparer, board, self.claim_status))
        await self.dra.start(self.paths.dra_socket)
        registration = RegistrationService(opts.driver_name, str(self.paths.dra_socket))
        self.registration = SocketServer("registration", lambda s: add_registration(s, registration))
        await self.registration.start(self.paths.registration_socket)
        await self._after_registration()

    async def _after_registration(self) -> None:
        opts = self.opts
        # Loaded in a worker thread: the event loop keeps answering the kubelet meanwhile.
        await asyncio.to_thread(_load_late_modules, opts.publish_slices)
        from dra_driver.probes import Heartbeat, plugin_probes

        heartbeat = Heartbeat("slice-publisher", stuck_after=PUBLISHER_STUCK_SECONDS)
        self.probes = plugin_probes(self.paths.dra_socket, self.paths.registration_socket,
                                    heartbeat if opts.publish_slices else None)
        if opts.metrics_port:
            await self.probes.start(opts.metrics_bind_address, opts.metrics_port)
        if opts.publish_slices:
            from dra_driver.node.publishing import publish

            keeper = self.health.keeper if self.health else None
            publisher = publish(self.api, opts, self.inventory, self.lease, keeper, heartbeat)
            self._task(publisher, "slice-publisher")
            self.tasks[-1].add_done_callback(heartbeat.task_ended)
        # What start made (modules, grpc's and protobuf's tables, the inventory) lives as long as
        # the process. Frozen, the collector's full passes stop walking it: otherwise the first
        # such pass after start held up one Prepare. Once, after registration.
        gc.collect()
        gc.freeze()

    def _task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self.tasks.append(asyncio.create_task(coro, name=name))

    async def stop(self) -> None:
        if self.probes is not None:
            await self.probes.stop()
        if self.registration is not None:  # first: the kubelet stops sending calls
            await self.registration.stop(grace=None)
        if self.dra is not None:
            await self.dra.stop(grace=5)
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.claim_status.stop()
        if self.health is not None:
            await self.health.stop()
        self.lease.release()
        await self.api.close()
        log.info("stopped")


def device_taints(keeper: HealthKeeper) -> TaintsOf:
    """A device's health taints now; a part or share of a GPU (`gpu-<i>-...`) also has its GPU's."""
    def taints_of(name: str) -> tuple[DeviceTaint, ...]:
        views = keeper.views
        own = views[name].taints if name in views else ()
        parent = "-".join(name.split("-")[:2])
        return own + (views[parent].taints if parent != name and parent in views else ())
    return taints_of


def _load_late_modules(publishing: bool) -> None:
    """Import what starts after registration: the probe server and the slice publisher (the
    controller and its API capability checks)."""
    import dra_driver.probes
    if publishing:
        import dra_driver.node.publishing  # noqa: F401


async def build(opts: NodeOptions) -> PluginNode:
    """Discover the hardware, read the API client's config, make the dirs, and refuse another
    driver's state dir or MPS root before recovery touches anything."""
    raise_open_files_limit()
    metrics.serve_claim_identity(opts.claim_identity_metric)
    # made first: a simulated node's injected health events live in the data dir
    paths = plugin_paths(opts.kubelet_dir, opts.driver_name, opts.rolling_update_uid)
    paths.data_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    opts.state.mkdir(parents=True, exist_ok=True, mode=0o700)
    gpus = choose_backend(opts.simulate, mig_state_file=opts.simulated_mig_state,
                          events_file=opts.simulate_health_events)
    inventory = await asyncio.to_thread(read_inventory, gpus)
    api = await kube.load_client(opts.kubeconfig, connections=API_CONNECTIONS)
    claims = ClaimReader(api, timeout=opts.claim_read_timeout)
    allocated = asked_once(lambda: claims.allocated_here(opts.driver_name, opts.node_name))
    # The instances this plugin made for claims are no static MIG: published as placements.
    # With an unreadable checkpoint they come from the claims recovery adopts (same answer).
    at_start = StartPaths(ckpt.checkpoint_path(opts.state), ckpt.read_boot_id(), opts.driver_name,
                          opts.node_name, opts.cdi_dir)
    own = await instances_at_start(inventory, at_start, allocated, ask_api=opts.dynamic_mig)
    inventory = without_own(inventory, own)
    # Share views resolve whether or not they are published now: claims allocated while
    # --memory-shares was on must still prepare and recover after it is turned off.
    devices = node_devices(inventory)
    devices.update(share_views(devices))
    placements, carved = dynamic_devices(inventory) if opts.dynamic_mig else ({}, {})
    devices.update(carved)
    driver_files = await asyncio.to_thread(functools.partial(
        scan_driver_files, opts.driver_root, opts.dev_root, opts.simulate is not None,
        host_driver_root=opts.host_driver_root, gpu_minors=[g.minor for g in inventory.gpus],
    ))
    log.info(
        "hardware discovered", gpus=len(inventory.gpus), devices=sorted(devices), source=inventory.source
    )
    mps = MpsControl(
        opts.mps_root or mps_default_root(opts.driver_name),
        opts.driver_root or Path("/"),
        host_cgroup=opts.mps_host_cgroup,
        compute=ComputeModes(gpus.nvml) if opts.mps_exclusive_compute_mode else None,
    )
    imex = ImexDaemons(
        opts.imex_root or Path("/run") / opts.driver_name / "imex", opts.driver_root or Path("/"),
        host_cgroup=opts.mps_host_cgroup,
    ) if opts.compute_domains else None
    preparer = NodePreparer(
        driver=opts.driver_name,
        pool=opts.node_name,
        devices=devices,
        claims=claims,
        driver_files=driver_files,
        cdi_dir=opts.cdi_dir,
        state_dir=opts.state,
        sharing=Sharing(opts.driver_name, opts.node_name, mps),
        mig=MigInstances(gpus.nvml) if opts.dynamic_mig else None,
        placements=placements,
        imex=imex,
        channel_major=driver_files.imex_channels_major,
    )
    if imex is not None:
        preparer.gate = ChannelGate(api, opts.driver_name, opts.node_name, node_clique(inventory), imex,
                                    preparer.steps.lock_path, node_ip=opts.node_ip,
                                    wait_seconds=opts.compute_domain_wait)
    # Another driver's state dir is refused first (its message names --state-dir, the usual
    # mistake), then another driver's MPS root, both before recovery touches anything.
    with contextlib.suppress(ckpt.CheckpointUnreadable):  # recovery quarantines it, keeping what pods use
        preparer.read_checkpoint()
    await _claim_mps_root(mps, preparer, opts.driver_name, allocated)
    described = CreatedDevices(devices, placements, RecordedInstances(preparer)) if placements else devices
    claim_status = ClaimStatus(api, opts.driver_name, opts.node_name, described,
                               nvlink_peers(inventory, devices))
    metrics.prepared_claims.set_function(lambda: len(preparer.read_checkpoint().claims))
    return PluginNode(opts, api, gpus, inventory, devices, described, paths, preparer, claim_status,
                      allocated, Lease(paths.data_dir / PUBLISHER_LEASE))


async def _claim_mps_root(
    mps: MpsControl, preparer: NodePreparer, driver: str, allocated: ListAllocated
) -> None:
    """Take the MPS root unless another driver's daemons live in it. A daemon is this
    driver's when its claim is in the checkpoint, or, where the checkpoint was lost, when
    the API server says the claim is allocated here to this driver (asked only then)."""

    def prepared() -> frozenset[str]:
        try:
            return frozenset(preparer.read_checkpoint().claims)
        except ckpt.CheckpointUnreadable:
            return frozenset()

    from_api: frozenset[str] = frozenset()
    unanswered = False
    if mps.live_claims() - prepared():
        listed = await allocated()
        unanswered = listed is None
        from_api = frozenset(str((c.get("metadata") or {}).get("uid", "")) for c in listed or [])
    mps.claim_root(driver, lambda: prepared() | from_api, api_unanswered=unanswered)


async def run(opts: NodeOptions) -> None:
    """Build, start and serve until cancelled (a signal), then stop."""
    node = await build(opts)
    try:
        await node.start()
        await asyncio.Event().wait()
    finally:
        await node.stop()
