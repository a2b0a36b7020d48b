"""Device health under a real kubelet: an injected fatal XID taints the GPU in the slice, the
pod's `allocatedResourcesStatus` says Unhealthy, new pods stay off the GPU, NoExecute (when
configured) evicts the pod using it, and recovery clears all of it.

The events go through the plugin's real NVML code path: the simulated NVML of the hgx-h200
node's driver follows a control file in the plugin's data dir, and its event wait returns
what the test appends there (dra_driver.gpu.sim.events). The driver is restarted with a
short quiet period for the test (and NoExecute for the eviction test) and restarted with
its original flags afterwards. Timings printed here are for reading, not asserted tightly:
the figures live in benchmarks/.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from dra_driver.health.node import SIMULATED_EVENTS_FILE
from tests.harness.driver import DRIVER
from tests.harness.node import Node
from tests.harness.objects import RESOURCE_API, get_pod, scheduler_reason, sync_request, watch_for
from tests.node import pods
from tests.node.conftest import NodeCluster

NODE = "hgx-h200"
QUIET = 3  # --health-quiet-period for the test
XID_KEY = f"{DRIVER}/xid"
JSON = dict[str, Any]
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, detail: Callable[[], str] = str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)  # the poll interval
    raise AssertionError(f"{what}: not within {timeout} s; {detail()}")


@pytest.fixture
def h200(cluster: NodeCluster) -> Iterator[Node]:
    node = cluster.nodes[NODE]
    assert node.driver is not None
    yield node
    if node.driver.extra_args != node.spec.driver_args:
        node.driver.extra_args = node.spec.driver_args
        node.restart_driver()


def restart_with(node: Node, *args: str) -> None:
    assert node.driver is not None
    node.driver.extra_args = (*node.spec.driver_args, *args)
    node.restart_driver()
    wait_for("the health monitor", lambda: '"health monitor started"' in node.driver.log_tail(10**6), 30)


def inject(node: Node, **record: Any) -> None:
    assert node.driver is not None
    with (node.driver.data_dir / SIMULATED_EVENTS_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")


def node_slices(cluster: NodeCluster) -> list[JSON]:
    return list(sync_request(cluster.api, "GET", f"{RESOURCE_API}/resourceslices",
                        query={"fieldSelector": f"spec.nodeName={NODE},spec.driver={DRIVER}"})["items"])


def slice_versions(cluster: NodeCluster) -> dict[str, str]:
    return {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in node_slices(cluster)}


def slice_device(cluster: NodeCluster, device: str) -> JSON:
    slices = node_slices(cluster)
    return next(d for s in slices for d in s["spec"].get("devices", []) if d["name"] == device)


def taints(cluster: NodeCluster, device: str) -> list[JSON]:
    return list(slice_device(cluster, device).get("taints", []))


def resource_health(cluster: NodeCluster, namespace: str, pod: str) -> list[JSON]:
    status = get_pod(cluster.api, namespace, pod)["status"].get("containerStatuses") or [{}]
    return [r for s in status[0].get("allocatedResourcesStatus") or [] for r in s.get("resources") or []]


def health_is(cluster: NodeCluster, namespace: str, pod: str, health: str) -> list[JSON] | None:
    resources = resource_health(cluster, namespace, pod)
    return resources if resources and {r.get("health") for r in resources} == {health} else None


def start_pod(cluster: NodeCluster, namespace: str, name: str, selectors: list[str] | None = None,
              tolerate: bool = False) -> None:
    claim = pods.gpu_claim(f"{name}-gpu", selectors=selectors)
    if tolerate:
        claim["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] = [
            {"key": XID_KEY, "operator": "Exists"}
        ]
    pod = pods.gpu_pod(name, claims={"gpu": f"{name}-gpu"})
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE}
    pods.create(cluster.api, namespace, claim, pod)


def phase_unless(cluster: NodeCluster, namespace: str, pod: str, phase: str) -> str | None:
    """The pod's phase when it is not `phase` (a probe for `watch_for`)."""
    now = str(get_pod(cluster.api, namespace, pod)["status"]["phase"])
    return None if now == phase else now


def allocated_gpu(cluster: NodeCluster, namespace: str, pod: str) -> tuple[str, int, str]:
    (result,) = pods.container_allocations(cluster.api, get_pod(cluster.api, namespace, pod), "main")
    device = result["device"]
    return device, int(device.removeprefix("gpu-")), cluster.uuid(NODE, device)


def test_a_fatal_xid_taints_the_gpu_marks_the_pod_unhealthy_and_recovery_clears_it(
    cluster: NodeCluster, namespace: str, h200: Node
) -> None:
    restart_with(h200, "--health-quiet-period", str(QUIET))
    start_pod(cluster, namespace, "victim")
    pods.wait_running(cluster.api, namespace, "victim")
    device, index, uuid = allocated_gpu(cluster, namespace, "victim")
    wait_for("the first health report", lambda: health_is(cluster, namespace, "victim", "Healthy"), 30)
    assert not taints(cluster, device)

    start = time.monotonic()
    inject(h200, gpu=index, xid=79, recovery_action=1)
    (taint,) = wait_for("the taint in the slice", lambda: taints(cluster, device), 15,
                        lambda: h200.driver.log_tail() if h200.driver else "")
    tainted_after = time.monotonic() - start
    assert (taint["key"], taint["value"], taint["effect"]) == (XID_KEY, "79", "NoSchedule")
    assert taint.get("timeAdded")
    resources = wait_for(
        "Unhealthy in the pod's status", lambda: health_is(cluster, namespace, "victim", "Unhealthy"), 30
    )
    unhealthy_after = time.monotonic() - start
    print(f"\ntaint in the slice after {tainted_after:.2f} s, Unhealthy in the pod status after "
          f"{unhealthy_after:.2f} s; resources: {resources}")
    assert "XID 79" in str(resources[0].get("message", "XID 79")), resources
    wait_for("a DeviceUnhealthy Event on the pod",
             lambda: [e for e in pods.pod_events(cluster.api, namespace, "victim")
                      if e.get("reason") == "DeviceUnhealthy"],
             15)
    phase = get_pod(cluster.api, namespace, "victim")["status"]["phase"]
    assert phase == "Running", "NoSchedule evicts nobody"

    # The GPU is free now, but tainted: a pod asking for exactly this H200 does not get it ...
    pods.delete_pod(cluster.api, namespace, "victim")
    pods.wait_gone(cluster.api, namespace, "victim")
    same_gpu = [f'device.attributes["{DRIVER}"].uuid == "{uuid}"']
    start_pod(cluster, namespace, "blocked", selectors=same_gpu)
    reason = wait_for("the scheduler's reason", lambda: scheduler_reason(cluster.api, namespace, "blocked"),
                      30)
    print(f"scheduler: {reason}")
    # kube-scheduler 1.37 says only "cannot allocate all claims" (dynamicresources.go), never
    # which taint: that the taint is the cause is shown by the tolerating pod next.
    assert "cannot allocate all claims" in reason, reason
    # The scheduler's reason above is the signal; a window of 3 s more shows it holds.
    left = watch_for(lambda: phase_unless(cluster, namespace, "blocked", "Pending"), 3)
    assert left is None, f"the blocked pod left Pending: {left}"
    # ... while the same request tolerating our taint does get it (the only difference).
    start_pod(cluster, namespace, "tolerant", selectors=same_gpu, tolerate=True)
    pods.wait_running(cluster.api, namespace, "tolerant")
    assert allocated_gpu(cluster, namespace, "tolerant")[0] == device
    assert get_pod(cluster.api, namespace, "blocked")["status"]["phase"] == "Pending"
    pods.delete_pod(cluster.api, namespace, "tolerant")
    pods.wait_gone(cluster.api, namespace, "tolerant")

    # Recovery: NVML reports no recovery action any more; after the quiet period the taint goes.
    start = time.monotonic()
    inject(h200, gpu=index, recover=True)
    wait_for("the taint to go", lambda: not taints(cluster, device) or None, 30)
    untainted_after = time.monotonic() - start
    pods.wait_running(cluster.api, namespace, "blocked", timeout=60)
    assert allocated_gpu(cluster, namespace, "blocked")[0] == device
    wait_for("Healthy in the new pod's status", lambda: health_is(cluster, namespace, "blocked", "Healthy"),
             30)
    print(f"taint removed {untainted_after:.2f} s after the recovery (quiet period {QUIET} s)")
    assert untainted_after >= QUIET
    log = h200.driver.log_tail(10**7) if h200.driver else ""
    assert '"device healthy again"' in log and '"publishing device taints"' in log


def test_with_noexecute_configured_the_pod_on_the_gpu_is_evicted(
    cluster: NodeCluster, namespace: str, h200: Node
) -> None:
    restart_with(h200, "--health-taint-effect", "NoExecute", "--health-quiet-period", str(QUIET))
    start_pod(cluster, namespace, "doomed")
    start_pod(cluster, namespace, "bystander")
    pods.wait_running(cluster.api, namespace, "doomed")
    pods.wait_running(cluster.api, namespace, "bystander")
    device, index, _ = allocated_gpu(cluster, namespace, "doomed")
    assert allocated_gpu(cluster, namespace, "bystander")[0] != device

    start = time.monotonic()
    inject(h200, gpu=index, xid=79, recovery_action=1)
    (taint,) = wait_for("the NoExecute taint", lambda: taints(cluster, device), 15)
    assert (taint["key"], taint["effect"]) == (XID_KEY, "NoExecute")

    def evicted() -> bool:
        try:
            return bool(get_pod(cluster.api, namespace, "doomed")["metadata"].get("deletionTimestamp"))
        except Exception:  # already gone
            return True

    wait_for("the eviction of the pod on the GPU", evicted, 60,
             lambda: pods.describe(cluster.api, namespace, "doomed"))
    print(f"\npod on the GPU evicted {time.monotonic() - start:.2f} s after the XID")
    pods.wait_gone(cluster.api, namespace, "doomed")
    # The eviction above shows the taint was acted on; a window of 2 s more shows the bystander stays.
    left = watch_for(lambda: phase_unless(cluster, namespace, "bystander", "Running"), 2)
    assert left is None, f"the pod on another GPU stays Running, not {left}"

    inject(h200, gpu=index, recover=True)
    wait_for("the taint to go", lambda: not taints(cluster, device) or None, 30)


def test_a_storm_of_informational_xids_changes_nothing(
    cluster: NodeCluster, namespace: str, h200: Node
) -> None:
    start_pod(cluster, namespace, "busy")
    pods.wait_running(cluster.api, namespace, "busy")
    device, index, _ = allocated_gpu(cluster, namespace, "busy")
    assert h200.driver is not None
    history = h200.driver.data_dir / "health.json"

    def counted() -> int:  # health.json is rewritten (atomically) at most every 2 s after a change
        try:
            return int(json.loads(history.read_text())["devices"][device]["counts"].get("xid-13", 0))
        except (FileNotFoundError, KeyError, ValueError):
            return 0

    slices_before = slice_versions(cluster)
    inject(h200, gpu=index, xid=13, repeat=20000, per_second=5000)  # application errors, 4 s
    # First the signal that the plugin took in the whole storm (4 s idle, longer on a loaded
    # machine), then that it changed nothing.
    wait_for("all 20,000 XID 13 events counted in health.json", lambda: counted() >= 20000, 60,
             lambda: f"xid-13 counted: {counted()}")
    assert slice_versions(cluster) == slices_before, "an informational storm must not write a slice"
    assert not taints(cluster, device)
    assert health_is(cluster, namespace, "busy", "Healthy"), resource_health(cluster, namespace, "busy")
    assert counted() == 20000
