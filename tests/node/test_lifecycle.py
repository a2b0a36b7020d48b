"""The driver under a real kubelet: unprepare on delete, restarts of driver and kubelet,
refusals the user sees, and device health in the pod's status.

Each test runs its pods on one node (the H200 box, picked by a node selector) in its own
namespace, and asserts on what a user or operator would look at: pod phase and restart
count, the container's live /dev (through /proc/<pid>/root), the CDI spec files in the
driver's CDI dir, the pod's events and `allocatedResourcesStatus`, the driver's log.
"""

from __future__ import annotations

import json
import re
import signal
import time
from typing import Any

import pytest

from tests.harness.node import Node
from tests.harness.objects import get_pod, wait_for
from tests.node import pods
from tests.node.conftest import NodeCluster

NODE = "hgx-h200"
JSON = dict[str, Any]


def _on_node(pod: JSON, node: str = NODE) -> JSON:
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return pod


def _start_gpu_pods(cluster: NodeCluster, namespace: str, names: list[str]) -> list[JSON]:
    for name in names:
        pods.create(
            cluster.api,
            namespace,
            pods.gpu_claim(f"{name}-gpu"),
            _on_node(pods.gpu_pod(name, claims={"gpu": f"{name}-gpu"})),
        )
    return [pods.wait_running(cluster.api, namespace, name) for name in names]


def _devices_now(node: Node, pod: JSON) -> set[int]:
    return pods.gpu_minors(pods.live_devices(node, pods.container_id(pod, "main")))


def _expected(cluster: NodeCluster, pod: JSON) -> set[int]:
    results = pods.container_allocations(cluster.api, pod, "main")
    return {cluster.minor(r["pool"], r["device"]) for r in results}


def _prepare_calls(node: Node) -> int:
    assert node.driver is not None
    count = 0
    for line in node.driver.log_path.read_text(errors="replace").splitlines():
        try:
            if json.loads(line).get("event") == "prepared":
                count += 1
        except ValueError:
            continue
    return count


def _first_syncs(node: Node) -> int:
    """Pods the kubelet has synced once since it started (its pod workers' "create" syncs)."""
    found = re.search(r'^kubelet_pod_worker_duration_seconds_count\{operation_type="create"\} (\S+)$',
                      node.metrics(), re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def _delete_and_check_unprepared(cluster: NodeCluster, namespace: str, running: list[JSON]) -> None:
    """Delete the pods; the kubelet's NodeUnprepareResources must remove each claim's CDI spec."""
    node = cluster.nodes[NODE]
    uids = {uid for pod in running for uid in pods.claim_uids(cluster.api, pod)}
    assert all(pods.cdi_specs_of(node, uid) for uid in uids)
    for pod in running:
        pods.delete_pod(cluster.api, namespace, pod["metadata"]["name"])
    for pod in running:
        pods.wait_gone(cluster.api, namespace, pod["metadata"]["name"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(pods.cdi_specs_of(node, uid) for uid in uids):
        time.sleep(0.1)  # the poll interval
    left = {uid: pods.cdi_specs_of(node, uid) for uid in uids if pods.cdi_specs_of(node, uid)}
    assert not left, f"CDI specs left after the pods went: {left}"


def test_pod_delete_unprepares_and_removes_the_cdi_spec(cluster: NodeCluster, namespace: str) -> None:
    (pod,) = _start_gpu_pods(cluster, namespace, ["one"])
    (uid,) = pods.claim_uids(cluster.api, pod)
    node = cluster.nodes[NODE]
    (spec,) = pods.cdi_specs_of(node, uid)
    assert _devices_now(node, pod) == _expected(cluster, pod)
    _delete_and_check_unprepared(cluster, namespace, [pod])
    assert not spec.exists()
    assert node.driver is not None and '"unprepared"' in node.driver.log_tail(10**7)  # type: ignore[union-attr]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_driver_restart_keeps_running_pods(cluster: NodeCluster, namespace: str, sig: signal.Signals) -> None:
    node = cluster.nodes[NODE]
    running = _start_gpu_pods(cluster, namespace, ["a", "b"])
    before = {p["metadata"]["name"]: _devices_now(node, p) for p in running}
    node.restart_driver(sig)  # waits until the kubelet registered the new process
    for pod in running:
        name = pod["metadata"]["name"]
        now = get_pod(cluster.api, namespace, name)
        assert now["status"]["phase"] == "Running"
        assert [s["restartCount"] for s in now["status"]["containerStatuses"]] == [0]
        assert pods.container_id(now, "main") == pods.container_id(pod, "main")
        assert _devices_now(node, now) == before[name] == _expected(cluster, now)
    # The new process unprepares what the old one prepared.
    _delete_and_check_unprepared(cluster, namespace, running)


def test_kubelet_restart_keeps_pods_and_prepares_nothing_new(cluster: NodeCluster, namespace: str) -> None:
    node = cluster.nodes[NODE]
    running = _start_gpu_pods(cluster, namespace, ["a", "b"])
    prepared = _prepare_calls(node)
    assert prepared >= len(running), "no Prepare in the driver's log: the check below would prove nothing"
    registered = node.registrations()
    node.restart_kubelet()
    node.wait_registered(after=registered)
    # "Prepares nothing new" means something only once the restarted kubelet has synced the
    # pods: a pod worker runs for each pod it finds at start, and that first sync is a "create".
    wait_for("the restarted kubelet's first sync of the pods", lambda: _first_syncs(node) >= len(running),
             timeout=60, detail=lambda: f"first syncs since the restart: {_first_syncs(node)}")
    for pod in running:
        name = pod["metadata"]["name"]
        now = pods.wait_running(cluster.api, namespace, name)
        assert [s["restartCount"] for s in now["status"]["containerStatuses"]] == [0]
        assert pods.container_id(now, "main") == pods.container_id(pod, "main")
        assert _devices_now(node, now) == _expected(cluster, now)
    assert _prepare_calls(node) == prepared, "the restarted kubelet prepared a claim again"
    _delete_and_check_unprepared(cluster, namespace, running)


def test_refused_claim_config_shows_the_plugins_error_in_the_pod_events(
    cluster: NodeCluster,
    namespace: str,
) -> None:
    config = {
        "apiVersion": "gpu.dra-driver.dev/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "Exclusive"},
    }
    pods.create(
        cluster.api,
        namespace,
        pods.gpu_claim("bad-gpu", config=config),
        _on_node(pods.gpu_pod("refused", claims={"gpu": "bad-gpu"})),
    )
    expected = "'Exclusive' is not a sharing strategy"
    deadline = time.monotonic() + 60
    messages: list[str] = []
    while time.monotonic() < deadline:
        messages = [str(e.get("message")) for e in pods.pod_events(cluster.api, namespace, "refused")]
        if any(expected in m for m in messages):
            break
        time.sleep(0.2)  # the poll interval
    assert any(expected in m for m in messages), messages
    pod = get_pod(cluster.api, namespace, "refused")
    assert pod["status"]["phase"] == "Pending"
    assert not any(s.get("state", {}).get("running") for s in pod["status"].get("containerStatuses", []))


def test_pod_status_shows_the_device_health_the_plugin_streams(cluster: NodeCluster, namespace: str) -> None:
    (pod,) = _start_gpu_pods(cluster, namespace, ["healthy"])
    allocated = pods.container_allocations(cluster.api, pod, "main")
    deadline = time.monotonic() + 30
    statuses: list[JSON] = []
    while time.monotonic() < deadline:
        now = get_pod(cluster.api, namespace, "healthy")
        (container,) = now["status"]["containerStatuses"]
        statuses = container.get("allocatedResourcesStatus") or []
        if statuses and all(r.get("health") for s in statuses for r in s.get("resources") or []):
            break
        time.sleep(0.2)  # the poll interval
    assert [s["name"] for s in statuses] == ["claim:gpu"], statuses
    resources = statuses[0]["resources"]
    assert len(resources) == len(allocated), (resources, allocated)
    assert {r["health"] for r in resources} == {"Healthy"}, resources
