"""Memory shares against the real kube-scheduler: placement by consumable capacity, whole
GPU vs shares kept apart by the shared counter, and each share's own limit in its container.

One `dra-driver kubelet-plugin --memory-shares` (and, for one test, a second node's with
`--memory-shares-only`) on a simulated single H200 (143771Mi, so
140Gi of shares) with a stand-in `nvidia-cuda-mps-control` (tests/harness/fake_mps.py)
under its driver root; the share DeviceClass and its admission policy come from
deploy/deviceclasses/gpu-share.yaml as shipped. Claims are standalone ResourceClaims used
by pods pinned to the node, so nothing here lands elsewhere or is landed on. The kubelet's
side of Prepare is tests/harness/kubelet.py; every CDI id is resolved by `cdicheck` (the
CDI library containerd and CRI-O use) and the container's environment read from that.
At the end the plugin stops and the node, its slices, the classes and the policy go.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.jsontypes import JSON
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER
from tests.harness.fake_mps import mps_driver_root
from tests.harness.objects import (
    RESOURCE_API,
    create_object,
    get_claim,
    get_pod,
    load_yaml_documents,
    pod_claim_names,
    sync_request,
)
from tests.harness.pinned_claims import Bench, Case, oci_env
from tests.harness.plugin_node import plugin_node

SLICES = f"{RESOURCE_API}/resourceslices"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SHARE_CLASS_FILE = DEPLOY / "deviceclasses" / "gpu-share.yaml"
EXAMPLE = DEPLOY / "examples" / "memory-shares" / "12-memory-shares.yaml"
SHARE_CLASS = "gpu-share.gpu.dra-driver.dev"
WHOLE_CLASS = "shares-test-whole-gpu"
SUFFIX = uuid.uuid4().hex[:6]
NODE = f"shares-{SUFFIX}"
ONLY_NODE = f"only-{SUFFIX}"  # --memory-shares-only
GI = 2**30


def _path(kind: str, name: str = "") -> str:
    plural = {
        "DeviceClass": "deviceclasses",
        "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
        "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    }[kind]
    group = RESOURCE_API if kind == "DeviceClass" else "/apis/admissionregistration.k8s.io/v1"
    return f"{group}/{plural}" + (f"/{name}" if name else "")


@contextlib.contextmanager
def _plugin_node(
    control_plane: ControlPlane, api: client.ApiClient, node: str, base: Path, *flags: str
) -> Iterator[Bench]:
    """A Node and its `dra-driver kubelet-plugin` on a simulated single H200 with `flags`,
    until its share view is published; afterwards the plugin, its slices and the Node go."""
    with plugin_node(
        api,
        control_plane.kubeconfig,
        node,
        "h200-single",
        base / "n",
        ("--driver-root", str(mps_driver_root(base / "driver")), *flags),
        published=lambda: "gpu-0-share" in _devices(api, node),
        what="the share view in the node's slices",
    ) as n:
        yield Bench(api, control_plane, n.plugin, n.side, node)


@pytest.fixture(scope="module")
def bench(control_plane: ControlPlane, api: client.ApiClient) -> Iterator[Bench]:
    base = Path(tempfile.mkdtemp(prefix="shr-", dir="/tmp"))  # short: UNIX socket paths
    base.chmod(0o755)  # MPS servers run as the client's user and must reach the pipe dirs
    shipped = load_yaml_documents(SHARE_CLASS_FILE)
    for doc in shipped:
        sync_request(api, "POST", _path(doc["kind"]), doc)
    sync_request(
        api,
        "POST",
        _path("DeviceClass"),
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": WHOLE_CLASS},
            "spec": {
                "selectors": [
                    {
                        "cel": {
                            "expression": f'device.driver == "{DRIVER}" && '
                            f'device.attributes["{DRIVER}"].type == "gpu"'
                        }
                    }
                ]
            },
        },
    )
    try:
        with _plugin_node(control_plane, api, NODE, base, "--memory-shares") as b:
            yield b
    finally:
        sync_request(api, "DELETE", _path("DeviceClass", WHOLE_CLASS))
        for doc in reversed(shipped):
            sync_request(api, "DELETE", _path(doc["kind"], doc["metadata"]["name"]))
        if not os.environ.get("KEEP_TMP"):
            shutil.rmtree(base, ignore_errors=True)


def _devices(api: client.ApiClient, node: str = NODE) -> dict[str, JSON]:
    items = sync_request(api, "GET", SLICES, query={"fieldSelector": f"spec.nodeName={node}"})["items"]
    return {d["name"]: d for s in items for d in s["spec"].get("devices", [])}


def share(memory: str | None) -> JSON:
    exactly: JSON = {"deviceClassName": SHARE_CLASS}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {"requests": [{"name": "mem", "exactly": exactly}]}


WHOLE: JSON = {"requests": [{"name": "gpu", "exactly": {"deviceClassName": WHOLE_CLASS}}]}


@pytest.fixture
def case(bench: Bench, namespace: str) -> Iterator[Case]:
    with Case(bench, namespace) as c:
        yield c


def test_the_node_publishes_both_views_of_its_gpu(bench: Bench) -> None:
    devices = _devices(bench.api)
    assert set(devices) == {"gpu-0", "gpu-0-share"}
    policy = devices["gpu-0-share"]["capacity"]["memory"]["requestPolicy"]
    assert policy == {"default": "8Gi", "validRange": {"min": "1Gi", "max": "140Gi", "step": "1Gi"}}
    assert devices["gpu-0-share"]["allowMultipleAllocations"] is True


def test_40_60_60_two_share_the_gpu_and_the_third_waits(case: Case, bench: Bench) -> None:
    first = case.create(share("40Gi"))
    a = case.bound(first)
    second = case.create(share("60Gi"))
    b = case.bound(second)
    assert a["device"] == b["device"] == "gpu-0-share"
    assert a["consumedCapacity"] == {"memory": "40Gi"} and b["consumedCapacity"] == {"memory": "60Gi"}
    assert a["shareID"] and b["shareID"] and a["shareID"] != b["shareID"]
    third = case.create(share("60Gi"))
    reason = case.pending(third)
    assert "cannot allocate all claims" in reason, reason

    # Each container gets its own daemon's pipe and its own share as the MPS limit; the
    # kubelet gets the share id on the v1 API.
    limits = {}
    for name, result in ((first, a), (second, b)):
        device, oci = case.prepare(name)
        assert device.share_id == result["shareID"]
        env = oci_env(oci)
        limits[name] = env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
        pipe = next(m["source"] for m in oci["mounts"] if m["destination"] == "/tmp/nvidia-mps")
        assert get_claim(case.api, case.ns, name)["metadata"]["uid"] in pipe
        assert {d["path"] for d in oci["linux"]["devices"]} >= {"/dev/nvidia0", "/dev/nvidiactl"}
    assert limits == {first: "0=40G", second: "0=60G"}

    # The third gets the GPU once a share is gone.
    case.delete(first)
    assert case.bound(third)["consumedCapacity"] == {"memory": "60Gi"}


def test_a_whole_gpu_never_lands_on_a_gpu_holding_shares_nor_the_reverse(case: Case) -> None:
    small = case.create(share("1Gi"))
    assert case.bound(small)["device"] == "gpu-0-share"
    whole = case.create(WHOLE)
    reason = case.pending(whole)
    assert "cannot allocate all claims" in reason, reason

    case.delete(small)
    assert case.bound(whole)["device"] == "gpu-0"
    late = case.create(share("1Gi"))
    reason = case.pending(late)
    assert "cannot allocate all claims" in reason, reason


def test_a_share_without_a_memory_request_gets_the_default(case: Case) -> None:
    name = case.create(share(None))
    assert case.bound(name)["consumedCapacity"] == {"memory": "8Gi"}
    _, oci = case.prepare(name)
    assert oci_env(oci)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8G"


def test_more_than_the_gpu_has_stays_pending(case: Case) -> None:
    name = case.create(share("141Gi"))
    reason = case.pending(name)
    assert "cannot allocate all claims" in reason, reason


@pytest.mark.parametrize("memory", ["40G", "512Mi", "40000Mi"])
def test_memory_off_the_step_is_refused_when_written(bench: Bench, namespace: str, memory: str) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "off-step"},
        "spec": {"devices": share(memory)},
    }
    with pytest.raises(ApiException) as refused:
        sync_request(bench.api, "POST", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims", body)
    text = str(refused.value.body)
    assert "whole number of Gi" in text and "write for example 40Gi" in text, text
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "off-step"},
        "spec": {"spec": {"devices": share(memory)}},
    }
    with pytest.raises(ApiException, match="whole number of Gi"):
        sync_request(
            bench.api, "POST", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaimtemplates", template
        )
    first_available = {
        "requests": [
            {
                "name": "mem",
                "firstAvailable": [
                    {
                        "name": "big",
                        "deviceClassName": SHARE_CLASS,
                        "capacity": {"requests": {"memory": "80Gi"}},
                    },
                    {
                        "name": "small",
                        "deviceClassName": SHARE_CLASS,
                        "capacity": {"requests": {"memory": memory}},
                    },
                ],
            }
        ]
    }
    with pytest.raises(ApiException, match="whole number of Gi"):
        sync_request(
            bench.api,
            "POST",
            f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims",
            {**body, "spec": {"devices": first_available}},
        )
    ok = {**body, "metadata": {"name": "on-step"}, "spec": {"devices": share("40Gi")}}
    sync_request(bench.api, "POST", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims", ok)


def test_example_12_two_pods_share_one_gpu_each_with_its_limit(case: Case) -> None:
    for doc in load_yaml_documents(EXAMPLE):
        create_object(case.api, doc, case.ns)
    limits = {}
    for pod, memory in (("share-a", "40Gi"), ("share-b", "60Gi")):
        result = case.bound(pod)
        assert result["device"] == "gpu-0-share" and result["consumedCapacity"] == {"memory": memory}
        ((claim, _),) = pod_claim_names(get_pod(case.api, case.ns, pod))
        _, oci = case.prepare(claim)
        limits[pod] = oci_env(oci)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    assert limits == {"share-a": "0=40G", "share-b": "0=60G"}


def test_a_shares_only_node_serves_shares_and_never_a_whole_gpu(bench: Bench, namespace: str) -> None:
    """--memory-shares-only: the GPU is published as its share view alone, with no counter;
    shares fill it by capacity as on a node with both views, a whole-GPU claim finds no
    device, and Prepare of a share is the same."""
    base = Path(tempfile.mkdtemp(prefix="sho-", dir="/tmp"))
    base.chmod(0o755)
    try:
        with _plugin_node(bench.control_plane, bench.api, ONLY_NODE, base, "--memory-shares-only") as only:
            devices = _devices(bench.api, ONLY_NODE)
            assert set(devices) == {"gpu-0-share"}
            assert "consumesCounters" not in devices["gpu-0-share"]
            query = {"fieldSelector": f"spec.nodeName={ONLY_NODE}"}
            items = sync_request(bench.api, "GET", SLICES, query=query)["items"]
            assert not any("sharedCounters" in s["spec"] for s in items)
            case = Case(only, namespace)
            try:
                # one after the other, as the tests above: created at once, the second was once
                # left pending in a full run ("cannot allocate all claims"; alone it binds)
                first = case.create(share("100Gi"))
                assert case.bound(first)["device"] == "gpu-0-share"
                second = case.create(share("40Gi"))
                assert case.bound(second)["device"] == "gpu-0-share"
                whole = case.create(WHOLE)
                assert "cannot allocate all claims" in case.pending(whole)
                third = case.create(share("1Gi"))
                assert "cannot allocate all claims" in case.pending(third), "140Gi of shares are taken"
                _, oci = case.prepare(first)
                assert oci_env(oci)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=100G"
            finally:
                case.clear()
    finally:
        if not os.environ.get("KEEP_TMP"):
            shutil.rmtree(base, ignore_errors=True)
