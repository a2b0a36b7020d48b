"""`dra-driver kubelet-plugin`: the node daemon, both halves in one process.

Start order matters to the kubelet: discover the hardware, recover the prepared-claim
state, serve the DRA socket, and only then create the registration socket (the kubelet
calls GetInfo and connects as soon as it appears). The slice controller runs beside
the servers. On SIGTERM the registration socket goes first (the kubelet stops sending
calls), then the DRA server drains. Slices are left in place: the kubelet removes
them if no plugin comes back, and a restarting plugin must not make the pool vanish.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc
import structlog

from controller.publisher import slice_controller
from dra_driver import kube
from dra_driver.devices import node_devices
from dra_driver.driver_root import scan_driver_files
from dra_driver.gpu import discover
from dra_driver.mps import MpsControl
from dra_driver.mps import default_root as mps_default_root
from dra_driver.plugin.claims import ClaimRef, ClaimRejected
from dra_driver.plugin.health import DeviceHealthBoard
from dra_driver.plugin.registration import RegistrationService, add_registration
from dra_driver.plugin.service import add_services
from dra_driver.plugin.sockets import PluginPaths, plugin_paths, prepare_socket_path, restrict_socket
from dra_driver.plugin.state import NodePreparer

log = structlog.get_logger(__name__)


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
    mps_root: Path | None = None
    rolling_update_uid: str | None = None
    list_attributes: Literal["auto", "on", "off"] = "auto"
    publish_slices: bool = True


async def _serve(socket: Path, register: object, name: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    register(server)  # type: ignore[operator]
    prepare_socket_path(socket)
    server.add_insecure_port(f"unix://{socket}")
    restrict_socket(socket)
    await server.start()
    log.info("serving", server=name, socket=str(socket))
    return server


async def run_plugin(opts: PluginOptions) -> None:
    inventory = await asyncio.to_thread(discover, opts.simulate)
    devices = node_devices(inventory)
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

    api = await kube.load_client(opts.kubeconfig)

    async def fetch_claim(ref: ClaimRef) -> kube.JSON:
        path = f"/apis/resource.k8s.io/v1/namespaces/{ref.namespace}/resourceclaims/{ref.name}"
        try:
            return await kube.request(api, "GET", path)
        except kube.ApiException as e:
            if e.status == 404:
                raise ClaimRejected(f"claim {ref.namespace}/{ref.name} does not exist (any more)") from e
            raise

    preparer = NodePreparer(
        driver=opts.driver,
        pool=opts.node_name,
        devices=devices,
        fetch_claim=fetch_claim,
        driver_files=driver_files,
        cdi_dir=opts.cdi_dir,
        data_dir=paths.data_dir,
        mps=MpsControl(opts.mps_root or mps_default_root(opts.driver), opts.driver_root or Path("/")),
    )
    await preparer.recover()
    board = DeviceHealthBoard(opts.node_name, devices)

    tasks: list[asyncio.Task[None]] = []
    dra_server = reg_server = None
    try:
        if opts.publish_slices:
            ctl = await slice_controller(api, opts.driver, {opts.node_name: inventory}, opts.list_attributes)
            tasks.append(asyncio.create_task(ctl.run(), name="slice-controller"))
        dra_server = await _serve(paths.dra_socket, lambda s: add_services(s, preparer, board), "dra")
        registration = RegistrationService(opts.driver, str(paths.dra_socket))
        reg_server = await _serve(
            paths.registration_socket, lambda s: add_registration(s, registration), "registration"
        )
        await asyncio.Event().wait()
    finally:
        if reg_server is not None:
            await reg_server.stop(grace=None)
        if dra_server is not None:
            await dra_server.stop(grace=5)
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await api.close()
        log.info("stopped")
