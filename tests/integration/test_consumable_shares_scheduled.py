"""NVIDIA's consumable shares against the real kube-scheduler and API server: several claims
of the standard class on one whole GPU, each with what it asked; and NVIDIA's share claims
refused when written where the release does not publish what they ask.

Two `dra-driver kubelet-plugin` nodes on a simulated single H200 (143771Mi), one with
`--consumable-shares=memory`, one with `--consumable-shares=4`, a stand-in
`nvidia-cuda-mps-control` under their driver root (tests/harness/fake_mps.py). Claims of a
class selecting whole GPUs are used by pods pinned to a node (tests/harness/pinned_claims.py);
the kubelet's side of Prepare is tests/harness/kubelet.py and every CDI id is resolved by
`cdicheck`. The admission policy is the chart's template as `helm template` renders it.
"""

from __future__ import annotations

import contextlib
import json
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
from tests.harness.driver_image import render_chart
from tests.harness.fake_mps import mps_driver_root
from tests.harness.objects import RESOURCE_API, create_object, delete_object, sync_request, wait_for
from tests.harness.pinned_claims import Bench, Case, oci_env
from tests.harness.plugin_node import plugin_node

SUFFIX = uuid.uuid4().hex[:6]
WHOLE_CLASS = f"consumable-{SUFFIX}"
H200 = "143771Mi"


def _devices(api: client.ApiClient, node: str) -> dict[str, JSON]:
    query = {"fieldSelector": f"spec.nodeName={node}"}
    items = sync_request(api, "GET", f"{RESOURCE_API}/resourceslices", query=query)["items"]
    return {d["name"]: d for s in items for d in s["spec"].get("devices", [])}


@contextlib.contextmanager
def _node(control_plane: ControlPlane, api: client.ApiClient, mode: str) -> Iterator[Bench]:
    name = f"cs{mode}-{SUFFIX}"
    base = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))  # short: UNIX socket paths
    base.chmod(0o755)  # MPS servers run as the client's user and must reach the pipe dirs
    try:
        with plugin_node(
            api, control_plane.kubeconfig, name, "h200-single", base / "n",
            ("--driver-root", str(mps_driver_root(base / "driver")), f"--consumable-shares={mode}"),
            published=lambda: _devices(api, name).get("gpu-0", {}).get("allowMultipleAllocations"),
            what="gpu-0 published for several claims",
        ) as n:
            yield Bench(api, control_plane, n.plugin, n.side, name)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def whole_class(api: client.ApiClient) -> Iterator[str]:
    selector = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
    sync_request(api, "POST", f"{RESOURCE_API}/deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": WHOLE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": selector}}]}})
    yield WHOLE_CLASS
    sync_request(api, "DELETE", f"{RESOURCE_API}/deviceclasses/{WHOLE_CLASS}")


@pytest.fixture(scope="module")
def memory_node(control_plane: ControlPlane, api: client.ApiClient, whole_class: str) -> Iterator[Bench]:
    with _node(control_plane, api, "memory") as bench:
        yield bench


@pytest.fixture(scope="module")
def four_node(control_plane: ControlPlane, api: client.ApiClient, whole_class: str) -> Iterator[Bench]:
    with _node(control_plane, api, "4") as bench:
        yield bench


def gpu(memory: str | None = None, shares: str | None = None, cls: str = WHOLE_CLASS) -> JSON:
    requests = {k: v for k, v in (("memory", memory), ("shares", shares)) if v is not None}
    exactly: JSON = {"deviceClassName": cls}
    if requests:
        exactly["capacity"] = {"requests": requests}
    return {"requests": [{"name": "gpu", "exactly": exactly}]}


def test_memory_mode_two_4gi_claims_share_the_gpu_each_held_to_its_4gi(
    memory_node: Bench, namespace: str
) -> None:
    """NVIDIA's memory-sharing.yaml: 4Gi each on one GPU, each with its own MPS limit; a claim
    without a memory request takes the whole GPU, so it waits until they are gone, and then
    runs with no MPS at all."""
    policy = _devices(memory_node.api, memory_node.node)["gpu-0"]["capacity"]["memory"]
    assert policy == {"value": H200, "requestPolicy": {
        "default": H200, "validRange": {"min": "1Mi", "max": H200, "step": "1Mi"}}}
    with Case(memory_node, namespace) as case:
        a, b = case.create(gpu("4Gi")), case.create(gpu("4Gi"))
        results = [case.bound(a), case.bound(b)]
        assert [r["device"] for r in results] == ["gpu-0", "gpu-0"]
        assert [r["consumedCapacity"] for r in results] == [{"memory": "4Gi"}] * 2
        assert results[0]["shareID"] != results[1]["shareID"]
        whole = case.create(gpu())
        assert "cannot allocate all claims" in case.pending(whole)
        for name, result in zip((a, b), results, strict=True):
            device, oci = case.prepare(name)
            assert device.share_id == result["shareID"]
            env = oci_env(oci)
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4G"
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
        case.clear()
        alone = case.create(gpu())
        assert case.bound(alone)["consumedCapacity"] == {"memory": H200}
        _, oci = case.prepare(alone)
        assert not any(k.startswith("CUDA_MPS_") for k in oci_env(oci))
        assert {d["path"] for d in oci["linux"]["devices"]} >= {"/dev/nvidia0"}


def test_integer_mode_four_claims_share_the_gpu_the_fifth_waits(four_node: Bench, namespace: str) -> None:
    """NVIDIA's integer-sharing.yaml with --consumable-shares=4: four claims that ask nothing
    get one share each of the one GPU, time-sliced (no MPS); a fifth waits; one that asks for
    8Gi beside them gets an MPS limit."""
    device = _devices(four_node.api, four_node.node)["gpu-0"]
    assert device["capacity"]["shares"] == {"value": "4", "requestPolicy": {
        "default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}}}
    with Case(four_node, namespace) as case:
        names = [case.create(gpu()) for _ in range(3)]
        results = [case.bound(n) for n in names]
        assert {r["device"] for r in results} == {"gpu-0"}
        assert all(r["consumedCapacity"] == {"memory": "0", "shares": "1"} for r in results), results
        assert len({r["shareID"] for r in results}) == 3
        eight = case.create(gpu("8Gi"))
        assert case.bound(eight)["consumedCapacity"] == {"memory": "8Gi", "shares": "1"}
        assert "cannot allocate all claims" in case.pending(case.create(gpu()))
        _, oci = case.prepare(names[0])
        assert not any(k.startswith("CUDA_MPS_") for k in oci_env(oci))
        _, oci = case.prepare(eight)
        assert oci_env(oci)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8G"


def _refused(api: client.ApiClient, namespace: str, devices: JSON) -> str | None:
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"generateName": "p-"}, "spec": {"devices": devices}}
    try:
        sync_request(api, "POST", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims", body)
    except ApiException as e:
        return str(json.loads(e.body)["message"])
    return None


@contextlib.contextmanager
def _policy(api: client.ApiClient, tmp: Path, *sets: str) -> Iterator[None]:
    docs = render_chart(tmp, *sets, show_only="templates/consumable-shares-policy.yaml")
    for doc in docs:
        create_object(api, doc)
    try:
        yield
    finally:
        for doc in reversed(docs):
            delete_object(api, doc)


def test_share_claims_the_release_cannot_serve_are_refused_when_written(
    api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    with _policy(api, tmp_path):  # the chart's default: consumableShares=disabled
        refusal = wait_for("the policy to refuse", lambda: _refused(api, namespace, gpu("4Gi", cls=DRIVER)),
                           timeout=30)
        assert "not shared here (consumableShares=disabled)" in refusal, refusal
        assert f"gpu-share.{DRIVER}" in refusal and "consumableShares=memory" in refusal, refusal
        refusal = _refused(api, namespace, gpu(shares="1", cls=DRIVER)) or ""
        assert "consumableShares=<shares per GPU>" in refusal, refusal
        assert _refused(api, namespace, gpu(cls=DRIVER)) is None
        assert _refused(api, namespace, gpu("4Gi", cls=f"gpu-share.{DRIVER}")) is None
    with _policy(api, tmp_path, "consumableShares=memory"):
        def refusal_of_this_release() -> str | None:
            # the policy is the one just deleted by name until the API server sees the new one
            text = _refused(api, namespace, gpu(shares="1", cls=DRIVER)) or ""
            return text if "runs with consumableShares=memory" in text else None

        wait_for("the memory release's policy to refuse", refusal_of_this_release, timeout=30)
        assert _refused(api, namespace, gpu("4Gi", cls=DRIVER)) is None
    # with shares published, nothing is left to refuse
    rendered = render_chart(tmp_path, "consumableShares=4")
    assert not [d for d in rendered if d["metadata"]["name"].startswith("consumable-shares.")]
