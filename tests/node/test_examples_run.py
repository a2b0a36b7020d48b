"""Every example of deploy/examples as real pods on real nodes: Running, with exactly their GPUs.

All examples are applied at once (each in its own namespace, the most constrained
first, as the demo does) with the pods' grace period cut to 1 s. For every container
the test compares the `/dev/nvidia*` nodes it listed (the examples' own `ls -l`,
read from the kubelet's log file) with the devices the scheduler allocated to it, by
minor number, and the environment of its running process with the CDI edits of those
devices (one `GPU_DRA_DEVICE_<name>_UUID` each, `NVIDIA_VISIBLE_DEVICES=void`).
No example is meant to stay pending (tests/integration/test_examples.py binds them
all); the one pod that must, the demo's 200Gi claim, is checked for the scheduler's reason.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from dra_driver.cdi.builders import device_env_name
from tests.harness.examples import apply_order, example_files, too_big_pod
from tests.harness.objects import (
    Applied,
    create_documents,
    create_namespace,
    get_pod,
    load_yaml_documents,
    scheduler_reason,
    sync_request,
    wait_settled,
)
from tests.node import pods
from tests.node.conftest import NodeCluster

EXAMPLES = {p.name: p for p in example_files()}
PENDING_NS = "node-too-big"


@dataclass
class Applied_:
    """The pods of each example, by file name: (namespace, pod name)."""

    pods: dict[str, list[tuple[str, str]]]


def _namespace(example: str) -> str:
    return "ex-" + example.removesuffix(".yaml").lower()


@pytest.fixture(scope="module")
def applied(cluster: NodeCluster) -> Iterator[Applied_]:
    result: dict[str, list[tuple[str, str]]] = {}
    namespaces: set[str] = set()
    for path in apply_order(list(EXAMPLES.values())):
        ns = _namespace(path.name)
        create_namespace(cluster.api, ns)
        docs = load_yaml_documents(path)
        for doc in docs:
            if doc["kind"] == "Pod":
                doc["spec"]["terminationGracePeriodSeconds"] = 1
        done: Applied = create_documents(cluster.api, docs, ns, path.name)
        assert not done.problems, done.problems
        result[path.name] = done.pods(ns)
        namespaces.update(n for n, _ in result[path.name])
        # The next, less constrained example must not take what this one needs.
        wait_settled(cluster.api, result[path.name])
    create_namespace(cluster.api, PENDING_NS)
    too_big = create_documents(cluster.api, too_big_pod(), PENDING_NS, "200Gi")
    assert not too_big.problems, too_big.problems
    namespaces.add(PENDING_NS)
    try:
        yield Applied_(result)
    finally:
        for ns in namespaces:
            sync_request(cluster.api, "DELETE", f"/api/v1/namespaces/{ns}/pods")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            pods.claims_released(cluster.api, ns) for ns in namespaces
        ):
            time.sleep(0.2)  # the poll interval
        for ns in namespaces:
            sync_request(cluster.api, "DELETE", f"/api/v1/namespaces/{ns}")


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_runs_with_exactly_its_gpus(example: str, applied: Applied_, cluster: NodeCluster) -> None:
    assert applied.pods[example], f"{example} has no pods"
    for ns, name in applied.pods[example]:
        pod = pods.wait_running(cluster.api, ns, name, timeout=90)
        node = cluster.nodes[pod["spec"]["nodeName"]]
        for container in pod["spec"]["containers"]:
            results = pods.container_allocations(cluster.api, pod, container["name"])
            assert results, f"{name}/{container['name']}: no allocated devices"
            expected = {cluster.minor(r["pool"], r["device"]) for r in results}
            assert {r["pool"] for r in results} == {node.name}
            listed = pods.logged_devices(node, pod, container["name"])
            assert pods.gpu_minors(listed) == expected, (
                f"{name}/{container['name']} lists {listed}, allocated {results}"
            )
            assert all(
                d.major == pods.NVIDIA_MAJOR for d in listed if re.fullmatch(r"/dev/nvidia(\d+|ctl)", d.path)
            )
            assert "/dev/nvidiactl" in {d.path for d in listed}
            env = pods.live_environment(node, pods.container_id(pod, container["name"]))
            for r in results:
                assert env.get(device_env_name(r["device"])) == cluster.uuid(r["pool"], r["device"]), env
            assert env.get("NVIDIA_VISIBLE_DEVICES") == "void"


def test_the_unsatisfiable_claim_stays_pending(applied: Applied_, cluster: NodeCluster) -> None:
    name = too_big_pod()[1]["metadata"]["name"]
    deadline = time.monotonic() + 30
    reason = ""
    while time.monotonic() < deadline and "cannot allocate all claims" not in reason:
        reason = scheduler_reason(cluster.api, PENDING_NS, name)
        time.sleep(0.2)  # the poll interval
    assert "cannot allocate all claims" in reason, reason
    assert f"0/{len(cluster.nodes.nodes)} nodes are available" in reason, reason
    pod = get_pod(cluster.api, PENDING_NS, name)
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
