"""A claim written for NVIDIA's GPU DRA driver selects on `resource.kubernetes.io/numaNode` and
`addressingMode` as that driver publishes them (a scalar int, a string), and the real
kube-scheduler allocates it here, with list-type attributes served where the control plane
serves them (`--list-attributes auto`; the harness turns DRAListTypeAttributes on from 1.36).

One simulated GB200 tray (`gb200-nvl-node`: GPUs 0-1 on NUMA node 0, 2-3 on node 1, addressing
mode ATS) published by a `dra-driver controller` under a driver name of this module's own, so
that no other test's claim can land on it; everything it created is deleted at the end.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from kubernetes import client

from dra_driver.jsontypes import JSON
from tests.harness.cluster import ControlPlane
from tests.harness.driver import spawn_dra_driver
from tests.harness.objects import (
    RESOURCE_API,
    allocation_results,
    create_device_class,
    create_node,
    delete_node_and_slices,
    get_claim,
    get_pod,
    pinned_pod,
    scheduler_reason,
    sync_request,
    wait_for,
)

pytestmark = pytest.mark.integration

SUFFIX = uuid.uuid4().hex[:6]
DRIVER = f"nv-{SUFFIX}.dra-driver.dev"
CLASS = f"nv-{SUFFIX}"
NODE = f"nv-gb200-{SUFFIX}"


def _devices(api: client.ApiClient) -> list[JSON]:
    query = {"fieldSelector": f"spec.driver={DRIVER},spec.nodeName={NODE}"}
    slices = sync_request(api, "GET", f"{RESOURCE_API}/resourceslices", query=query)
    return [d for s in slices["items"] for d in s["spec"].get("devices", [])]


def _claim_and_pod(api: client.ApiClient, namespace: str, name: str, expression: str) -> None:
    """What a claim written for NVIDIA's driver becomes after docs/migrating.md's sed."""
    sync_request(api, "POST", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": CLASS, "count": 2, "selectors": [{"cel": {"expression": expression}}]}}]}}})
    sync_request(api, "POST", f"/api/v1/namespaces/{namespace}/pods",
                 pinned_pod(name, NODE, name, command=("sleep", "3600")))


def _allocated(api: client.ApiClient, namespace: str, name: str) -> set[str]:
    def bound() -> JSON | None:
        pod = get_pod(api, namespace, name)
        return pod if pod["spec"].get("nodeName") else None

    try:
        wait_for(f"pod {name} bound", bound, timeout=60)
    except TimeoutError as e:
        raise AssertionError(f"{e}; scheduler says: {scheduler_reason(api, namespace, name)}") from e
    results = allocation_results(get_claim(api, namespace, name))
    assert {(r["driver"], r["pool"]) for r in results} == {(DRIVER, NODE)}
    return {str(r["device"]) for r in results}


def test_nvidia_style_numa_and_addressing_mode_selectors_are_allocated(
    control_plane: ControlPlane, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    create_device_class(api, CLASS,
                        f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"')
    create_node(api, NODE)
    proc = spawn_dra_driver(
        ["controller", "--node-name", NODE, "--simulate", "gb200-nvl-node", "--driver-name", DRIVER,
         "--list-attributes", "auto", "--kubeconfig", str(control_plane.kubeconfig)],
        tmp_path / "controller.log", log_level="info",
    )
    try:
        devices = wait_for("the GB200 slices", lambda: _devices(api) or None, timeout=60)
        by_name = {d["name"]: d["attributes"] for d in devices}
        # as the API server stores them: NVIDIA's types, whatever the list-attribute mode
        assert {n: a["resource.kubernetes.io/numaNode"] for n, a in by_name.items()} == {
            "gpu-0": {"int": 0}, "gpu-1": {"int": 0}, "gpu-2": {"int": 1}, "gpu-3": {"int": 1}}
        assert {n: a.get("addressingMode") for n, a in by_name.items()} == {
            n: {"string": "ATS"} for n in by_name}

        _claim_and_pod(api, namespace, "numa1",
                       f'device.attributes["{DRIVER}"].addressingMode == "ATS" && '
                       'device.attributes["resource.kubernetes.io"].numaNode == 1')
        assert _allocated(api, namespace, "numa1") == {"gpu-2", "gpu-3"}
        _claim_and_pod(api, namespace, "numa0", 'device.attributes["resource.kubernetes.io"].numaNode == 0')
        assert _allocated(api, namespace, "numa0") == {"gpu-0", "gpu-1"}
    finally:
        proc.terminate()
        proc.wait(15)
        sync_request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods", query={"gracePeriodSeconds": "0"})
        delete_node_and_slices(api, NODE)
        sync_request(api, "DELETE", f"{RESOURCE_API}/deviceclasses/{CLASS}")
