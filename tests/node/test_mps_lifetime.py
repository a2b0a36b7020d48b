"""MPS daemons live from their claim's Prepare to its Unprepare, whatever happens to the plugin.

The chart installed as users install it (image from the Dockerfile, `helm install`) on one
real node (kubelet + containerd + runc) with simulated GPUs and a stand-in
`nvidia-cuda-mps-control` (tests/harness/fake_mps.py) as the driver root's MPS tool. A pod
holding a memory share and a pod holding an MPS claim run; then, in order, `helm upgrade`
(the plugin pod is replaced), kill -9 of the plugin (the kubelet restarts its container)
and `helm uninstall` with the pods still running. After each:

- the same daemon processes (same host PIDs, found by the claim marker in their
  environment) are alive;
- each container's pipe directory is the directory the daemon listens on (same inode as
  `<mpsRoot>/<claim uid>/pipe` on the node), and its /dev/shm is the claim's own tmpfs;
- a new process in each container reaches its daemon: it writes a line into
  `/tmp/nvidia-mps/control` (the stand-in's FIFO) and the daemon logs it.

After a reinstall, deleting the pods stops both daemons and removes their directories.
On e84c1ef the daemons are children of the plugin and die with its container (the
upgrade step fails).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from kubernetes import client

from tests.harness.driver import DRIVER
from tests.harness.driver_image import CHART, IMAGE_REPOSITORY
from tests.harness.fake_mps import install_fake_mps_control
from tests.harness.node import Node, NodeSpec, descendants
from tests.harness.objects import sync_request, wait_for
from tests.node import pods
from tests.node.daemonset_cluster import OneNodeRelease, daemonset_cluster

logger = structlog.get_logger(__name__)

JSON = dict[str, Any]
NODE = NodeSpec("mps-a", "l4x4")
RELEASE = "gpu-dra-driver"
NAMESPACE = "gpu-dra-driver"
PODS_NS = "mps-life"
RUN_DIR = Path(f"/run/{DRIVER}")
MPS_ROOT = RUN_DIR / "mps"
FAKE_ROOT = RUN_DIR / "state" / "fake-driver"  # a host dir the chart mounts at the same path
IMAGE_PYTHON = "/opt/dra-driver/bin/python3"
PLUGIN_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=kubelet-plugin"
MARKER = "GPU_DRA_MPS_CLAIM"
MPS_CONFIG = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OneNodeRelease]:
    with daemonset_cluster(tmp_path_factory, "mps-life", (NODE,)) as base:
        helm, image, node = base.helm(), base.image, base.nodes[NODE.name]
        node.ctr("images", "tag", image.name, f"{IMAGE_REPOSITORY}:{image.tag}-upgrade")
        install_fake_mps_control(node.host_path(FAKE_ROOT), python=IMAGE_PYTHON)
        try:
            yield OneNodeRelease(base.cp, base.api, node, helm, image)
        finally:
            helm.run("uninstall", RELEASE, "-n", NAMESPACE, "--ignore-not-found", check=False, timeout=60)


# -- reading the node ------------------------------------------------------------------------


def _plugins(api: client.ApiClient) -> list[JSON]:
    query = {"labelSelector": PLUGIN_SELECTOR}
    items: list[JSON] = sync_request(api, "GET", f"/api/v1/namespaces/{NAMESPACE}/pods", query=query)["items"]
    return items


def _ready(pod: JSON) -> bool:
    conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return pod.get("status", {}).get("phase") == "Running" and conditions.get("Ready") == "True"


def _wait_one_ready_plugin(env: OneNodeRelease, not_uid: str | None = None, restarts: int = 0) -> JSON:
    def one() -> JSON | None:
        found = _plugins(env.api)
        if len(found) != 1 or not _ready(found[0]) or found[0]["metadata"]["uid"] == not_uid:
            return None
        (status,) = found[0]["status"]["containerStatuses"]
        return found[0] if status["restartCount"] >= restarts else None

    try:
        return wait_for("one Ready plugin pod", one, timeout=180, interval=0.5)
    except TimeoutError as e:
        seen = [(p["metadata"]["name"], p.get("status", {}).get("phase")) for p in _plugins(env.api)]
        raise AssertionError(f"{e}; plugin pods: {seen}") from None


def _daemon_pids(node: Node, claim_uid: str) -> set[int]:
    """Host PIDs of the processes carrying the claim's marker, anywhere on the node."""
    marker = f"{MARKER}={claim_uid}".encode()
    found = set()
    for pid in descendants(node.init_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in environ:
            found.add(pid)
    return found


@dataclass(frozen=True)
class Workload:
    pod: str
    claim_uid: str


def _container_pid(env: OneNodeRelease, w: Workload) -> int:
    pod = pods.wait_running(env.api, PODS_NS, w.pod)
    return pods.host_pid(env.node, pods.container_id(pod, "main"))


def _check_served(env: OneNodeRelease, w: Workload, pids: set[int], when: str, round_: int) -> None:
    """The same daemon, the container's pipe dir is the daemon's, and a new client reaches it."""
    now = _daemon_pids(env.node, w.claim_uid)
    assert now == pids, f"{when}: {w.pod}'s daemon processes were {sorted(pids)}, now {sorted(now)}"
    claim_dir = env.node.host_path(MPS_ROOT / w.claim_uid)
    cpid = _container_pid(env, w)
    inside = Path(f"/proc/{cpid}/root")
    assert (inside / "tmp/nvidia-mps").stat().st_ino == (claim_dir / "pipe").stat().st_ino, (
        f"{when}: {w.pod}'s /tmp/nvidia-mps is not the directory its daemon listens on"
    )
    assert (inside / "dev/shm").stat().st_dev == (claim_dir / "shm").stat().st_dev, (
        f"{when}: {w.pod}'s /dev/shm is not its claim's tmpfs"
    )
    line = f"client-{round_}-{w.pod}"
    # a new process in the container: the pod's own shell, in its mount namespace and root
    pods_run = ["nsenter", "-t", str(cpid), "-m", "-r", "--", "/bin/sh", "-c",
                f"echo {line} > /tmp/nvidia-mps/control"]
    done = subprocess.run(pods_run, capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 0, f"{when}: the client in {w.pod} failed: {done.stderr}"
    log = claim_dir / "log" / "control.log"
    try:
        wait_for(f"{when}: {w.pod}'s daemon to log {line}", lambda: f"cmd {line}" in log.read_text(),
                 timeout=20, interval=0.1)
    except TimeoutError as e:
        raise AssertionError(f"{e}; its control.log ends: {log.read_text()[-500:]}") from None


# -- the test --------------------------------------------------------------------------------


def test_mps_daemons_outlive_upgrade_kill_and_uninstall(env: OneNodeRelease) -> None:
    env.helm.run(
        "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
        "--set", f"simulate={NODE.profile}", "--set", f"image.repository={IMAGE_REPOSITORY}",
        "--set", f"image.tag={env.image.tag}", "--set", "memoryShares.enabled=true",
        "--set-json", f'kubeletPlugin.extraArgs=["--driver-root={FAKE_ROOT}"]',
        "--set", f"mpsRoot={MPS_ROOT}", "--set", f"stateDir={RUN_DIR / 'state'}",
    )
    plugin = _wait_one_ready_plugin(env)
    sync_request(env.api, "POST", "/api/v1/namespaces", {"metadata": {"name": PODS_NS}})  # a fresh plane
    share_claim = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "share"},
        "spec": {"devices": {"requests": [{"name": "mem", "exactly": {
            "deviceClassName": f"gpu-share.{DRIVER}", "capacity": {"requests": {"memory": "4Gi"}}}}]}},
    }
    pods.create(env.api, PODS_NS, share_claim, pods.gpu_claim("mps", config=MPS_CONFIG),
                pods.gpu_pod("share-pod", {"gpu": "share"}, command="sleep 3600"),
                pods.gpu_pod("mps-pod", {"gpu": "mps"}, command="sleep 3600"))
    workloads = []
    for name in ("share-pod", "mps-pod"):
        pod = pods.wait_running(env.api, PODS_NS, name, timeout=120)
        (uid,) = pods.claim_uids(env.api, pod)
        workloads.append(Workload(name, uid))
    daemons = {w.pod: _daemon_pids(env.node, w.claim_uid) for w in workloads}
    assert all(daemons.values()), f"a daemon per claim: {daemons}"
    for w in workloads:
        _check_served(env, w, daemons[w.pod], "after install", 0)

    env.helm.run("upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "--reuse-values",
                 "--set", f"image.tag={env.image.tag}-upgrade")
    plugin = _wait_one_ready_plugin(env, not_uid=plugin["metadata"]["uid"])
    for w in workloads:
        _check_served(env, w, daemons[w.pod], "after helm upgrade", 1)

    plugin_pid = pods.host_pid(env.node, pods.container_id(plugin, "kubelet-plugin"))
    os.kill(plugin_pid, 9)
    plugin = _wait_one_ready_plugin(env, restarts=1)
    for w in workloads:
        _check_served(env, w, daemons[w.pod], "after kill -9 of the plugin", 2)

    env.helm.run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "120s", timeout=180)
    wait_for("no plugin pod", lambda: not _plugins(env.api), timeout=120)
    for w in workloads:
        _check_served(env, w, daemons[w.pod], "after helm uninstall", 3)

    # the plugin comes back; deleting the pods unprepares their claims
    env.helm.run(
        "install", RELEASE, str(CHART), "-n", NAMESPACE,
        "--set", f"simulate={NODE.profile}", "--set", f"image.repository={IMAGE_REPOSITORY}",
        "--set", f"image.tag={env.image.tag}", "--set", "memoryShares.enabled=true",
        "--set-json", f'kubeletPlugin.extraArgs=["--driver-root={FAKE_ROOT}"]',
        "--set", f"mpsRoot={MPS_ROOT}", "--set", f"stateDir={RUN_DIR / 'state'}",
    )
    _wait_one_ready_plugin(env)
    for w in workloads:
        _check_served(env, w, daemons[w.pod], "after a new install", 4)
    t0 = time.monotonic()
    for w in workloads:
        pods.delete_pod(env.api, PODS_NS, w.pod)
    for w in workloads:
        pods.wait_gone(env.api, PODS_NS, w.pod, timeout=120)
        claim_dir = env.node.host_path(MPS_ROOT / w.claim_uid)

        def released(uid: str = w.claim_uid, d: Path = claim_dir) -> bool:
            return not _daemon_pids(env.node, uid) and not d.exists()

        wait_for(f"{w.pod}'s daemon to stop and its directory to go", released, timeout=60, interval=0.2)
    logger.info("pods deleted, daemons stopped", seconds=round(time.monotonic() - t0, 1))
