"""Dynamic MIG against the real kube-scheduler: placement devices with shared counters.

The slices of a simulated node are what the plugin would publish with dynamic MIG
(`controller.slices.desired_slices(..., SliceFeatures(dynamic_mig=True))` of the
`hgx-h200-mig` profile), written once; the scheduler alone decides. The DeviceClass is
deploy/deviceclasses/mig-dynamic.yaml as shipped. Claims are standalone ResourceClaims used
by pods pinned to the node. At the end the node, its slices and the classes go.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from controller.slices import SliceFeatures, desired_slices
from dra_driver.gpu import discover
from dra_driver.jsontypes import JSON
from tests.harness.driver import DRIVER
from tests.harness.objects import (
    RESOURCE_API,
    create_node,
    load_yaml_documents,
    sync_request,
)
from tests.harness.pinned_claims import PinnedClaims

SLICES = f"{RESOURCE_API}/resourceslices"
CLASSES = f"{RESOURCE_API}/deviceclasses"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MIG_CLASS = "mig-dynamic.gpu.dra-driver.dev"
WHOLE_CLASS = "dynmig-test-whole-gpu"
NODE = f"dynmig-{uuid.uuid4().hex[:6]}"
A = f'device.attributes["{DRIVER}"]'


@pytest.fixture(scope="module")
def node(api: client.ApiClient) -> Iterator[str]:
    (mig_class,) = load_yaml_documents(DEPLOY / "deviceclasses" / "mig-dynamic.yaml")
    sync_request(api, "POST", CLASSES, mig_class)
    whole = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": WHOLE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}" && {A}.type == "gpu"'}}]},
    }
    sync_request(api, "POST", CLASSES, whole)
    create_node(api, NODE)
    specs = desired_slices(discover("hgx-h200-mig"), NODE, DRIVER, SliceFeatures(dynamic_mig=True))
    try:
        for n, spec in enumerate(specs):
            spec["pool"] = {**spec["pool"], "generation": 1, "resourceSliceCount": len(specs)}
            body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                    "metadata": {"name": f"{NODE}-{n}"}, "spec": spec}
            sync_request(api, "POST", SLICES, body)
        yield NODE
    finally:
        sync_request(api, "DELETE", SLICES, query={"fieldSelector": f"spec.nodeName={NODE}"})
        sync_request(api, "DELETE", f"/api/v1/nodes/{NODE}")
        for name in (MIG_CLASS, WHOLE_CLASS):
            sync_request(api, "DELETE", f"{CLASSES}/{name}")


class Case(PinnedClaims):
    """tests/harness/pinned_claims.py's claims and pods, pinned to this module's node."""

    def bound(self, name: str) -> list[str]:
        """The pod is bound: the devices its claim was given."""
        return [r["device"] for r in self.results(name)]


@pytest.fixture
def case(api: client.ApiClient, node: str, namespace: str) -> Iterator[Case]:
    with Case(api, namespace, node) as c:
        yield c


def mig(profile: str, gpu: int, count: int = 1) -> JSON:
    expression = f'{A}.profile == "{profile}" && {A}.parentIndex == {gpu}'
    selectors = [{"cel": {"expression": expression}}]
    exactly = {"deviceClassName": MIG_CLASS, "count": count, "selectors": selectors}
    return {"requests": [{"name": "mig", "exactly": exactly}]}


def whole(gpu: int) -> JSON:
    exactly = {"deviceClassName": WHOLE_CLASS, "selectors": [{"cel": {"expression": f"{A}.index == {gpu}"}}]}
    return {"requests": [{"name": "gpu", "exactly": exactly}]}


def test_seven_1g_slices_fill_an_h200_and_a_3g_waits_until_its_slices_are_free(case: Case) -> None:
    ones = [case.create(mig("1g.18gb", 0)) for _ in range(7)]
    placed = {case.bound(name)[0]: name for name in ones}
    assert sorted(placed) == [f"gpu-0-mig-1g-18gb-19-{s}" for s in range(7)]
    big = case.create(mig("3g.71gb", 0))
    reason = case.pending(big)
    assert "cannot allocate all claims" in reason, reason
    # A 3g starts at slice 0 or 4 and spans four memory slices: freeing two 1g (4 and 5)
    # frees compute but not slice 6, so it still waits; the third (6) lets it in at 4.
    for start in (4, 5):
        case.delete(placed[f"gpu-0-mig-1g-18gb-19-{start}"])
    case.pending(big)
    case.delete(placed["gpu-0-mig-1g-18gb-19-6"])
    assert case.bound(big) == ["gpu-0-mig-3g-71gb-9-4"]


def test_a_whole_gpu_and_a_mig_slice_never_share_a_gpu(case: Case) -> None:
    slice_ = case.create(mig("2g.35gb", 0))
    assert case.bound(slice_)[0].startswith("gpu-0-mig-2g-35gb-14-")
    gpu = case.create(whole(0))
    reason = case.pending(gpu)
    assert "cannot allocate all claims" in reason, reason
    case.delete(slice_)
    assert case.bound(gpu) == ["gpu-0"]
    other = case.create(mig("1g.18gb", 0))
    case.pending(other)


def test_two_slices_of_one_gpu_and_static_mig_keeps_its_slices(case: Case) -> None:
    two = case.create(mig("3g.71gb", 1, count=2))  # GPU 1 holds a static 3g.71gb at 4-7
    case.pending(two)
    one = case.create(mig("3g.71gb", 1))
    assert case.bound(one) == ["gpu-1-mig-3g-71gb-9-0"]
    pair = case.create(mig("2g.35gb", 0, count=2))
    devices = case.bound(pair)
    assert len(set(devices)) == 2 and all(d.startswith("gpu-0-mig-2g-35gb-14-") for d in devices)


EXAMPLES = {
    "01-slice-3g-71gb.yaml": "-mig-3g-71gb-9-",
    "02-smallest-slice-35gb.yaml": "-mig-1g-35gb-15-",
    "03-two-slices-one-gpu.yaml": "-mig-1g-18gb-19-",
    "04-mig-memory-share.yaml": "-mig-1g-18gb-",
}


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_shipped_mig_examples_are_allocated(case: Case, example: str) -> None:
    (doc,) = load_yaml_documents(DEPLOY / "examples" / "mig" / example)
    devices = case.bound(case.create(doc["spec"]["devices"]))
    assert devices and all(EXAMPLES[example] in d for d in devices), devices
    if example.startswith("03-"):
        assert len(set(devices)) == 2 and len({d.split("-mig-")[0] for d in devices}) == 1
