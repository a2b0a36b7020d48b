"""The documented NVLink claim shapes against the real kube-scheduler, on topologies made to fragment.

Three simulated nodes, each published by a real `dra-driver controller` process under a
driver name of this module's own (`nvlink-<suffix>.dra-driver.dev`), so that no claim of
another test can land on them (its DeviceClass selects `gpu.dra-driver.dev`) and ours can
land only on them (our DeviceClass selects our driver); every pod is pinned to its node:
- an 8-GPU NVLink ring (published without list-type attributes: the GA form),
- two NVLink triangles joined by one link,
- an 8-GPU NVSwitch board.
Chosen GPUs are made busy by claims allocated first (one request per GPU, selected by
`index`, for a pod pinned to the node); then the documented claim for k GPUs
(`controller.claim_shapes`) either gets a set whose every two GPUs are linked (checked
against the simulated hardware's own links) or stays Pending with the scheduler's
"cannot allocate all claims". Each case frees everything it created before the next.
At the end the processes stop and the nodes, slices and DeviceClass are deleted.
`test_ga_cluster_stable_allocator` repeats the GA cases on a control plane of its own
whose gates keep the scheduler on its GA ("stable") allocator and serve no list attributes.
`test_random_topology_*`: six more nodes, each a seeded random 8-GPU NVLink graph
(tests/harness/topologies.py, not hand-picked), with seeded random busy sets: the claim
`dra-driver claim --linked k` prints for the node (controller.claim_fit) and the 8-layer
fallback get a set of mutually linked GPUs whenever brute force finds a free one, and stay
Pending only when it finds none, for every k up to one past the largest clique.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from kubernetes import client

from controller.claim_fit import fit_linked_claim
from controller.claim_shapes import linked_class, linked_gpus_ga, linked_gpus_list
from dra_driver.gpu import discover
from dra_driver.gpu.topology import nvlink_topology
from dra_driver.jsontypes import JSON
from tests.harness.cluster import FEATURE_GATES, ControlPlane
from tests.harness.driver import spawn_dra_driver
from tests.harness.driver_image import render_chart
from tests.harness.objects import (
    RESOURCE_API,
    allocation_results,
    create_node,
    create_object,
    delete_object,
    get_claim,
    get_pod,
    policy_denial,
    scheduler_reason,
    sync_client,
    sync_request,
    wait_for,
)
from tests.harness.topologies import free_cliques, largest_clique, random_profile

pytestmark = pytest.mark.integration

SUFFIX = uuid.uuid4().hex[:6]
DRIVER = f"nvlink-{SUFFIX}.dra-driver.dev"
CLASS = f"nvlink-{SUFFIX}"
SLICES = f"{RESOURCE_API}/resourceslices"


@dataclass(frozen=True)
class Node:
    name: str
    profile: str
    list_attributes: str  # --list-attributes
    links: frozenset[frozenset[int]]

    def linked(self, members: list[int]) -> bool:
        return all(frozenset(p) in self.links for p in itertools.combinations(members, 2))


RANDOM_SEEDS = {1: 2, 2: 5, 3: 2, 4: 4, 5: 4, 6: 5}  # seed -> its graph's largest clique (asserted below)


def _node(kind: str, profile: str, list_attributes: str) -> Node:
    topology = nvlink_topology(discover(profile))
    links = frozenset(frozenset((p.a, p.b)) for p in topology.links)
    return Node(f"nvl-{kind}-{SUFFIX}", profile, list_attributes, links)


@dataclass
class Bench:
    api: client.ApiClient
    nodes: dict[str, Node]


@contextlib.contextmanager
def published(kubeconfig: Path, api: client.ApiClient, nodes: dict[str, Node], logs: Path) -> Iterator[Bench]:
    """Our DeviceClass and nodes, one `dra-driver controller` per node; all removed afterwards."""
    procs: list[subprocess.Popen[bytes]] = []
    sync_request(api, "POST", f"{RESOURCE_API}/deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": CLASS},
        "spec": {"selectors": [{"cel": {"expression":
            f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'}}]},
    })
    # the chart's selector-free gpu-linked class and its policy, for this test's driver name
    sync_request(api, "POST", f"{RESOURCE_API}/deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": linked_class(DRIVER)}, "spec": {}})
    policy = render_chart(logs / "helm", f"driverName={DRIVER}",
                          show_only="templates/linked-claim-policy.yaml")
    for doc in policy:
        create_object(api, doc)
    try:
        for node in nodes.values():
            create_node(api, node.name)
            procs.append(spawn_dra_driver(
                ["controller", "--node-name", node.name, "--simulate", node.profile,
                 "--driver-name", DRIVER, "--list-attributes", node.list_attributes,
                 "--kubeconfig", str(kubeconfig)],
                logs / f"{node.name}.log", log_level="info",
            ))
        for node in nodes.values():
            wait_for(f"slices of {node.name}", partial(_devices, api, node.name), timeout=60)
        yield Bench(api, nodes)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(15)
        sync_request(api, "DELETE", SLICES, query={"fieldSelector": f"spec.driver={DRIVER}"})
        for node in nodes.values():
            sync_request(api, "DELETE", f"/api/v1/nodes/{node.name}")
        sync_request(api, "DELETE", f"{RESOURCE_API}/deviceclasses/{CLASS}")
        sync_request(api, "DELETE", f"{RESOURCE_API}/deviceclasses/{linked_class(DRIVER)}")
        for doc in reversed(policy):
            delete_object(api, doc)


@pytest.fixture(scope="module")
def bench(
    control_plane: ControlPlane, api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Bench]:
    topologies = tmp_path_factory.mktemp("topologies")
    nodes = {
        "ring": _node("ring", "ring8-v100", "off"),
        "triangles": _node("tri", "bridged-triangles-v100", "auto"),
        "nvswitch": _node("nvs", "hgx-h200", "auto"),
        # seed 1 without list attributes: the generator's GA form there
        **{f"random-{seed}": _node(f"r{seed}", str(random_profile(seed, topologies)),
                                     "off" if seed == 1 else "auto")
           for seed in RANDOM_SEEDS},
    }
    with published(control_plane.kubeconfig, api, nodes, tmp_path_factory.mktemp("nvlink")) as b:
        yield b


def _devices(api: client.ApiClient, node: str) -> list[JSON]:
    query = {"fieldSelector": f"spec.driver={DRIVER},spec.nodeName={node}"}
    slices = sync_request(api, "GET", SLICES, query=query)
    return [d for s in slices["items"] for d in s["spec"].get("devices", [])]


def _index_of(api: client.ApiClient, node: str) -> dict[str, int]:
    return {d["name"]: d["attributes"]["index"]["int"] for d in _devices(api, node)}


class Case:
    """One namespace's worth of claims and pods on one node; `clear()` frees them all."""

    def __init__(self, bench: Bench, namespace: str, node: Node) -> None:
        self.api, self.ns, self.node = bench.api, namespace, node
        self.pods: list[str] = []
        self.counter = itertools.count()

    def _create(self, devices: JSON) -> str:
        name = f"c{next(self.counter)}"
        sync_request(self.api, "POST", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": devices}})
        self._create_pod(name)
        self.pods.append(name)
        return name

    def _create_pod(self, name: str) -> None:
        sync_request(self.api, "POST", f"/api/v1/namespaces/{self.ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": self.node.name},
                "automountServiceAccountToken": False,
                "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
                "containers": [{"name": "main", "image": "busybox:1.37", "command": ["sleep", "3600"],
                                "resources": {"claims": [{"name": "gpus"}]}}],
            }})

    def busy(self, *indexes: int) -> None:
        """Make these GPUs busy: one claim with one request per GPU, allocated before the test claim."""
        if not indexes:
            return
        requests = [{"name": f"gpu{i}", "exactly": {"deviceClassName": CLASS, "selectors": [
            {"cel": {"expression": f'device.attributes["{DRIVER}"].index == {i}'}}]}} for i in indexes]
        name = self._create({"requests": requests})
        self._bound(name)

    def _bound(self, name: str) -> JSON:
        def probe() -> JSON | None:
            pod = get_pod(self.api, self.ns, name)
            return pod if pod["spec"].get("nodeName") else None

        try:
            return wait_for(f"pod {name} bound", probe, timeout=30)
        except TimeoutError:
            first = scheduler_reason(self.api, self.ns, name)
        # The scheduler can try a pod while its view of the devices the last case freed is
        # still stale, and then wait minutes for an event (once in CI at load 9, never
        # alone). A fresh pod for the same claim is a fresh try on the view of now: a claim
        # that cannot fit fails it too.
        sync_request(self.api, "DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}",
                     query={"gracePeriodSeconds": "0"})
        wait_for(f"pod {name} gone", lambda: not self._exists(name), timeout=30)
        self._create_pod(name)
        try:
            return wait_for(f"pod {name} bound (a fresh pod)", probe, timeout=30)
        except TimeoutError as e:
            raise AssertionError(f"{e}; scheduler says: {scheduler_reason(self.api, self.ns, name)} "
                                 f"(the first pod: {first})") from e

    def _exists(self, name: str) -> bool:
        pods = sync_request(self.api, "GET", f"/api/v1/namespaces/{self.ns}/pods",
                            query={"fieldSelector": f"metadata.name={name}"})
        return bool(pods["items"])

    def gets(self, devices: JSON) -> tuple[str, list[int]]:
        """The claim is allocated: (the request or subrequest that got it, the GPU indexes)."""
        name = self._create(devices)
        assert self._bound(name)["spec"]["nodeName"] == self.node.name
        results = allocation_results(get_claim(self.api, self.ns, name))
        index = _index_of(self.api, self.node.name)
        assert {r["driver"] for r in results} == {DRIVER} and {r["pool"] for r in results} == {self.node.name}
        members = sorted(index[r["device"]] for r in results)
        assert self.node.linked(members), f"{self.node.profile}: {members} are not all NVLink-linked"
        (request,) = {r["request"] for r in results}
        return request, members

    def pending(self, devices: JSON) -> str:
        name = self._create(devices)

        def probe() -> str | None:
            assert not get_pod(self.api, self.ns, name)["spec"].get("nodeName"), f"{name} was bound"
            return scheduler_reason(self.api, self.ns, name) or None

        reason = wait_for(f"a FailedScheduling event for {name}", probe, timeout=30)
        assert "cannot allocate all claims" in reason, reason
        assert not allocation_results(get_claim(self.api, self.ns, name))
        return reason

    def clear(self) -> None:
        now = {"gracePeriodSeconds": "0"}
        sync_request(self.api, "DELETE", f"/api/v1/namespaces/{self.ns}/pods", query=now)
        sync_request(self.api, "DELETE", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims")

        def released() -> bool:
            claims = sync_request(self.api, "GET", f"{RESOURCE_API}/namespaces/{self.ns}/resourceclaims")
            pods = sync_request(self.api, "GET", f"/api/v1/namespaces/{self.ns}/pods")
            return not claims["items"] and not pods["items"]

        wait_for("the case's claims and pods to be gone", released, timeout=60)
        self.pods.clear()


def ga(k: int) -> JSON:
    """The 8-layer fallback on the selector-free gpu-linked class, as documented."""
    return linked_gpus_ga(k, driver=DRIVER)


def lists(k: int) -> JSON:
    return linked_gpus_list(k, driver=DRIVER)


@pytest.fixture
def case(bench: Bench, namespace: str, request: pytest.FixtureRequest) -> Iterator[Case]:
    c = Case(bench, namespace, bench.nodes[request.param])
    try:
        yield c
    finally:
        c.clear()


def _layer(request: str) -> int:
    assert request.startswith("gpus/layer"), request
    return int(request.removeprefix("gpus/layer"))


@pytest.mark.parametrize("case", ["ring"], indirect=True)
def test_ring_every_linked_pair_is_given(case: Case) -> None:
    # Published without list attributes: the GA form. The case: 0 and 3 busy.
    assert not any("strings" in v or "ints" in v for d in _devices(case.api, case.node.name)
                   for v in d["attributes"].values())
    case.busy(0, 3)
    request, members = case.gets(ga(2))
    assert not {0, 3} & set(members)
    case.clear()
    # Only 1-2 is a free linked pair, and a fixed pairing (0-1, 2-3, ...) never offers it.
    case.busy(0, 3, 4, 5, 6, 7)
    request, members = case.gets(ga(2))
    assert members == [1, 2] and _layer(request) == 1
    case.clear()
    case.busy(0, 2, 4, 6)  # the free GPUs 1, 3, 5, 7 have no link between them
    case.pending(ga(2))
    case.clear()
    case.pending(ga(3))  # a ring has no triangle


@pytest.mark.parametrize("case", ["triangles"], indirect=True)
def test_bridged_triangles_give_pairs_triangles_and_the_bridge(case: Case) -> None:
    request, members = case.gets(ga(3))
    assert members in ([0, 1, 2], [3, 4, 5])
    case.clear()
    case.busy(0, 1, 4, 5)  # only the bridge 2-3 is free and linked
    request, members = case.gets(ga(2))
    assert members == [2, 3] and _layer(request) == 1
    case.clear()
    case.busy(2)
    assert case.gets(ga(3))[1] == [3, 4, 5]
    case.clear()
    case.busy(2, 3)  # no linked triple left; linked pairs are
    case.pending(ga(3))
    assert case.gets(ga(2))[1] in ([0, 1], [4, 5])
    case.clear()
    case.pending(ga(4))


@pytest.mark.parametrize("case", ["triangles"], indirect=True)
def test_bridged_triangles_list_attribute_shape(case: Case) -> None:
    case.busy(0)
    request, members = case.gets(lists(3))
    assert members == [3, 4, 5] and request == "gpus"
    case.clear()
    case.busy(1, 4)
    assert case.gets(lists(2))[1] in ([0, 2], [2, 3], [3, 5])
    case.clear()
    case.busy(2, 3)
    case.pending(lists(3))


@pytest.mark.parametrize("case", ["nvswitch"], indirect=True)
def test_nvswitch_any_free_gpus_are_linked(case: Case) -> None:
    for k in (2, 3, 4):
        case.busy(0, 2)  # single-GPU pods on 0 and 2: {1,3}, {5,7}... must still be offered
        request, members = case.gets(ga(k))
        assert _layer(request) == 0 and not {0, 2} & set(members)
        case.clear()
    case.busy(0, 2, 4, 6)
    assert case.gets(ga(4))[1] == [1, 3, 5, 7]
    case.pending(ga(2))  # all eight busy now
    case.clear()
    case.busy(0, 2, 4, 6)
    case.pending(ga(5))


@pytest.mark.parametrize("case", [f"random-{seed}" for seed in RANDOM_SEEDS], indirect=True)
def test_random_topology_linked_sets_found_exactly_when_free(case: Case) -> None:
    links = case.node.links
    seed = int(case.node.name.split("-")[1].removeprefix("r"))
    largest = largest_clique(links)
    assert largest == RANDOM_SEEDS[seed]
    rnd = random.Random(seed)
    query = {"fieldSelector": f"spec.driver={DRIVER},spec.nodeName={case.node.name}"}
    slices = sync_request(case.api, "GET", SLICES, query=query)["items"]
    found = pending = 0
    for k in range(2, largest + 2):
        # what `dra-driver claim` prints (the selector-free gpu-linked class), the same with a class
        # of one's own (the fail-fast selector in the claim), the 8-layer fallback
        generated = fit_linked_claim(k, slices, DRIVER).devices
        own_class = fit_linked_claim(k, slices, DRIVER, CLASS).devices
        for shape in (generated, own_class, ga(k)) if k <= largest else (generated, own_class):
            busy = sorted(rnd.sample(range(8), rnd.randint(0, 8 - k)))
            case.busy(*busy)
            if free_cliques(k, busy, links):
                _, members = case.gets(shape)
                assert not set(members) & set(busy) and len(members) == k
                found += 1
            else:
                case.pending(shape)
                pending += 1
            case.clear()
    assert found and pending  # both outcomes were put to the test


def _refusal(api: client.ApiClient, namespace: str, devices: JSON, template: bool = False) -> str | None:
    """The policy's refusal of a claim (or claim template) with these devices, by a dry run."""
    spec = {"devices": devices}
    kind, body = ("ResourceClaimTemplate", {"spec": spec}) if template else ("ResourceClaim", spec)
    return policy_denial(api, namespace, {"apiVersion": "resource.k8s.io/v1", "kind": kind,
                                          "metadata": {"name": "probe"}, "spec": body}, dry_run=True)


def test_the_policy_admits_the_linked_claims_and_refuses_the_class_without_a_clique_constraint(
    bench: Bench, namespace: str
) -> None:
    """The gpu-linked class has no selector: the chart's linked-claims policy refuses a request
    naming it that no constraint on a clique attribute covers, and admits every documented and
    generated shape, as a claim and as a template."""
    api, cls = bench.api, linked_class(DRIVER)
    bare = {"requests": [{"name": "gpus", "exactly": {"deviceClassName": cls, "count": 2}}]}
    message = wait_for("the linked-claims policy to take effect",
                       lambda: _refusal(api, namespace, bare), timeout=30)
    assert message.startswith(f"request gpus names DeviceClass {cls}, which selects no devices"), message
    assert f"{DRIVER}/nvlinkClique<L>" in message, message
    assert _refusal(api, namespace, bare, template=True) == message
    slices = sync_request(api, "GET", SLICES, query={"fieldSelector": f"spec.driver={DRIVER}"})["items"]
    for k in (2, 3, 5, 9):
        for devices in (ga(k), lists(k), fit_linked_claim(k, slices, DRIVER).devices,
                        linked_gpus_ga(k, driver=DRIVER, layers=[0])):
            assert _refusal(api, namespace, devices) is None, devices
            assert _refusal(api, namespace, devices, template=True) is None, devices
    # a constraint without `requests` covers them all; the whole-GPU class is not this policy's
    everything = {**bare, "constraints": [{"matchAttribute": f"{DRIVER}/nvlinkDomain"}]}
    assert _refusal(api, namespace, everything) is None
    whole = {"requests": [{"name": "gpus", "exactly": {"deviceClassName": CLASS, "count": 2}}]}
    assert _refusal(api, namespace, whole) is None
    # refused: a constraint that covers another request only, an attribute that says nothing of
    # links, one subrequest of the fallback left without its constraint
    other = {"requests": [*bare["requests"], {"name": "other", "exactly": {"deviceClassName": CLASS}}],
             "constraints": [{"requests": ["other"], "matchAttribute": f"{DRIVER}/nvlinkClique0"}]}
    assert (_refusal(api, namespace, other) or "").startswith("request gpus names")
    size = {**bare, "constraints": [{"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkCliqueSize"}]}
    assert (_refusal(api, namespace, size) or "").startswith("request gpus names")
    fallback = ga(2)
    fallback["constraints"] = [c for c in fallback["constraints"] if c["requests"] != ["gpus/layer3"]]
    assert (_refusal(api, namespace, fallback) or "").startswith("request gpus/layer3 names")


# A GA cluster as far as DRA goes: no list-type attributes, and none of the beta features
# that move the scheduler off its "stable" allocator (k8s.io/dynamic-resource-allocation
# structured/internal/stable SupportedFeatures: admin access, prioritized list,
# partitionable devices, device taints).
GA_GATES = ",".join(
    [g for g in FEATURE_GATES.split(",")
     if g.split("=")[0] not in {"DRAConsumableCapacity", "DRAListTypeAttributes"}]
    + ["DRAConsumableCapacity=false", "DRADeviceBindingConditions=false", "DRAFractionalCapacityRange=false",
       "DRAListTypeAttributes=false"]
)


@dataclass
class GaControlPlane(ControlPlane):
    feature_gates: str = GA_GATES


def test_ga_cluster_stable_allocator(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The GA claim shape on a control plane whose scheduler runs the stable allocator."""
    cp = GaControlPlane.start(work_dir=tmp_path_factory.mktemp("ga-cluster"))
    try:
        api = sync_client(str(cp.kubeconfig))
        nodes = {"ring": _node("ring", "ring8-v100", "auto"),
                 "triangles": _node("tri", "bridged-triangles-v100", "auto")}
        with published(cp.kubeconfig, api, nodes, tmp_path_factory.mktemp("ga-nvlink")) as b:
            # --list-attributes auto found no list-type attributes on this server.
            for node in nodes.values():
                assert not any("strings" in v or "ints" in v for d in _devices(api, node.name)
                               for v in d["attributes"].values())
            namespace = "nvlink-ga"
            sync_request(api, "POST", "/api/v1/namespaces",
                         {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
            ring = Case(b, namespace, nodes["ring"])
            ring.busy(0, 3, 4, 5, 6, 7)
            request, members = ring.gets(ga(2))
            assert members == [1, 2] and _layer(request) == 1
            ring.clear()
            tri = Case(b, namespace, nodes["triangles"])
            assert tri.gets(ga(3))[1] in ([0, 1, 2], [3, 4, 5])
            tri.clear()
            tri.busy(0, 1, 4, 5)
            request, members = tri.gets(ga(2))
            assert members == [2, 3] and _layer(request) == 1
            tri.clear()
            tri.busy(2, 3)
            tri.pending(ga(3))
            tri.clear()
    finally:
        cp.stop()
