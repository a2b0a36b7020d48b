"""Two drivers given one MPS root, the first's kept from a release that wrote no owner file
(issue 49, item 5): the second driver's real `dra-driver kubelet-plugin` refuses to start,
names the fix (its own --mps-root) and the claim whose daemon lives there, and leaves the
first driver's live MPS daemon running and the root without an owner; the first driver,
restarted on that root, takes it (its checkpoint knows the claim) and keeps its daemon.

The daemons are the stand-in `nvidia-cuda-mps-control` (tests/harness/fake_mps.py) under a
driver root both plugins share; the claim is allocated by hand.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.layout import OWNER_FILE
from tests.harness.claims import allocated_claim
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.fake_mps import shared_mps_root
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_node, wait_for

pytestmark = pytest.mark.integration

PROFILE = "l4x4"
OTHER_DRIVER = "gpu-b.dra-driver.dev"
MPS = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}


@pytest.fixture
def shared_root() -> Iterator[Path]:
    with shared_mps_root("dra-own-") as path:
        yield path


def _plugin(node: str, kubeconfig: Path, shared: Path, name: str, *args: str) -> DriverProcess:
    """A plugin with state, CDI and kubelet dirs of its own under `shared/name`, on the
    shared MPS root and driver root (a later flag wins over the harness's --mps-root)."""
    shared_dirs = ("--driver-root", str(shared / "driver"), "--mps-root", str(shared / "mps"))
    return DriverProcess(node, PROFILE, kubeconfig, shared / name,
                         extra_args=("--no-publish-slices", *shared_dirs, *args))


def test_a_root_without_owner_is_not_taken_while_another_drivers_daemon_lives_in_it(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, unique: str, shared_root: Path
) -> None:
    node = f"own-{unique}"
    create_node(api, node)
    mps = MpsControl(shared_root / "mps", shared_root / "driver")
    first = _plugin(node, control_plane.kubeconfig, shared_root, "a").start()
    second = _plugin(node, control_plane.kubeconfig, shared_root, "b", "--driver-name", OTHER_DRIVER)
    try:
        results = [{"pool": node, "device": "gpu-1"}]
        claim = allocated_claim(api, namespace, "mps", results, node, parameters=MPS)
        ref = ClaimName(namespace, "mps", claim["metadata"]["uid"])
        kubelet = KubeletSide(first.registration_socket())
        assert kubelet.prepare(ref).claims[ref.uid].error == ""
        kubelet.close()
        assert mps.is_running(ref.uid)
        (shared_root / "mps" / OWNER_FILE).unlink()  # as a release before owner files left it

        second.data_dir.mkdir(parents=True)  # the harness's health-events file is under DRIVER's name
        second.start(wait=False)
        proc = second.proc
        assert proc is not None
        wait_for("the second driver to exit or to stop the first's daemon",
                 lambda: proc.poll() is not None or not mps.is_running(ref.uid) or None, timeout=60)
        assert mps.is_running(ref.uid), "the second driver stopped the first driver's live MPS daemon"
        assert second.wait_exit() != 0, "the second driver started on the first's MPS root"
        log = second.log_tail(20000)
        assert "refusing to start" in log and "--mps-root" in log and ref.uid in log, log
        assert not (shared_root / "mps" / OWNER_FILE).exists(), "the refused plugin took the root"

        first.stop()  # the first driver's next start takes the root: its checkpoint knows the claim
        first.start()
        owner = json.loads((shared_root / "mps" / OWNER_FILE).read_text())
        assert owner == {"driver": DRIVER}
        assert mps.is_running(ref.uid), "the first driver stopped its own claim's daemon"
        kubelet = KubeletSide(first.registration_socket())
        assert kubelet.prepare(ref).claims[ref.uid].error == ""
        kubelet.close()
    finally:
        second.stop()
        first.stop()
