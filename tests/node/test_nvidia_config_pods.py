"""Claims written for NVIDIA's driver, sharing config included, as real pods on a real node.

NVIDIA's quickstart gpu-test-mps.yaml and gpu-test5.yaml after the domain sed
(deploy/examples/nvidia/) run on the hgx-h200 node, whose plugin is restarted for this test
with a driver root holding the stand-in `nvidia-cuda-mps-control` (tests/harness/fake_mps.py)
and restored after. The running containers' environment (read from /proc) and /dev/nvidia*
nodes are checked: the MPS containers carry the limits their config asks for, the
time-sliced containers carry none, and each request's containers see only their own GPU.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.jsontypes import JSON
from tests.harness.fake_mps import install_fake_mps_control
from tests.harness.node import Node
from tests.harness.objects import load_yaml_documents, sync_request, wait_for
from tests.node import pods
from tests.node.conftest import NodeCluster

NODE = "hgx-h200"
EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "nvidia"


@pytest.fixture
def mps_node(cluster: NodeCluster, namespace: str) -> Iterator[Node]:
    node = cluster.nodes[NODE]
    assert node.driver is not None
    root = Path(tempfile.mkdtemp(prefix="nvcfg-", dir="/tmp"))
    root.chmod(0o755)
    install_fake_mps_control(root / "driver")
    try:
        # MPS servers run as the client's user: the MPS root must be searchable by others,
        # which the node's own (0700) directory is not.
        node.driver.extra_args = (
            *node.spec.driver_args,
            "--driver-root",
            str(root / "driver"),
            "--mps-root",
            str(root / "mps"),
        )
        node.restart_driver()
        yield node
    finally:
        # The pods go while this plugin still serves them: its Unprepare stops the claims'
        # daemons and removes their directories (a plugin on another MPS root would not).
        sync_request(cluster.api, "DELETE", f"/api/v1/namespaces/{namespace}/pods")
        wait_for(
            "the claims to be released", lambda: pods.claims_released(cluster.api, namespace), timeout=90
        )
        wait_for("the MPS daemons to be stopped", lambda: not any((root / "mps").glob("*/")), timeout=60)
        node.driver.extra_args = node.spec.driver_args
        node.restart_driver()
        shutil.rmtree(root, ignore_errors=True)


def _create(cluster: NodeCluster, namespace: str, example: str) -> JSON:
    template, pod = load_yaml_documents(EXAMPLES / example)
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE}
    pod["spec"]["terminationGracePeriodSeconds"] = 1
    pods.create(cluster.api, namespace, template, pod)
    return pods.wait_running(cluster.api, namespace, pod["metadata"]["name"], timeout=90)


def _mps_env(node: Node, pod: JSON, container: str) -> dict[str, str]:
    env = pods.live_environment(node, pods.container_id(pod, container))
    return {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")}


def _gpus(node: Node, pod: JSON, container: str) -> set[int]:
    return pods.gpu_minors(pods.live_devices(node, pods.container_id(pod, container)))


def test_nvidia_mps_claim_runs_with_its_limits(cluster: NodeCluster, mps_node: Node, namespace: str) -> None:
    pod = _create(cluster, namespace, "13-nvidia-mps.yaml")
    for container in ("mps-ctr0", "mps-ctr1"):
        env = _mps_env(mps_node, pod, container)
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50", env
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10G", env
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps", env
    assert len(_gpus(mps_node, pod, "mps-ctr0")) == 1
    assert _gpus(mps_node, pod, "mps-ctr0") == _gpus(mps_node, pod, "mps-ctr1")


def test_nvidia_time_sliced_and_mps_gpus_in_one_claim(
    cluster: NodeCluster, mps_node: Node, namespace: str
) -> None:
    pod = _create(cluster, namespace, "14-nvidia-time-slicing-and-mps.yaml")
    ts, mps = _gpus(mps_node, pod, "ts-ctr0"), _gpus(mps_node, pod, "mps-ctr0")
    assert len(ts) == 1 and len(mps) == 1 and ts != mps
    assert _gpus(mps_node, pod, "ts-ctr1") == ts and _gpus(mps_node, pod, "mps-ctr1") == mps
    for container in ("ts-ctr0", "ts-ctr1"):
        assert _mps_env(mps_node, pod, container) == {}
    for container in ("mps-ctr0", "mps-ctr1"):
        env = _mps_env(mps_node, pod, container)
        assert (
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
            and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10G"
        )
