"""ResourceSlice controller figures against a real control plane: time to publish, and API requests used.

Method: a fresh control plane; `dra-driver controller` as a subprocess, timed from
process start until the benchmark sees every expected device in the API server
(polling LIST every 0.25 s). API requests are the API server's own counter
(`apiserver_request_total`, all resources) before and after, minus the benchmark's own
polls and metric reads, so the figure is what the controller sent (its initial
list/watch, node lookups, creates). Cases: one 8-GPU node (hgx-h200), one MIG node
(a100-mig), and fleets of simulated 8-GPU nodes (`--simulate-fleet`, Node objects created
beforehand, many at once, so that node creation is not counted): 100 by default, 100, 1,000
and 5,000 with `--full`. Completion is polled as the number of slices (a LIST with limit=1
and its remainingItemCount: a full LIST of 5,000 nodes' slices every 0.25 s would load the
API server more than the controller does), then checked once device by device.

Per case also: the API server's RSS after publishing (VmRSS), etcd's database size
(`etcd_mvcc_db_total_size_in_bytes`, and its growth during the case), and the bytes of one
node's slice objects as JSON beside the reference shape's (benchmarks.scheduler: devices
with index, uuid, productName and capacity memory only). The cluster serves list-type
attributes, so the controller publishes them. Taken on 2 cores shared with other
engineers' test runs.

Run alone: `python -m benchmarks.slices [--full]` (prints JSON; writes benchmarks/results/slices.json).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import fresh_control_plane, report
from benchmarks.scheduler import create_nodes, rss_mib, slice_bytes
from controller.plan import SLICES
from controller.slices import SliceFeatures, desired_slices
from dra_driver.devices import node_devices
from dra_driver.gpu import discover
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, spawn_dra_driver
from tests.harness.objects import create_node, sync_client, sync_request


def _requests_total(cp: ControlPlane) -> int:
    _, metrics = cp.get("/metrics", timeout=30)
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in metrics.splitlines()
        if line.startswith("apiserver_request_total{")
    )


def _slice_count(api: Any) -> int:
    page = sync_request(api, "GET", SLICES, query={"limit": "1"})
    return len(page["items"]) + int(page["metadata"].get("remainingItemCount") or 0)


def _etcd_db_bytes(cp: ControlPlane) -> int:
    with urllib.request.urlopen(f"{cp.etcd_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return next(int(float(line.split()[1])) for line in text.splitlines()
                if line.startswith("etcd_mvcc_db_total_size_in_bytes "))


def _devices_published(api: Any, node_prefix: str) -> int:
    items = sync_request(api, "GET", SLICES)["items"]
    return sum(
        len(s["spec"].get("devices", []))
        for s in items
        if s["spec"].get("nodeName", "").startswith(node_prefix)
    )


def _case(cp: ControlPlane, api: Any, profile: str, nodes: int, work: Path) -> dict[str, Any]:
    inventory = discover(profile)
    per_node = len(node_devices(inventory))
    prefix = f"b{nodes}-{profile}"
    if nodes == 1:
        names = [prefix]
        args = ["--node-name", prefix]
    else:
        names = [f"{prefix}-{i:04d}" for i in range(nodes)]
        args = ["--simulate-fleet", str(nodes), "--fleet-prefix", prefix]
    if nodes == 1:
        create_node(api, names[0])
    else:
        create_nodes(cp, names)
    expected = per_node * nodes
    slices_per_node = len(desired_slices(inventory, names[0], DRIVER, SliceFeatures(list_attributes=True)))
    expected_slices = _slice_count(api) + slices_per_node * nodes
    db_before = _etcd_db_bytes(cp)
    before = _requests_total(cp)
    polls = 0
    log = work / f"{prefix}.log"
    t0 = time.perf_counter()
    args = ["controller", "--simulate", profile, "--kubeconfig", str(cp.kubeconfig), *args]
    proc = spawn_dra_driver(args, log, log_level="warning")
    try:
        while _slice_count(api) < expected_slices:
            polls += 1
            if proc.poll() is not None or time.perf_counter() - t0 > 900:
                raise RuntimeError(f"controller for {prefix} failed; see {log}")
            time.sleep(0.25)  # the poll interval
        elapsed = time.perf_counter() - t0
        published = _devices_published(api, prefix)
        if published != expected:
            raise RuntimeError(f"{prefix}: {published} devices published, {expected} expected; see {log}")
        time.sleep(2)  # let the controller settle: it must not keep writing
        after = _requests_total(cp)
    finally:
        proc.terminate()
        proc.wait(30)
    own = polls + 1 + 2 + 1  # our LISTs, the two metric reads and the device check
    stats = next(
        json.loads(line)
        for line in reversed(log.read_text().splitlines())
        if '"controller stopping"' in line
    )
    return {
        "profile": profile,
        "nodes": nodes,
        "devices": expected,
        "seconds_to_published": round(elapsed, 2),
        "controller_writes": stats["creates"] + stats["updates"] + stats["deletes"],
        "controller_lists": stats["lists"],
        "api_requests_all_clients": after - before - own,
        "apiserver_rss_mib": rss_mib(cp.processes["kube-apiserver"].pid),
        "etcd_db_mib": round(_etcd_db_bytes(cp) / 2**20, 1),
        "etcd_db_growth_mib": round((_etcd_db_bytes(cp) - db_before) / 2**20, 1),
        "slice_bytes_per_node": slice_bytes("ours", inventory),
        "reference_slice_bytes_per_node": slice_bytes("reference", inventory),
    }


SMALL_FLEETS = (100,)
FULL_FLEETS = (100, 1000, 5000)


def run(full: bool = False, fleets: tuple[int, ...] | None = None) -> dict[str, Any]:
    fleets = fleets or (FULL_FLEETS if full else SMALL_FLEETS)
    with fresh_control_plane("dra-bench-slices-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        cases = [_case(cp, api, "hgx-h200", 1, work), _case(cp, api, "a100-mig", 1, work)]
        cases += [_case(cp, api, "hgx-h200", n, work) for n in fleets]
        return {"driver": DRIVER, "contention": "2 cores shared with other engineers' test runs",
                "cases": cases}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.slices",
                                     description="ResourceSlice publishing against a real control plane.")
    parser.add_argument("--full", action="store_true", help="fleets of 100, 1,000 and 5,000 nodes")
    parser.add_argument("--fleet", action="append", type=int, metavar="NODES")
    args = parser.parse_args(argv)
    report("slices", run(args.full, tuple(args.fleet or ()) or None))


if __name__ == "__main__":
    main()
