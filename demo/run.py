"""`python -m demo.run [--keep]` (`make demo`): the driver end to end on a real control plane.

Starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler (built by
hack/cluster), creates three Nodes and runs one `dra-driver kubelet-plugin` process per
node, each simulating a different GPU box (8x V100 hybrid cube-mesh, 4x A100 PCIe in
bridged pairs, 8x H200 on NVSwitch). It applies the DeviceClasses of deploy/deviceclasses
and every example of deploy/examples, lets the real scheduler allocate, then prepares
each bound pod's claims through the plugin's socket exactly as a kubelet would, and
prints what every pod got. There is no kubelet and no container runtime: pods stay
Pending (unstarted) after binding, and nothing runs.

The node/driver helpers here (`DEMO_NODES`, `DriverProcess`, `wait_for_slices`,
`apply_documents`...) are also what tests/integration/test_examples.py builds on.
The report's layout lives apart, in `demo.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from demo.report import (
    ClaimView,
    DemoReport,
    DeviceView,
    ExampleView,
    NodeView,
    PodView,
    describe_excerpt,
    render,
)
from dra_driver import log
from dra_driver.jsontypes import JSON
from tests.harness.cluster import REPO_ROOT, ControlPlane, build_binaries
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import (
    create_node,
    create_object,
    load_yaml_documents,
    sync_client,
    sync_request,
    wait_for,
)

logger = structlog.get_logger(__name__)

DESCRIPTION = "The GPU DRA driver end to end on a real control plane, with three simulated GPU nodes."

DeviceMap = dict[tuple[str, str], JSON]  # (pool, device name) -> the device in its ResourceSlice
DEMO_NAMESPACE = "gpu-demo"
TOO_BIG_SELECTOR = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("200Gi")) >= 0'
RESOURCE_API = "/apis/resource.k8s.io/v1"
EXTENDED_RESOURCE_CLAIM = "resource.kubernetes.io/extended-resource-claim"


@dataclass(frozen=True)
class SimulatedNode:
    name: str
    profile: str  # `dra-driver inventory --list-profiles`
    description: str


DEMO_NODES: tuple[SimulatedNode, ...] = (
    SimulatedNode("dgx1-v100", "dgx1-v100", "hybrid cube-mesh: each GPU has NVLink to 4 of the 7 others"),
    SimulatedNode("a100-pcie", "a100-pcie-bridged", "PCIe cards, NVLink bridges join only 0-1 and 2-3"),
    SimulatedNode("hgx-h200", "hgx-h200", "NVSwitch: every GPU linked to every other"),
)


def deploy_dir() -> Path:
    """deploy/ of the source tree, or the copy shipped inside the wheel."""
    source = REPO_ROOT / "deploy"
    return source if source.is_dir() else Path(__file__).parent / "_deploy"


def example_files() -> list[Path]:
    return sorted((deploy_dir() / "examples").glob("*.yaml"))


# The scheduler places the unconstrained examples wherever it likes; applied before
# them, the examples that need a particular box (or a particular set of GPUs on it)
# always find it free, so every run of the demo ends the same way.
MOST_CONSTRAINED_FIRST = ("06-", "04-", "10-", "07-", "05-")


def apply_order(files: Sequence[Path]) -> list[Path]:
    def rank(path: Path) -> tuple[int, str]:
        prefix = next((i for i, p in enumerate(MOST_CONSTRAINED_FIRST) if path.name.startswith(p)), None)
        return (prefix if prefix is not None else len(MOST_CONSTRAINED_FIRST), path.name)

    return sorted(files, key=rank)


def device_class_files() -> list[Path]:
    return sorted((deploy_dir() / "deviceclasses").glob("*.yaml"))


def first_comment_line(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return ""


def api_error(e: ApiException) -> str:
    """The API server's own message from an error response, else the HTTP reason."""
    with contextlib.suppress(ValueError, TypeError):
        message = json.loads(e.body or "").get("message")
        if message:
            return str(message)
    return f"{e.status} {e.reason}"


# -- driver processes ----------------------------------------------------------------------


def start_node_drivers(
    api: client.ApiClient,
    kubeconfig: Path,
    base: Path,
    nodes: Sequence[SimulatedNode] = DEMO_NODES,
    detach: bool = False,
) -> list[DriverProcess]:
    """Create each Node object and start its driver, with its own kubelet and CDI dirs under `base`."""
    drivers: list[DriverProcess] = []
    try:
        for node in nodes:
            create_node(api, node.name)
            driver = DriverProcess(node.name, node.profile, kubeconfig, base / node.name, detach=detach)
            drivers.append(driver.start(wait=False))
    except BaseException:
        stop_drivers(drivers)
        raise
    return drivers


def stop_drivers(drivers: Iterable[DriverProcess]) -> None:
    for driver in drivers:
        driver.stop()


def published_devices(api: client.ApiClient) -> DeviceMap:
    """Every device of our driver's slices, by (pool, device name)."""
    slices = sync_request(
        api, "GET", f"{RESOURCE_API}/resourceslices", query={"fieldSelector": f"spec.driver={DRIVER}"}
    )["items"]
    return {(s["spec"]["pool"]["name"], d["name"]): d for s in slices for d in s["spec"].get("devices", [])}


def wait_for_slices(
    api: client.ApiClient, drivers: Sequence[DriverProcess], timeout: float = 60.0
) -> DeviceMap:
    """Wait until every node's pool is complete (all `resourceSliceCount` slices of its newest generation)."""
    deadline = time.monotonic() + timeout
    while True:
        for driver in drivers:
            driver.check_alive()
        slices = sync_request(
            api, "GET", f"{RESOURCE_API}/resourceslices", query={"fieldSelector": f"spec.driver={DRIVER}"}
        )["items"]
        if all(_pool_complete(slices, d.node) for d in drivers):
            return published_devices(api)
        if time.monotonic() > deadline:
            missing = [d.node for d in drivers if not _pool_complete(slices, d.node)]
            raise TimeoutError(f"no complete ResourceSlice pool after {timeout}s for: {', '.join(missing)}")
        time.sleep(0.2)


def _pool_complete(slices: Sequence[JSON], node: str) -> bool:
    mine = [s["spec"] for s in slices if s["spec"].get("nodeName") == node]
    if not mine:
        return False
    newest = max(s["pool"]["generation"] for s in mine)
    current = [s for s in mine if s["pool"]["generation"] == newest]
    return len(current) == current[0]["pool"]["resourceSliceCount"] and any(s.get("devices") for s in current)


# -- applying YAML -------------------------------------------------------------------------


@dataclass(frozen=True)
class Applied:
    """What creating the documents of one file did."""

    title: str
    created: tuple[JSON, ...]
    problems: tuple[str, ...]

    def pods(self, namespace: str) -> list[tuple[str, str]]:
        return [
            (o["metadata"].get("namespace", namespace), o["metadata"]["name"])
            for o in self.created
            if o.get("kind") == "Pod"
        ]


def apply_documents(api: client.ApiClient, path: Path, namespace: str) -> Applied:
    """Create every object of a YAML file; a rejected object is recorded, not raised.

    Objects that name their own namespace (example 9) keep it; an existing Namespace is fine.
    """
    return create_documents(api, load_yaml_documents(path), namespace, path.name)


def create_documents(api: client.ApiClient, docs: Iterable[JSON], namespace: str, title: str) -> Applied:
    created: list[JSON] = []
    problems: list[str] = []
    for doc in docs:
        what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            obj = create_object(api, doc, namespace)
        except ApiException as e:
            if e.status == 409 and doc.get("kind") == "Namespace":
                continue
            problems.append(f"{what} rejected by the API server: {api_error(e)}")
            continue
        obj.setdefault("kind", doc.get("kind"))
        created.append(obj)
    return Applied(title=title, created=tuple(created), problems=tuple(problems))


def create_namespace(api: client.ApiClient, name: str, labels: dict[str, str] | None = None) -> None:
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}
    try:
        sync_request(api, "POST", "/api/v1/namespaces", body)
    except ApiException as e:
        if e.status != 409:
            raise
    # Pods are refused until the controller-manager has made the namespace's default
    # service account, which takes seconds on a loaded machine.
    wait_for(
        f"the default service account of namespace {name}",
        lambda: sync_request(api, "GET", f"/api/v1/namespaces/{name}/serviceaccounts/default"),
    )


# -- pods, claims, scheduler ----------------------------------------------------------------


def get_pod(api: client.ApiClient, namespace: str, name: str) -> JSON:
    return sync_request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/{name}")


def get_claim(api: client.ApiClient, namespace: str, name: str) -> JSON:
    return sync_request(api, "GET", f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims/{name}")


def unschedulable_message(pod: JSON) -> str | None:
    """The PodScheduled=False condition's message, once the scheduler gave up on a pass."""
    for cond in pod.get("status", {}).get("conditions", []):
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("message") or cond.get("reason") or "unschedulable")
    return None


def scheduler_reason(api: client.ApiClient, namespace: str, pod: str) -> str:
    """Why a pod is not bound: its newest FailedScheduling event, else its PodScheduled
    condition, else its newest Warning event from another component (a missing claim
    template stops a pod before the scheduler ever tries it)."""
    events = sync_request(
        api,
        "GET",
        f"/api/v1/namespaces/{namespace}/events",
        query={"fieldSelector": f"involvedObject.kind=Pod,involvedObject.name={pod}"},
    )["items"]
    failed = [e for e in events if e.get("reason") == "FailedScheduling"]
    if failed:
        return _event_text(max(failed, key=_event_order))
    condition = unschedulable_message(get_pod(api, namespace, pod))
    if condition:
        return condition
    warnings = [e for e in events if e.get("type") == "Warning"]
    return _event_text(max(warnings, key=_event_order)) if warnings else ""


def _event_order(event: JSON) -> int:
    return int(event["metadata"].get("resourceVersion") or 0)


def _event_text(event: JSON) -> str:
    return f"{event.get('reason')}: {event.get('message') or event.get('note') or ''}".strip()


def wait_settled(api: client.ApiClient, pods: Sequence[tuple[str, str]], timeout: float = 30.0) -> None:
    """Wait until each pod is bound to a node or the scheduler has reported it unschedulable."""
    deadline = time.monotonic() + timeout
    waiting = list(pods)
    while waiting and time.monotonic() < deadline:
        still: list[tuple[str, str]] = []
        for ns, name in waiting:
            try:
                pod = get_pod(api, ns, name)
            except ApiException:
                still.append((ns, name))
                continue
            if not pod["spec"].get("nodeName") and unschedulable_message(pod) is None:
                still.append((ns, name))
        waiting = still
        if waiting:
            time.sleep(0.2)


def pod_claim_names(pod: JSON) -> list[tuple[str, str]]:
    """(claim name, origin) of every ResourceClaim a pod uses, in the pod's order."""
    status = pod.get("status", {})
    statuses = {s["name"]: s.get("resourceClaimName") for s in status.get("resourceClaimStatuses", [])}
    names: list[tuple[str, str]] = []
    for ref in pod["spec"].get("resourceClaims", []):
        if ref.get("resourceClaimName"):
            names.append((ref["resourceClaimName"], "claim"))
        elif statuses.get(ref["name"]):
            names.append((str(statuses[ref["name"]]), "template"))
    extended = status.get("extendedResourceClaimStatus", {}).get("resourceClaimName")
    if extended:
        names.append((str(extended), "extended resource"))
    return names


def allocation_results(claim: JSON) -> list[JSON]:
    allocation = claim.get("status", {}).get("allocation") or {}
    results: list[JSON] = allocation.get("devices", {}).get("results", [])
    return results


def claim_ref(claim: JSON) -> ClaimName:
    meta = claim["metadata"]
    return ClaimName(meta["namespace"], meta["name"], meta["uid"])


def prepared_cdi_ids(response: Any, uid: str) -> tuple[tuple[str, ...], str]:
    """(CDI device ids, error) for one claim of a NodePrepareResources response."""
    if uid not in response.claims:
        return (), "the plugin's answer has no entry for this claim"
    result = response.claims[uid]
    if result.error:
        return (), str(result.error)
    return tuple(cdi for device in result.devices for cdi in device.cdi_device_ids), ""


def cdi_spec_files(drivers: Iterable[DriverProcess]) -> list[Path]:
    return sorted(p for d in drivers for p in d.cdi_dir.glob("*") if p.is_file())


# -- report gathering ------------------------------------------------------------------------


def _attribute(device: JSON, name: str) -> Any:
    value = device.get("attributes", {}).get(name, {})
    for kind in ("string", "int", "version", "bool", "ints", "strings"):
        if kind in value:
            return value[kind]
    return None


def _peers(device: JSON) -> tuple[int, ...]:
    raw = _attribute(device, "nvlinkPeers")
    if isinstance(raw, list):
        return tuple(int(x) for x in raw)
    peers: list[int] = []
    for part in str(raw or "").split(","):
        lo, _, hi = part.partition("-")
        if lo.strip():
            peers.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(peers)


def device_view(result: JSON, device: JSON | None, in_use_by: tuple[str, ...] = ()) -> DeviceView:
    device = device or {}
    groups = sorted(
        (int(k.removeprefix("nvlinkGroup")), str(_attribute(device, k)))
        for k in device.get("attributes", {})
        if k.startswith("nvlinkGroup")
    )
    index = _attribute(device, "index")
    return DeviceView(
        request=result["request"],
        pool=result["pool"],
        device=result["device"],
        product=str(_attribute(device, "productName") or "?"),
        memory=str(device.get("capacity", {}).get("memory", {}).get("value", "?")),
        index=int(index) if index is not None else None,
        nvlink_groups=tuple(g for _, g in groups),
        nvlink_peers=_peers(device),
        admin_access=bool(result.get("adminAccess")),
        in_use_by=in_use_by,
    )


@dataclass
class Gathered:
    """Pods and claims as read back from the API server after scheduling."""

    pods: DeviceMap = field(default_factory=dict)
    claims: dict[str, JSON] = field(default_factory=dict)  # by uid
    # pod -> [(claim uid, origin)]
    pod_claims: dict[tuple[str, str], list[tuple[str, str]]] = field(default_factory=dict)


def gather(api: client.ApiClient, pods: Iterable[tuple[str, str]]) -> Gathered:
    g = Gathered()
    for ns, name in pods:
        try:
            pod = get_pod(api, ns, name)
        except ApiException:
            continue
        g.pods[(ns, name)] = pod
        g.pod_claims[(ns, name)] = []
        for claim_name, origin in pod_claim_names(pod):
            try:
                claim = get_claim(api, ns, claim_name)
            except ApiException:
                continue
            g.claims[claim["metadata"]["uid"]] = claim
            g.pod_claims[(ns, name)].append((claim["metadata"]["uid"], origin))
    return g


@dataclass(frozen=True)
class Prepared:
    cdi_ids: tuple[str, ...]
    error: str
    for_pod: str


def prepare_like_kubelet(g: Gathered, drivers: Sequence[DriverProcess]) -> dict[str, Prepared]:
    """One NodePrepareResources call per bound pod, for the claims not yet prepared on its node.

    That is the kubelet's behaviour: a claim shared by several pods is prepared once and
    stays prepared while any of them runs. Returns the outcome per claim UID.
    """
    sides: dict[str, KubeletSide] = {}
    done: dict[str, Prepared] = {}
    by_node = {d.node: d for d in drivers}
    try:
        for (ns, name), pod in g.pods.items():
            node = pod["spec"].get("nodeName")
            if not node or node not in by_node:
                continue
            todo = [uid for uid, _ in g.pod_claims[(ns, name)] if uid not in done]
            if not todo:
                continue
            if node not in sides:
                sides[node] = KubeletSide(by_node[node].registration_socket())
            try:
                response = sides[node].prepare(*(claim_ref(g.claims[uid]) for uid in todo))
            except Exception as e:  # a failed call is reported per claim, the demo goes on
                for uid in todo:
                    done[uid] = Prepared((), f"NodePrepareResources failed: {e}", f"{ns}/{name}")
                continue
            for uid in todo:
                cdi_ids, error = prepared_cdi_ids(response, uid)
                done[uid] = Prepared(cdi_ids, error, f"{ns}/{name}")
    finally:
        for side in sides.values():
            side.close()
    return done


def in_use_map(g: Gathered) -> dict[tuple[str, str], tuple[str, ...]]:
    """(pool, device) -> pods holding it through an ordinary (not admin-access) allocation."""
    users: dict[tuple[str, str], list[str]] = {}
    for claim in g.claims.values():
        ns = claim["metadata"]["namespace"]
        holders = [f"{ns}/{r['name']}" for r in claim.get("status", {}).get("reservedFor", [])]
        for result in allocation_results(claim):
            if not result.get("adminAccess"):
                users.setdefault((result["pool"], result["device"]), []).extend(holders)
    return {key: tuple(sorted(set(pods))) for key, pods in users.items()}


def pod_view(
    key: tuple[str, str],
    g: Gathered,
    devices: DeviceMap,
    prepared: dict[str, Prepared],
    reason: str,
    in_use: dict[tuple[str, str], tuple[str, ...]],
) -> PodView:
    pod = g.pods[key]
    containers = tuple(c["name"] for c in pod["spec"].get("containers", []))
    node = pod["spec"].get("nodeName")
    if not node:
        return PodView(key[0], key[1], None, containers, pending_reason=reason)
    claims: list[ClaimView] = []
    for uid, origin in g.pod_claims[key]:
        claim = g.claims[uid]
        ns = claim["metadata"]["namespace"]
        outcome = prepared.get(uid)
        claims.append(
            ClaimView(
                name=claim["metadata"]["name"],
                origin=origin,
                devices=tuple(
                    device_view(
                        r,
                        devices.get((r["pool"], r["device"])),
                        in_use.get((r["pool"], r["device"]), ()) if r.get("adminAccess") else (),
                    )
                    for r in allocation_results(claim)
                ),
                cdi_ids=outcome.cdi_ids if outcome else (),
                prepared_for=outcome.for_pod if outcome else "",
                prepare_error=outcome.error if outcome else "",
                used_by=tuple(f"{ns}/{r['name']}" for r in claim.get("status", {}).get("reservedFor", [])),
            )
        )
    return PodView(key[0], key[1], node, containers, tuple(claims))


def node_views(drivers: Sequence[DriverProcess], devices: DeviceMap) -> tuple[NodeView, ...]:
    views = []
    for d in drivers:
        mine = [dev for (pool, _), dev in devices.items() if pool == d.node]
        product = str(_attribute(mine[0], "productName")) if mine else "?"
        description = next((n.description for n in DEMO_NODES if n.name == d.node), "")
        views.append(NodeView(d.node, d.profile, len(mine), product, description))
    return tuple(views)


def slice_excerpt(cp: ControlPlane, node: str) -> tuple[str, str]:
    """(slice name, excerpt of `kubectl describe resourceslice`) for the first slice of a node."""
    name = cp.kubectl(
        "get",
        "resourceslices",
        f"--field-selector=spec.nodeName={node}",
        "-o",
        "jsonpath={.items[0].metadata.name}",
    ).stdout.strip()
    return name, describe_excerpt(cp.kubectl("describe", "resourceslice", name).stdout)


# -- the demo -----------------------------------------------------------------------------------


class Progress:
    """One line per step, with the seconds since the demo started."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed:6.1f}s] {message}", flush=True)


def too_big_pod() -> list[JSON]:
    """A claim no node can satisfy (200Gi on one GPU): shows the scheduler's reason, harms nothing."""
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpu-200gi"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "selectors": [
                                    {
                                        "cel": {"expression": TOO_BIG_SELECTOR}
                                    }
                                ],
                            },
                        }
                    ]
                }
            }
        },
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "too-big-200gi"},
        "spec": {
            "automountServiceAccountToken": False,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-200gi"}],
            "containers": [
                {"name": "main", "image": "busybox:1.37", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }
    return [template, pod]


def _summarise_pods(api: client.ApiClient, pods: Sequence[tuple[str, str]]) -> str:
    placed: list[str] = []
    for ns, name in pods:
        try:
            node = get_pod(api, ns, name)["spec"].get("nodeName")
        except ApiException:
            node = None
        placed.append(f"{name} -> {node}" if node else f"{name} PENDING")
    return ", ".join(placed) if placed else "no pods"


def apply_examples(api: client.ApiClient, progress: Progress) -> list[tuple[str, Applied]]:
    """Apply every example (most constrained first) and the extra 200Gi pod; (summary, what was applied)."""
    applied: list[tuple[str, Applied]] = []
    for path in apply_order(example_files()):
        result = apply_documents(api, path, DEMO_NAMESPACE)
        pods = result.pods(DEMO_NAMESPACE)
        # A pod whose claim template was rejected is never tried by the scheduler.
        wait_settled(api, pods, timeout=5.0 if result.problems else 30.0)
        applied.append((first_comment_line(path), result))
        progress(
            f"{path.name}: {_summarise_pods(api, pods)}"
            + (f"; {len(result.problems)} objects rejected" if result.problems else "")
        )
    too_big = create_documents(api, too_big_pod(), DEMO_NAMESPACE, "extra (not an example file)")
    wait_settled(api, too_big.pods(DEMO_NAMESPACE))
    applied.append(("a GPU with 200Gi: no node has one, so the pod stays pending, on purpose", too_big))
    progress(f"extra pod asking for a 200Gi GPU: {_summarise_pods(api, too_big.pods(DEMO_NAMESPACE))}")
    return sorted(applied, key=lambda a: a[1].title)


def example_views(
    api: client.ApiClient,
    applied: Sequence[tuple[str, Applied]],
    g: Gathered,
    devices: DeviceMap,
    prepared: dict[str, Prepared],
) -> list[ExampleView]:
    in_use = in_use_map(g)
    views: list[ExampleView] = []
    for summary, result in applied:
        pods = []
        for key in result.pods(DEMO_NAMESPACE):
            if key in g.pods:
                reason = "" if g.pods[key]["spec"].get("nodeName") else scheduler_reason(api, *key)
                pods.append(pod_view(key, g, devices, prepared, reason, in_use))
        views.append(ExampleView(result.title, summary, tuple(pods), result.problems))
    return views


def run_demo(keep: bool) -> int:
    progress = Progress()
    base = Path(tempfile.mkdtemp(prefix="gpu-dra-demo-"))
    cp: ControlPlane | None = None
    drivers: list[DriverProcess] = []
    ok = False
    try:
        bin_dir = build_binaries()
        progress(f"control-plane binaries ready in {bin_dir}")
        cp = ControlPlane.start(work_dir=base / "cluster", bin_dir=bin_dir, detach=keep)
        version = str(json.loads(cp.get("/version")[1]).get("gitVersion", "?"))
        progress(f"control plane {version} up at {cp.server}")
        api = sync_client(str(cp.kubeconfig))

        drivers = start_node_drivers(api, cp.kubeconfig, base / "nodes", detach=keep)
        progress(
            "nodes created, one driver each: "
            + ", ".join(f"{d.node} ({d.profile}, pid {d.pid})" for d in drivers)
        )
        devices = wait_for_slices(api, drivers)
        progress(f"ResourceSlices published: {len(devices)} devices on {len(drivers)} nodes")

        class_problems = [
            problem
            for path in device_class_files()
            for problem in apply_documents(api, path, "default").problems
        ]
        progress(
            f"DeviceClasses applied: {', '.join(p.name for p in device_class_files())}"
            + (f" ({len(class_problems)} rejected)" if class_problems else "")
        )

        create_namespace(api, DEMO_NAMESPACE)
        applied = apply_examples(api, progress)
        g = gather(api, [p for _, a in applied for p in a.pods(DEMO_NAMESPACE)])
        prepared = prepare_like_kubelet(g, drivers)
        failures = sum(1 for p in prepared.values() if p.error)
        progress(
            f"prepared {len(prepared)} claims through the plugin sockets, as the kubelet would"
            + (f" ({failures} failed)" if failures else "")
        )

        examples = example_views(api, applied, g, devices, prepared)
        if class_problems:
            examples.insert(0, ExampleView("deviceclasses", "DeviceClasses", (), tuple(class_problems)))
        excerpt_name, excerpt = slice_excerpt(cp, DEMO_NODES[0].name)
        report = DemoReport(
            kubernetes_version=version,
            nodes=node_views(drivers, devices),
            examples=tuple(examples),
            slice_excerpt=excerpt,
            slice_excerpt_name=excerpt_name,
            cdi_spec_files=len(cdi_spec_files(drivers)),
            elapsed_s=progress.elapsed,
        )
        progress("report:")
        print(render(report), flush=True)
        ok = True
    finally:
        if keep and cp is not None:
            _print_keep_hints(cp, drivers, base)
        else:
            stop_drivers(drivers)
            if cp is not None:
                cp.stop(remove=ok)
            if ok:
                shutil.rmtree(base, ignore_errors=True)
                progress("torn down: drivers stopped with SIGTERM, control plane stopped")
            else:
                progress(f"stopped everything; logs kept in {base} (driver logs: nodes/<node>/plugin.log)")
    return 0 if ok else 1


def _print_keep_hints(cp: ControlPlane, drivers: Sequence[DriverProcess], base: Path) -> None:
    pids = " ".join(str(d.pid) for d in drivers)
    print("\nLeft running (--keep):")
    print(f"  export KUBECONFIG={cp.kubeconfig}")
    print(f"  {cp.bin_dir / 'kubectl'} get resourceslices,resourceclaims -A")
    print(f"  driver logs: {base / 'nodes'}/<node>/plugin.log")
    print("To stop everything:")
    print(f"  kill -TERM {pids}")
    print(f"  {sys.executable} -m tests.harness.cluster down --state-dir {cp.work_dir}")
    print(f"  rm -rf {base}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.run", description=DESCRIPTION)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="leave the cluster and the drivers running; print how to reach and stop them",
    )
    args = parser.parse_args(argv)
    # The report explains itself; the components' own chatter goes to their log files.
    log.configure("warning", "console")
    try:
        return run_demo(keep=args.keep)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
