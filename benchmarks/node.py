"""Real-node figures: node binaries' build time, node start to Ready, pod start with and
without a claim, and the kubelet's own view of our plugin's gRPC calls.

Method:
* build: `hack/node/build.sh` into an empty binary cache (`DRA_NODE_CACHE` in a temp dir),
  timed with `time.monotonic`. With `--cold`, also with an empty Go build cache
  (`GOCACHE` in a temp dir; the module download cache is kept, so no download is
  timed); without it the Go build cache is the machine's as found (on a machine that
  built the node before, that is links only; a first CI run, which builds the control
  plane first, sits between the two: 166 s on this machine, 2026-12-02). `--skip-build`
  leaves the build untimed (the cached binaries are still checked and used).
* node start to Ready: one control plane (already running, not timed), then one node
  (`tests.harness.node.Nodes.start`: veth, sandbox, containerd, image import, kubelet)
  until its Node object is Ready without the not-ready taint; then the driver
  (`dra-driver kubelet-plugin --simulate hgx-h200`) until the kubelet registered it.
* pod create -> Running: a busybox pod (`sleep 3600`, grace period 1 s) POSTed to the
  API server, then its status polled every 20 ms until phase Running with the container
  running; one pod at a time, each deleted (and gone) before the next. Two kinds: without
  a claim, and with a one-GPU ResourceClaimTemplate (claim creation, allocation, the
  kubelet's NodePrepareResources, CDI injection). `--warmup` pods of each kind first,
  untimed (first sandbox, image, CNI, first claim); then `--pods` N of each (default 20),
  interleaved in pairs whose order alternates (plain, claim, claim, plain, ...), so that
  drift on the machine hits both kinds alike. Median, p90 (nearest rank), min and max of
  each; `claim_to_no_claim_median` divides the two medians; every sample in `samples_s`,
  and any pod slower than 2 s with its own and its claim's events (read after its timing).
* the plugin: the working tree's, or with `--plugin-ref REF` a commit's, run from a git
  worktree with the same .venv (see benchmarks.prepare: PYTHONPATH at the worktree,
  PYTHONSAFEPATH=1, every module imported once before the node starts).
* kubelet metrics: `dra_grpc_operations_duration_seconds` from the kubelet's /metrics,
  for our driver only, per method, scraped before the timed pods and after each of them
  (outside the timed windows; the warm-up pods are not counted). Over the whole run:
  count and mean (sum/count), and p50/p90 from the histogram buckets, as Prometheus'
  `histogram_quantile` estimates them (linear inside the bucket holding the rank), with
  that bucket's bounds; the kubelet's first bucket is (0, 100 ms], so while every call
  is faster than that the estimate is left out (null) and only the bounds are given.
  `single_calls`: each call's own duration, where the method's count grew by exactly one
  between two scrapes (pods run one at a time, so nearly every call), from the growth of
  its sum; their p50 (median), p90 (nearest rank) and max.

Run alone: `python -m benchmarks.node [--pods N] [--warmup N] [--skip-build | --cold] [--plugin-ref REF]`
(root; real kubelets: one node tier at a time on a machine, e.g. under
`flock /tmp/node-tier.lock`; writes benchmarks/results/node.json).
Never asserted in tests: timings depend on the machine (2 cores here).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.prepare import check_imports, commit_side, working_tree_side
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER
from tests.harness.examples import device_class_files, wait_for_slices
from tests.harness.node import BUILD_SCRIPT, Nodes, NodeSpec, build_node_binaries, node_tokens
from tests.harness.objects import apply_documents, create_object, get_pod, sync_client, sync_request
from tests.node.pods import gpu_pod, wait_gone

NODE = NodeSpec("bench-h200", "hgx-h200")
PODS = 20
WARMUP = 2
WARM_CACHE = "the machine's, as found (where these packages were built before: links only)"
NS = "bench"


def build_time(cold: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="node-build-") as tmp:
        env = {**os.environ, "DRA_NODE_CACHE": str(Path(tmp) / "bin")}
        if cold:
            env["GOCACHE"] = str(Path(tmp) / "gocache")
        t0 = time.monotonic()
        subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, check=True, stdout=subprocess.DEVNULL)
        return {
            "seconds": round(time.monotonic() - t0, 1),
            "go_build_cache": "empty" if cold else WARM_CACHE,
        }


def _running(api: Any, ns: str, name: str) -> None:
    while True:
        pod = get_pod(api, ns, name)
        statuses = pod.get("status", {}).get("containerStatuses", [])
        if (
            pod["status"].get("phase") == "Running"
            and statuses
            and "running" in (statuses[0].get("state") or {})
        ):
            return
        time.sleep(0.02)


SLOW_S = 2.0
SLOW_PODS: list[dict[str, Any]] = []  # pods slower than SLOW_S, with their events


def _events(api: Any, name: str) -> list[str]:
    """The events of pod `name` and of the claim made for it, oldest first."""
    pod = get_pod(api, NS, name)
    claims = {c.get("resourceClaimName") for c in pod.get("status", {}).get("resourceClaimStatuses", [])}
    items = sync_request(api, "GET", f"/api/v1/namespaces/{NS}/events").get("items", [])
    mine = [e for e in items if e["involvedObject"].get("name") in {name} | claims]
    mine.sort(key=lambda e: e.get("eventTime") or e.get("firstTimestamp") or "")
    return [
        f"{e.get('eventTime') or e.get('firstTimestamp')} {e['involvedObject'].get('kind')}"
        f" {e.get('reason')}: {e.get('message')}"
        for e in mine
    ]


def pod_start_time(api: Any, name: str, with_claim: bool) -> float:
    """Create one pod, time it to Running, delete it and wait until it is gone; a pod slower
    than SLOW_S goes to SLOW_PODS with its events (read after the timing)."""
    pod = gpu_pod(name, templates={"gpu": "one-gpu"} if with_claim else None, command="sleep 3600")
    t0 = time.monotonic()
    create_object(api, pod, NS)
    _running(api, NS, name)
    elapsed = time.monotonic() - t0
    if elapsed > SLOW_S:
        SLOW_PODS.append({"pod": name, "seconds": round(elapsed, 3), "events": _events(api, name)})
    sync_request(api, "DELETE", f"/api/v1/namespaces/{NS}/pods/{name}")
    wait_gone(api, NS, name)
    return elapsed


def _nearest_rank(ordered: list[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "median_s": round(statistics.median(ordered), 3),
        "p90_s": round(_nearest_rank(ordered, 0.9), 3),
        "min_s": round(ordered[0], 3),
        "max_s": round(ordered[-1], 3),
    }


def interleaved_pod_starts(
    api: Any, pods: int, scrape: Callable[[], Histograms]
) -> tuple[dict[str, list[float]], list[Histograms]]:
    """`pods` of each kind, in pairs whose order alternates: plain, claim, claim, plain, ...;
    the kubelet's DRA histograms scraped before the first pod and after each (untimed)."""
    samples: dict[str, list[float]] = {"plain": [], "claim": []}
    scrapes = [scrape()]
    for i in range(pods):
        order = ("plain", "claim") if i % 2 == 0 else ("claim", "plain")
        for kind in order:
            samples[kind].append(pod_start_time(api, f"{kind}-{i}", with_claim=kind == "claim"))
            scrapes.append(scrape())
    return samples, scrapes


_SERIES = re.compile(r"^dra_grpc_operations_duration_seconds_(sum|count|bucket)\{([^}]*)\} (\S+)$")

Histograms = dict[str, dict[str, Any]]


def parse_histograms(text: str) -> Histograms:
    """Our driver's `dra_grpc_operations_duration_seconds` per method (plus the status code
    when not OK): {"sum": s, "count": n, "buckets": {le: cumulative count}}."""
    found: Histograms = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("driver_name") != DRIVER:
            continue
        key = labels.get("method_name", "?") + (
            f" ({labels['grpc_status_code']})" if labels.get("grpc_status_code") not in (None, "OK") else ""
        )
        entry = found.setdefault(key, {"sum": 0.0, "count": 0.0, "buckets": {}})
        value = float(m.group(3))
        if m.group(1) == "bucket":
            le = float(labels["le"])  # "+Inf" parses as inf
            entry["buckets"][le] = entry["buckets"].get(le, 0.0) + value
        else:
            entry[m.group(1)] += value
    return found


def histogram_delta(after: Histograms, before: Histograms) -> Histograms:
    delta: Histograms = {}
    for key, a in after.items():
        b = before.get(key, {"sum": 0.0, "count": 0.0, "buckets": {}})
        delta[key] = {
            "sum": a["sum"] - b["sum"],
            "count": a["count"] - b["count"],
            "buckets": {le: n - b["buckets"].get(le, 0.0) for le, n in a["buckets"].items()},
        }
    return delta


def quantile_bucket(q: float, buckets: dict[float, float]) -> tuple[float, float] | None:
    """The bounds of the bucket that holds rank q*count (the first starts at 0)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower = 0.0
    for le in bounds:
        if buckets[le] >= rank:
            return lower, le
        lower = le
    return lower, math.inf


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' estimate, linear inside the bucket that holds rank q*count; None where
    that bucket starts at 0 or ends at +Inf (an estimate there says nothing: the kubelet's
    first bucket is (0, 100 ms], where every call of a healthy plugin falls)."""
    bucket = quantile_bucket(q, buckets)
    if bucket is None or bucket[0] == 0 or math.isinf(bucket[1]):
        return None
    lower, upper = bucket
    below = buckets[lower]
    rank = q * buckets[max(buckets)]
    return lower + (upper - lower) * (rank - below) / (buckets[upper] - below)


def single_calls(scrapes: list[Histograms]) -> dict[str, list[float]]:
    """Each call's own duration, per method: between two consecutive scrapes in which the
    method's count grew by exactly one, the growth of its sum is that one call's duration."""
    calls: dict[str, list[float]] = {}
    for before, after in itertools.pairwise(scrapes):
        for key, h in histogram_delta(after, before).items():
            if round(h["count"]) == 1:
                calls.setdefault(key, []).append(h["sum"])
    return calls


def plugin_grpc_metrics(histograms: Histograms, calls: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, h in sorted(histograms.items()):
        count = int(h["count"])
        if count <= 0:
            continue
        figures: dict[str, Any] = {"count": count, "mean_ms": round(1000 * h["sum"] / count, 2)}
        for q in (0.5, 0.9):
            name = f"p{round(q * 100)}"
            estimate, bucket = histogram_quantile(q, h["buckets"]), quantile_bucket(q, h["buckets"])
            figures[f"{name}_ms_from_buckets"] = None if estimate is None else round(1000 * estimate, 2)
            figures[f"{name}_bucket_ms"] = None if bucket is None else [round(1000 * b, 3) for b in bucket]
        own = sorted(calls.get(key, []))
        if own:
            figures["single_calls"] = {
                "n": len(own),
                "p50_ms": round(1000 * statistics.median(own), 2),
                "p90_ms": round(1000 * _nearest_rank(own, 0.9), 2),
                "max_ms": round(1000 * own[-1], 2),
            }
        out[key.rsplit("/", 1)[-1]] = figures
    return out


def _setup_namespace(api: Any) -> None:
    for path in device_class_files():
        apply_documents(api, path, "default")
    sync_request(
        api,
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
    )
    create_object(
        api,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-gpu"},
            "spec": {
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}
            },
        },
        NS,
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.node", description=__doc__.split("\n")[0])
    builds = parser.add_mutually_exclusive_group()
    builds.add_argument(
        "--cold", action="store_true", help="also time the build with an empty Go build cache"
    )
    builds.add_argument(
        "--skip-build", action="store_true", help="do not time the build (the cached binaries are used)"
    )
    parser.add_argument("--pods", type=int, default=PODS, help=f"timed pods of each kind (default {PODS})")
    parser.add_argument(
        "--plugin-ref",
        metavar="REF",
        help="run this commit's plugin (a git worktree, as `benchmarks.prepare --baseline-ref`)"
        " instead of the working tree's",
    )
    parser.add_argument(
        "--warmup", type=int, default=WARMUP, help=f"untimed pods of each kind first (default {WARMUP})"
    )
    args = parser.parse_args()
    if args.pods < 1 or args.warmup < 0:
        parser.error("--pods must be at least 1 and --warmup at least 0")
    side = commit_side(args.plugin_ref, "plugin") if args.plugin_ref else working_tree_side("plugin")
    check_imports(side)
    os.environ.update(side.env)  # the driver's subprocess inherits it (others ignore it)
    result: dict[str, Any] = {"plugin_code": side.describe}
    build_node_binaries()  # packages and the cached build the rest uses
    if not args.skip_build:
        result["build_node_binaries"] = build_time(cold=False)
    if args.cold:
        result["build_node_binaries_cold"] = build_time(cold=True)

    cp = ControlPlane.start(
        work_dir=Path(tempfile.mkdtemp(prefix="bench-node-cp-")),
        node_lifecycle=True,
        extra_tokens=node_tokens([NODE.name]),
    )
    nodes: Nodes | None = None
    try:
        api = sync_client(str(cp.kubeconfig))
        t0 = time.monotonic()
        nodes = Nodes.start(cp, [NODE])
        total = time.monotonic() - t0
        result["node_start"] = {
            "to_ready_s": round(nodes.timings["nodes_ready_s"], 2),
            "to_driver_registered_s": round(nodes.timings["drivers_registered_s"], 2),
            "total_with_reaper_and_images_s": round(total, 2),
        }
        node = nodes[NODE.name]
        assert node.driver is not None
        wait_for_slices(api, [node.driver])
        _setup_namespace(api)
        for i in range(args.warmup):
            pod_start_time(api, f"warm-plain-{i}", with_claim=False)
            pod_start_time(api, f"warm-claim-{i}", with_claim=True)
        samples, scrapes = interleaved_pod_starts(api, args.pods, lambda: parse_histograms(node.metrics()))
        plain, claim = summary(samples["plain"]), summary(samples["claim"])
        result["pods_each"] = args.pods
        result["warmup_pods_each"] = args.warmup
        result["order"] = "interleaved pairs: plain,claim then claim,plain, alternating"
        result["pod_create_to_running_no_claim"] = plain
        result["pod_create_to_running_one_gpu_claim"] = claim
        result["claim_to_no_claim_median"] = round(claim["median_s"] / plain["median_s"], 3)
        result["claim_to_no_claim_p90"] = round(claim["p90_s"] / plain["p90_s"], 3)
        result["samples_s"] = {k: [round(s, 3) for s in v] for k, v in samples.items()}
        result[f"slower_than_{SLOW_S:g}_s"] = SLOW_PODS
        result["kubelet_dra_grpc_operations"] = plugin_grpc_metrics(
            histogram_delta(scrapes[-1], scrapes[0]), single_calls(scrapes)
        )
    finally:
        try:
            if nodes is not None:
                nodes.stop()
        finally:
            cp.stop()
    result["machine"] = f"{os.cpu_count()} cores"
    report("node", result)


if __name__ == "__main__":
    main()
