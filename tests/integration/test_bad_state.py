"""Bad state met as an outsider would meet it, against the real plugin process and API server.

An unreadable checkpoint (a directory in its place, a torn file, `{}`) must not stop the
plugin nor cost a running pod its devices: the specs of claims still allocated to the node
stay and are adopted, only those of deleted claims go. A checkpoint from a newer build
stops the plugin with a message naming that build, and is left as it was. A hung API server
(SIGSTOP) gives each waiting claim a clear error well inside the kubelet's 45 s.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client

from dra_driver.plugin import checkpoint as ckpt
from tests.harness.claims import allocated_claim
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_device_class, create_node, sync_request

PROFILE = "l4x4"
NO_SLICES = ("--no-publish-slices",)  # claims are allocated by hand; other tests' must not land here


@pytest.fixture
def node(api: client.ApiClient, unique: str) -> str:
    name = f"bad-{unique}"
    create_node(api, name)
    create_device_class(api, name, f'device.driver == "{DRIVER}"')  # the class is named like the node
    return name


def _claim(api: client.ApiClient, namespace: str, node: str, name: str, device: str) -> ClaimName:
    claim = allocated_claim(api, namespace, name, [{"pool": node, "device": device}], node)
    m = claim["metadata"]
    return ClaimName(m["namespace"], m["name"], m["uid"])


def _specs(proc: DriverProcess) -> set[str]:
    return {p.stem.split("_", 1)[1] for p in proc.cdi_dir.glob(f"{DRIVER}-gpu_*.json")}


def _prepare(proc: DriverProcess, *refs: ClaimName) -> dict[str, str]:
    """claim UID -> error text ('' when prepared)."""
    kubelet = KubeletSide(proc.registration_socket())
    try:
        answer = kubelet.prepare(*refs)
        return {r.uid: answer.claims[r.uid].error for r in refs}
    finally:
        kubelet.close()


def _torn(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:50])


def _directory(path: Path) -> None:
    path.unlink()
    (path / "not-a-checkpoint").mkdir(parents=True)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "a directory": _directory,
    "torn": _torn,
    "empty object": lambda path: path.write_text("{}"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_an_unreadable_checkpoint_never_removes_what_running_pods_use(
    control_plane: ControlPlane,
    api: client.ApiClient,
    namespace: str,
    node: str,
    node_root: Path,
    damage: str,
) -> None:
    proc = DriverProcess(node, PROFILE, control_plane.kubeconfig, node_root, extra_args=NO_SLICES).start()
    try:
        running = _claim(api, namespace, node, "running", "gpu-0")
        deleted = _claim(api, namespace, node, "deleted", "gpu-1")
        assert _prepare(proc, running, deleted) == {running.uid: "", deleted.uid: ""}
        proc.stop()
        sync_request(api, "DELETE", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/deleted")
        DAMAGE[damage](ckpt.checkpoint_path(proc.state_dir))

        proc.start()
        assert _specs(proc) == {running.uid}, "the running pod's spec stays; the deleted claim's goes"
        assert list(proc.state_dir.glob("checkpoint.json.corrupt-*")), "moved aside for a person to read"
        assert "unreadable checkpoint moved aside" in proc.log_tail(20000)
        adopted = ckpt.load(ckpt.checkpoint_path(proc.state_dir), ckpt.read_boot_id()).checkpoint
        assert set(adopted.claims) == {running.uid}
        thief = _claim(api, namespace, node, "thief", "gpu-0")
        assert "already prepared for claim" in _prepare(proc, thief)[thief.uid]
        assert _prepare(proc, running) == {running.uid: ""}
    finally:
        proc.stop(signal.SIGKILL)


def test_a_checkpoint_from_a_newer_build_stops_the_plugin_and_is_kept(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, node: str, node_root: Path
) -> None:
    proc = DriverProcess(node, PROFILE, control_plane.kubeconfig, node_root, extra_args=NO_SLICES).start()
    try:
        ref = _claim(api, namespace, node, "kept", "gpu-2")
        assert _prepare(proc, ref) == {ref.uid: ""}
        proc.stop()
        path = ckpt.checkpoint_path(proc.state_dir)
        doc = json.loads(path.read_text())
        doc.update(version=ckpt.FORMAT_VERSION + 1, writtenBy="gpu-dra-driver 9.0.0")
        path.write_text(json.dumps(doc))
        before = path.read_bytes()
        proc.start(wait=False)
        code = proc.wait_exit(timeout=30)
        assert code != 0
        log = proc.log_tail(20000)
        assert "written by gpu-dra-driver 9.0.0" in log and "refusing to start" in log
        assert path.read_bytes() == before and _specs(proc) == {ref.uid}
    finally:
        proc.stop(signal.SIGKILL)


def test_a_hung_api_server_gives_each_claim_a_clear_error_in_time(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, node: str, node_root: Path
) -> None:
    proc = DriverProcess(
        node,
        PROFILE,
        control_plane.kubeconfig,
        node_root,
        extra_args=("--claim-read-timeout", "3", "--no-publish-slices"),
    ).start()
    apiserver = control_plane.processes["kube-apiserver"].pid
    refs = [_claim(api, namespace, node, f"wait{i}", f"gpu-{i}") for i in range(3)]
    try:
        os.kill(apiserver, signal.SIGSTOP)
        started = time.monotonic()
        errors = _prepare(proc, *refs)
        elapsed = time.monotonic() - started
    finally:
        os.kill(apiserver, signal.SIGCONT)
    try:
        assert elapsed < 10, f"answered after {elapsed:.1f} s"
        for ref in refs:
            expected = f"timed out after 3 s reading ResourceClaim {namespace}/{ref.name} from the API server"
            assert expected in errors[ref.uid], errors[ref.uid]
        assert _specs(proc) == set()
        assert _prepare(proc, *refs) == {r.uid: "" for r in refs}, "served again once the API server is back"
    finally:
        proc.stop(signal.SIGKILL)
