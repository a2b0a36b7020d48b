"""Every DeviceClass and example of deploy/ against a real control plane, checked against its intent.

One control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) and three
`dra-driver kubelet-plugin` processes (8x V100 hybrid cube-mesh, 4x A100 PCIe bridged in
pairs, 8x H200 on NVSwitch) serve the whole module. Each test applies one example in its
own namespace and checks the allocation against the simulated hardware itself
(`dra_driver.gpu.discover` + `nvlink_topology`), not merely that the pod was bound; then
it unprepares what it prepared, force-deletes its pods (there is no kubelet to confirm a
graceful deletion) and waits until its claims are gone, so the next test starts from
free GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from controller.attribute_docs import CAPACITIES, VOCABULARY
from controller.claim_shapes import linked_gpus_ga
from dra_driver.gpu import discover
from dra_driver.gpu.model import GpuInfo, Inventory
from dra_driver.gpu.topology import NvlinkTopology, nvlink_topology
from dra_driver.jsontypes import JSON
from dra_driver.sharing.config import quantity_value
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.examples import (
    DEMO_NODES,
    device_class_files,
    example_files,
    published_devices,
    wait_for_slices,
)
from tests.harness.kubelet import ClaimName, KubeletSide, claim_ref, prepared_cdi_ids
from tests.harness.objects import (
    EXTENDED_RESOURCE_CLAIM,
    RESOURCE_API,
    Applied,
    allocation_results,
    apply_documents,
    create_documents,
    create_namespace,
    create_node,
    get_claim,
    get_pod,
    load_yaml_documents,
    pod_claim_names,
    scheduler_reason,
    sync_client,
    sync_request,
    wait_for,
    watch_for,
)

pytestmark = pytest.mark.integration

V100, A100, H200 = (n.name for n in DEMO_NODES)
EXAMPLES = {p.name: p for p in example_files()}
GI = 2**30


def _version(cc: str) -> tuple[int, ...]:
    return tuple(int(x) for x in cc.split("."))


@dataclass
class Cluster:
    cp: ControlPlane
    api: client.ApiClient
    drivers: dict[str, DriverProcess]
    inventories: dict[str, Inventory]
    topologies: dict[str, NvlinkTopology]
    devices: dict[tuple[str, str], JSON]  # (pool, device) -> device of the published slice
    sides: dict[str, KubeletSide] = field(default_factory=dict)

    def index(self, pool: str, device: str) -> int:
        return int(self.devices[(pool, device)]["attributes"]["index"]["int"])

    def gpu(self, pool: str, device: str) -> GpuInfo:
        index = self.index(pool, device)
        return next(g for g in self.inventories[pool].gpus if g.index == index)

    def linked(self, pool: str, a: str, b: str) -> bool:
        return self.topologies[pool].link(self.index(pool, a), self.index(pool, b)) is not None

    def kubelet(self, node: str) -> KubeletSide:
        if node not in self.sides:
            self.sides[node] = KubeletSide(self.drivers[node].registration_socket())
        return self.sides[node]


def start_node_drivers(api: client.ApiClient, kubeconfig: Path, base: Path) -> list[DriverProcess]:
    """Create each demo Node object and start its driver, with its own kubelet and CDI dirs
    under `base`; there is no kubelet: the tests play its side (KubeletSide)."""
    drivers: list[DriverProcess] = []
    try:
        for node in DEMO_NODES:
            create_node(api, node.name)
            driver = DriverProcess(node.name, node.profile, kubeconfig, base / node.name)
            drivers.append(driver.start(wait=False))
    except BaseException:
        stop_drivers(drivers)
        raise
    return drivers


def stop_drivers(drivers: list[DriverProcess]) -> None:
    for driver in drivers:
        driver.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cp = ControlPlane.start(work_dir=tmp_path_factory.mktemp("examples-cluster"))
    drivers: list[DriverProcess] = []
    cl: Cluster | None = None
    try:
        api = sync_client(str(cp.kubeconfig))
        # A short base dir: unix socket paths must stay under 108 bytes.
        drivers = start_node_drivers(api, cp.kubeconfig, tmp_path_factory.mktemp("nodes"))
        devices = wait_for_slices(api, drivers)
        for path in device_class_files():
            applied = apply_documents(api, path, "default")
            assert not applied.problems, f"{path.name}: {applied.problems}"
        inventories = {n.name: discover(n.profile) for n in DEMO_NODES}
        cl = Cluster(cp=cp, api=api, drivers={d.node: d for d in drivers}, inventories=inventories,
                     topologies={name: nvlink_topology(inv) for name, inv in inventories.items()},
                     devices=devices)
        yield cl
    finally:
        if cl is not None:
            for side in cl.sides.values():
                side.close()
        stop_drivers(drivers)
        cp.stop(remove=False)


@dataclass
class Scope:
    """One test's namespace(s) and the claims it prepared, cleaned up when the test ends."""

    cluster: Cluster
    namespace: str
    namespaces: list[str]
    prepared: list[tuple[str, ClaimName]] = field(default_factory=list)

    @property
    def api(self) -> client.ApiClient:
        return self.cluster.api

    def apply(self, example: str) -> Applied:
        applied = apply_documents(self.api, EXAMPLES[example], self.namespace)
        assert not applied.problems, applied.problems
        for obj in applied.created:
            ns = obj["metadata"].get("namespace")
            if ns and ns not in self.namespaces:
                self.namespaces.append(ns)
        return applied

    def create(self, *docs: JSON) -> Applied:
        applied = create_documents(self.api, docs, self.namespace, "test objects")
        assert not applied.problems, applied.problems
        return applied

    def bound(self, pod: str, namespace: str | None = None, timeout: float = 30.0) -> JSON:
        ns = namespace or self.namespace

        def probe() -> JSON | None:
            obj = get_pod(self.api, ns, pod)
            return obj if obj["spec"].get("nodeName") else None

        try:
            return wait_for(f"pod {ns}/{pod} to be bound", probe, timeout=timeout)
        except TimeoutError as e:
            raise AssertionError(f"{e}; scheduler says: {scheduler_reason(self.api, ns, pod)}") from e

    def pending_reason(self, pod: str, timeout: float = 30.0) -> str:
        """Wait for the scheduler's FailedScheduling event of a pod that must stay pending."""

        def probe() -> str | None:
            assert not get_pod(self.api, self.namespace, pod)["spec"].get("nodeName"), f"{pod} was bound"
            return scheduler_reason(self.api, self.namespace, pod) or None

        return wait_for(f"a FailedScheduling event for {pod}", probe, timeout=timeout)

    def claims(self, pod: JSON) -> list[JSON]:
        ns = pod["metadata"]["namespace"]
        return [get_claim(self.api, ns, name) for name, _ in pod_claim_names(pod)]

    def prepare(self, pod: JSON, claim: JSON) -> tuple[str, ...]:
        """NodePrepareResources for one claim on the pod's node; returns the CDI device ids."""
        node = pod["spec"]["nodeName"]
        ref = claim_ref(claim)
        response = self.cluster.kubelet(node).prepare(ref)
        self.prepared.append((node, ref))
        cdi_ids, error = prepared_cdi_ids(response, ref.uid)
        assert not error, error
        return cdi_ids

    def delete_pod(self, name: str) -> None:
        with_grace_zero = {"gracePeriodSeconds": "0"}
        pod_path = f"/api/v1/namespaces/{self.namespace}/pods/{name}"
        sync_request(self.api, "DELETE", pod_path, query=with_grace_zero)

    def cleanup(self) -> None:
        """Unprepare (as the kubelet does when the pods stop), then free every claim of the test."""
        errors: list[str] = []
        for node, ref in reversed(self.prepared):
            try:
                response = self.cluster.kubelet(node).unprepare(ref)
                if response.claims[ref.uid].error:
                    errors.append(f"unprepare {ref.name}: {response.claims[ref.uid].error}")
            except Exception as e:  # keep cleaning: the next tests need the GPUs back
                errors.append(f"unprepare {ref.name}: {e}")
        for ns in self.namespaces:
            sync_request(
                self.api, "DELETE", f"/api/v1/namespaces/{ns}/pods", query={"gracePeriodSeconds": "0"}
            )
            sync_request(self.api, "DELETE", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims")
        for ns in self.namespaces:
            path = f"{RESOURCE_API}/namespaces/{ns}/resourceclaims"

            def released(path: str = path) -> bool:
                return not sync_request(self.api, "GET", path)["items"]

            wait_for(f"the claims of {ns} to be released", released, timeout=60)
            sync_request(self.api, "DELETE", f"/api/v1/namespaces/{ns}")
        assert not errors, errors


_counter = iter(range(1_000_000))


@pytest.fixture
def scope(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Scope]:
    name = f"ex{next(_counter)}-{re.sub(r'[^a-z0-9]+', '-', request.node.name.lower())[:40].strip('-')}"
    create_namespace(cluster.api, name)
    s = Scope(cluster=cluster, namespace=name, namespaces=[name])
    try:
        yield s
    finally:
        s.cleanup()


def allocated(claim: JSON) -> list[tuple[str, str]]:
    return [(r["pool"], r["device"]) for r in allocation_results(claim)]


def gpu_claim_pod(name: str, template: str, selectors: list[str] | None = None, count: int = 1,
                  match_attribute: str | None = None) -> list[JSON]:
    """A ResourceClaimTemplate for whole GPUs and a pod using it."""
    exactly: JSON = {"deviceClassName": DRIVER, "count": count}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    devices: JSON = {"requests": [{"name": "gpus", "exactly": exactly}]}
    if match_attribute:
        devices["constraints"] = [{"requests": ["gpus"], "matchAttribute": match_attribute}]
    return [
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": template},
         "spec": {"spec": {"devices": devices}}},
        pod_using(name, template),
    ]


def pod_using(name: str, template: str) -> JSON:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"automountServiceAccountToken": False,
                 "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
                 "containers": [{"name": "main", "image": "busybox:1.37",
                                 "resources": {"claims": [{"name": "gpus"}]}}]},
    }


def product_is(fragment: str) -> str:
    return f'device.attributes["{DRIVER}"].productName.contains("{fragment}")'


def index_is(index: int) -> str:
    return f'device.attributes["{DRIVER}"].index == {index}'


# -- the files themselves ------------------------------------------------------------------


def test_every_example_file_has_an_intent_test() -> None:
    numbers = {name[:2] for name in EXAMPLES}
    tests = {name[len("test_"):][:2] for name in globals() if re.match(r"test_\d\d_", name)}
    assert numbers == {f"{n:02d}" for n in range(1, 12)}
    assert numbers <= tests, f"examples without a test_NN_ function: {sorted(numbers - tests)}"
    # gpu-share.yaml and examples/memory-shares/: tests/integration/test_memory_shares.py;
    # mig-dynamic.yaml and examples/mig/: tests/integration/test_dynamic_mig.py
    # gpu-linked.yaml: tests/integration/test_nvlink_claims.py (the class dra-driver claim names)
    assert {p.name for p in device_class_files()} == {
        "gpu.yaml", "mig.yaml", "gpu-extended-resource.yaml", "gpu-share.yaml", "mig-dynamic.yaml",
        "gpu-linked.yaml",
    }


def test_device_classes_are_served(cluster: Cluster) -> None:
    classes = sync_request(cluster.api, "GET", f"{RESOURCE_API}/deviceclasses")["items"]
    by_name = {c["metadata"]["name"]: c["spec"] for c in classes}
    assert {"gpu.dra-driver.dev", "mig.gpu.dra-driver.dev", "extended.gpu.dra-driver.dev"} <= set(by_name)
    assert by_name["extended.gpu.dra-driver.dev"]["extendedResourceName"] == "nvidia.com/gpu"


# -- one test per example ------------------------------------------------------------------


def test_01_two_pods_get_distinct_gpus(scope: Scope) -> None:
    scope.apply("01-two-pods-distinct-gpus.yaml")
    pods = [scope.bound("distinct-gpu-a"), scope.bound("distinct-gpu-b")]
    devices: list[tuple[str, str]] = []
    cdi: list[str] = []
    for pod in pods:
        (claim,) = scope.claims(pod)
        assert len(allocated(claim)) == 1
        devices += allocated(claim)
        cdi += scope.prepare(pod, claim)
    assert devices[0] != devices[1], "both pods were given the same GPU"
    assert len(set(cdi)) == 2


def test_02_two_containers_share_one_gpu(scope: Scope) -> None:
    scope.apply("02-two-containers-one-gpu.yaml")
    pod = scope.bound("two-containers-one-gpu")
    containers = pod["spec"]["containers"]
    assert len(containers) == 2
    assert {c["resources"]["claims"][0]["name"] for c in containers} == {"gpu"}
    (claim,) = scope.claims(pod)
    assert len(allocated(claim)) == 1
    assert len(scope.prepare(pod, claim)) == 1


def test_03_shared_claim_is_one_gpu_prepared_once(scope: Scope, cluster: Cluster) -> None:
    scope.apply("03-shared-claim-two-pods.yaml")
    a, b = scope.bound("shared-claim-a"), scope.bound("shared-claim-b")
    assert a["spec"]["nodeName"] == b["spec"]["nodeName"]
    (claim_a,), (claim_b,) = scope.claims(a), scope.claims(b)
    assert claim_a["metadata"]["uid"] == claim_b["metadata"]["uid"]
    assert sorted(r["name"] for r in claim_a["status"]["reservedFor"]) == ["shared-claim-a", "shared-claim-b"]
    assert len(allocated(claim_a)) == 1
    # The kubelet prepares the claim for the first pod; asked again (the second pod, or a
    # kubelet restart) the plugin answers from its state: same CDI ids, no second spec.
    first = scope.prepare(a, claim_a)
    again = scope.prepare(b, claim_b)
    assert first == again and len(first) == 1
    uid = claim_a["metadata"]["uid"]
    cdi_dir = cluster.drivers[a["spec"]["nodeName"]].cdi_dir
    specs = [p for p in cdi_dir.iterdir() if uid in p.read_text()]
    assert len(specs) == 1, specs
    # Unprepared once both pods are gone, the claim's spec goes with it.
    node = a["spec"]["nodeName"]
    assert not cluster.kubelet(node).unprepare(claim_ref(claim_a)).claims[uid].error
    assert not [p for p in cdi_dir.iterdir() if uid in p.read_text()]


def test_04_big_memory_claim_lands_only_on_capable_gpus(scope: Scope, cluster: Cluster) -> None:
    capable = {(node, f"gpu-{g.index}") for node, inv in cluster.inventories.items() for g in inv.gpus
               if g.memory_bytes >= 80 * GI and _version(g.cuda_compute_capability) >= (9, 0)}
    # The selector has to exclude something real: the A100s have 80Gi but CC 8.0.
    assert capable and {p for p, _ in capable} == {H200}
    assert any(g.memory_bytes >= 80 * GI for g in cluster.inventories[A100].gpus)

    scope.apply("04-big-memory-hopper.yaml")
    pod = scope.bound("big-memory-hopper")
    (claim,) = scope.claims(pod)
    (device,) = allocated(claim)
    assert device in capable
    gpu = cluster.gpu(*device)
    assert gpu.memory_bytes >= 80 * GI and _version(gpu.cuda_compute_capability) >= (9, 0)
    assert scope.prepare(pod, claim)

    # With every H200 taken, the same claim waits rather than settle for an 80Gi A100.
    scope.create(*gpu_claim_pod("fill-h200", "all-free-h200", [product_is("H200")],
                                count=_free_gpus(cluster, H200)))
    scope.bound("fill-h200")
    scope.create(pod_using_named_claim("big-memory-again", "big-memory-hopper", "gpu"))
    assert "cannot allocate all claims" in scope.pending_reason("big-memory-again")


def test_05_nvlink_pair_is_really_linked(scope: Scope, cluster: Cluster) -> None:
    scope.apply("05-nvlink-pair.yaml")
    pod = scope.bound("nvlink-pair")
    (claim,) = scope.claims(pod)
    (pool_a, a), (pool_b, b) = allocated(claim)
    assert pool_a == pool_b == pod["spec"]["nodeName"]
    assert cluster.linked(pool_a, a, b), f"{a} and {b} on {pool_a} have no NVLink between them"
    assert len(scope.prepare(pod, claim)) == 2


def test_06_four_gpus_are_mutually_linked_on_the_cube_mesh(scope: Scope, cluster: Cluster) -> None:
    # With V100 1 taken, "any four" would start 0,2,3,4 (2-4 and 3-4 have no link); only
    # the constraint leads to the intact quad 4-7.
    scope.create(*gpu_claim_pod("block-1", "v100-1", [product_is("V100"), index_is(1)]))
    scope.bound("block-1")
    assert not cluster.linked(V100, "gpu-2", "gpu-4")
    scope.apply("06-nvlink-quad-cube-mesh.yaml")
    pod = scope.bound("nvlink-quad")
    assert pod["spec"]["nodeName"] == V100
    (claim,) = scope.claims(pod)
    devices = [d for _, d in allocated(claim)]
    assert len(devices) == 4
    for i, a in enumerate(devices):
        for b in devices[i + 1:]:
            assert cluster.linked(V100, a, b), f"{a} and {b} are not NVLink peers"
    assert {cluster.index(V100, d) for d in devices} == {4, 5, 6, 7}
    assert len(scope.prepare(pod, claim)) == 4


def test_11_three_linked_gpus_through_the_list_attribute(scope: Scope, cluster: Cluster) -> None:
    # This control plane serves list-type attributes (DRAListTypeAttributes is on).
    scope.apply("11-nvlink-three-gpus-list-attributes.yaml")
    pod = scope.bound("nvlink-three")
    (claim,) = scope.claims(pod)
    devices = allocated(claim)
    assert len(devices) == 3
    node = pod["spec"]["nodeName"]
    for i, (_, a) in enumerate(devices):
        for _, b in devices[i + 1:]:
            assert cluster.linked(node, a, b), f"{a} and {b} on {node} are not NVLink peers"
    assert len(scope.prepare(pod, claim)) == 3


def _free_gpus(cluster: Cluster, node: str) -> int:
    claims = sync_request(cluster.api, "GET", f"{RESOURCE_API}/resourceclaims")["items"]
    used = {(r["pool"], r["device"]) for c in claims for r in allocation_results(c)
            if r["pool"] == node and not r.get("adminAccess")}
    return sum(1 for pool, _ in cluster.devices if pool == node) - len(used)


def test_07_prioritized_list_prefers_h200_then_falls_back(scope: Scope, cluster: Cluster) -> None:
    applied = scope.apply("07-prioritized-list.yaml")
    pod = scope.bound("prioritized-gpu")
    (claim,) = scope.claims(pod)
    (result,) = allocation_results(claim)
    assert result["request"] == "gpu/h200" and result["pool"] == H200, result

    free = _free_gpus(cluster, H200)
    assert free > 0
    scope.create(*gpu_claim_pod("fill-h200", "all-free-h200", [product_is("H200")], count=free))
    scope.bound("fill-h200")
    assert _free_gpus(cluster, H200) == 0

    template = next(o["metadata"]["name"] for o in applied.created if o["kind"] == "ResourceClaimTemplate")
    scope.create(pod_using_named_claim("prioritized-again", template, "gpu"))
    again = scope.bound("prioritized-again")
    (claim,) = scope.claims(again)
    (result,) = allocation_results(claim)
    # No H200 left and no H100 in the cluster: the third choice, a >= 40Gi GPU (an A100).
    assert result["request"] == "gpu/any-40gi", result
    assert result["pool"] == A100
    assert cluster.gpu(result["pool"], result["device"]).memory_bytes >= 40 * GI


def pod_using_named_claim(name: str, template: str, claim_name: str) -> JSON:
    pod = pod_using(name, template)
    pod["spec"]["resourceClaims"][0]["name"] = claim_name
    pod["spec"]["containers"][0]["resources"]["claims"][0]["name"] = claim_name
    return pod


def test_08_extended_resource_pod_gets_a_dra_allocation(scope: Scope, cluster: Cluster) -> None:
    scope.apply("08-extended-resource.yaml")
    pod = scope.bound("extended-resource-gpu")
    status = pod["status"].get("extendedResourceClaimStatus")
    assert status, f"no extendedResourceClaimStatus in {pod['status']}"
    assert [(m["containerName"], m["resourceName"]) for m in status["requestMappings"]] == [
        ("main", "nvidia.com/gpu")]
    claim = get_claim(scope.api, scope.namespace, status["resourceClaimName"])
    assert claim["metadata"]["annotations"].get(EXTENDED_RESOURCE_CLAIM) == "true"
    (result,) = allocation_results(claim)
    assert result["driver"] == DRIVER
    device = cluster.devices[(result["pool"], result["device"])]
    assert device["attributes"]["type"]["string"] == "gpu"
    assert result["pool"] == pod["spec"]["nodeName"]
    assert len(scope.prepare(pod, claim)) == 1


def test_09_admin_access_sees_a_gpu_in_use(scope: Scope) -> None:
    scope.create(*gpu_claim_pod("worker", "one-h200", [product_is("H200")]))
    worker = scope.bound("worker")
    (worker_claim,) = scope.claims(worker)
    (busy,) = allocated(worker_claim)

    applied = scope.apply("09-admin-access-monitoring.yaml")
    ns = next(o["metadata"]["name"] for o in applied.created if o["kind"] == "Namespace")
    monitor = scope.bound("gpu-monitor", namespace=ns)
    assert monitor["spec"]["nodeName"] == H200
    (claim,) = scope.claims(monitor)
    results = allocation_results(claim)
    assert all(r.get("adminAccess") is True for r in results)
    assert busy in [(r["pool"], r["device"]) for r in results], "admin access does not see the GPU in use"
    assert len(results) == 8, "allocationMode All: every H200 of the node"
    # The worker keeps its GPU: admin access takes nothing away.
    assert allocated(get_claim(scope.api, scope.namespace, worker_claim["metadata"]["name"])) == [busy]
    assert len(scope.prepare(monitor, claim)) == 8


def test_09_admin_access_needs_the_namespace_label(scope: Scope) -> None:
    docs = load_yaml_documents(EXAMPLES["09-admin-access-monitoring.yaml"])
    template = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")
    template["metadata"].pop("namespace")
    with pytest.raises(ApiException) as err:
        sync_request(scope.api, "POST", f"{RESOURCE_API}/namespaces/{scope.namespace}/resourceclaimtemplates",
                template)
    assert err.value.status in (403, 422)
    assert "resource.kubernetes.io/admin-access" in (err.value.body or ""), err.value.body


def test_10_claim_written_for_nvidias_driver(scope: Scope, cluster: Cluster) -> None:
    text = EXAMPLES["10-nvidia-driver-claim.yaml"].read_text()
    as_nvidia = text.replace(DRIVER, "gpu.nvidia.com")
    attrs = set(re.findall(r'device\.attributes\["gpu\.nvidia\.com"\]\.(\w+)', as_nvidia))
    capacities = set(re.findall(r'device\.capacity\["gpu\.nvidia\.com"\]\.(\w+)', as_nvidia))
    assert attrs and capacities
    nvidia_attrs = {a.name for a in VOCABULARY if a.nvidia == "yes"}
    nvidia_caps = {c.name for c in CAPACITIES if c.nvidia == "yes"}
    assert attrs <= nvidia_attrs and capacities <= nvidia_caps, "uses names NVIDIA's driver does not publish"
    assert DRIVER not in as_nvidia

    scope.apply("10-nvidia-driver-claim.yaml")
    pod = scope.bound("nvidia-style-a100")
    (claim,) = scope.claims(pod)
    (device,) = allocated(claim)
    gpu = cluster.gpu(*device)
    assert gpu.product_name.startswith("NVIDIA A100") and gpu.memory_bytes >= 40 * GI
    assert scope.prepare(pod, claim)


# -- contrasts -----------------------------------------------------------------------------


def example_05_on_a100(name: str, with_constraint: bool) -> JSON:
    """Example 05's claim template, pinned to the bridged A100 box, with or without its constraint
    (without: on the whole-GPU class, as the selector-free gpu-linked class is refused without
    one by the chart's policy)."""
    docs = load_yaml_documents(EXAMPLES["05-nvlink-pair.yaml"])
    template = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")
    template["metadata"]["name"] = name
    devices = template["spec"]["spec"]["devices"]
    assert devices == linked_gpus_ga(2, layers=(0, 1))  # what `dra-driver claim --linked 2` prints here
    if not with_constraint:
        del devices["constraints"]
    for sub in devices["requests"][0]["firstAvailable"]:
        sub["selectors"] = [{"cel": {"expression": product_is("A100")}}]
        if not with_constraint:
            sub["deviceClassName"] = DRIVER
    return template


def test_count_only_pair_can_be_unlinked_but_never_with_the_nvlink_constraint(
    scope: Scope, cluster: Cluster,
) -> None:
    # Occupy A100 1 and 3: only 0 and 2 stay free, and those have no bridge between them.
    assert not cluster.linked(A100, "gpu-0", "gpu-2")
    for index in (1, 3):
        scope.create(*gpu_claim_pod(f"block-{index}", f"a100-{index}", [product_is("A100"), index_is(index)]))
        scope.bound(f"block-{index}")

    count_only = example_05_on_a100("count-only", with_constraint=False)
    scope.create(count_only, pod_using("count-only", "count-only"))
    pod = scope.bound("count-only")
    (claim,) = scope.claims(pod)
    (_, a), (_, b) = allocated(claim)
    assert {a, b} == {"gpu-0", "gpu-2"}
    assert not cluster.linked(A100, a, b), "without the constraint the scheduler hands out an unlinked pair"
    scope.delete_pod("count-only")
    wait_for("the count-only claim to be released", lambda: _free_gpus(cluster, A100) == 2, timeout=30)

    scope.create(example_05_on_a100("linked", with_constraint=True), pod_using("linked", "linked"))
    reason = scope.pending_reason("linked")
    assert "cannot allocate all claims" in reason, reason

    # Once a bridged pair is free again, the same pending pod gets exactly that pair.
    scope.delete_pod("block-1")
    pod = scope.bound("linked", timeout=60)
    (claim,) = scope.claims(pod)
    (_, a), (_, b) = allocated(claim)
    assert {a, b} == {"gpu-0", "gpu-1"} and cluster.linked(A100, a, b)


def test_unsatisfiable_claim_stays_pending_and_nothing_else_breaks(scope: Scope, cluster: Cluster) -> None:
    too_big = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("200Gi")) >= 0'
    assert not any(g.memory_bytes >= 200 * GI for inv in cluster.inventories.values() for g in inv.gpus)
    scope.create(*gpu_claim_pod("too-big", "gpu-200gi", [too_big]))
    reason = scope.pending_reason("too-big")
    assert "0/3 nodes are available" in reason and "cannot allocate all claims" in reason, reason
    (claim,) = scope.claims(get_pod(scope.api, scope.namespace, "too-big"))
    assert not allocation_results(claim)

    scope.create(*gpu_claim_pod("fine", "any-gpu"))
    pod = scope.bound("fine")
    (claim,) = scope.claims(pod)
    assert len(scope.prepare(pod, claim)) == 1
    # 'fine' bound above is the signal; for a second on, watched, too-big stays unbound
    watch_for(lambda: get_pod(scope.api, scope.namespace, "too-big")["spec"].get("nodeName"), 1.0, 0.2)
    assert not get_pod(scope.api, scope.namespace, "too-big")["spec"].get("nodeName")
    for driver in cluster.drivers.values():
        driver.check_alive()
    assert set(published_devices(scope.api)) == set(cluster.devices)


def test_examples_cover_every_node(cluster: Cluster) -> None:
    """The three simulated boxes are what the examples' comments say they are."""
    assert {pool for pool, _ in cluster.devices} == {V100, A100, H200}
    assert cluster.topologies[V100].groups(4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert cluster.topologies[A100].groups(2) == ((0, 1), (2, 3))
    assert cluster.topologies[H200].groups(8) == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert all(quantity_value(d["capacity"]["memory"]["value"]) for d in cluster.devices.values())
