"""Fleet-scale scheduling through the real kube-scheduler: pods/s on our slices and claim shapes
beside the reference shape (plain devices), as upstream's scheduler_perf DRA benchmark measures it.

Method: one fresh control plane per profile (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler exactly as tests/harness/cluster.py starts them), the scheduler and the
controller-manager restarted with their client rate limits raised (`--kube-api-qps/burst`
5000, as scheduler_perf runs without a client limit) unless `--default-limits`; N Node objects
without kubelets (pods are bound, never run, as in scheduler_perf); each node's
ResourceSlices built by `controller.slices.desired_slices` + `controller.plan.desired_objects`,
the functions our publisher writes with, and created by this benchmark (publishing speed is
benchmarks/slices.py's figure, not this one's). The cluster serves list-type attributes, so
the slices carry them, as our publisher's probe would decide.

Per shape, in a namespace of its own: one ResourceClaimTemplate, then P pods created at once
(64 requests in flight); P is the pod count asked for, capped at what the fleet can hold for
that shape (an 8-GPU node holds 8 one-GPU pods, 4 pairs, 2 quads), and with `--fill F` at F
of that. Compare shapes at one fill: a pod looks at nodes until it has found enough that fit
(kube-scheduler's percentageOfNodesToScore: 230 of 500), so on a fleet nearly full of a shape
its last pods look at every node, most of which fail only after a whole search; 600 one-GPU
pods fill 15% of 500 8-GPU nodes, 600 triples may fill it. Figures:
- `pods_per_s`: bound pods / (last binding - first creation). The binding count is the
  scheduler's own `scheduler_schedule_attempts_total{result="scheduled"}` (counted after the
  bind succeeds), polled every second (every 0.25 s cost the scheduler 8% of its CPU: its
  /metrics is large); the run ends when all P are bound or nothing was bound for `--stall` s.
- `create_s`: how long creating the P pods took (if it is close to the total, creation bound it).
- the scheduler's `scheduler_pod_scheduling_sli_duration_seconds` (count, mean, p50/p99 from
  the histogram buckets) and `scheduler_schedule_attempts_total` by result, as deltas;
- CPU seconds (utime+stime from /proc) of kube-scheduler, kube-apiserver,
  kube-controller-manager and etcd during the shape, and their RSS at its end.
After each shape its pods are deleted (grace 0) and the benchmark waits until their claims
are gone, so the next shape starts on a free fleet.

Per shape also the scheduler's CPU per bound pod (`scheduler_cpu_ms_per_bound_pod`: its CPU
during the shape / pods bound) and per unschedulable attempt (`..._per_unschedulable_attempt`,
for claims that can never fit), and at the end of a profile each shape's CPU per pod as a
multiple of the `reference` shape's (`cpu_vs_reference`, the mean of its two runs); the
impossible shapes per attempt against `reference-impossible`'s (`cpu_per_attempt_vs_reference`).
CPU is read from /proc, which a busy machine distorts far less than pods/s.

Shapes: `reference` (devices with index, uuid, productName and capacity memory only; one GPU
per pod: upstream's shape), `reference-impossible` (the same with a selector no device passes:
what one unschedulable plain pod costs), and ours: `one-gpu`, `cel-memory` (one GPU, memory >= 24Gi), `pair`
and `quad` (the documented 8-layer firstAvailable shape of controller/claim_shapes.py,
deploy/examples/05), `pair-fit` and `quad-fit` (the same with only the layers where some node
of the fleet has a group of 2 or 4: `claim_shapes.fleet_layers`; it finds the same GPUs),
`share` (an 8Gi memory share, on slices published with memory shares: each GPU whole and as a
share view, kept apart by a counter set), `share-only` (the same claim on slices published with
`--memory-shares-only`: each GPU as its share view alone, no counters); `linked2`, `linked3`,
`linked4`: the claim `dra-driver claim --linked K` prints for the fleet (controller.claim_fit,
read from the fleet's slices), the shape the docs lead with; `impossible`: the same for K one
more than the largest clique of the fleet (100 pods, none can ever bind: CPU per attempt);
`impossible-8`: that K in the 8-layer form (`pair`, `quad`; no longer a documented claim form);
`impossible-list`: that K in the list form of deploy/examples/11 (`linked_gpus_list`), with the
fail-fast selector where `dra-driver claim` adds it (a node's largest group of
`claim_fit.SEARCH_BOUND_GROUP` or more).
The NVLink shapes carry the fail-fast selector (claim_shapes.fits_selector). `*-before` shapes
are the claims and slices of d20fbb0, for a before/after in one run: no fail-fast selector, and
`before` slices (legacy nvlinkGroup<N> and numaNode and the topology-detail nvlinkPeers,
nvlinkPeerCount, nvlinkIsland published, no nvlinkCliqueSize);
`one-gpu-before` against `one-gpu` is what the attributes no claim needs cost.
`--topology-detail-attributes`: all our slices as the plugin publishes them with that flag
(nvlinkPeers, nvlinkPeerCount, nvlinkIsland: the default before they became opt-in), for a
before/after of those three on one machine state.
For the linked shapes the pod count is capped at the most disjoint k-cliques each node holds
(brute force over its links, benchmarks/packing.py), not at what the scheduler's first finds
leave room for: a set the first finds strand shows as a pod left pending. `model_bound` is what
the allocator model (tests/harness/first_found.py, the first find in slice order) says will
bind: per node, the shape's claim filled one pod at a time on the node's published slices; the
real scheduler's `bound` checks the model.
Profiles: hgx-h200, dgx1-v100, mixed (the two alternating), and `random-<seed>`: every node an
8-GPU NVLink graph drawn from the seed (tests/harness/topologies.py: a density from the seed,
then each pair linked with it), not hand-picked.

`--pprof-seconds S` takes a CPU profile of kube-scheduler over S seconds of each shape, from
the moment all its pods exist and a quarter of them are bound (its /debug/pprof/profile: the
steady state, after the burst of claim-add events that pod creation causes) and keeps
`go tool pprof -top`'s first entries; `--pprof-dir D` keeps the profiles for `go tool pprof`.

The machine this runs on has 2 cores, at times shared with other engineers' test runs: read
each shape's `load_average_1m` beside its figures. Run alone:
`python -m benchmarks.scheduler [--full]`; results go to benchmarks/results/scheduler.json (or
`--out NAME`). `--scheduler-feature-gate NAME=true` adds
a gate to kube-scheduler's (reported in the results). Each shape records the machine's 1-minute
load average at its start and end. This module must NOT assert timings nor change the control
plane's flags beyond those two.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import http.client
import itertools
import json
import os
import re
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import cpu_clock, fresh_control_plane, report
from benchmarks.packing import cliques, max_disjoint, raw_links
from controller.attributes import NVLINK_CLIQUE_SIZE
from controller.claim_fit import SEARCH_BOUND_GROUP, fit_linked_claim
from controller.claim_shapes import fleet_layers, linked_class, linked_gpus_ga, linked_gpus_list
from controller.plan import MANAGED_BY_LABEL, SLICES, PoolSpec, desired_objects
from controller.slices import SliceFeatures, desired_slices, published_topology
from dra_driver import DEFAULT_DRIVER_NAME, kube
from dra_driver.devices import node_devices
from dra_driver.gpu import discover
from dra_driver.gpu.model import Inventory
from dra_driver.jsontypes import JSON
from tests.harness.cluster import ADMIN_TOKEN, ControlPlane
from tests.harness.first_found import FastModel, class_devices
from tests.harness.objects import (
    RESOURCE_API,
    create_namespace,
    create_object,
    load_yaml_documents,
    sync_client,
    sync_request,
    wait_for,
)
from tests.harness.topologies import random_profile

REPO = Path(__file__).resolve().parents[1]
DRIVER = DEFAULT_DRIVER_NAME
GPU_CLASS = DRIVER
SHARE_CLASS = f"gpu-share.{DRIVER}"
REFERENCE_CLASS = f"reference.{DRIVER}"
RAISED_QPS = 5000
IN_FLIGHT = 64
POLL_S = 1.0
PROFILES: dict[str, tuple[str, ...]] = {
    "hgx-h200": ("hgx-h200",),
    "dgx1-v100": ("dgx1-v100",),
    "mixed": ("hgx-h200", "dgx1-v100"),
}
SHARE_REQUEST = 8 * 2**30
SLICE_KINDS = ("reference", "ours", "before", "shares", "shares-only")
# `--topology-detail-attributes`: our slices as the kubelet plugin publishes them with that flag
# (nvlinkPeers, nvlinkPeerCount, nvlinkIsland too): the default before they became opt-in.
TOPOLOGY_DETAIL = False
RANDOM_PREFIX = "random-"
IMPOSSIBLE_PODS = 100
CEL_MEMORY = 'device.capacity["gpu.dra-driver.dev"].memory.compareTo(quantity("24Gi")) >= 0'
COMPONENTS = ("kube-scheduler", "kube-apiserver", "kube-controller-manager", "etcd")


@dataclass(frozen=True)
class Shape:
    """One claim shape: which slices it needs, how many GPUs (or shares) a pod takes, its claim."""

    name: str
    slices: str  # "reference" | "ours" | "shares" | "shares-only"
    gpus: int  # whole GPUs per pod; 0 for a memory share
    claim: JSON
    # the GA linked shape with only the layers the fleet can use (claim_shapes.fleet_layers),
    # built per fleet in run_profile
    fit: bool = False
    # built per fleet in run_profile: "generated" (controller.claim_fit, gpus = K), "impossible"
    # (K = the fleet's largest clique + 1; as generated, or as `claim` says for -before shapes)
    build: str = ""
    fail_fast: bool = True  # the NVLink claims' fits_selector (False: as d20fbb0)
    # generated / 8-layer claims: the selector-free gpu-linked class (the constraint picks the
    # GPUs; no CEL at all); False: the whole-GPU class, the fail-fast selector in the claim
    linked_class: bool = False


def _one(device_class: str, selectors: Sequence[str] = ()) -> JSON:
    exactly: JSON = {"deviceClassName": device_class}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"requests": [{"name": "gpu", "exactly": exactly}]}


_SHARE: JSON = {"requests": [{"name": "mem", "exactly": {
    "deviceClassName": SHARE_CLASS, "capacity": {"requests": {"memory": "8Gi"}}}}]}

_NOTHING = f'device.attributes["{DRIVER}"].index > 1000'  # no device passes
_OLD = {"fail_fast": False}

SHAPES: tuple[Shape, ...] = (
    Shape("reference", "reference", 1, _one(REFERENCE_CLASS)),
    Shape("reference-impossible", "reference", 1, _one(REFERENCE_CLASS, [_NOTHING]), build="never"),
    # the same unschedulable claim on our slices: the difference is what their attributes cost
    Shape("ours-impossible", "ours", 1, _one(REFERENCE_CLASS, [_NOTHING]), build="never"),
    Shape("one-gpu", "ours", 1, _one(GPU_CLASS)),
    Shape("cel-memory", "ours", 1, _one(GPU_CLASS, [CEL_MEMORY])),
    Shape("linked2", "ours", 2, {}, build="generated", linked_class=True),
    Shape("linked3", "ours", 3, {}, build="generated", linked_class=True),
    Shape("linked4", "ours", 4, {}, build="generated", linked_class=True),
    Shape("impossible", "ours", 0, {}, build="impossible", linked_class=True),
    Shape("impossible-8", "ours", 0, {}, build="impossible-8", linked_class=True),  # the 8-layer form
    Shape("impossible-list", "ours", 0, {}, build="impossible-list", linked_class=True),
    Shape("pair-linked", "ours", 2, {}, build="eight", linked_class=True),
    Shape("quad-linked", "ours", 4, {}, build="eight", linked_class=True),
    # the generated claims on the whole-GPU class + the fail-fast selector (as before the linked class)
    Shape("linked2-sel", "ours", 2, {}, build="generated"),
    Shape("linked3-sel", "ours", 3, {}, build="generated"),
    Shape("linked4-sel", "ours", 4, {}, build="generated"),
    Shape("impossible-sel", "ours", 0, {}, build="impossible"),
    Shape("impossible-8-sel", "ours", 0, {}, build="impossible-8"),
    Shape("pair", "ours", 2, linked_gpus_ga(2, device_class=GPU_CLASS)),
    Shape("quad", "ours", 4, linked_gpus_ga(4, device_class=GPU_CLASS)),
    Shape("pair-fit", "ours", 2, {}, fit=True),
    Shape("quad-fit", "ours", 4, {}, fit=True),
    # the fitted layers on the selector-free class, where the generator may take the list form
    Shape("pair-fit-linked", "ours", 2, {}, fit=True, linked_class=True, fail_fast=False),
    Shape("triple-fit-linked", "ours", 3, {}, fit=True, linked_class=True, fail_fast=False),
    Shape("quad-fit-linked", "ours", 4, {}, fit=True, linked_class=True, fail_fast=False),
    Shape("share", "shares", 0, _SHARE),
    Shape("share-only", "shares-only", 0, _SHARE),
    # d20fbb0's slices and claims
    Shape("one-gpu-before", "before", 1, _one(GPU_CLASS)),
    Shape("pair-before", "before", 2, linked_gpus_ga(2, device_class=GPU_CLASS, fail_fast=False),
          fail_fast=False),
    Shape("quad-before", "before", 4, linked_gpus_ga(4, device_class=GPU_CLASS, fail_fast=False),
          fail_fast=False),
    Shape("pair-fit-before", "before", 2, {}, fit=True, fail_fast=False),
    Shape("quad-fit-before", "before", 4, {}, fit=True, fail_fast=False),
    Shape("triple-fit-before", "before", 3, {}, fit=True, fail_fast=False),
    Shape("impossible-before", "before", 0, {}, build="impossible", fail_fast=False),
    Shape("impossible-fit-before", "before", 0, {}, build="impossible", fit=True, fail_fast=False),
)


# -- slices ----------------------------------------------------------------------------------


def reference_specs(inventory: Inventory, node: str) -> tuple[JSON, ...]:
    """The upstream benchmark's device shape: index, uuid, productName, capacity memory."""
    devices = [
        {
            "name": d.name,
            "attributes": {
                "index": {"int": d.gpu.index},
                "uuid": {"string": d.gpu.uuid},
                "productName": {"string": d.gpu.product_name[:64]},
            },
            "capacity": {"memory": {"value": str(d.gpu.memory_bytes)}},
        }
        for d in sorted(node_devices(inventory).values(), key=lambda d: d.gpu.index)
        if d.mig is None
    ]
    return ({"driver": DRIVER, "nodeName": node, "pool": {"name": node}, "devices": devices},)


def node_specs(kind: str, inventory: Inventory, node: str) -> tuple[JSON, ...]:
    if kind == "reference":
        return reference_specs(inventory, node)
    features = SliceFeatures(list_attributes=True, memory_shares=kind.startswith("shares"),
                             shares_only=kind == "shares-only", legacy_attributes=kind == "before",
                             topology_detail_attributes=kind == "before" or TOPOLOGY_DETAIL)
    specs = desired_slices(inventory, node, DRIVER, features)
    return tuple(_without_clique_size(s) for s in specs) if kind == "before" else specs


def _without_clique_size(spec: JSON) -> JSON:
    """d20fbb0's slices had no nvlinkCliqueSize."""
    devices = [{**d, "attributes": {k: v for k, v in d["attributes"].items() if k != NVLINK_CLIQUE_SIZE}}
               if "attributes" in d else d for d in spec.get("devices", [])]
    return {**spec, "devices": devices} if devices else spec


def node_objects(kind: str, inventory: Inventory, node: str) -> list[JSON]:
    pool = PoolSpec(node, node, node_specs(kind, inventory, node))
    return list(desired_objects(DRIVER, pool, 1, None).values())


def entries_per_gpu(kind: str, inventory: Inventory) -> int:
    """Attributes + capacities of the node's first whole GPU (what CEL builds its map from)."""
    for spec in node_specs(kind, inventory, "node-0000"):
        for d in spec.get("devices", []):
            return len(d.get("attributes", {})) + len(d.get("capacity", {}))
    return 0


def slice_bytes(kind: str, inventory: Inventory) -> int:
    """Bytes of one node's ResourceSlice objects as JSON (what the benchmark sends)."""
    return sum(len(json.dumps(o, separators=(",", ":"))) for o in node_objects(kind, inventory, "node-0000"))


# -- async creation --------------------------------------------------------------------------


async def _create_all(kubeconfig: Path, posts: Sequence[tuple[str, JSON]]) -> None:
    api = await kube.load_client(str(kubeconfig))
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(path: str, body: JSON) -> None:
        async with gate:
            await kube.request(api, "POST", path, body=body, timeout=300)

    try:
        await asyncio.gather(*(one(p, b) for p, b in posts))
    finally:
        await api.close()


def create_all(cp: ControlPlane, posts: Sequence[tuple[str, JSON]]) -> None:
    asyncio.run(_create_all(cp.kubeconfig, posts))


def _node_body(name: str) -> JSON:
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "simulated node without a kubelet",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}],
        },
    }


def create_nodes(cp: ControlPlane, names: Sequence[str]) -> None:
    """Nodes as tests.harness.objects.create_node makes them, many at once: created, then the
    not-ready taint lifted and Ready set (status is a subresource; there is no kubelet)."""
    create_all(cp, [("/api/v1/nodes", _node_body(n)) for n in names])

    async def finish() -> None:
        api = await kube.load_client(str(cp.kubeconfig))
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one(name: str) -> None:
            async with gate:
                await kube.request(api, "PATCH", f"/api/v1/nodes/{name}", body={"spec": {"taints": []}},
                                   content_type="application/merge-patch+json")
                await kube.request(api, "PATCH", f"/api/v1/nodes/{name}/status",
                                   body={"status": _node_body(name)["status"]},
                                   content_type="application/merge-patch+json")

        try:
            await asyncio.gather(*(one(n) for n in names))
        finally:
            await api.close()

    asyncio.run(finish())


def publish(cp: ControlPlane, api: Any, kind: str, fleet: dict[str, Inventory]) -> float:
    """Replace every slice with `kind`'s; returns the seconds it took."""
    t0 = time.perf_counter()
    sync_request(api, "DELETE", SLICES, query={"labelSelector": f"{MANAGED_BY_LABEL}={DRIVER}"})
    wait_for("old slices gone", lambda: not sync_request(api, "GET", SLICES, query={"limit": "1"})["items"],
             timeout=300, interval=0.5)
    create_all(cp, [(SLICES, o) for node, inv in fleet.items() for o in node_objects(kind, inv, node)])
    return time.perf_counter() - t0


# -- measurements ----------------------------------------------------------------------------


def secure_port(cp: ControlPlane, component: str) -> int:
    flag = next(a for a in cp.argv[component] if a.startswith("--secure-port="))
    return int(flag.split("=", 1)[1])


def _tls() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


class ComponentClient:
    """GETs on one component's secure port as admin over one kept connection: a poll every
    0.25 s with a TLS handshake each would cost the scheduler more than the poll itself."""

    def __init__(self, cp: ControlPlane, component: str, timeout: float = 30) -> None:
        self.port, self.timeout = secure_port(cp, component), timeout
        self.conn: http.client.HTTPSConnection | None = None

    def get(self, path: str) -> str:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=self.timeout,
                                                        context=_tls())
            try:
                self.conn.request("GET", path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
                resp = self.conn.getresponse()
                body = resp.read().decode(errors="replace")
                if resp.status != 200:
                    raise OSError(f"GET {path} on port {self.port}: HTTP {resp.status}: {body[:200]}")
                return body
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def component_get(cp: ControlPlane, component: str, path: str, timeout: float = 30) -> str:
    client = ComponentClient(cp, component, timeout)
    try:
        return client.get(path)
    finally:
        client.close()


Samples = dict[tuple[str, str], float]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


def parse_metrics(text: str, names: Sequence[str]) -> Samples:
    """(metric name, label string) -> value, for the metrics named (prefix match)."""
    out: Samples = {}
    for line in text.splitlines():
        if not line.startswith(tuple(names)):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


SCHED_METRICS = ("scheduler_schedule_attempts_total", "scheduler_pod_scheduling_sli_duration_seconds")


def scheduler_metrics(client: ComponentClient) -> Samples:
    return parse_metrics(client.get("/metrics"), SCHED_METRICS)


def scheduled(metrics: Samples) -> float:
    return sum(v for (n, labels), v in metrics.items()
               if n == "scheduler_schedule_attempts_total" and 'result="scheduled"' in labels)


def _delta(after: Samples, before: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def sli_summary(delta: Samples) -> JSON:
    """Count, mean and bucket-bound quantiles of the SLI histogram's growth during a shape."""
    base = "scheduler_pod_scheduling_sli_duration_seconds"
    count = sum(v for (n, _), v in delta.items() if n == base + "_count")
    total = sum(v for (n, _), v in delta.items() if n == base + "_sum")
    buckets: dict[float, float] = {}
    for (n, labels), v in delta.items():
        if n == base + "_bucket":
            le = re.search(r'le="([^"]+)"', labels)
            if le:
                bound = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
                buckets[bound] = buckets.get(bound, 0.0) + v

    def quantile(q: float) -> float | None:
        for bound in sorted(buckets):
            if count and buckets[bound] >= q * count:
                return bound
        return None

    return {"count": int(count), "mean_s": round(total / count, 4) if count else None,
            "p50_le_s": quantile(0.5), "p99_le_s": quantile(0.99)}


def attempts(delta: Samples) -> dict[str, int]:
    out: dict[str, int] = {}
    for (n, labels), v in delta.items():
        if n == "scheduler_schedule_attempts_total":
            result = re.search(r'result="([^"]+)"', labels)
            key = result.group(1) if result else "?"
            out[key] = out.get(key, 0) + int(v)
    return out


_RUNS = itertools.count()


def cpu_seconds(pid: int) -> float:
    """The process's CPU time (benchmarks.cpu_clock: to the nanosecond, not in ticks)."""
    return cpu_clock.process_cpu_ns(pid) / 1e9


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def cpu_all(cp: ControlPlane) -> dict[str, float]:
    return {c: cpu_seconds(cp.processes[c].pid) for c in COMPONENTS}


class Profiler(threading.Thread):
    """kube-scheduler's CPU profile over `seconds`, then `go tool pprof -top`'s first entries,
    by own time and by cumulative time."""

    def __init__(self, cp: ControlPlane, seconds: int, out: Path) -> None:
        super().__init__(daemon=True)
        self.cp, self.seconds, self.out = cp, seconds, out
        self.top: list[str] = []

    def run(self) -> None:
        try:
            client = ComponentClient(self.cp, "kube-scheduler", timeout=self.seconds + 60)
            client.conn = http.client.HTTPSConnection("127.0.0.1", client.port, timeout=client.timeout,
                                                      context=_tls())
            client.conn.request("GET", f"/debug/pprof/profile?seconds={self.seconds}",
                                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            self.out.write_bytes(client.conn.getresponse().read())
            client.close()
            for order in ("-flat", "-cum"):
                proc = subprocess.run(["go", "tool", "pprof", "-top", order, "-nodecount=20", str(self.out)],
                                      capture_output=True, text=True, check=False, timeout=120)
                lines = [line.rstrip() for line in proc.stdout.splitlines() if line.strip()]
                self.top += lines[4:] if self.top else lines[3:]
        except Exception as e:  # a profile is extra: its failure is reported, not fatal
            self.top = [f"profile failed: {e}"]


def _claim_template(shape: Shape) -> JSON:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": shape.name}, "spec": {"spec": {"devices": shape.claim}}}


def _pod(shape: Shape, i: int) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{shape.name}-{i:05d}"},
        "spec": {
            "automountServiceAccountToken": False,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": shape.name}],
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                            "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }


def capacity(shape: Shape, fleet: dict[str, Inventory]) -> int:
    """How many pods of `shape` the fleet holds (whole GPUs per node // GPUs per pod, or shares;
    for linked GPUs the most disjoint k-cliques of each node)."""
    if shape.build.startswith("impossible") or shape.build == "never":
        return IMPOSSIBLE_PODS
    total = 0
    for inv in fleet.values():
        if shape.gpus >= 2 and shape.slices != "reference":
            total += most_linked_sets(inv, shape.gpus)
        elif shape.gpus:
            total += len(inv.gpus) // shape.gpus
        else:
            total += sum(g.memory_bytes // SHARE_REQUEST for g in inv.gpus)
    return total


def pods_for(shape: Shape, fleet: dict[str, Inventory], pods: int, fill: float | None = None) -> int:
    """How many pods the shape runs: `pods`, capped at what the fleet holds, and with `fill` at
    that fraction of it (claims that can never fit: not capped by fill)."""
    held = capacity(shape, fleet)
    if fill and not (shape.build.startswith("impossible") or shape.build == "never"):
        held = max(1, round(fill * held))
    return min(pods, held)


@functools.cache
def most_linked_sets(inventory: Inventory, k: int) -> int:
    """The most disjoint sets of k mutually linked GPUs the node holds (brute force)."""
    n = len(inventory.gpus)
    return max_disjoint(cliques(n, raw_links(inventory), k), (1 << n) - 1)


def model_bound(shape: Shape, fleet: dict[str, Inventory], pods: int) -> int | None:
    """How many of `pods` pods of a linked shape the allocator model binds on an empty fleet: per
    node, the shape's claim found one pod at a time on the node's published slices."""
    if shape.gpus < 2 or shape.slices != "ours" or shape.build.startswith("impossible"):
        return None
    return min(pods, sum(_node_fill(inv, json.dumps(shape.claim, sort_keys=True)) for inv in fleet.values()))


@functools.cache
def _node_fill(inventory: Inventory, claim: str) -> int:
    devices = class_devices(list(node_specs("ours", inventory, "n0")))
    model = FastModel.build(devices, json.loads(claim), list_semantics=True)
    busy: frozenset[int] = frozenset()
    bound = 0
    while (got := model.allocate(busy)) is not None:
        busy |= frozenset(got[1])
        bound += 1
    return bound


def largest_clique(fleet: dict[str, Inventory]) -> int:
    return max((len(c) for inv in set(fleet.values()) for c in published_topology(inv).cliques), default=1)


def run_shape(cp: ControlPlane, api: Any, shape: Shape, fleet: dict[str, Inventory], pods: int,
              stall_s: float, pprof_s: int, work: Path, fill: float | None = None) -> JSON:
    ns = f"s{next(_RUNS)}-{shape.name}"  # a namespace of its own: the last one may still be terminating
    create_namespace(api, ns)
    create_object(api, _claim_template(shape), ns)
    count = pods_for(shape, fleet, pods, fill)
    bodies = [(f"/api/v1/namespaces/{ns}/pods", _pod(shape, i)) for i in range(count)]
    metrics = ComponentClient(cp, "kube-scheduler")
    before, cpu0 = scheduler_metrics(metrics), cpu_all(cp)
    base = scheduled(before)
    profiler = Profiler(cp, pprof_s, work / f"{len(fleet)}-{shape.name}.pprof") if pprof_s else None
    creator = threading.Thread(target=create_all, args=(cp, bodies), daemon=True)
    load_at_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    creator.start()
    created_at: float | None = None
    last_bound, last_change, bound = t0, t0, 0
    while bound < count:
        time.sleep(POLL_S)  # the poll interval
        now = time.perf_counter()
        if created_at is None and not creator.is_alive():
            created_at = now
        seen = int(scheduled(scheduler_metrics(metrics)) - base)
        if seen > bound:
            bound, last_bound, last_change = seen, now, now
        elif now - last_change > stall_s and not creator.is_alive():
            break
        # (a claim that can never fit binds nothing: its profile starts 3 s after the last pod exists)
        if profiler and profiler.ident is None and created_at and (
                count // 4 <= bound < count or (not bound and now - created_at > 3)):
            # steady state: every pod and claim exists, the queue's burst of claim-add events
            # is over, and the scheduler alone has work
            profiler.start()
    creator.join()
    created_at = created_at or time.perf_counter()
    after, cpu1 = scheduler_metrics(metrics), cpu_all(cp)
    metrics.close()
    if profiler and profiler.is_alive():
        profiler.join()
    delta = _delta(after, before)
    elapsed = last_bound - t0
    pending = "" if bound >= count else _why_pending(api, ns)
    sched_cpu = cpu1["kube-scheduler"] - cpu0["kube-scheduler"]
    tries = attempts(delta)
    result: JSON = {
        "shape": shape.name,
        "k": shape.gpus,
        "subrequests": len(shape.claim["requests"][0].get("firstAvailable", ())),
        "pods": count,
        "bound": bound,
        "seconds": round(elapsed, 2),
        "pods_per_s": round(bound / elapsed, 1) if elapsed > 0 else None,
        "create_s": round(created_at - t0, 2),
        "sli": sli_summary(delta),
        "attempts": tries,
        "cpu_s": {c: round(cpu1[c] - cpu0[c], 1) for c in COMPONENTS},
        "scheduler_cpu_ms_per_bound_pod": round(1000 * sched_cpu / bound, 1) if bound else None,
        "model_bound": model_bound(shape, fleet, count),
        "scheduler_cpu_ms_per_unschedulable_attempt": round(1000 * sched_cpu / tries["unschedulable"], 1)
        if not bound and tries.get("unschedulable") else None,
        # below 1.0 the scheduler was waiting (on the API server, or for a core: 2 are shared here)
        "scheduler_cores_used": round((cpu1["kube-scheduler"] - cpu0["kube-scheduler"]) / elapsed, 2)
        if elapsed > 0 else None,
        "rss_mib": {c: rss_mib(cp.processes[c].pid) for c in COMPONENTS},
        "load_average_1m": [round(load_at_start, 1), round(os.getloadavg()[0], 1)],
    }
    if pending:
        result["pending_reason"] = pending
    if profiler:
        result["scheduler_pprof_top"] = profiler.top
    _clean(cp, api, ns, count, shape)
    return result


def _why_pending(api: Any, ns: str) -> str:
    pods = sync_request(api, "GET", f"/api/v1/namespaces/{ns}/pods",
                        query={"fieldSelector": "spec.nodeName="})
    for pod in pods["items"][:1]:
        for cond in pod.get("status", {}).get("conditions", []):
            if cond.get("type") == "PodScheduled":
                return str(cond.get("message", ""))[:300]
    return ""


def _clean(cp: ControlPlane, api: Any, ns: str, count: int, shape: Shape) -> None:
    """Delete the shape's pods at once (grace 0: no kubelet will confirm a graceful stop; one
    request per pod, 64 in flight: the API server's delete-collection works one pod at a time)
    and wait until the controller-manager has deleted their claims, so that the next shape
    finds every GPU free."""

    async def delete_all() -> None:
        client = await kube.load_client(str(cp.kubeconfig))
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one(name: str) -> None:
            async with gate:
                try:
                    await kube.request(client, "DELETE", f"/api/v1/namespaces/{ns}/pods/{name}",
                                       body={"gracePeriodSeconds": 0}, timeout=300)
                except kube.ApiException as e:
                    if e.status != 404:
                        raise

        try:
            await asyncio.gather(*(one(_pod(shape, i)["metadata"]["name"]) for i in range(count)))
        finally:
            await client.close()

    asyncio.run(delete_all())
    wait_for(f"claims of {ns} deleted",
             lambda: not sync_request(api, "GET", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims",
                                      query={"limit": "1"})["items"],
             timeout=600, interval=1.0)
    sync_request(api, "DELETE", f"/api/v1/namespaces/{ns}")


def raise_limits(cp: ControlPlane, scheduler_gates: Sequence[str] = ()) -> None:
    """Restart kube-scheduler and kube-controller-manager with client limits raised (scheduler_perf
    runs its scheduler without a client rate limit; 50/100 and 20/30 are the defaults), and the
    scheduler with `scheduler_gates` (NAME=true) added to its feature gates."""
    for name in ("kube-controller-manager", "kube-scheduler"):
        cp.stop_component(name)
        cp.argv[name] += [f"--kube-api-qps={RAISED_QPS}", f"--kube-api-burst={RAISED_QPS}"]
        if name == "kube-scheduler" and scheduler_gates:
            # a second --feature-gates adds to the first (component-base's MapStringBool)
            cp.argv[name].append(f"--feature-gates={','.join(scheduler_gates)}")
        cp.start_component(name)
        wait_for(f"{name} healthy", lambda n=name: _healthy(cp, n), timeout=120, interval=0.5)  # type: ignore[misc]


def _healthy(cp: ControlPlane, name: str) -> bool:
    try:
        return component_get(cp, name, "/healthz", timeout=5).strip() == "ok"
    except (OSError, http.client.HTTPException):
        return False


def device_classes(api: Any) -> None:
    for path in ("deploy/deviceclasses/gpu.yaml", "deploy/deviceclasses/gpu-share.yaml",
                 "deploy/deviceclasses/gpu-linked.yaml"):
        for doc in load_yaml_documents(REPO / path):
            create_object(api, doc)
    create_object(api, {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                        "metadata": {"name": REFERENCE_CLASS},
                        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}})


def for_fleet(shape: Shape, fleet: dict[str, Inventory]) -> Shape:
    """`shape` with its claim built for the fleet (fitted layers, generated, impossible), else as it is."""
    k = largest_clique(fleet) + 1 if shape.build.startswith("impossible") else shape.gpus
    eight_layers = shape.build == "impossible" and not shape.fail_fast and not shape.fit
    cls = linked_class(DRIVER) if shape.linked_class else GPU_CLASS
    if shape.build in ("impossible-8", "eight") or eight_layers:
        fail_fast = shape.fail_fast and cls == GPU_CLASS
        claim = linked_gpus_ga(k, device_class=cls, fail_fast=fail_fast)
        return dataclasses.replace(shape, gpus=k, claim=claim)
    if shape.build == "impossible-list":
        # as claim_fit decides it: the selector where the search of a node's largest group is dear
        dear = largest_clique(fleet) >= SEARCH_BOUND_GROUP
        claim = linked_gpus_list(k, device_class=None if shape.linked_class else GPU_CLASS, fail_fast=dear)
        return dataclasses.replace(shape, gpus=k, claim=claim)
    if shape.fit:
        topologies = [published_topology(inv) for inv in set(fleet.values())]
        claim = linked_gpus_ga(k, device_class=None if shape.linked_class else GPU_CLASS,
                               layers=fleet_layers(k, topologies), fail_fast=shape.fail_fast)
        return dataclasses.replace(shape, gpus=k, claim=claim)
    if shape.build in ("generated", "impossible"):
        slices = [{"spec": s} for i, inv in enumerate(set(fleet.values()))
                  for s in node_specs("ours", inv, f"n{i}")]
        chosen = None if shape.linked_class else GPU_CLASS
        return dataclasses.replace(shape, gpus=k, claim=fit_linked_claim(k, slices, DRIVER, chosen).devices)
    return shape


@functools.cache
def profile_inventories(profile: str) -> tuple[Inventory, ...]:
    """A shipped profile's inventories, or `random-<seed>`'s one (tests/harness/topologies.py)."""
    if profile.startswith(RANDOM_PREFIX):
        where = Path(tempfile.gettempdir()) / "dra-bench-topologies"
        where.mkdir(exist_ok=True)
        return (discover(str(random_profile(int(profile.removeprefix(RANDOM_PREFIX)), where))),)
    return tuple(discover(p) for p in PROFILES[profile])


def fleet_of(profile: str, nodes: int) -> dict[str, Inventory]:
    inventories = profile_inventories(profile)
    return {f"{profile}-{i:04d}": inventories[i % len(inventories)] for i in range(nodes)}


def run_profile(profile: str, nodes: int, pods: int, shapes: Sequence[Shape], *, raised: bool,
                stall_s: float, pprof_s: int, log: Callable[[str], None],
                pprof_dir: Path | None = None, scheduler_gates: Sequence[str] = (),
                fill: float | None = None) -> JSON:
    fleet = fleet_of(profile, nodes)
    shapes = [for_fleet(s, fleet) for s in shapes]
    for s in [s for s in shapes if not capacity(s, fleet)]:
        log(f"{profile}: no node has {s.gpus} linked GPUs; {s.name} left out (see `impossible`)")
    shapes = [s for s in shapes if capacity(s, fleet)]
    with fresh_control_plane("dra-bench-sched-") as (cp, work):
        if raised:
            raise_limits(cp, scheduler_gates)
        api = sync_client(str(cp.kubeconfig))
        device_classes(api)
        t0 = time.perf_counter()
        create_nodes(cp, list(fleet))
        log(f"{profile}: {nodes} nodes in {time.perf_counter() - t0:.1f}s")
        results: list[JSON] = []
        published: dict[str, float] = {}
        # The reference shape runs first and again last: on a shared machine the spread between
        # its two runs is the noise to read the other shapes' ratios against. An unmeasured
        # warm-up (a tenth of the pods) goes before it, as scheduler_perf's init pods do.
        order = [s for s in shapes if s.slices == "reference"]
        order += [s for s in shapes if s.slices != "reference"]
        if order and order[0].slices == "reference" and len(order) > 1:
            order.append(order[0])
        warm = bool(order)
        kind_now = ""
        keep = pprof_dir / profile if pprof_dir else work
        keep.mkdir(parents=True, exist_ok=True)
        for shape in order:
            if shape.slices != kind_now:
                kind_now = shape.slices
                published[kind_now] = round(publish(cp, api, kind_now, fleet), 1)
                log(f"{profile}: {kind_now} slices in {published[kind_now]}s")
            if warm:
                run_shape(cp, api, shape, fleet, max(pods // 10, 20), stall_s, 0, work, fill)
                warm = False
            r = run_shape(cp, api, shape, fleet, pods, stall_s, pprof_s, keep, fill)
            if any(x["shape"] == shape.name for x in results):
                r["shape"] = f"{shape.name}-again"
            log(f"{profile} {nodes} nodes {r['shape']}: {r['bound']}/{r['pods']} pods, "
                f"{r['pods_per_s']} pods/s (created in {r['create_s']}s)")
            results.append(r)
            log("so far: " + json.dumps(r, separators=(",", ":")))  # a long run interrupted keeps these
        plain = [r for r in results if r["shape"] in ("reference", "reference-again")]
        refs = [r["pods_per_s"] for r in plain if r["pods_per_s"]]
        ref = sum(refs) / len(refs) if refs else None
        ref_cpus = [r["scheduler_cpu_ms_per_bound_pod"] for r in plain if r["scheduler_cpu_ms_per_bound_pod"]]
        ref_cpu = sum(ref_cpus) / len(ref_cpus) if ref_cpus else None
        ref_attempt = next((r["scheduler_cpu_ms_per_unschedulable_attempt"] for r in results
                            if r["shape"] == "reference-impossible"), None)
        for r in results:
            if ref and r["pods_per_s"]:
                r["vs_reference"] = round(r["pods_per_s"] / ref, 2)
            if ref_cpu and r["scheduler_cpu_ms_per_bound_pod"]:
                r["cpu_vs_reference"] = round(r["scheduler_cpu_ms_per_bound_pod"] / ref_cpu, 2)
            per_attempt = r["scheduler_cpu_ms_per_unschedulable_attempt"]
            if per_attempt and ref_attempt:
                r["cpu_per_attempt_vs_reference"] = round(per_attempt / ref_attempt, 2)
            if per_attempt and ref_cpu:
                r["cpu_per_attempt_vs_reference_bound_pod"] = round(per_attempt / ref_cpu, 2)
        inventories = {p: discover(p) for p in PROFILES[profile]} if profile in PROFILES else {
            profile: profile_inventories(profile)[0]}
        return {
            "profile": profile,
            "nodes": nodes,
            "client_limits": "raised" if raised else "default",
            "fill": fill,
            "scheduler_feature_gates_added": list(scheduler_gates),
            "topology_detail_attributes": TOPOLOGY_DETAIL,
            "reference_pods_per_s_mean": round(ref, 1) if ref else None,
            "reference_scheduler_cpu_ms_per_bound_pod_mean": round(ref_cpu, 1) if ref_cpu else None,
            "largest_clique": largest_clique(fleet),
            "claims": {s.name: s.claim for s in shapes if s.slices != "reference"},
            "entries_per_gpu": {p: {k: entries_per_gpu(k, inv) for k in SLICE_KINDS}
                                for p, inv in inventories.items()},
            "slices_publish_s": published,
            "slice_bytes_per_node": {p: {k: slice_bytes(k, inv) for k in SLICE_KINDS}
                                     for p, inv in inventories.items()},
            "shapes": results,
        }


SMALL = {"sizes": [(20, 100)], "profiles": list(PROFILES), "default_limits": (20, 100)}
FULL = {"sizes": [(100, 5000), (500, 5000), (1000, 5000)], "profiles": list(PROFILES),
        "default_limits": (100, 300)}


def run(full: bool = False, sizes: Sequence[tuple[int, int]] | None = None,
        profiles: Sequence[str] | None = None, shapes: Sequence[str] | None = None,
        defaults: bool = True, stall_s: float = 30.0, pprof_s: int = 0,
        pprof_dir: Path | None = None, scheduler_gates: Sequence[str] = (),
        fill: float | None = None) -> JSON:
    plan = FULL if full else SMALL
    chosen = [s for s in SHAPES if not shapes or s.name in shapes]
    cases: list[JSON] = []

    def log(msg: str) -> None:
        print(f"[scheduler-bench] {msg}", flush=True)

    for nodes, pods in sizes or plan["sizes"]:  # type: ignore[attr-defined]
        for profile in profiles or plan["profiles"]:  # type: ignore[attr-defined]
            cases.append(run_profile(profile, nodes, pods, chosen, raised=True, stall_s=stall_s,
                                     pprof_s=pprof_s, log=log, pprof_dir=pprof_dir,
                                     scheduler_gates=scheduler_gates, fill=fill))
    if defaults:
        nodes, pods = plan["default_limits"]  # type: ignore[misc]
        two = [s for s in chosen if s.name in ("reference", "one-gpu")]
        cases.append(run_profile("hgx-h200", nodes, pods, two, raised=False, stall_s=stall_s, pprof_s=0,
                                 log=log))
    return {"driver": DRIVER, "contention": "2 cores, at times shared: see each shape's load_average_1m",
            "method": "benchmarks/scheduler.py docstring", "cases": cases}


def _profile(text: str) -> str:
    if text in PROFILES or (text.startswith(RANDOM_PREFIX) and text.removeprefix(RANDOM_PREFIX).isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"--profile {text!r}: one of {', '.join(sorted(PROFILES))} or "
                                     f"{RANDOM_PREFIX}<seed>")


def _size(text: str) -> tuple[int, int]:
    nodes, _, pods = text.partition(":")
    try:
        return int(nodes), int(pods or 5000)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size {text!r}: write NODES:PODS, e.g. 500:5000") from None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduler",
                                     description="Pods/s through the real kube-scheduler, per claim shape.")
    parser.add_argument("--full", action="store_true", help="100, 500 and 1,000 nodes, 5,000 pods")
    parser.add_argument("--size", action="append", type=_size, metavar="NODES:PODS")
    parser.add_argument("--profile", action="append", type=_profile,
                        help=f"one of {', '.join(sorted(PROFILES))}, or {RANDOM_PREFIX}<seed>")
    parser.add_argument("--shape", action="append", choices=[s.name for s in SHAPES])
    parser.add_argument("--no-defaults", action="store_true", help="skip the default-rate-limit case")
    parser.add_argument("--stall", type=float, default=30.0,
                        help="end a shape after this long without a binding")
    parser.add_argument("--pprof-seconds", type=int, default=0)
    parser.add_argument("--pprof-dir", type=Path, help="keep the profiles here (for go tool pprof -peek)")
    parser.add_argument("--scheduler-feature-gate", action="append", default=[], metavar="NAME=true",
                        help="add to kube-scheduler's feature gates (e.g. SchedulerPreQueueingHints=true)")
    parser.add_argument("--fill", type=float, metavar="F",
                        help="every shape fills the same fraction F of what the fleet holds for it")
    parser.add_argument("--topology-detail-attributes", action="store_true",
                        help="our slices with the kubelet plugin's --topology-detail-attributes")
    parser.add_argument("--out", default="scheduler", help="results file name under benchmarks/results")
    args = parser.parse_args(argv)
    global TOPOLOGY_DETAIL
    TOPOLOGY_DETAIL = args.topology_detail_attributes
    result = run(args.full, args.size, args.profile, args.shape, not args.no_defaults, args.stall,
                 args.pprof_seconds, args.pprof_dir, args.scheduler_feature_gate, args.fill)
    report(args.out, result)


if __name__ == "__main__":
    main()
