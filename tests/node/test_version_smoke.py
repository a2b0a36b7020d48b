"""The node-tier smoke of `make test-versions` (issue 41): on the session's Kubernetes version
(DRA_K8S_VERSION; the kubelet is built for it by hack/node/build.sh, the control plane by
hack/cluster/build.sh, both with the gates that version knows) and its gates (DRA_FEATURE_GATES),
the chart installed with helm as users install it, with --memory-shares and --dynamic-mig asked,
on one real kubelet + containerd + runc node (simulated hgx-h200-mig: one whole GPU, one in MIG
mode without instances, one with a static 3g).

In turn: a whole-GPU pod runs and sees the device of its allocation (CDI-injected); a memory
share and a dynamic MIG slice run where the version carries them (1.36 on, or the DRA gates on);
elsewhere the plugin turned them off with one Warning Event each on the Node, and neither
claim is allocated (no share or placement is published for the scheduler to give out).

Skipped unless DRA_K8S_VERSION is set (tests.harness.versions sets it): `make test` keeps
its node tier on the default version and its time.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.health.node import SIMULATED_EVENTS_FILE
from tests.harness.cluster import ControlPlane, gate_mode
from tests.harness.driver import DRIVER
from tests.harness.driver_image import CHART, IMAGE_REPOSITORY
from tests.harness.fake_mps import install_fake_mps_control
from tests.harness.node import NodeSpec
from tests.harness.objects import (
    RESOURCE_API,
    create_namespace,
    get_pod,
    scheduler_reason,
    sync_request,
    wait_for,
)
from tests.node import pods
from tests.node.daemonset_cluster import OneNodeRelease, daemonset_cluster

pytestmark = pytest.mark.skipif(
    not os.environ.get("DRA_K8S_VERSION"), reason="make test-versions sets DRA_K8S_VERSION"
)

JSON = dict[str, Any]
NODE = NodeSpec("smoke-a", "hgx-h200-mig")
RELEASE = "gpu-dra-driver"
NAMESPACE = "gpu-dra-driver"
PODS_NS = "smoke"
RUN_DIR = Path(f"/run/{DRIVER}")
FAKE_ROOT = RUN_DIR / "state" / "fake-driver"
IMAGE_PYTHON = "/opt/dra-driver/bin/python3"
EVENTS = RUN_DIR / "state" / SIMULATED_EVENTS_FILE  # the simulated NVML's event source
QUIET = 2  # seconds a recovered GPU stays well before it is offered again
PLUGIN_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=kubelet-plugin"
# What the operator names in kubernetesFeatureGates: the chart then renders shares and MIG on
# 1.34/1.35 too, and it is the plugin that must find out what the API server keeps.
GATES = "{DRAPartitionableDevices,DRAConsumableCapacity}"


def carries(cp: ControlPlane) -> bool:
    """Whether this control plane keeps shared counters and consumable capacity."""
    return cp.version[1] >= 36 or gate_mode() == "all"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OneNodeRelease]:
    with daemonset_cluster(tmp_path_factory, "version-smoke", (NODE,)) as base:
        cp, api, image, helm = base.cp, base.api, base.image, base.helm()
        node = base.nodes[NODE.name]
        install_fake_mps_control(node.host_path(FAKE_ROOT), python=IMAGE_PYTHON)
        try:
            helm.run(
                "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
                "--set", f"simulate={NODE.profile}", "--set", f"image.repository={IMAGE_REPOSITORY}",
                "--set", f"image.tag={image.tag}", "--set", "memoryShares.enabled=true",
                # 1.34's and 1.35's schedulers give a GPU out whole and as a share: the chart asks `only`
                *(("--set", "memoryShares.only=true") if cp.version[1] <= 35 else ()),
                "--set", "dynamicMig.enabled=true", "--set", f"kubernetesFeatureGates={GATES}",
                "--set-json", f'kubeletPlugin.extraArgs=["--driver-root={FAKE_ROOT}", '
                f'"--simulate-health-events={EVENTS}"]', "--set", f"health.quietPeriodSeconds={QUIET}",
                "--set", f"mpsRoot={RUN_DIR / 'mps'}", "--set", f"stateDir={RUN_DIR / 'state'}",
            )
            wait_for("the node's whole pool published", lambda: _pool_complete(api), timeout=180,
                     interval=0.5)
            create_namespace(api, PODS_NS)
            yield OneNodeRelease(cp, api, node, helm, image)
        finally:
            helm.run("uninstall", RELEASE, "-n", NAMESPACE, "--ignore-not-found", check=False, timeout=60)


def _record(env: OneNodeRelease, feature: str, outcome: str) -> None:
    """One cell of tests.harness.versions' node-tier table, written once the test passed."""
    report = os.environ.get("DRA_VERSIONS_REPORT")
    if report:
        version = "v" + ".".join(map(str, env.cp.version))
        with open(report, "a") as f:
            f.write(json.dumps({"node": True, "version": version, "gates": gate_mode(),
                                "feature": feature, "outcome": outcome}) + "\n")


def _slices(api: client.ApiClient) -> list[JSON]:
    items: list[JSON] = sync_request(api, "GET", f"{RESOURCE_API}/resourceslices", query={
        "fieldSelector": f"spec.driver={DRIVER},spec.nodeName={NODE.name}"})["items"]
    return items


def _pool_complete(api: client.ApiClient) -> bool | None:
    """Every slice of the pool's newest generation is there (a pool is published slice by slice)."""
    slices = _slices(api)
    if not slices:
        return None
    newest = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == newest]
    return len(current) == current[0]["spec"]["pool"]["resourceSliceCount"] or None


def _devices(api: client.ApiClient) -> dict[str, JSON]:
    return {d["name"]: d for s in _slices(api) for d in s["spec"].get("devices", [])}


def _feature_events(api: client.ApiClient) -> list[JSON]:
    selector = f"involvedObject.kind=Node,involvedObject.name={NODE.name},reason=DRAFeatureOff"
    items: list[JSON] = sync_request(api, "GET", "/api/v1/namespaces/default/events",
                                     query={"fieldSelector": selector})["items"]
    return items


def _run(env: OneNodeRelease, name: str, claim: JSON, command: str = "ls -l /dev/nvidia*; sleep 3600",
         ) -> JSON | None:
    """Creates the claim and a pod using it; returns the Running pod where the claim can be
    served, else None once the scheduler said why not (the claim must then be unallocated)."""
    claim["metadata"]["name"] = name
    pod = pods.gpu_pod(name, {"gpu": name}, command=command)
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE.name}
    pods.create(env.api, PODS_NS, claim, pod)
    decided = wait_for(
        f"{name} Running or refused by the scheduler",
        lambda: ("running" if get_pod(env.api, PODS_NS, name).get("status", {}).get("phase") == "Running"
                 else "refused" if scheduler_reason(env.api, PODS_NS, name) and not
                 get_pod(env.api, PODS_NS, name)["spec"].get("nodeName") else None),
        timeout=120, interval=0.5,
    )
    return get_pod(env.api, PODS_NS, name) if decided == "running" else None


def _plugin_log(env: OneNodeRelease) -> str:
    """The plugin pod's last log lines, for a failure's message."""
    listed = sync_request(env.api, "GET", f"/api/v1/namespaces/{NAMESPACE}/pods",
                          query={"labelSelector": PLUGIN_SELECTOR})["items"]
    if not listed:
        return "(no plugin pod)"
    name = listed[0]["metadata"]["name"]
    try:
        logs: str = client.CoreV1Api(env.api).read_namespaced_pod_log(name, NAMESPACE, tail_lines=40)
    except ApiException as e:
        return f"(the plugin's log could not be read: {e.status} {e.reason})"
    return logs


def _done(env: OneNodeRelease, name: str) -> None:
    pods.delete_pod(env.api, PODS_NS, name)
    pods.wait_gone(env.api, PODS_NS, name, timeout=60)
    sync_request(env.api, "DELETE", f"{RESOURCE_API}/namespaces/{PODS_NS}/resourceclaims/{name}")


def _allocated(env: OneNodeRelease, name: str) -> list[JSON]:
    claim = sync_request(env.api, "GET", f"{RESOURCE_API}/namespaces/{PODS_NS}/resourceclaims/{name}")
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results: list[JSON] = allocation.get("devices", {}).get("results", [])
    return results


def test_the_kubelet_is_the_control_planes_version(env: OneNodeRelease) -> None:
    found = sync_request(env.api, "GET", f"/api/v1/nodes/{NODE.name}")
    assert found["status"]["nodeInfo"]["kubeletVersion"] == "v" + ".".join(map(str, env.cp.version))


def test_features_on_where_carried_else_one_warning_each(env: OneNodeRelease) -> None:
    devices = _devices(env.api)
    shares = [d for d in devices if d.endswith("-share")]
    placements = [d for d in devices if "-mig-" in d and "uuid" not in devices[d]["attributes"]]
    if carries(env.cp):
        assert shares and placements, f"shares and MIG placements published: {sorted(devices)}"
        assert not _feature_events(env.api)
        _record(env, "warnings", "none")
        return
    assert not shares and not placements, f"published what the server would not keep: {sorted(devices)}"
    events = wait_for("one DRAFeatureOff Event per feature", lambda: (
        e if len(e := _feature_events(env.api)) >= 2 else None), timeout=30)
    off = sorted(e["message"].split(" is off")[0] for e in events)
    # health taints (the chart's default) are off too where DRADeviceTaints is
    shares_flag = "--memory-shares-only" if env.cp.version[1] <= 35 else "--memory-shares"
    assert {"--dynamic-mig", shares_flag} <= set(off) and len(off) == len(set(off)), off
    assert all(e.get("count", 1) == 1 and e["type"] == "Warning" for e in events), "warned once"
    generations = {s["metadata"]["generation"] for s in _slices(env.api)}
    assert generations == {1}, f"no slice rewritten: {generations}"
    _record(env, "warnings", "one each: " + ", ".join(off))


def test_a_whole_gpu_pod_sees_its_cdi_injected_device(env: OneNodeRelease) -> None:
    pod = _run(env, "whole", pods.gpu_claim("whole"))
    assert pod is not None, "a whole GPU is served on every version"
    (result,) = pods.container_allocations(env.api, pod, "main")
    minor = int(_devices(env.api)[result["device"]]["attributes"]["minor"]["int"])
    seen = pods.gpu_minors(pods.logged_devices(env.node, pod, "main"))
    assert seen == {minor}, f"the pod sees GPUs {seen}, allocated minor {minor}"
    _done(env, "whole")
    _record(env, "whole GPU", "works")


def test_a_memory_share_runs_where_carried(env: OneNodeRelease) -> None:
    claim = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {},
        "spec": {"devices": {"requests": [{"name": "mem", "exactly": {
            "deviceClassName": f"gpu-share.{DRIVER}", "capacity": {"requests": {"memory": "4Gi"}}}}]}},
    }
    pod = _run(env, "share", claim, command="sleep 3600")
    if carries(env.cp):
        assert pod is not None, scheduler_reason(env.api, PODS_NS, "share")
        (result,) = _allocated(env, "share")
        assert result["device"].endswith("-share"), result
    else:
        assert pod is None and not _allocated(env, "share"), "a share allocated where shares are off"
    _done(env, "share")
    _record(env, "share", "works" if carries(env.cp) else "off (warning)")


def test_a_mig_slice_runs_where_carried(env: OneNodeRelease) -> None:
    a = f'device.attributes["{DRIVER}"]'
    claim = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
            "deviceClassName": f"mig-dynamic.{DRIVER}",
            "selectors": [{"cel": {"expression": f'{a}.profile == "1g.18gb"'}}]}}]}},
    }
    pod = _run(env, "mig", claim, command="ls -l /dev/nvidia* /dev/nvidia-caps; sleep 3600")
    if carries(env.cp):
        assert pod is not None, scheduler_reason(env.api, PODS_NS, "mig")
        (result,) = _allocated(env, "mig")
        assert "-mig-1g-18gb-" in result["device"], result
    else:
        assert pod is None and not _allocated(env, "mig"), "a MIG placement allocated where MIG is off"
    _done(env, "mig")
    _record(env, "MIG", "works" if carries(env.cp) else "off (warning)")


def test_a_gpu_with_a_fatal_xid_gets_no_new_pod(env: OneNodeRelease) -> None:
    """Issue 54 item 2: a fatal XID on the whole GPU keeps new pods off it on every version:
    tainted NoSchedule where the server keeps device taints, left out of the slice where it does
    not (1.34/1.35 default gates). A pod asking for exactly that GPU waits with the scheduler's
    reason; once the GPU has recovered (and stayed well for the quiet period) it runs there."""
    device = _devices(env.api)["gpu-2"]  # the profile's one GPU with MIG mode off
    uuid, index = device["attributes"]["uuid"]["string"], 2
    events = env.node.host_path(EVENTS)

    def inject(**record: Any) -> None:
        with events.open("a") as f:
            f.write(json.dumps({"gpu": index, **record}) + "\n")

    def kept_off() -> str | None:
        found = _devices(env.api).get(device["name"])
        if found is None:
            return "left out of the slice"
        keeps_off = [t for t in found.get("taints", []) if t["effect"] in ("NoSchedule", "NoExecute")]
        return "tainted" if keeps_off else None

    inject(xid=79, recovery_action=1)
    how = wait_for(f"{device['name']} kept from new pods", kept_off, timeout=30, interval=0.5)
    claim = pods.gpu_claim("sick", selectors=[f'device.attributes["{DRIVER}"].uuid == "{uuid}"'])
    assert _run(env, "sick", claim, command="sleep 3600") is None, f"a pod got {uuid} while {how}"
    reason = scheduler_reason(env.api, PODS_NS, "sick") or ""
    assert "cannot allocate all claims" in reason, reason
    inject(recover=True)
    recovered = time.monotonic()
    wait_for("the pod on the recovered GPU", lambda: get_pod(env.api, PODS_NS, "sick").get(
        "status", {}).get("phase") == "Running" or None, timeout=120, interval=0.5,
        detail=lambda: f"plugin log:\n{_plugin_log(env)[-1500:]}\n{device['name']}: "
                       f"{kept_off() or 'offered'}; claim {_allocated(env, 'sick')}; "
                       f"pod {get_pod(env.api, PODS_NS, 'sick').get('status')}")
    assert time.monotonic() - recovered >= QUIET, "offered again only after the quiet period"
    (result,) = _allocated(env, "sick")
    assert result["device"] == device["name"], result
    _done(env, "sick")
    _record(env, "sick GPU", f"kept from new pods ({how})")
