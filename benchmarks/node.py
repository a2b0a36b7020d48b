"""Real-node figures: node binaries' build time, node start to Ready, pod start with and
without a claim, and the kubelet's own view of our plugin's gRPC calls.

Method:
* build: `hack/node/build.sh` into an empty binary cache (`DRA_NODE_CACHE` in a temp dir),
  timed with `time.monotonic`. With `--cold`, also with an empty Go build cache
  (`GOCACHE` in a temp dir; the module download cache is kept, so no download is
  timed); without it the Go build cache is the machine's as found (on a machine that
  built the node before, that is links only; a first CI run, which builds the control
  plane first, sits between the two: 166 s on this machine, 2026-12-02).
* node start to Ready: one control plane (already running, not timed), then one node
  (`tests.harness.node.Nodes.start`: veth, sandbox, containerd, image import, kubelet)
  until its Node object is Ready without the not-ready taint; then the driver
  (`dra-driver kubelet-plugin --simulate hgx-h200`) until the kubelet registered it.
* pod create -> Running: a busybox pod (`sleep 3600`, grace period 1 s) POSTed to the
  API server, then its status polled every 20 ms until phase Running with the container
  running; 10 pods one after the other, each deleted (and gone) before the next; without
  a claim, and with a one-GPU ResourceClaimTemplate (claim creation, allocation, the
  kubelet's NodePrepareResources, CDI injection). Median, min and max.
* kubelet metrics: `dra_grpc_operations_duration_seconds` from the kubelet's /metrics
  after those pods (count, mean from sum/count, per method), for our driver only.

Run alone: `python -m benchmarks.node [--cold]` (root; writes benchmarks/results/node.json).
Never asserted in tests: timings depend on the machine (2 cores here).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from demo.run import apply_documents, device_class_files, get_pod, wait_for_slices
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER
from tests.harness.node import BUILD_SCRIPT, Nodes, NodeSpec, build_node_binaries, node_tokens
from tests.harness.objects import create_object, sync_client, sync_request
from tests.node.pods import gpu_pod, wait_gone

NODE = NodeSpec("bench-h200", "hgx-h200")
PODS = 10
WARM_CACHE = "the machine's, as found (where these packages were built before: links only)"


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


def pod_start_times(api: Any, ns: str, with_claim: bool) -> dict[str, Any]:
    samples: list[float] = []
    for i in range(PODS):
        name = f"{'claim' if with_claim else 'plain'}-{i}"
        pod = gpu_pod(name, templates={"gpu": "one-gpu"} if with_claim else None, command="sleep 3600")
        t0 = time.monotonic()
        create_object(api, pod, ns)
        _running(api, ns, name)
        samples.append(time.monotonic() - t0)
        sync_request(api, "DELETE", f"/api/v1/namespaces/{ns}/pods/{name}")
        wait_gone(api, ns, name)
    return {
        "n": PODS,
        "median_s": round(statistics.median(samples), 3),
        "min_s": round(min(samples), 3),
        "max_s": round(max(samples), 3),
    }


_METRIC = re.compile(r"^dra_grpc_operations_duration_seconds_(sum|count)\{([^}]*)\} (\S+)$")


def plugin_grpc_metrics(text: str) -> dict[str, Any]:
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("driver_name") != DRIVER:
            continue
        key = labels.get("method_name", "?") + (
            f" ({labels['grpc_status_code']})" if labels.get("grpc_status_code") not in (None, "OK") else ""
        )
        found.setdefault(key, {})[m.group(1)] = float(m.group(3))
    return {
        k: {
            "count": int(v.get("count", 0)),
            "mean_ms": round(1000 * v["sum"] / v["count"], 2) if v.get("count") else None,
        }
        for k, v in sorted(found.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.node")
    parser.add_argument(
        "--cold", action="store_true", help="also time the build with an empty Go build cache"
    )
    args = parser.parse_args()
    result: dict[str, Any] = {}
    build_node_binaries()  # packages and the cached build the rest uses
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
        for path in device_class_files():
            apply_documents(api, path, "default")
        ns = "bench"
        sync_request(
            api,
            "POST",
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        )
        create_object(
            api,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "one-gpu"},
                "spec": {
                    "spec": {
                        "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
                    }
                },
            },
            ns,
        )
        pod_start_times(api, ns, with_claim=False)  # warm-up: first sandbox, image, CNI
        result["pod_create_to_running_no_claim"] = pod_start_times(api, ns, with_claim=False)
        result["pod_create_to_running_one_gpu_claim"] = pod_start_times(api, ns, with_claim=True)
        result["kubelet_dra_grpc_operations"] = plugin_grpc_metrics(node.metrics())
    finally:
        if nodes is not None:
            nodes.stop()
        cp.stop()
    result["machine"] = f"{os.cpu_count()} cores"
    report("node", result)


if __name__ == "__main__":
    main()
