"""The driver's own NodePreparer over a simulated node, for unit tests of Prepare with MPS and
shares: the profile's devices (with share views when asked), the driver files the profile's
GPU minors give, CDI specs and state under one folder. Nothing here starts a process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dra_driver import DEFAULT_DRIVER_NAME as DRIVER
from dra_driver.devices import node_devices
from dra_driver.driver_root import scan_driver_files
from dra_driver.gpu import discover
from dra_driver.plugin.state import NodePreparer
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.policy import Sharing
from dra_driver.sharing.shares import share_views
from tests.harness.claims_in_memory import ClaimsInMemory


def preparer_factory(
    root: Path, mps: MpsControl, pool: str, profile: str = "h200-single", shares: bool = False
) -> Callable[..., NodePreparer]:
    """make(*claims): a new NodePreparer (as a restarted plugin makes) serving `claims`, on the
    same node dirs under `root` each time."""
    inventory = discover(profile)
    files = scan_driver_files(None, "/dev", True, gpu_minors=[g.minor for g in inventory.gpus])
    devices = node_devices(inventory)
    if shares:
        devices.update(share_views(devices))

    def make(*claims: dict[str, Any]) -> NodePreparer:
        (root / "state").mkdir(exist_ok=True)
        return NodePreparer(
            driver=DRIVER,
            pool=pool,
            devices=devices,
            claims=ClaimsInMemory(*claims),
            driver_files=files,
            cdi_dir=root / "cdi",
            state_dir=root / "state",
            sharing=Sharing(DRIVER, pool, mps),
            boot_id="boot-1",
        )

    return make
