"""The ResourceSlice controller against the real API server: publish, repair, stay quiet, survive outages,
and the node-scoped write policy."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller.plan import SLICES
from controller.publisher import slice_controller
from dra_driver import kube
from dra_driver.devices import node_devices
from dra_driver.gpu import discover, profile_names
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, spawn_dra_driver
from tests.harness.objects import (
    create_node,
    create_object,
    load_yaml_documents,
    sync_request,
    wait_for,
    watch_for,
)

REPO = Path(__file__).resolve().parents[2]


def _slices(api: client.ApiClient, node: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = sync_request(
        api, "GET", SLICES, query={"fieldSelector": f"spec.nodeName={node}"}
    )["items"]
    return items


def test_every_profile_is_published_and_accepted(control_plane: ControlPlane, api: client.ApiClient) -> None:
    """All simulated machines at once through the real reconcile loop; the server keeps what we sent."""
    inventories = {f"profile-{name}": discover(name) for name in profile_names()}
    for node in inventories:
        create_node(api, node)

    async def publish() -> dict[str, int]:
        aio = await kube.load_client(str(control_plane.kubeconfig))
        try:
            ctl = await slice_controller(aio, DRIVER, inventories, "auto")
            task = asyncio.create_task(ctl.run())
            await asyncio.wait_for(ctl.synced.wait(), 60)
            task.cancel()
            return {"errors": ctl.stats.errors, "writes": ctl.stats.writes}
        finally:
            await aio.close()

    stats = asyncio.run(publish())
    assert stats["errors"] == 0
    for node, inventory in inventories.items():
        slices = _slices(api, node)
        devices = [d for s in slices for d in s["spec"].get("devices", [])]
        expected = len(node_devices(inventory))
        assert len(devices) == expected, node
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
        assert all(
            o["kind"] == "Node" and o["name"] == node
            for s in slices
            for o in s["metadata"]["ownerReferences"]
        )
    described = control_plane.kubectl(
        "describe", "resourceslice", _slices(api, "profile-dgx1-v100")[0]["metadata"]["name"]
    ).stdout
    for readable in (
        "Product Name:",
        "Tesla V100",
        "nvlinkClique0",
        "Memory:",
        "Cuda Compute Capability:",
        "7.0.0",
    ):
        assert readable in described


@pytest.fixture
def controller_process(
    control_plane: ControlPlane, api: client.ApiClient, tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    node = f"ctl-{tmp_path.name[-12:].lower().strip('_')}".replace("_", "-")
    create_node(api, node)
    log = tmp_path / "controller.log"
    args = [
        "controller",
        "--node-name",
        node,
        "--simulate",
        "dgx1-v100",
        "--kubeconfig",
        str(control_plane.kubeconfig),
    ]
    proc = spawn_dra_driver(args, log, log_level="info")
    try:
        wait_for("slices published", lambda: _slices(api, node), timeout=30)
        yield node, proc, log
    finally:
        proc.terminate()
        proc.wait(15)


def _slice_writes(control_plane: ControlPlane) -> int:
    """Write requests to resourceslices served so far, from the API server's own metrics."""
    _, metrics = control_plane.get("/metrics", timeout=10)
    total = 0
    for line in metrics.splitlines():
        if line.startswith("apiserver_request_total{") and 'resource="resourceslices"' in line:
            verb = re.search(r'verb="([A-Z]+)"', line)
            if verb and verb.group(1) in ("POST", "PUT", "PATCH", "DELETE", "APPLY", "CREATE", "UPDATE"):
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


def _settled_slice_writes(control_plane: ControlPlane, quiet: float = 2.0) -> int:
    """`_slice_writes` once it has not moved for `quiet` seconds (the writes of a repair done)."""
    last = [_slice_writes(control_plane), time.monotonic()]

    def settled() -> bool:
        now = _slice_writes(control_plane)
        if now != last[0]:
            last[:] = [now, time.monotonic()]
        return time.monotonic() - last[1] >= quiet

    wait_for(f"no slice write for {quiet} s", settled, timeout=60, detail=lambda: f"{last[0]} writes")
    return int(last[0])


def test_deleted_or_edited_slice_is_repaired_and_no_change_means_no_write(
    control_plane: ControlPlane,
    api: client.ApiClient,
    controller_process: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    node, _, _ = controller_process
    (original,) = _slices(api, node)
    name = original["metadata"]["name"]

    sync_request(api, "DELETE", f"{SLICES}/{name}")
    t0 = time.monotonic()
    wait_for(
        "deleted slice re-created",
        lambda: [s for s in _slices(api, node) if s["metadata"]["uid"] != original["metadata"]["uid"]],
        timeout=10,
    )
    repaired_delete = time.monotonic() - t0

    (current,) = _slices(api, node)
    edited = current
    edited["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1Gi"
    edited["spec"]["devices"][0]["attributes"]["handEdited"] = {"string": "yes"}
    sync_request(api, "PUT", f"{SLICES}/{name}", edited)
    t0 = time.monotonic()

    def restored() -> bool:
        (s,) = _slices(api, node)
        device = s["spec"]["devices"][0]
        return (
            device["capacity"]["memory"]["value"]
            == original["spec"]["devices"][0]["capacity"]["memory"]["value"]
            and "handEdited" not in device["attributes"]
        )

    wait_for("edited slice restored", restored, timeout=10)
    repaired_edit = time.monotonic() - t0
    print(f"repair after delete {repaired_delete:.2f}s, after edit {repaired_edit:.2f}s")

    before = _settled_slice_writes(control_plane)
    # the 60 quiet seconds are what the test asserts on: watched, so a write ends them at once
    watch_for(lambda: _slice_writes(control_plane) != before, 60, interval=1.0)
    after = _slice_writes(control_plane)
    assert after == before, f"{after - before} slice writes in 60 s with nothing changed"


def test_api_server_outage_is_survived(
    control_plane: ControlPlane,
    api: client.ApiClient,
    controller_process: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    node, proc, log = controller_process
    control_plane.stop_component("kube-apiserver")
    stopped = time.monotonic()
    try:
        wait_for("the controller to notice the outage", lambda: "API server unreachable" in log.read_text(),
                 timeout=60, detail=lambda: log.read_text()[-3000:])
        # the outage lasts 30 s in all, the controller retrying throughout: watched, so an exit
        # ends it at once
        watch_for(lambda: proc.poll() is not None, max(0.0, 30 - (time.monotonic() - stopped)))
        assert proc.poll() is None, "the controller must not exit while the API server is down"
    finally:
        control_plane.start_component("kube-apiserver")
    (name,) = [s["metadata"]["name"] for s in _slices(api, node)]
    sync_request(api, "DELETE", f"{SLICES}/{name}")
    wait_for("controller catches up after the outage", lambda: _slices(api, node), timeout=30)
    assert "reachable again" in log.read_text()
    assert proc.poll() is None


def test_policy_limits_the_driver_to_its_own_node(control_plane: ControlPlane, api: client.ApiClient) -> None:
    for path in sorted((REPO / "deploy" / "base").glob("*.yaml")):
        if path.name == "daemonset.yaml":
            continue
        for doc in load_yaml_documents(path):
            try:
                create_object(api, doc, "gpu-dra-driver")
            except ApiException as e:
                if e.status != 409:
                    raise
    create_node(api, "vap-node-a")
    create_node(api, "vap-node-b")
    pod = sync_request(
        api,
        "POST",
        "/api/v1/namespaces/gpu-dra-driver/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "driver-on-a"},
            "spec": {
                "nodeName": "vap-node-a",
                "serviceAccountName": "gpu-dra-driver",
                "automountServiceAccountToken": False,
                "containers": [{"name": "c", "image": "driver"}],
            },
        },
    )
    token = sync_request(
        api,
        "POST",
        "/api/v1/namespaces/gpu-dra-driver/serviceaccounts/gpu-dra-driver/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": "driver-on-a",
                    "uid": pod["metadata"]["uid"],
                },
            },
        },
    )["status"]["token"]
    cfg = client.Configuration()
    cfg.host = control_plane.server
    cfg.ssl_ca_cert = str(control_plane.ca_file)
    cfg.api_key = {"BearerToken": f"Bearer {token}"}
    as_driver = client.ApiClient(cfg)

    def slice_for(node: str) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"vap-{node}"},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            },
        }

    def refused_for_b() -> str | None:
        try:
            sync_request(as_driver, "POST", SLICES, slice_for("vap-node-b"))
        except ApiException as e:
            # A ValidatingAdmissionPolicy denial is 422 Invalid (RBAC would be 403).
            return (
                str(e.body)
                if e.status == 422 and "may not write ResourceSlices of node vap-node-b" in str(e.body)
                else None
            )
        sync_request(api, "DELETE", f"{SLICES}/vap-vap-node-b")  # policy not active yet: undo and retry
        return None

    message = wait_for("the admission policy to refuse node B", refused_for_b, timeout=30, interval=1)
    assert "vap-node-a" in message
    created = sync_request(as_driver, "POST", SLICES, slice_for("vap-node-a"))
    assert created["spec"]["nodeName"] == "vap-node-a"
    sync_request(as_driver, "DELETE", f"{SLICES}/vap-vap-node-a")
