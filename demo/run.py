"""`python -m demo.run [--keep]` (`make demo`): the driver end to end, with pods that really run.

Starts a real control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler; built by hack/cluster) and four real nodes on this machine, each a
kubelet + containerd + runc in its own mount and PID namespace (built by hack/node;
tests.harness.node), with one `dra-driver kubelet-plugin --simulate <profile>` per node
as users run it: 8x V100 hybrid cube-mesh, 4x A100 PCIe in bridged pairs, 8x H200 on
NVSwitch; and a fourth, `h200-mig`, whose H200s are in MIG mode and whose plugin runs with
`--dynamic-mig`. It applies the DeviceClasses of deploy/deviceclasses and every example of
deploy/examples unchanged, plus deploy/examples/mig/01-slice-3g-71gb.yaml with a pod (the
3g.71gb instance is made when that pod's claim is prepared), lets the scheduler allocate
and the kubelets prepare the claims through the plugin and start the containers, then
prints per pod what the scheduler allocated and what each container itself sees: its own
`ls -l /dev/nvidia*`, read back from its log as `kubectl logs` would, checked against the
allocated minors.
One extra pod asks for a GPU no node has and stays Pending with the scheduler's reason.

The demo only observes: it never calls the plugin itself (the kubelet-side test client,
tests.harness.kubelet, belongs to tests/integration). It builds on the test harness
(`tests.harness.examples`: the boxes, the examples, waiting for slices;
`tests.harness.objects`: applying YAML, pods, claims, the scheduler's reasons); nothing
in tests/ or benchmarks/ imports it back. The report's layout lives apart, in `demo.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import structlog
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from demo.report import (
    ClaimView,
    ContainerView,
    DemoReport,
    DeviceView,
    ExampleView,
    NodeView,
    PodView,
    counts,
    describe_excerpt,
    render,
)
from dra_driver import log
from dra_driver.jsontypes import JSON
from tests.harness.cluster import ControlPlane, build_binaries
from tests.harness.driver import DriverProcess
from tests.harness.examples import (
    DEMO_NODES,
    MIG_NODE,
    MIG_TAINT,
    DeviceMap,
    apply_order,
    deploy_dir,
    device_class_files,
    example_files,
    node_specs,
    too_big_pod,
    wait_for_slices,
)
from tests.harness.node import Nodes, NodeSpec, build_node_binaries, node_cluster
from tests.harness.objects import (
    Applied,
    allocation_results,
    api_error,
    apply_documents,
    create_documents,
    create_namespace,
    event_order,
    event_text,
    get_claim,
    get_pod,
    load_yaml_documents,
    pod_claim_names,
    pod_events,
    scheduler_reason,
    sync_client,
    sync_request,
    wait_settled,
)

logger = structlog.get_logger(__name__)

DESCRIPTION = (
    "The GPU DRA driver end to end on a real control plane and four real nodes "
    "(kubelet + containerd + runc), each simulating a different GPU box."
)

DEMO_NAMESPACE = "gpu-demo"

MIG_SPEC = NodeSpec(MIG_NODE.name, MIG_NODE.profile, ("--dynamic-mig",))
MIG_EXAMPLE = deploy_dir() / "examples" / "mig" / "01-slice-3g-71gb.yaml"


def taint_mig_node(api: client.ApiClient) -> None:
    path = f"/api/v1/nodes/{MIG_NODE.name}"
    for _ in range(20):  # the kubelet updates the node too: retry on a conflict
        node = sync_request(api, "GET", path)
        node["spec"]["taints"] = [*node["spec"].get("taints", []), MIG_TAINT]
        try:
            sync_request(api, "PUT", path, node)
            return
        except ApiException as e:
            if e.status != 409:
                raise
    raise RuntimeError(f"could not taint node {MIG_NODE.name}: the update kept conflicting")


def dynamic_mig_pod() -> list[JSON]:
    """The shipped 3g.71gb claim and a pod that lists its device and caps nodes and its MIG UUID."""
    (claim,) = load_yaml_documents(MIG_EXAMPLE)
    pod: JSON = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "mig-slice"},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{"key": MIG_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}],
            "resourceClaims": [{"name": "mig", "resourceClaimName": claim["metadata"]["name"]}],
            "containers": [
                {
                    "name": "main",
                    "image": "busybox:1.37",
                    "command": ["sh", "-c", "ls -l /dev/nvidia* /dev/nvidia-caps/*; "
                                "env | grep GPU_DRA_DEVICE_; sleep 3600"],
                    "resources": {"claims": [{"name": "mig"}]},
                }
            ],
        },
    }
    return [claim, pod]


def first_comment_paragraph(path: Path) -> str:
    """The file's leading comment up to its first blank comment line, as one line."""
    words: list[str] = []
    for line in path.read_text().splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or (words and not text):
            break
        if text:
            words.append(text)
    return " ".join(words)


# -- report gathering ------------------------------------------------------------------------


def _attribute(device: JSON, name: str) -> Any:
    value = device.get("attributes", {}).get(name, {})
    for kind in ("string", "int", "version", "bool", "ints", "strings"):
        if kind in value:
            return value[kind]
    return None


def _status_peers(data: JSON) -> tuple[int, ...]:
    """The `nvlinkPeers` the plugin wrote in the claim's status ([{gpu: "gpu-3", uuid}])."""
    names = (str(p.get("gpu", "")) for p in data.get("nvlinkPeers") or [] if isinstance(p, dict))
    return tuple(sorted(int(n.removeprefix("gpu-")) for n in names if n.removeprefix("gpu-").isdigit()))


def _peers(device: JSON) -> tuple[int, ...]:
    """nvlinkPeers of the slice: published only with --topology-detail-attributes."""
    raw = _attribute(device, "nvlinkPeers")
    if isinstance(raw, list):
        return tuple(int(x) for x in raw)
    peers: list[int] = []
    for part in str(raw or "").split(","):
        lo, _, hi = part.partition("-")
        if lo.strip():
            peers.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(peers)


def _int_or_none(value: Any) -> int | None:
    return int(value) if value is not None else None


def device_view(
    result: JSON, device: JSON | None, in_use_by: tuple[str, ...] = (), minor: int | None = None,
    peers: tuple[int, ...] = (),
) -> DeviceView:
    """`minor`: where the slice has none (a MIG slice), the one the plugin reported for it;
    `peers`: the NVLink peers the plugin reported in the claim's status (the slice has them
    only with --topology-detail-attributes)."""
    device = device or {}
    published = _int_or_none(_attribute(device, "minor"))
    layers = sorted(
        (int(k.removeprefix("nvlinkClique")), f"{k}={_attribute(device, k)}")
        for k in device.get("attributes", {})
        if k.startswith("nvlinkClique") and k.removeprefix("nvlinkClique").isdigit()
    )
    return DeviceView(
        request=result["request"],
        pool=result["pool"],
        device=result["device"],
        product=str(_attribute(device, "productName") or "?"),
        memory=str(device.get("capacity", {}).get("memory", {}).get("value", "?")),
        index=_int_or_none(_attribute(device, "index")),
        minor=published if published is not None else minor,
        nvlink_cliques=tuple(text for _, text in layers),
        nvlink_domain=str(_attribute(device, "nvlinkDomain") or ""),
        nvlink_peers=tuple(sorted(set(_peers(device)) | set(peers))),
        admin_access=bool(result.get("adminAccess")),
        in_use_by=in_use_by,
    )


@dataclass
class Gathered:
    """Pods and claims as read back from the API server once the pods run."""

    pods: dict[tuple[str, str], JSON] = field(default_factory=dict)
    claims: dict[str, JSON] = field(default_factory=dict)  # by uid
    # pod -> [(claim uid, origin)], in the pod's order
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


def container_results(pod: JSON, claims_by_name: dict[str, JSON], container: str) -> list[JSON]:
    """The allocation results a container gets: its `resources.claims` (narrowed to a request
    where it names one), plus what the scheduler mapped to it for an extended resource."""
    spec = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    status = pod.get("status", {})
    generated = {s["name"]: s.get("resourceClaimName") for s in status.get("resourceClaimStatuses", [])}
    named = {r["name"]: r.get("resourceClaimName") for r in pod["spec"].get("resourceClaims", [])}
    results: list[JSON] = []
    for ref in spec.get("resources", {}).get("claims", []) or []:
        claim = claims_by_name.get(named.get(ref["name"]) or generated.get(ref["name"]) or "")
        wanted = ref.get("request")
        for r in allocation_results(claim or {}):
            if not wanted or r["request"] == wanted or r["request"].startswith(wanted + "/"):
                results.append(r)
    extended = status.get("extendedResourceClaimStatus")
    if extended and extended.get("resourceClaimName") in claims_by_name:
        mapped = {m["requestName"] for m in extended["requestMappings"] if m["containerName"] == container}
        claim = claims_by_name[extended["resourceClaimName"]]
        results += [r for r in allocation_results(claim) if r["request"] in mapped]
    return results


def container_log(api: client.ApiClient, namespace: str, pod: str, container: str) -> str:
    """The container's log through the API server and its kubelet, as `kubectl logs` reads it."""
    params = api.param_serialize(
        method="GET",
        resource_path=f"/api/v1/namespaces/{namespace}/pods/{pod}/log",
        query_params=[("container", container)],
        # The log endpoint answers text, but only accepts the API's own media types.
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*params)
    data = str(response.read().decode(errors="replace"))
    if response.status >= 400:
        raise ApiException(status=response.status, reason=response.reason, body=data)
    return data


def listing_of(
    api: client.ApiClient, namespace: str, pod: str, container: str
) -> tuple[tuple[str, ...], str]:
    """(the lines of the container's `ls -l /dev/nvidia*`, error); waits briefly for the output."""
    deadline = time.monotonic() + 10
    while True:
        try:
            text = container_log(api, namespace, pod, container)
        except ApiException as e:
            if time.monotonic() > deadline:
                return (), api_error(e)
            text = ""
        lines = tuple(line.rstrip() for line in text.splitlines() if line.strip())
        if any("/dev/nvidia" in line for line in lines) or time.monotonic() > deadline:
            return lines, ""
        time.sleep(0.3)


def _container_state(status: JSON | None) -> str:
    state = (status or {}).get("state") or {}
    if "running" in state:
        return "Running"
    for kind in ("waiting", "terminated"):
        if kind in state:
            detail = state[kind]
            text = f"{kind} ({detail.get('reason', '?')})"
            return text + (f": {detail['message']}" if detail.get("message") else "")
    return "not started"


def _cdi_status(status: JSON | None) -> tuple[tuple[str, str], ...]:
    return tuple(
        (str(r.get("resourceID")), str(r.get("health", "?")))
        for entry in (status or {}).get("allocatedResourcesStatus", [])
        if str(entry.get("name", "")).startswith("claim:")
        for r in entry.get("resources", [])
    )


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
    api: client.ApiClient,
    key: tuple[str, str],
    g: Gathered,
    devices: DeviceMap,
    in_use: dict[tuple[str, str], tuple[str, ...]],
) -> PodView:
    pod = g.pods[key]
    node = pod["spec"].get("nodeName")
    phase = str(pod.get("status", {}).get("phase", "Unknown"))
    if not node:
        return PodView(key[0], key[1], None, phase, pending_reason=scheduler_reason(api, *key))

    claims = [(g.claims[uid], origin) for uid, origin in g.pod_claims[key]]
    # What the claim's status says of each device: a MIG slice's parent minor (no attribute of
    # its device) and the NVLink peers (in the slices only with --topology-detail-attributes)
    reported: dict[tuple[Any, Any], int | None] = {}
    reported_peers: dict[tuple[Any, Any], tuple[int, ...]] = {}
    for claim, _ in claims:
        for d in claim.get("status", {}).get("devices", []) or []:
            data = d.get("data") or {}
            reported[(d.get("pool"), d.get("device"))] = _int_or_none(data.get("minor"))
            reported_peers[(d.get("pool"), d.get("device"))] = _status_peers(data)

    def view(r: JSON) -> DeviceView:
        where = (r["pool"], r["device"])
        in_use_by = in_use.get(where, ()) if r.get("adminAccess") else ()
        return device_view(r, devices.get(where), in_use_by, reported.get(where),
                           reported_peers.get(where, ()))

    claim_views = tuple(
        ClaimView(
            name=claim["metadata"]["name"],
            origin=origin,
            devices=tuple(view(r) for r in allocation_results(claim)),
            used_by=tuple(
                f"{claim['metadata']['namespace']}/{r['name']}"
                for r in claim.get("status", {}).get("reservedFor", [])
            ),
        )
        for claim, origin in claims
    )
    by_name = {claim["metadata"]["name"]: claim for claim, _ in claims}
    statuses = {s["name"]: s for s in pod.get("status", {}).get("containerStatuses", [])}
    containers: list[ContainerView] = []
    for spec in pod["spec"]["containers"]:
        name = spec["name"]
        state = _container_state(statuses.get(name))
        listing, error = listing_of(api, key[0], key[1], name) if state == "Running" else ((), "")
        containers.append(
            ContainerView(
                name=name,
                state=state,
                allocated=tuple(view(r) for r in container_results(pod, by_name, name)),
                cdi=_cdi_status(statuses.get(name)),
                listing=listing,
                log_error=error,
            )
        )
    running = phase == "Running" and all(c.state == "Running" for c in containers)
    return PodView(
        key[0],
        key[1],
        node,
        phase,
        tuple(containers),
        claim_views,
        pending_reason="" if running else kubelet_reason(api, *key),
    )


def kubelet_reason(api: client.ApiClient, namespace: str, pod: str) -> str:
    """The newest Warning event of a bound pod that does not run (a failed prepare says why)."""
    events = pod_events(api, namespace, pod)
    # Every pod gets MissingClusterDNS here (the nodes run no cluster DNS); it never says why
    # a pod does not run.
    warnings = [e for e in events if e.get("type") == "Warning" and e.get("reason") != "MissingClusterDNS"]
    return event_text(max(warnings, key=event_order)) if warnings else ""


def node_views(api: client.ApiClient, nodes: Nodes, devices: DeviceMap) -> tuple[NodeView, ...]:
    views = []
    for name, node in nodes.nodes.items():
        mine = [dev for (pool, _), dev in devices.items() if pool == name]
        product = str(_attribute(mine[0], "productName")) if mine else "?"
        description = next((n.description for n in (*DEMO_NODES, MIG_NODE) if n.name == name), "")
        info = sync_request(api, "GET", f"/api/v1/nodes/{name}").get("status", {}).get("nodeInfo", {})
        runtime = (
            f"node IP {node.ip}, kubelet {info.get('kubeletVersion', '?')}, "
            f"{info.get('containerRuntimeVersion', '?')}, runc"
        )
        # A MIG-mode GPU is published as itself and its MIG devices (or only those, when a
        # static instance keeps the whole GPU out): count distinct GPUs.
        gpus = len({_attribute(d, "uuid") if _attribute(d, "type") == "gpu" else _attribute(d, "parentUUID")
                    for d in mine})
        views.append(NodeView(name, node.spec.profile, gpus, product, description, runtime))
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


def cdi_spec_files(nodes: Nodes) -> list[Path]:
    return sorted(
        p for n in nodes.nodes.values() if n.driver for p in n.driver.cdi_dir.glob("*") if p.is_file()
    )


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
        applied.append((first_comment_paragraph(path), result))
        progress(
            f"{path.name}: {_summarise_pods(api, pods)}"
            + (f"; {len(result.problems)} objects rejected" if result.problems else "")
        )
    mig = create_documents(api, dynamic_mig_pod(), DEMO_NAMESPACE, f"mig/{MIG_EXAMPLE.name} + a pod")
    wait_settled(api, mig.pods(DEMO_NAMESPACE), timeout=5.0 if mig.problems else 30.0)
    applied.append(
        ("a 3g.71gb MIG slice, made on h200-mig when the pod's claim is prepared (dynamic MIG)", mig)
    )
    progress(f"mig/{MIG_EXAMPLE.name} + a pod: {_summarise_pods(api, mig.pods(DEMO_NAMESPACE))}")
    too_big = create_documents(api, too_big_pod(), DEMO_NAMESPACE, "extra (not an example file)")
    wait_settled(api, too_big.pods(DEMO_NAMESPACE))
    applied.append(("a GPU with 200Gi: no node has one, so the pod stays pending, on purpose", too_big))
    progress(f"extra pod asking for a 200Gi GPU: {_summarise_pods(api, too_big.pods(DEMO_NAMESPACE))}")
    return sorted(applied, key=lambda a: a[1].title)


def _is_running(pod: JSON) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses", [])
    return (
        pod.get("status", {}).get("phase") == "Running"
        and bool(statuses)
        and all("running" in (s.get("state") or {}) for s in statuses)
    )


def wait_running(
    api: client.ApiClient, pods: Sequence[tuple[str, str]], progress: Progress, timeout: float = 180.0
) -> None:
    """Wait until every bound pod's containers run; one progress line whenever the count moves."""
    deadline = time.monotonic() + timeout
    reported = (-1, 0.0)
    while True:
        bound: list[str] = []
        waiting: list[str] = []
        for ns, name in pods:
            with contextlib.suppress(ApiException):
                pod = get_pod(api, ns, name)
                if pod["spec"].get("nodeName"):
                    bound.append(name)
                    if not _is_running(pod):
                        waiting.append(name)
        running = len(bound) - len(waiting)
        # A line when the count moves, and every 10 s while it does not.
        if running != reported[0] or time.monotonic() - reported[1] > 10:
            progress(
                f"pods Running: {running} of the {len(bound)} bound"
                + (f" (waiting for {', '.join(waiting)})" if 0 < len(waiting) <= 3 else "")
            )
            reported = (running, time.monotonic())
        if not waiting or time.monotonic() > deadline:
            return
        time.sleep(0.5)


def example_views(
    api: client.ApiClient, applied: Sequence[tuple[str, Applied]], g: Gathered, devices: DeviceMap
) -> list[ExampleView]:
    in_use = in_use_map(g)
    views: list[ExampleView] = []
    for summary, result in applied:
        keys = [key for key in result.pods(DEMO_NAMESPACE) if key in g.pods]
        pods = tuple(pod_view(api, key, g, devices, in_use) for key in keys)
        views.append(ExampleView(result.title, summary, pods, result.problems))
    return views


def run_demo(keep: bool) -> int:
    progress = Progress()
    if os.geteuid() != 0:
        progress("the demo runs real kubelets, containerd and runc on this machine: it needs root")
        return 2
    base = Path(tempfile.mkdtemp(prefix="gpu-dra-demo-", dir="/tmp"))
    ok = False
    try:
        cluster_bin = build_binaries()
        progress(f"control-plane binaries ready in {cluster_bin}")
        node_bin = build_node_binaries()
        progress(f"node binaries (kubelet, containerd) ready in {node_bin}")
        with node_cluster(
            (*node_specs(), MIG_SPEC),
            base / "cluster",
            nodes_dir=base / "nodes",
            cluster_bin_dir=cluster_bin,
            node_bin_dir=node_bin,
            keep_files=True,  # removed below once the demo succeeded; kept for a look otherwise
            progress=progress,
        ) as (cp, nodes):
            ok = demo_on(cp, nodes, base, progress, keep)
    finally:
        if ok:
            shutil.rmtree(base, ignore_errors=True)
            progress("torn down: drivers, kubelets, containerd and the control plane stopped")
        else:
            progress(f"stopped everything; logs kept in {base} (nodes/<node>/*.log, cluster/*.log)")
    return 0 if ok else 1


def demo_on(cp: ControlPlane, nodes: Nodes, base: Path, progress: Progress, keep: bool) -> bool:
    """Everything between the nodes coming up and the teardown; True if the report shows no problem."""
    version = str(json.loads(cp.get("/version")[1]).get("gitVersion", "?"))
    api = sync_client(str(cp.kubeconfig))
    drivers: list[DriverProcess] = [n.driver for n in nodes.nodes.values() if n.driver]
    devices = wait_for_slices(api, drivers)
    progress(f"ResourceSlices published: {len(devices)} devices on {len(drivers)} nodes")

    class_problems = [
        problem for path in device_class_files() for problem in apply_documents(api, path, "default").problems
    ]
    progress(
        f"DeviceClasses applied: {', '.join(p.name for p in device_class_files())}"
        + (f" ({len(class_problems)} rejected)" if class_problems else "")
    )

    create_namespace(api, DEMO_NAMESPACE)
    taint_mig_node(api)
    applied = apply_examples(api, progress)
    pods = [p for _, a in applied for p in a.pods(DEMO_NAMESPACE)]
    wait_running(api, pods, progress)
    g = gather(api, pods)
    examples = example_views(api, applied, g, devices)
    progress(f"read back {len(g.pods)} pods, {len(g.claims)} claims and every GPU container's log")
    if class_problems:
        examples.insert(0, ExampleView("deviceclasses", "DeviceClasses", (), tuple(class_problems)))
    excerpt_name, excerpt = slice_excerpt(cp, DEMO_NODES[0].name)
    report = DemoReport(
        kubernetes_version=version,
        nodes=node_views(api, nodes, devices),
        examples=tuple(examples),
        expected_pending=(f"{DEMO_NAMESPACE}/{too_big_pod()[1]['metadata']['name']}",),
        slice_excerpt=excerpt,
        slice_excerpt_name=excerpt_name,
        cdi_spec_files=len(cdi_spec_files(nodes)),
        elapsed_s=progress.elapsed,
    )
    progress("report:")
    print(render(report), flush=True)
    print_kubectl_gpu(cp, [DEMO_NODES[-1].name], progress)
    print_kubectl_gpu(cp, [MIG_NODE.name], progress)
    # why the deliberately pending pod waits, node by node (kubectl finds kubectl-gpu for `gpu why`)
    print_kubectl_gpu(cp, ["why", f"{DEMO_NAMESPACE}/{too_big_pod()[1]['metadata']['name']}"], progress)
    if keep:
        _wait_for_interrupt(cp, nodes, base)
    return counts(report).ok


def print_kubectl_gpu(cp: ControlPlane, args: Sequence[str], progress: Progress) -> None:
    """`kubectl gpu <node>`, `kubectl gpu why <pod>`: the real kubectl finding the driver's
    kubectl-gpu plugin on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig), "PATH": path}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    progress(f"kubectl gpu {' '.join(args)}:")
    shown = subprocess.run([str(cp.bin_dir / "kubectl"), "gpu", *args], capture_output=True, text=True,
                           env=env, timeout=60, check=False)
    failed = f"kubectl gpu failed: {shown.stderr.strip()}"
    print(shown.stdout if shown.returncode == 0 else failed, flush=True)


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _wait_for_interrupt(cp: ControlPlane, nodes: Nodes, base: Path) -> None:
    """--keep: the nodes die with this process (their sandboxes have a parent-death signal),
    so it stays until it is told to stop, then tears down as usual. What it prints is what a
    user types in another shell (tests.harness.kept_demo reads it as such)."""
    pending = too_big_pod()[1]["metadata"]["name"]
    commands = (
        "kubectl get pods,resourceclaims -A -o wide",
        f"kubectl gpu {MIG_NODE.name}",
        f"kubectl gpu why -n {DEMO_NAMESPACE} {pending}",
        f"kubectl logs -n {DEMO_NAMESPACE} nvlink-pair",
    )
    print("\nLeft running (--keep). To use it, in another shell:")
    print(f"  export KUBECONFIG={cp.kubeconfig}")
    # kubectl itself, and kubectl-gpu and dra-driver beside this Python
    print(f"  export PATH={Path(sys.executable).parent}:{cp.bin_dir}:$PATH")
    for command in commands:
        print(f"  {command}")
    print(f"  node files (kubelet.log, containerd.log, plugin.log, cdi/): {base / 'nodes'}/<node>/")
    print(f"To stop it and tear everything down: Ctrl-C here, or kill {os.getpid()}", flush=True)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    with contextlib.suppress(KeyboardInterrupt):
        while all(n.driver is None or n.driver.proc is not None for n in nodes.nodes.values()):
            time.sleep(1)
    print("stopping...", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.run", description=DESCRIPTION)
    parser.add_argument(
        "--keep",
        action="store_true",
        help="after the report, keep cluster and nodes up until Ctrl-C or SIGTERM; print how to reach them",
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
