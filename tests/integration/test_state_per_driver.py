"""A plugin of one driver started on another driver's state, as an operator who points two
releases at one state dir would: the real `dra-driver kubelet-plugin` process refuses to
start with a message naming both drivers and what to change, and leaves every file as it
was; the first driver's plugin then starts on it and still knows its claim.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client

from dra_driver.plugin import checkpoint as ckpt
from tests.harness.claims import allocated_claim
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_node

pytestmark = pytest.mark.integration

PROFILE = "l4x4"
OTHER_DRIVER = "gpu-b.dra-driver.dev"
NO_SLICES = ("--no-publish-slices",)  # the claim is allocated by hand


def _files(root: Path) -> dict[str, tuple[bytes, int]]:
    """The checkpoint, its lock and the CDI specs under `root`: content and mtime."""
    wanted = [*root.glob("state/*"), *root.glob("cdi/*")]
    files = [p for p in sorted(wanted) if p.is_file()]
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def test_a_plugin_on_another_drivers_checkpoint_refuses_and_changes_nothing(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, unique: str, node_root: Path
) -> None:
    node = f"drv-{unique}"
    create_node(api, node)
    first = DriverProcess(node, PROFILE, control_plane.kubeconfig, node_root, extra_args=NO_SLICES).start()
    try:
        claim = allocated_claim(api, namespace, "kept", [{"pool": node, "device": "gpu-1"}], node)
        ref = ClaimName(namespace, "kept", claim["metadata"]["uid"])
        kubelet = KubeletSide(first.registration_socket())
        assert kubelet.prepare(ref).claims[ref.uid].error == ""
        kubelet.close()
        first.stop()
        written = ckpt.load(ckpt.checkpoint_path(first.state_dir), ckpt.read_boot_id()).checkpoint
        assert written.driver == DRIVER
        before = _files(node_root)

        second = DriverProcess(node, PROFILE, control_plane.kubeconfig, node_root,
                               extra_args=(*NO_SLICES, "--driver-name", OTHER_DRIVER))
        second.start(wait=False)
        assert second.wait_exit(timeout=60) != 0
        log = second.log_tail(20000)
        assert "refusing to start" in log and DRIVER in log and OTHER_DRIVER in log, log
        assert "--state-dir" in log, "the message says what to change"
        assert _files(node_root) == before, "the refused plugin changed the first driver's files"

        first.start()
        kubelet = KubeletSide(first.registration_socket())
        assert kubelet.prepare(ref).claims[ref.uid].error == "", "the first driver still knows its claim"
        kubelet.close()
    finally:
        first.stop()
