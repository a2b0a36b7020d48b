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
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.jsontypes import JSON
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.fake_mps import install_fake_mps_control
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import (
    allocation_results,
    create_object,
    get_claim,
    get_pod,
    load_yaml_documents,
    pod_claim_names,
    scheduler_reason,
    sync_request,
    wait_for,
)
from tests.harness.plugin_node import plugin_node

RESOURCE_API = "/apis/resource.k8s.io/v1"
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


@dataclass
class Bench:
    api: client.ApiClient
    control_plane: ControlPlane
    plugin: DriverProcess
    kubelet: KubeletSide
    node: str


def _fake_driver_root(root: Path) -> Path:
    """ELF files under the real library names (the scanner keeps only those) and the
    stand-in MPS control tool."""
    lib = root / "lib64"
    lib.mkdir(parents=True)
    elf = Path("/bin/true").resolve()
    for name in ("libcuda.so", "libnvidia-ml.so"):
        real = lib / f"{name}.580.159.04"
        shutil.copy(elf, real)
        (lib / f"{name}.1").symlink_to(real.name)
    install_fake_mps_control(root)
    return root


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
        ("--driver-root", str(_fake_driver_root(base / "driver")), *flags),
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


class Case:
    """Claims and pods of one test in its namespace, pinned to the node; `clear()` frees them."""

    def __init__(self, bench: Bench, namespace: str) -> None:
        self.bench, self.api, self.ns = bench, bench.api, namespace
        self.counter = itertools.count()
        self.prepared: list[ClaimName] = []

    def create(self, devices: JSON) -> str:
        name = f"c{next(self.counter)}"
        sync_request(
            self.api,
            "POST",
            f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name},
                "spec": {"devices": devices},
            },
        )
        sync_request(
            self.api,
            "POST",
            f"/api/v1/namespaces/{self.ns}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": self.bench.node},
                    "automountServiceAccountToken": False,
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                    "containers": [
                        {
                            "name": "main",
                            "image": "busybox:1.37",
                            "command": ["sleep", "3600"],
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                },
            },
        )
        return name

    def bound(self, name: str) -> JSON:
        """The pod is bound: the one allocation result of its one claim."""

        def probe() -> JSON | None:
            pod = get_pod(self.api, self.ns, name)
            return pod if pod["spec"].get("nodeName") else None

        try:
            pod = wait_for(f"pod {name} bound", probe, timeout=30)
        except TimeoutError as e:
            raise AssertionError(f"{e}; scheduler says: {scheduler_reason(self.api, self.ns, name)}") from e
        ((claim, _),) = pod_claim_names(pod)
        (result,) = allocation_results(get_claim(self.api, self.ns, claim))
        return result

    def pending(self, name: str) -> str:
        """The pod stays unbound: the scheduler's reason."""

        def probe() -> str | None:
            assert not get_pod(self.api, self.ns, name)["spec"].get("nodeName"), f"{name} was bound"
            return scheduler_reason(self.api, self.ns, name) or None

        reason = wait_for(f"a FailedScheduling event for {name}", probe, timeout=30)
        assert not allocation_results(get_claim(self.api, self.ns, name))
        return reason

    def delete(self, name: str) -> None:
        sync_request(
            self.api, "DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}", query={"gracePeriodSeconds": "0"}
        )
        sync_request(self.api, "DELETE", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims/{name}")

        def gone() -> bool:
            try:
                get_claim(self.api, self.ns, name)
            except ApiException as e:
                return bool(e.status == 404)
            return False

        wait_for(f"claim {name} to be gone", gone, timeout=60)

    def prepare(self, name: str) -> tuple[Any, dict[str, Any]]:
        """NodePrepareResources as the kubelet sends it (v1); the device answered and the OCI
        edits cdicheck makes of its CDI ids."""
        claim = get_claim(self.api, self.ns, name)
        ref = ClaimName(self.ns, name, claim["metadata"]["uid"])
        response = self.bench.kubelet.prepare(ref)
        self.prepared.append(ref)
        answer = response.claims[ref.uid]
        assert not answer.error, answer.error
        (device,) = answer.devices
        out = subprocess.run(
            [
                str(self.bench.control_plane.bin_dir / "cdicheck"),
                "-dir",
                str(self.bench.plugin.cdi_dir),
                *device.cdi_device_ids,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        oci: dict[str, Any] = json.loads(out.stdout)
        return device, oci

    def clear(self) -> None:
        for ref in reversed(self.prepared):
            self.bench.kubelet.unprepare(ref)
        now = {"gracePeriodSeconds": "0"}
        sync_request(self.api, "DELETE", f"/api/v1/namespaces/{self.ns}/pods", query=now)
        sync_request(self.api, "DELETE", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims")

        def released() -> bool:
            claims = sync_request(self.api, "GET", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims")
            return not claims["items"]

        wait_for("the case's claims to be gone", released, timeout=60)


@pytest.fixture
def case(bench: Bench, namespace: str) -> Iterator[Case]:
    c = Case(bench, namespace)
    try:
        yield c
    finally:
        c.clear()


def _env(oci: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in oci["process"]["env"])


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
        env = _env(oci)
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
    assert _env(oci)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8G"


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
        limits[pod] = _env(oci)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
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
                assert _env(oci)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=100G"
            finally:
                case.clear()
    finally:
        if not os.environ.get("KEEP_TMP"):
            shutil.rmtree(base, ignore_errors=True)
