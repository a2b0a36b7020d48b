"""Two Helm releases of the driver with different driver names on the same two real nodes
(kubelet + containerd + runc), as an operator runs one per GPU model or a test channel.

Each release writes only paths that carry its driver name (state dir, MPS root, plugin
sockets, CDI spec names), so: pods of both run; kill -9 of every plugin, then a corrupted
checkpoint of one release on one node and a kill -9 there, leave every pod with its devices
and every CDI spec as it was (no spec of one driver is written or removed by the other; a
container restarted after all that resolves its CDI devices); a second release with a
driver name already served is refused; and each release's uninstall leaves the other's
pods running and its plugin serving new ones.

Its own control plane and nodes (the DaemonSet needs the kubelet's usual paths, which each
node has inside its sandbox), as tests/node/test_helm.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from kubernetes import client

from tests.harness.cluster import ControlPlane
from tests.harness.driver_image import CHART, IMAGE_REPOSITORY, DriverImage
from tests.harness.helm import Helm
from tests.harness.node import Node, Nodes, NodeSpec
from tests.harness.objects import RESOURCE_API, create_namespace, get_pod, sync_request, wait_for
from tests.node import pods
from tests.node.daemonset_cluster import daemonset_cluster

logger = structlog.get_logger(__name__)

JSON = dict[str, Any]
PROFILE = "hgx-h200"
SPECS = (NodeSpec("duo-a", PROFILE), NodeSpec("duo-b", PROFILE))
GPU_LABEL = "nvidia.com/gpu.present"


@dataclass(frozen=True)
class Release:
    name: str
    driver: str

    @property
    def namespace(self) -> str:
        return self.name

    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component=kubelet-plugin"


A = Release("gpu-a", "gpu-a.dra-driver.dev")
B = Release("gpu-b", "gpu-b.dra-driver.dev")
WORKLOADS = "duo-pods"


@dataclass
class Env:
    cp: ControlPlane
    api: client.ApiClient
    nodes: Nodes
    helm: Helm
    image: DriverImage


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with daemonset_cluster(tmp_path_factory, "two-releases", SPECS) as base:
        helm = base.helm()
        try:
            yield Env(base.cp, base.api, base.nodes, helm, base.image)
        finally:
            for release in (A, B):
                helm.run("uninstall", release.name, "-n", release.namespace, "--ignore-not-found",
                         check=False, timeout=60)


# -- reading the cluster and the nodes ---------------------------------------------------------


def _install(env: Env, release: Release, check: bool = True) -> Any:
    return env.helm.run(
        "install", release.name, str(CHART), "-n", release.namespace, "--create-namespace",
        "--set", f"driverName={release.driver}", "--set", f"simulate={PROFILE}",
        "--set", f"image.repository={IMAGE_REPOSITORY}", "--set", f"image.tag={env.image.tag}",
        check=check,
    )


def _plugins(env: Env, release: Release, node: str | None = None) -> list[JSON]:
    query = {"labelSelector": release.selector}
    if node:
        query["fieldSelector"] = f"spec.nodeName={node}"
    items: list[JSON] = sync_request(env.api, "GET", f"/api/v1/namespaces/{release.namespace}/pods",
                                     query=query)["items"]
    return items


def _ready(pod: JSON) -> bool:
    conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return pod.get("status", {}).get("phase") == "Running" and conditions.get("Ready") == "True"


def _restarts(pod: JSON) -> int:
    return sum(s["restartCount"] for s in pod.get("status", {}).get("containerStatuses", []))


def _slices(env: Env, driver: str, node: str) -> list[JSON]:
    items: list[JSON] = sync_request(env.api, "GET", f"{RESOURCE_API}/resourceslices", query={
        "fieldSelector": f"spec.driver={driver},spec.nodeName={node}"})["items"]
    return items


def _plugin_state(env: Env, release: Release) -> str:
    """Each plugin pod's phase, container state and the tail of its log, for a failure message."""
    out = []
    for pod in _plugins(env, release):
        meta, node = pod["metadata"], pod["spec"].get("nodeName", "")
        statuses = pod.get("status", {}).get("containerStatuses", [])
        out.append(f"{meta['name']} on {node}: {pod.get('status', {}).get('phase')} {statuses}")
        if node:
            logs = env.nodes[node].pod_logs_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
            for log_file in sorted(logs.glob("*/*.log")):
                out.append(f"  {log_file.name}: ..." + log_file.read_text(errors="replace")[-1500:])
    slices = {s.name: len(_slices(env, release.driver, s.name)) for s in SPECS}
    return f"slices per node {slices}; pods:\n" + "\n".join(out)


def _wait_serving(env: Env, release: Release) -> None:
    wait_for(
        f"{release.name}: a Ready plugin pod and a published pool on each node",
        lambda: (p := _plugins(env, release)) and len(p) == len(SPECS) and all(_ready(x) for x in p)
        and all(_slices(env, release.driver, s.name) for s in SPECS),
        timeout=300, detail=lambda: _plugin_state(env, release),
    )


def _minor(env: Env, driver: str, node: str, device: str) -> int:
    found = next(d for s in _slices(env, driver, node) for d in s["spec"]["devices"] if d["name"] == device)
    return int(found["attributes"]["minor"]["int"])


def _expected_minors(env: Env, release: Release, pod: JSON) -> set[int]:
    results = pods.container_allocations(env.api, pod, "main")
    assert {r["driver"] for r in results} == {release.driver}, results
    return {_minor(env, release.driver, r["pool"], r["device"]) for r in results}


def _specs(node: Node, driver: str) -> dict[str, tuple[str, int]]:
    """This driver's CDI spec files on the node: name -> (content, mtime)."""
    directory = node.host_path(node.cdi_dir)
    return {
        p.name: (p.read_text(), p.stat().st_mtime_ns)
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name.startswith(f"{driver}-")
    }


def _all_specs(env: Env) -> dict[tuple[str, str], dict[str, tuple[str, int]]]:
    return {(n.name, r.driver): _specs(n, r.driver) for n in env.nodes.nodes.values() for r in (A, B)}


def _kill_plugin(env: Env, release: Release, node_name: str) -> None:
    """kill -9 of the release's plugin process on the node; returns once its restart is Ready."""
    (pod,) = _plugins(env, release, node_name)
    restarts = _restarts(pod)
    node = env.nodes[node_name]
    os.kill(pods.host_pid(node, pods.container_id(pod, "kubelet-plugin")), signal.SIGKILL)
    wait_for(
        f"{release.name}'s plugin on {node_name} restarted and Ready",
        lambda: (p := _plugins(env, release, node_name)) and _restarts(p[0]) > restarts and _ready(p[0]),
        timeout=180,
    )


def _template(release: Release) -> JSON:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": release.name},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": release.driver}}
        ]}}},
    }


def _gpu_pod(release: Release, name: str, node: str) -> JSON:
    pod = pods.gpu_pod(name, templates={"gpu": release.name})
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return pod


def _workload(release: Release, node: str) -> str:
    return f"{release.name}-on-{node}"


def _check_running(env: Env, before: dict[str, JSON], release: Release | None = None) -> None:
    """Every pod of `before` (of `release`, or all) is the same pod, Running, with no container
    restart, and its container sees the devices its claim was allocated."""
    for name, old in before.items():
        owner = A if name.startswith(A.name) else B
        if release is not None and owner != release:
            continue
        pod = get_pod(env.api, WORKLOADS, name)
        assert pod["metadata"]["uid"] == old["metadata"]["uid"], f"{name} was replaced"
        assert pod["status"]["phase"] == "Running" and _restarts(pod) == _restarts(old), pods.describe(
            env.api, WORKLOADS, name)
        node = env.nodes[pod["spec"]["nodeName"]]
        seen = pods.gpu_minors(pods.live_devices(node, pods.container_id(pod, "main")))
        assert seen == _expected_minors(env, owner, pod), f"{name} sees GPUs {seen}"


def _restart_container(env: Env, node: Node, name: str) -> JSON:
    """kill -9 of the pod's container; the pod once the kubelet has it running again."""
    pod = get_pod(env.api, WORKLOADS, name)
    restarts = _restarts(pod)
    os.kill(pods.host_pid(node, pods.container_id(pod, "main")), signal.SIGKILL)

    def running_again() -> JSON | None:
        now = get_pod(env.api, WORKLOADS, name)
        statuses = now["status"].get("containerStatuses", [])
        again = _restarts(now) > restarts and all(s.get("state", {}).get("running") for s in statuses)
        return now if again else None

    restarted: JSON = wait_for(f"{name}'s container restarted and running", running_again, timeout=120,
                               detail=lambda: pods.describe(env.api, WORKLOADS, name))
    return restarted


# -- the test ----------------------------------------------------------------------------------


def test_two_releases_never_touch_each_others_state(env: Env) -> None:
    for release in (A, B):
        _install(env, release)
    for release in (A, B):
        _wait_serving(env, release)

    # One driver name, one release: the chart asks the cluster and says which release has it.
    refused = env.helm.run(
        "install", "gpu-a-again", str(CHART), "-n", "gpu-a-again", "--create-namespace",
        "--set", f"driverName={A.driver}", "--set", f"simulate={PROFILE}", check=False,
    )
    assert refused.returncode != 0, "a second release with the same driver name was installed"
    assert f'release "{A.name}"' in refused.stderr and "already served" in refused.stderr, refused.stderr

    create_namespace(env.api, WORKLOADS)
    pods.create(env.api, WORKLOADS, _template(A), _template(B))
    for release in (A, B):
        for spec in SPECS:
            pods.create(env.api, WORKLOADS, _gpu_pod(release, _workload(release, spec.name), spec.name))
    before = {
        _workload(r, s.name): pods.wait_running(env.api, WORKLOADS, _workload(r, s.name), timeout=120)
        for r in (A, B) for s in SPECS
    }
    _check_running(env, before)
    specs = _all_specs(env)
    for (where, driver), files in specs.items():
        assert len(files) == 1, f"{driver} on {where} should have one claim spec: {sorted(files)}"

    # kill -9 of every plugin, one at a time.
    for release in (A, B):
        for spec in SPECS:
            _kill_plugin(env, release, spec.name)
    _check_running(env, before)
    assert _all_specs(env) == specs, "a plugin restart wrote or removed a CDI spec"

    # B's checkpoint on one node corrupted, then B's plugin there killed: B adopts its claims
    # from the API server; A's files there stay as they were.
    node = env.nodes[SPECS[0].name]
    checkpoint = node.host_path(Path(f"/run/{B.driver}/state/checkpoint.json"))
    assert checkpoint.exists(), f"B's checkpoint is not under its own state dir: {checkpoint}"
    a_checkpoint = node.host_path(Path(f"/run/{A.driver}/state/checkpoint.json"))
    a_before = a_checkpoint.read_bytes()
    checkpoint.write_text("{}")
    _kill_plugin(env, B, node.name)
    assert list(checkpoint.parent.glob("checkpoint.json.corrupt-*")), "the corrupted checkpoint moved aside"
    assert a_checkpoint.read_bytes() == a_before, "B's recovery touched A's checkpoint"
    _check_running(env, before)
    assert _all_specs(env) == specs, "a recovery wrote or removed a CDI spec"

    # A container restarted now resolves its CDI devices from the specs left in place.
    for release in (A, B):
        name = _workload(release, node.name)
        restarted = _restart_container(env, node, name)
        seen = pods.gpu_minors(pods.live_devices(node, pods.container_id(restarted, "main")))
        assert seen == _expected_minors(env, release, restarted)
        before[name] = restarted

    # Each release's uninstall leaves the other's pods running and its plugin serving.
    for gone, kept in ((B, A), (A, B)):
        env.helm.run("uninstall", gone.name, "-n", gone.namespace, "--wait", timeout=180)
        wait_for(f"{gone.name}'s plugin pods gone", lambda g=gone: not _plugins(env, g),  # type: ignore[misc]
                 timeout=120)
        _check_running(env, before, kept)
        assert all(_specs(env.nodes[s.name], kept.driver) for s in SPECS), f"{kept.name}'s specs went"
        probe = f"{kept.name}-after-{gone.name}-left"
        pods.create(env.api, WORKLOADS, _gpu_pod(kept, probe, SPECS[1].name))
        started = pods.wait_running(env.api, WORKLOADS, probe, timeout=120)
        assert pods.container_allocations(env.api, started, "main")[0]["driver"] == kept.driver
        pods.delete_pod(env.api, WORKLOADS, probe)
        pods.wait_gone(env.api, WORKLOADS, probe, timeout=120)
        if gone == B:
            # B back, so that its pods can finish and A's uninstall is tried against a live B.
            _install(env, B)
            _wait_serving(env, B)
            _check_running(env, before, B)
    logger.info("two releases: every pod kept its devices through restarts, a corrupted checkpoint and "
                "the other's uninstall")
