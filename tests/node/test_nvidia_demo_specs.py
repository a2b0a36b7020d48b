"""Every demo spec of NVIDIA's GPU DRA driver v0.5.0 (demo/specs of
sigs.k8s.io/dra-driver-nvidia-gpu, fetched from the Go module proxy at test time and read from
Go's module cache) after docs/migrating.md's recipe, on real kubelets with simulated GPUs:
each one either runs with what it asked for (the devices, the sharing, the limits, checked in
the running containers), or is refused when it is written, with a message that names the fix.
No spec may be admitted and then left stuck, and none may quietly run as something else (a
spec that asks for sharing must share).

What is changed, and only that: the recipe's sed (read from docs/migrating.md, run by the real
sed); every container becomes busybox sleeping under `sh -c`, with a 1 s grace period (the nodes
have no network and no NVIDIA images, so no `nvidia-smi`); each namespace gets a suffix; pods
that need the stand-in MPS get a nodeSelector; the consumable-shares Deployments get one too,
and more replicas than their node has GPUs, so that they can only run by sharing. The
simulated nodes get what each spec needs, each node's plugin restarted for it and restored at
the end (`Setups`):
- gpu-test4 (and gpu-test6 once fixed): the V100 node becomes NVIDIA's quickstart box, a DGX
  A100 40GB after the quickstart's own mig-parted-config.yaml (`-c half-balanced`);
- mig-1g-12gb: the A100 node becomes four H100 NVL, one as seven 1g.12gb (no shipped profile
  has that MIG profile);
- gpu-test-mps (and gpu-test5 once fixed): the H200 node's plugin gets a driver root with the
  stand-in `nvidia-cuda-mps-control` (tests/harness/fake_mps.py), as test_nvidia_config_pods.py;
- consumable shares: the A100 node's plugin runs with `--consumable-shares=<mode>`, as NVIDIA's
  README says for each file, and the stand-in MPS (the memory form starts MPS daemons).
The chart's admission policies (`helm template`) are installed for this module and removed
after it: claim-config, and consumable-shares as the chart's default renders it (under which
memory-sharing.yaml is refused when written), or, for a consumable-shares spec, as rendered
with the mode its node runs with. A spec refused when written is also written again as its
message says, and the pods that waited for it must then run.

Not run here, with the reason (the table in docs/migrating.md says the same):
- IMEX (imex/*, quickstart/*/imex-test1.yaml): IMEX channels and ComputeDomains are
  tests/node/test_compute_domains.py's;
- VFIO (quickstart/*/gpu-test-vfio*.yaml) and Fabric Manager partitions
  (fabric-manager-partitioning/*, a VFIO class): this driver has no passthrough; refusing the
  VFIO class and config when written is tests/integration/test_claim_config_policy.py's;
- mig+mps/sharing-demo-mig-parted-config.yaml: not a Kubernetes object (an nvidia-mig-parted
  config for the classic-DRA demo, whose claims the API server refuses: checked here).

It must not change what a spec asks for beyond the above, nor leave a plugin, class, policy
or namespace of its own behind.
"""

from __future__ import annotations

import collections
import copy
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from dra_driver.cdi.builders import device_env_name
from dra_driver.jsontypes import JSON
from tests.harness.driver import DRIVER
from tests.harness.driver_image import render_chart
from tests.harness.examples import DeviceMap, published_devices
from tests.harness.fake_mps import install_fake_mps_control
from tests.harness.node import Node
from tests.harness.nvidia_specs import (
    MIGRATING,
    Created,
    create_as_kubectl,
    expected_pods,
    half_balanced_profile,
    mig_1g_12gb_profile,
    migrated_documents,
    namespaces_of,
    pod_spec_of,
    runnable,
    served,
    spec_files,
    specs_dir,
)
from tests.harness.objects import (
    RESOURCE_API,
    get_claim,
    pod_events,
    policy_denial,
    scheduler_reason,
    sync_request,
    wait_for,
)
from tests.node import pods
from tests.node.conftest import NodeCluster

ADMISSION_API = "/apis/admissionregistration.k8s.io/v1"
V100, A100, H200 = "dgx1-v100", "a100-pcie", "hgx-h200"
A100_GPUS = 4  # the a100-pcie node's whole GPUs, where the consumable-shares specs run

# -- what each spec does here ------------------------------------------------------------------

RUNS = (
    "quickstart/v1/gpu-test1.yaml",
    "quickstart/v1/gpu-test2.yaml",
    "quickstart/v1/gpu-test3.yaml",
    "quickstart/v1beta1/gpu-test1.yaml",
    "quickstart/v1beta1/gpu-test2.yaml",
    "quickstart/v1beta1/gpu-test3.yaml",
    "quickstart/gpu-test7.yaml",
    "quickstart/gpu-test8.yaml",
    "extended-resources/gpu-full.yaml",
    "quickstart/v1/gpu-test4.yaml",
    "quickstart/v1beta1/gpu-test4.yaml",
    "extended-resources/mig-1g-12gb.yaml",
    "quickstart/v1/gpu-test-mps.yaml",
    "quickstart/v1beta1/gpu-test-mps.yaml",
    "consumable-shares/integer-sharing.yaml",
    "consumable-shares/memory-sharing.yaml",
    "consumable-shares/unlimited-sharing.yaml",
)
# Refused when written by the claim-config policy: spec -> what the message must say.
INTERVAL_FIX = "remove interval or write Default"
REFUSED_BY_POLICY = {
    "quickstart/v1/gpu-test5.yaml": INTERVAL_FIX,
    "quickstart/v1/gpu-test6.yaml": INTERVAL_FIX,
    "quickstart/v1beta1/gpu-test5.yaml": INTERVAL_FIX,
    "quickstart/v1beta1/gpu-test6.yaml": INTERVAL_FIX,
}
# NVIDIA's classic-DRA demos (resource.k8s.io/v1alpha2 and its parameter CRDs, gone since
# Kubernetes 1.31; pods naming claims through `source:`): the API server refuses every object.
CLASSIC_DRA = (
    "mig+mps/sharing-demo-claims-1.yaml",
    "mig+mps/sharing-demo-claims.yaml",
    "mig+mps/sharing-demo-job-1.yaml",
    "mig+mps/sharing-demo-job.yaml",
    "mig+mps/sharing-demo-parameters-1.yaml",
    "mig+mps/sharing-demo-parameters.yaml",
    "selectors/claims.yaml",
    "selectors/parameters.yaml",
    "selectors/pods.yaml",
)
IMEX = "needs IMEX (channels, ComputeDomains): tests/node/test_compute_domains.py"
VFIO = "needs VFIO passthrough: refused when written, tests/integration/test_claim_config_policy.py"
FABRIC = "needs Fabric Manager partitions of VFIO GPUs (class vfio.gpu.nvidia.com)"
NOT_RUN = {
    "imex/channel-injection-all.yaml": IMEX,
    "imex/channel-injection.yaml": IMEX,
    "imex/nvbandwidth-test-job-1.yaml": IMEX,
    "imex/nvbandwidth-test-job-2.yaml": IMEX,
    "imex/nvbandwidth-test-job.yaml": IMEX,
    "imex/nvbandwidth-test-no-compute-domain-job.yaml": IMEX,
    "quickstart/v1/imex-test1.yaml": IMEX,
    "quickstart/v1beta1/imex-test1.yaml": IMEX,
    "quickstart/v1/gpu-test-vfio-config.yaml": VFIO,
    "quickstart/v1/gpu-test-vfiopci.yaml": VFIO,
    "quickstart/v1beta1/gpu-test-vfiopci.yaml": VFIO,
    "fabric-manager-partitioning/pod.yaml": FABRIC,
    "fabric-manager-partitioning/resourceClaimTemplates.yaml": FABRIC,
    "mig+mps/sharing-demo-mig-parted-config.yaml": "not a Kubernetes object (nvidia-mig-parted config)",
    "quickstart/mig-parted-config.yaml": "not a Kubernetes object: the MIG layout gpu-test4's node is given",
}


def test_every_v050_spec_is_accounted_for_here_and_in_docs_migrating_md() -> None:
    here = [*RUNS, *REFUSED_BY_POLICY, *CLASSIC_DRA, *NOT_RUN]
    assert len(here) == len(set(here))
    assert sorted(here) == spec_files(), "a spec of v0.5.0 this test does not know, or one gone"
    table = MIGRATING.read_text().split("## NVIDIA's demo specs", 1)
    assert len(table) == 2, "docs/migrating.md has no section \"NVIDIA's demo specs\""
    listed = re.findall(r"^\| `([^`]+)`", table[1], re.MULTILINE)
    assert sorted(listed) == spec_files(), "docs/migrating.md's table must list every spec once"


# -- fixtures: the policy, the node setups ---------------------------------------------------


def _admission_path(doc: JSON, named: bool = False) -> str:
    plural = {"ValidatingAdmissionPolicy": "validatingadmissionpolicies",
              "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings"}[doc["kind"]]
    return f"{ADMISSION_API}/{plural}" + (f"/{doc['metadata']['name']}" if named else "")


def _claim(name: str, capacity: JSON | None = None, parameters: JSON | None = None) -> JSON:
    exactly: JSON = {"deviceClassName": DRIVER}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    devices: JSON = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if parameters:
        devices["config"] = [{"opaque": {"driver": DRIVER, "parameters": parameters}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": devices}}


VFIO_PROBE = _claim("probe", parameters={"apiVersion": "resource.nvidia.com/v1beta1",
                                         "kind": "VfioDeviceConfig"})
MEMORY_PROBE = _claim("probe", capacity={"memory": "4Gi"})
SHARES_PROBE = _claim("probe", capacity={"shares": "1"})


@dataclass
class Policies:
    """The chart's admission policies as `helm template` renders them: the claim-config policy,
    and the consumable-shares policy of the chart's default (consumableShares=disabled) or of
    the mode a test's plugin runs with (`consumable_shares`)."""

    api: client.ApiClient
    helm_home: Path
    consumable: list[JSON] = field(default_factory=list)

    def render(self, template: str, *sets: str) -> list[JSON]:
        docs = render_chart(self.helm_home, *sets, show_only=f"templates/{template}")
        kinds = sorted(d["kind"] for d in docs)
        # policies and a binding each (the claim-config template holds two: claims, and classes' configs)
        each = len(kinds) // 2
        policy, binding = "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"
        assert kinds and kinds == [policy] * each + [binding] * each, kinds
        return docs

    def install(self, docs: list[JSON]) -> None:
        for doc in docs:
            sync_request(self.api, "POST", _admission_path(doc), doc)

    def uninstall(self, docs: list[JSON]) -> None:
        for doc in reversed(docs):
            sync_request(self.api, "DELETE", _admission_path(doc, named=True))

    def refuses(self, probe: JSON) -> bool:
        return policy_denial(self.api, "default", probe, dry_run=True) is not None

    def consumable_shares(self, mode: str) -> None:
        """The consumable-shares policy of a release installed with consumableShares=`mode`
        (none for a number: that release publishes both capacities)."""
        self.uninstall(self.consumable)
        self.consumable = [] if mode.isdigit() else self.render(
            "consumable-shares-policy.yaml", f"consumableShares={mode}")
        self.install(self.consumable)
        memory_refused, shares_refused = mode == "disabled", not mode.isdigit()
        wait_for(f"the consumable-shares policy of consumableShares={mode}",
                 lambda: (self.refuses(MEMORY_PROBE), self.refuses(SHARES_PROBE))
                 == (memory_refused, shares_refused), timeout=60)


@pytest.fixture(scope="module")
def policy(cluster: NodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Policies]:
    """The chart's policies as its defaults render them, for this module only."""
    policies = Policies(cluster.api, tmp_path_factory.mktemp("helm"))
    claim_config = policies.render("claim-config-policy.yaml")
    policies.install(claim_config)
    try:
        wait_for("the claim-config policy to take effect", lambda: policies.refuses(VFIO_PROBE), timeout=60)
        policies.consumable_shares("disabled")
        yield policies
    finally:
        policies.uninstall(policies.consumable)
        policies.uninstall(claim_config)


Ready = Callable[[list[JSON]], bool]  # the node's published devices -> is this setup's slice out?


@dataclass
class Setups:
    """Which `dra-driver kubelet-plugin` flags each node runs with beyond its own; a node's plugin
    is restarted only when a spec needs other flags, and every node is restored at the end."""

    cluster: NodeCluster
    root: Path  # short, searchable by others: MPS servers run as the client's user
    changed: set[str] = field(default_factory=set)

    @property
    def mps_args(self) -> tuple[str, ...]:
        return ("--driver-root", str(self.root / "driver"), "--mps-root", str(self.root / "mps"))

    def node_devices(self, node: str) -> list[JSON]:
        return [d for (pool, _), d in published_devices(self.cluster.api).items() if pool == node]

    def use(self, node: str, args: tuple[str, ...], ready: Ready) -> Node:
        n = self.cluster.nodes[node]
        assert n.driver is not None
        wanted = (*n.spec.driver_args, *args)
        if n.driver.extra_args != wanted:
            self.changed.add(node)  # restored at the end even if this start fails
            n.driver.extra_args = wanted
            n.restart_driver()
        wait_for(f"{node}'s slices for plugin flags {args}", lambda: ready(self.node_devices(node)),
                 timeout=60, detail=lambda: [d["name"] for d in self.node_devices(node)])
        return n

    def default(self, node: str) -> Node:
        original = sorted(name for (pool, name) in self.cluster.devices if pool == node)
        return self.use(node, (), lambda devices: sorted(d["name"] for d in devices) == original
                        and not any(d.get("allowMultipleAllocations") for d in devices))

    def all_default(self) -> None:
        for node in (V100, A100, H200):
            self.default(node)


@pytest.fixture(scope="module")
def setups(cluster: NodeCluster, policy: Policies) -> Iterator[Setups]:
    root = Path(tempfile.mkdtemp(prefix="nvspec-", dir="/tmp"))
    root.chmod(0o755)
    install_fake_mps_control(root / "driver")
    s = Setups(cluster, root)
    try:
        yield s
    finally:
        for node in sorted(s.changed):
            s.default(node)
        shutil.rmtree(root, ignore_errors=True)


# -- applying a spec, reading what its pods got -----------------------------------------------

_suffix = iter(range(1, 10**6))


@dataclass
class Applied:
    spec: str
    docs: list[JSON]
    created: list[Created]

    @property
    def namespaces(self) -> list[str]:
        return namespaces_of(self.docs)

    @property
    def refused(self) -> list[Created]:
        return [c for c in self.created if c.refusal is not None]


def load(spec: str) -> list[JSON]:
    return runnable(migrated_documents(spec), f"t{next(_suffix)}")


def apply(cluster: NodeCluster, spec: str, docs: list[JSON]) -> Applied:
    """Create the documents in order, as `kubectl apply -f` does; a refusal is kept."""
    return Applied(spec, docs, [create_as_kubectl(cluster.api, doc) for doc in docs])


def remove(cluster: NodeCluster, applied: Applied) -> None:
    """Delete what the spec made (its namespaces, its cluster-wide classes) and wait until the
    namespaces are gone: their pods unprepared, their claims deallocated, the GPUs free again."""
    for c in applied.created:
        if c.obj is not None and c.kind == "DeviceClass":
            sync_request(cluster.api, "DELETE", f"{RESOURCE_API}/deviceclasses/{c.name}")
    for ns in applied.namespaces:
        try:
            sync_request(cluster.api, "DELETE", f"/api/v1/namespaces/{ns}")
        except ApiException as e:
            if e.status != 404:
                raise

    def gone() -> bool:
        for ns in applied.namespaces:
            try:
                sync_request(cluster.api, "GET", f"/api/v1/namespaces/{ns}")
            except ApiException as e:
                if e.status == 404:
                    continue
                raise
            return False
        return True

    wait_for(f"{applied.spec}'s namespaces to be gone", gone, timeout=180)


def list_pods(cluster: NodeCluster, namespaces: list[str]) -> list[JSON]:
    return [p for ns in namespaces
            for p in sync_request(cluster.api, "GET", f"/api/v1/namespaces/{ns}/pods")["items"]]


def running(pod: JSON) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return (pod.get("status", {}).get("phase") == "Running" and bool(statuses)
            and all("running" in (s.get("state") or {}) for s in statuses)
            and not pod["metadata"].get("deletionTimestamp"))


def wait_all_running(cluster: NodeCluster, applied: Applied, timeout: float = 180) -> list[JSON]:
    count = expected_pods(applied.docs)
    deadline = time.monotonic() + timeout
    while True:
        found = list_pods(cluster, applied.namespaces)
        if len(found) == count and all(running(p) for p in found):
            return found
        if time.monotonic() > deadline:
            waiting = [
                f"{pods.describe(cluster.api, ns, name)} on {p['spec'].get('nodeName')}; "
                f"scheduler: {scheduler_reason(cluster.api, ns, name)}"
                for p in found if not running(p)
                for ns, name in [(p["metadata"]["namespace"], p["metadata"]["name"])]
            ]
            raise AssertionError(f"{applied.spec}: {len(found)} of {count} pods, not all Running after "
                                 f"{timeout}s (admitted, then stuck): {waiting}")
        time.sleep(0.5)  # the poll interval


@dataclass(frozen=True)
class Got:
    """What one container got: its allocation results and what it sees."""

    pod: JSON
    container: str
    node: Node
    results: tuple[JSON, ...]  # the claim's results this container was given
    devices: tuple[JSON, ...]  # the published device of each result
    env: dict[str, str]
    extended_classes: tuple[str, ...]  # the classes of the scheduler's claim for extended resources

    @property
    def names(self) -> tuple[tuple[str, str], ...]:
        return tuple((r["pool"], r["device"]) for r in self.results)

    @property
    def mps(self) -> dict[str, str]:
        return {k: v for k, v in self.env.items() if k.startswith("CUDA_MPS_")}


def _minor(device: JSON) -> int:
    """A whole GPU's minor; a MIG device's is its parent's (the simulated boxes here number
    minors as indices)."""
    attrs = device["attributes"]
    return int(attrs["minor"]["int"] if "minor" in attrs else attrs["parentIndex"]["int"])


def what_they_got(cluster: NodeCluster, found: list[JSON]) -> list[Got]:
    """Each container's allocation, checked against what it sees: exactly the GPUs (/dev/nvidiaN,
    MIG: its parent's) of its results, and each device's UUID in its environment."""
    published: DeviceMap = published_devices(cluster.api)
    out: list[Got] = []
    for pod in found:
        node = cluster.nodes[pod["spec"]["nodeName"]]
        for spec in pod["spec"]["containers"]:
            results = tuple(pods.container_allocations(cluster.api, pod, spec["name"]))
            for r in results:
                assert (r["driver"], r["pool"]) == (DRIVER, node.name), r
            devices = tuple(published[(r["pool"], r["device"])] for r in results)
            cid = pods.container_id(pod, spec["name"])
            live = pods.gpu_minors(pods.live_devices(node, cid))
            env = pods.live_environment(node, cid)
            where = f"{pod['metadata']['name']}/{spec['name']} on {node.name}"
            assert live == {_minor(d) for d in devices}, f"{where} sees GPUs {live}, was given {results}"
            for r, d in zip(results, devices, strict=True):
                assert env.get(device_env_name(r["device"])) == d["attributes"]["uuid"]["string"], where
            out.append(Got(pod, spec["name"], node, results, devices, env, extended_classes(cluster, pod)))
    return out


def extended_classes(cluster: NodeCluster, pod: JSON) -> tuple[str, ...]:
    status = pod.get("status", {}).get("extendedResourceClaimStatus")
    if not status:
        return ()
    claim = get_claim(cluster.api, pod["metadata"]["namespace"], status["resourceClaimName"])
    return tuple(r["exactly"]["deviceClassName"] for r in claim["spec"]["devices"]["requests"])


def by_container(got: list[Got]) -> dict[tuple[str, str], Got]:
    return {(g.pod["metadata"]["name"], g.container): g for g in got}


def attr(device: JSON, name: str) -> str:
    value = device["attributes"][name]
    return str(next(iter(value.values())))


# -- the specs that run -----------------------------------------------------------------------


def whole_gpus(got: list[Got], each: int) -> None:
    for g in got:
        assert len(g.results) == each and all(attr(d, "type") == "gpu" for d in g.devices), g.results
        assert not any("shareID" in r for r in g.results), "a whole GPU, not a share"
        assert g.mps == {}, "no MPS asked for"


def check_gpu_test1(got: list[Got]) -> None:
    """Two pods, one claim each from one template: two different GPUs."""
    whole_gpus(got, 1)
    assert len(got) == 2 and got[0].names != got[1].names


def check_gpu_test2(got: list[Got]) -> None:
    """One pod, two containers on one claim: the same GPU in both."""
    whole_gpus(got, 1)
    assert len(got) == 2 and got[0].names == got[1].names


def check_gpu_test3(got: list[Got]) -> None:
    """Two pods on one ResourceClaim: the same GPU in both, on one node."""
    whole_gpus(got, 1)
    assert len(got) == 2 and got[0].names == got[1].names and got[0].node is got[1].node


def check_gpu_test7(got: list[Got]) -> None:
    """One pod, two claims from one template, one per container: two different GPUs."""
    whole_gpus(got, 1)
    containers = by_container(got)
    assert containers[("gpu-pod", "ctr0")].names != containers[("gpu-pod", "ctr1")].names


def check_gpu_test8(got: list[Got]) -> None:
    """One container, one claim of count 2: two GPUs."""
    whole_gpus(got, 2)
    assert len(got) == 1 and len(set(got[0].names)) == 2


def check_gpu_full(got: list[Got]) -> None:
    """`nvidia.com/gpu: 1` and no claim: one whole GPU through the extended-resource class."""
    whole_gpus(got, 1)
    (g,) = got
    assert g.extended_classes == (f"extended.{DRIVER}",), "the scheduler's claim for nvidia.com/gpu"


def check_gpu_test4(got: list[Got]) -> None:
    """Four replicas, each a claim of four MIG devices (1g.5gb x2, 2g.10gb, 3g.20gb) on one
    parent (matchAttribute parentUUID), one per container: each replica on its own A100."""
    profiles = {"ctr0": "1g.5gb", "ctr1": "1g.5gb", "ctr2": "2g.10gb", "ctr3": "3g.20gb"}
    parents: dict[str, set[str]] = collections.defaultdict(set)
    for g in got:
        (d,) = g.devices
        assert attr(d, "type") == "mig" and attr(d, "profile") == profiles[g.container], g.results
        parents[g.pod["metadata"]["name"]].add(attr(d, "parentUUID"))
    assert len(parents) == 4 and all(len(p) == 1 for p in parents.values()), parents
    assert len({next(iter(p)) for p in parents.values()}) == 4, "four replicas on four parents"
    for pod in {g.pod["metadata"]["name"] for g in got}:
        mine = [g.names[0] for g in got if g.pod["metadata"]["name"] == pod]
        assert len(set(mine)) == 4, f"{pod}: four different MIG devices"


def check_mig_1g_12gb(got: list[Got]) -> None:
    """`nvidia.com/mig-1g.12gb: 1` and the spec's own class: one 1g.12gb MIG device."""
    (g,) = got
    (d,) = g.devices
    assert attr(d, "type") == "mig" and attr(d, "profile") == "1g.12gb"
    assert g.extended_classes == (f"mig-1g-12gb.{DRIVER}",), "the scheduler's claim, of the spec's class"


def check_gpu_test_mps(got: list[Got]) -> None:
    """Two containers on one MPS GPU: the claim's thread percentage and pinned memory limit."""
    assert len(got) == 2 and got[0].names == got[1].names and len(got[0].results) == 1
    for g in got:
        assert g.mps == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
                         "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10G",
                         "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}, g.mps


CHECKS: dict[str, Callable[[list[Got]], None]] = {
    "gpu-test1.yaml": check_gpu_test1,
    "gpu-test2.yaml": check_gpu_test2,
    "gpu-test3.yaml": check_gpu_test3,
    "gpu-test4.yaml": check_gpu_test4,
    "gpu-test7.yaml": check_gpu_test7,
    "gpu-test8.yaml": check_gpu_test8,
    "gpu-test-mps.yaml": check_gpu_test_mps,
    "gpu-full.yaml": check_gpu_full,
    "mig-1g-12gb.yaml": check_mig_1g_12gb,
}


def _profiles(devices: list[JSON]) -> collections.Counter[str]:
    return collections.Counter(attr(d, "profile") for d in devices if attr(d, "type") == "mig")


def half_balanced(setups: Setups) -> None:
    """The V100 node as NVIDIA's quickstart DGX A100: MIG on 0-3 as mig-parted-config.yaml says."""
    profile = half_balanced_profile(specs_dir() / "quickstart" / "mig-parted-config.yaml",
                                    setups.root / "half-balanced.yaml")
    setups.use(V100, ("--simulate", str(profile)), lambda d: _profiles(d)["3g.20gb"] == 4)


def prepare_nodes(setups: Setups, spec: str) -> None:
    """Give the nodes what the spec needs (its pods may go to any node unless `pin`ned)."""
    name = Path(spec).name
    if name == "gpu-test4.yaml":
        half_balanced(setups)
    elif name == "gpu-test6.yaml":  # A100s of index 0, 2, 4 and 6: 4 and 6 whole on the DGX
        half_balanced(setups)
        setups.default(A100)
    elif name == "mig-1g-12gb.yaml":
        profile = mig_1g_12gb_profile(setups.root / "h100-nvl.yaml")
        setups.use(A100, ("--simulate", str(profile)), lambda d: _profiles(d)["1g.12gb"] == 7)
    elif name in ("gpu-test-mps.yaml", "gpu-test5.yaml"):
        setups.use(H200, setups.mps_args, lambda d: len(d) == 8)
    else:
        setups.all_default()


def pin(docs: list[JSON], node: str) -> None:
    for doc in docs:
        spec = pod_spec_of(doc)
        if spec is not None:
            spec["nodeSelector"] = {"kubernetes.io/hostname": node}


@pytest.mark.parametrize("spec", [s for s in RUNS if not s.startswith("consumable-shares/")])
def test_spec_runs_with_what_it_asked_for(cluster: NodeCluster, setups: Setups, spec: str) -> None:
    docs = load(spec)
    unserved = [d["apiVersion"] for d in docs if not served(cluster.api, d)]
    if unserved:  # the quickstart's v1beta1 files, on a server without that version
        pytest.skip(f"{spec}: this cluster does not serve {', '.join(sorted(set(unserved)))}")
    prepare_nodes(setups, spec)
    if Path(spec).name == "gpu-test-mps.yaml":
        pin(docs, H200)  # the node whose plugin has the stand-in MPS
    applied = apply(cluster, spec, docs)
    try:
        assert not applied.refused, [(c.what, c.refusal) for c in applied.refused]
        got = what_they_got(cluster, wait_all_running(cluster, applied))
        CHECKS[Path(spec).name](got)
    finally:
        remove(cluster, applied)


# -- consumable shares ------------------------------------------------------------------------


def claim_dirs(setups: Setups, uid: str) -> Path:
    return setups.root / "mps" / uid


@pytest.mark.parametrize(("spec", "mode", "replicas"), [
    # N=2 and 8 replicas on 4 GPUs: all run only if every GPU holds exactly 2 claims.
    ("consumable-shares/integer-sharing.yaml", "2", 2 * A100_GPUS),
    # 4Gi each, more replicas than GPUs: some GPU holds two, each held to 4Gi by its MPS daemon.
    ("consumable-shares/memory-sharing.yaml", "memory", A100_GPUS + 2),
    ("consumable-shares/unlimited-sharing.yaml", "unlimited", A100_GPUS + 2),
])
def test_consumable_shares_share(
    cluster: NodeCluster, policy: Policies, setups: Setups, spec: str, mode: str, replicas: int
) -> None:
    """As NVIDIA's README runs each file: the plugin with --consumable-shares=<mode> (and the
    chart's policy of a release installed with consumableShares=<mode>)."""
    policy.consumable_shares(mode)
    setups.use(A100, ("--consumable-shares", mode, *setups.mps_args),
               lambda d: len(d) == A100_GPUS and all(x.get("allowMultipleAllocations") for x in d)
               and (not mode.isdigit() or all("shares" in x.get("capacity", {}) for x in d)))
    docs = load(spec)
    pin(docs, A100)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    deployment["spec"]["replicas"] = replicas
    applied = apply(cluster, spec, docs)
    try:
        assert not applied.refused, [(c.what, c.refusal) for c in applied.refused]
        got = what_they_got(cluster, wait_all_running(cluster, applied))
        assert len(got) == replicas
        per_gpu = collections.Counter(g.names for g in got)
        assert all(len(n) == 1 for n in per_gpu), "one GPU per claim"
        assert len(per_gpu) <= A100_GPUS and max(per_gpu.values()) >= 2, f"shared: {per_gpu}"
        for g in got:
            (r,) = g.results
            assert r.get("shareID"), f"a share, not the whole GPU: {r}"
            consumed = r.get("consumedCapacity", {})
            if mode == "memory":
                assert consumed.get("memory") == "4Gi", r
                assert g.mps.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == "0=4G", g.mps
                # only memory is held: the compute stays the whole GPU's, as NVIDIA's driver gives it
                assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in g.mps, g.mps
                (claim,) = pods.pod_claims(cluster.api, g.pod).values()
                log = claim_dirs(setups, claim["metadata"]["uid"]) / "log" / "control.log"
                assert "set_default_device_pinned_mem_limit 0 4G" in log.read_text(), log
            else:
                assert g.mps == {}, f"time-sliced, no MPS: {g.mps}"
                assert consumed.get("memory", "0") == "0", r
            if mode.isdigit():
                assert consumed.get("shares") == "1", r
        if mode.isdigit():
            assert set(per_gpu.values()) == {int(mode)}, f"{mode} claims on each GPU: {per_gpu}"
        assert len({r["shareID"] for g in got for r in g.results}) == replicas, "one share per claim"
    finally:
        remove(cluster, applied)
        policy.consumable_shares("disabled")


def test_memory_sharing_refused_by_the_charts_default(cluster: NodeCluster, setups: Setups) -> None:
    """memory-sharing.yaml where consumable shares are off (the chart's default): refused when
    written, naming both ways to share by memory here, not a whole GPU per 4Gi claim."""
    setups.all_default()
    spec = "consumable-shares/memory-sharing.yaml"
    applied = apply(cluster, spec, load(spec))
    try:
        (refused,) = applied.refused
        assert refused.kind == "ResourceClaimTemplate", refused
        for fix in ("capacity.requests.memory", "consumableShares=memory", f"gpu-share.{DRIVER}"):
            assert fix in str(refused.refusal), refused.refusal
        waiting_for_template(cluster, applied, refused.name)
    finally:
        remove(cluster, applied)


# -- refused when written ---------------------------------------------------------------------


def waiting_for_template(cluster: NodeCluster, applied: Applied, template: str) -> None:
    """The pods of a file whose template was refused (created beside the refusal, as `kubectl
    apply` creates them) have no claim and no node, and each names the missing template."""
    ns = applied.namespaces[0]

    def named() -> list[JSON] | None:
        found = list_pods(cluster, [ns])
        if len(found) != expected_pods(applied.docs):
            return None
        said = [" ".join(str(e.get("message")) for e in pod_events(cluster.api, ns, name))
                for name in (p["metadata"]["name"] for p in found)]
        return found if all(f'resourceclaimtemplate.resource.k8s.io "{template}" not found' in s
                            for s in said) else None

    found = wait_for("the pods to name the template they wait for", named, timeout=60)
    assert not any(p["spec"].get("nodeName") for p in found)
    claims = sync_request(cluster.api, "GET", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims")["items"]
    assert claims == []


def without_interval(template: JSON) -> JSON:
    """The template as the refusal says to write it: `interval` removed."""
    fixed = copy.deepcopy(template)
    for entry in fixed["spec"]["spec"]["devices"]["config"]:
        sharing = entry["opaque"]["parameters"].get("sharing") or {}
        (sharing.get("timeSlicingConfig") or {}).pop("interval", None)
    return fixed


def check_gpu_test5(got: list[Got]) -> None:
    """A time-sliced GPU for ts-ctr0/1, an MPS GPU (50 %, 10Gi pinned) for mps-ctr0/1."""
    c = {g.container: g for g in got}
    assert len(got) == 4 and c["ts-ctr0"].names == c["ts-ctr1"].names != c["mps-ctr0"].names
    assert c["mps-ctr0"].names == c["mps-ctr1"].names and len(c["ts-ctr0"].names) == 1
    for name in ("ts-ctr0", "ts-ctr1"):
        assert c[name].mps == {}, c[name].mps
    for name in ("mps-ctr0", "mps-ctr1"):
        assert c[name].mps["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50", c[name].mps
        assert c[name].mps["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10G", c[name].mps


def check_gpu_test6(got: list[Got]) -> None:
    """Four replicas, each an A100 of index 0, 2, 4 or 6 of its own, time-sliced (no MPS)."""
    whole_gpus(got, 1)
    assert len({g.names for g in got}) == 4
    for g in got:
        (d,) = g.devices
        assert "A100" in attr(d, "productName") and attr(d, "index") in ("0", "2", "4", "6"), d["name"]


AFTER_THE_FIX = {"gpu-test5.yaml": check_gpu_test5, "gpu-test6.yaml": check_gpu_test6}


@pytest.mark.parametrize("spec", list(REFUSED_BY_POLICY))
def test_spec_refused_when_written_naming_the_fix(cluster: NodeCluster, setups: Setups, spec: str) -> None:
    """Refused when written, saying what to change; its pods (created beside the refusal) wait
    for the template without a claim or a node; once the template is written as the message
    says, those same pods run with what the fixed template asks."""
    prepare_nodes(setups, spec)
    docs = load(spec)
    if Path(spec).name == "gpu-test5.yaml":
        pin(docs, H200)  # its MPS request needs the stand-in MPS
    applied = apply(cluster, spec, docs)
    try:
        (refused,) = applied.refused
        assert refused.kind == "ResourceClaimTemplate", refused
        assert "timeSlicingConfig.interval" in str(refused.refusal), refused.refusal
        assert REFUSED_BY_POLICY[spec] in str(refused.refusal), refused.refusal
        template = refused.name
        waiting_for_template(cluster, applied, template)

        (doc,) = [d for d in docs if d["metadata"]["name"] == template and d["kind"] == refused.kind]
        fixed = create_as_kubectl(cluster.api, without_interval(doc))
        assert fixed.refusal is None, fixed.refusal
        got = what_they_got(cluster, wait_all_running(cluster, applied))
        AFTER_THE_FIX[Path(spec).name](got)
    finally:
        remove(cluster, applied)


@pytest.mark.parametrize("spec", CLASSIC_DRA)
def test_classic_dra_spec_refused_by_the_api_server(cluster: NodeCluster, spec: str) -> None:
    docs = load(spec)
    applied = Applied(spec, docs, [])
    for ns in applied.namespaces:  # their READMEs create the namespace first
        sync_request(cluster.api, "POST", "/api/v1/namespaces",
                     {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    applied.created.extend(create_as_kubectl(cluster.api, d) for d in docs)
    try:
        assert len(applied.refused) == len(docs), [c.what for c in applied.created if c.refusal is None]
        for c in applied.refused:
            assert ('in version "resource.k8s.io/v1alpha2"' in str(c.refusal)
                    or 'in version "gpu.resource.nvidia.com/v1alpha1"' in str(c.refusal)
                    or ("unknown field" in str(c.refusal) and ".source" in str(c.refusal))), c.refusal
    finally:
        remove(cluster, applied)
