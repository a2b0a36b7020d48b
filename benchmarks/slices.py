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

Per case also: where the time went, as CPU seconds during the case of the controller, the
API server, etcd and this benchmark's own process (utime+stime from /proc), beside the wall
time and the load average at the case's start and end (the machine's other work takes the
rest), and how long until the first of the controller's slices was seen (its start-up:
imports, inventory, list); `--profile-controller` runs the controller under cProfile and keeps
its top entries, and the controller's own counters (writes, reconciles, echoes of its own
writes, watches followed on) come from its log.
The API server's RSS after publishing (VmRSS), etcd's database size
(`etcd_mvcc_db_total_size_in_bytes`, and its growth during the case), and the bytes of one
node's slice objects as JSON beside the reference shape's (benchmarks.scheduler: devices
with index, uuid, productName and capacity memory only). The cluster serves list-type
attributes, so the controller publishes them. Taken on 2 cores shared with other
engineers' test runs.

Run alone: `python -m benchmarks.slices [--full]` (prints JSON; writes benchmarks/results/slices.json).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import fresh_control_plane, report
from benchmarks.scheduler import cpu_seconds, create_nodes, rss_mib, slice_bytes
from controller.plan import SLICES
from controller.slices import SliceFeatures, desired_slices
from dra_driver.devices import node_devices
from dra_driver.gpu import discover
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, spawn_dra_driver, with_parent_death_signal
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


def _spawn_profiled(args: list[str], log_path: Path, profile_out: Path) -> subprocess.Popen[bytes]:
    """`dra-driver <args>` as spawn_dra_driver starts it, under cProfile (written when it stops)."""
    argv = [sys.executable, "-m", "cProfile", "-o", str(profile_out), "-m", "dra_driver",
            "--log-format", "json", "--log-level", "warning", *args]
    with open(log_path, "ab") as log:
        return subprocess.Popen(with_parent_death_signal(argv), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def _top(profile_out: Path, sort: str, entries: int = 20) -> list[str]:
    out = io.StringIO()
    pstats.Stats(str(profile_out), stream=out).sort_stats(sort).print_stats(entries)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return [line.rstrip() for line in lines[start : start + entries + 1] if line.strip()]


def _case(cp: ControlPlane, api: Any, profile: str, nodes: int, work: Path,
          profile_controller: bool = False) -> dict[str, Any]:
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
    prof = work / f"{prefix}.prof"
    server_pids = {c: cp.processes[c].pid for c in ("kube-apiserver", "etcd")}
    load_start = os.getloadavg()
    cpu_before = {c: cpu_seconds(pid) for c, pid in server_pids.items()}
    own_before = time.process_time()
    t0 = time.perf_counter()
    args = ["controller", "--simulate", profile, "--kubeconfig", str(cp.kubeconfig), *args]
    proc = (_spawn_profiled(args, log, prof) if profile_controller
            else spawn_dra_driver(args, log, log_level="warning"))
    first_seen: float | None = None
    try:
        while (count := _slice_count(api)) < expected_slices:
            polls += 1
            if first_seen is None and count > expected_slices - slices_per_node * nodes:
                first_seen = time.perf_counter() - t0
            if proc.poll() is not None or time.perf_counter() - t0 > 900:
                raise RuntimeError(f"controller for {prefix} failed; see {log}")
            time.sleep(0.25)  # the poll interval
        elapsed = time.perf_counter() - t0
        cpu = {c: round(cpu_seconds(pid) - cpu_before[c], 1) for c, pid in server_pids.items()}
        cpu["controller"] = round(cpu_seconds(proc.pid), 1)
        cpu["benchmark_client"] = round(time.process_time() - own_before, 1)
        load_end = os.getloadavg()
        published = _devices_published(api, prefix)
        if published != expected:
            raise RuntimeError(f"{prefix}: {published} devices published, {expected} expected; see {log}")
        time.sleep(2)  # let the controller settle: it must not keep writing
        after = _requests_total(cp)
    finally:
        proc.terminate()
        proc.wait(30)
    own = polls + 1 + 2 + 1  # our LISTs, the two metric reads and the device check
    profiled = {"controller_profile_tottime": _top(prof, "tottime"),
                "controller_profile_cumulative": _top(prof, "cumulative")} if profile_controller else {}
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
        # the controller's start (imports, the inventory, its list) until its first slice is seen
        "seconds_to_first_slice": round(first_seen if first_seen is not None else elapsed, 2),
        "cpu_seconds_to_published": cpu,
        "load_average_start_end": [round(load_start[0], 2), round(load_end[0], 2)],
        "controller_writes": stats["creates"] + stats["updates"] + stats["deletes"],
        "controller_lists": stats["lists"],
        "controller_stats": {k: stats[k] for k in ("creates", "updates", "deletes", "errors", "reconciles",
                                                   "echoes", "rewatches", "slices_examined") if k in stats},
        "api_requests_all_clients": after - before - own,
        "apiserver_rss_mib": rss_mib(cp.processes["kube-apiserver"].pid),
        "etcd_db_mib": round(_etcd_db_bytes(cp) / 2**20, 1),
        "etcd_db_growth_mib": round((_etcd_db_bytes(cp) - db_before) / 2**20, 1),
        "slice_bytes_per_node": slice_bytes("ours", inventory),
        "reference_slice_bytes_per_node": slice_bytes("reference", inventory),
        **profiled,
    }


SMALL_FLEETS = (100,)
FULL_FLEETS = (100, 1000, 5000)


def run(full: bool = False, fleets: tuple[int, ...] | None = None,
        profile_controller: bool = False) -> dict[str, Any]:
    fleets = fleets or (FULL_FLEETS if full else SMALL_FLEETS)
    with fresh_control_plane("dra-bench-slices-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        cases = [_case(cp, api, "hgx-h200", 1, work), _case(cp, api, "a100-mig", 1, work)]
        cases += [_case(cp, api, "hgx-h200", n, work, profile_controller) for n in fleets]
        return {"driver": DRIVER, "contention": "2 cores shared with other engineers' test runs",
                "cases": cases}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.slices",
                                     description="ResourceSlice publishing against a real control plane.")
    parser.add_argument("--full", action="store_true", help="fleets of 100, 1,000 and 5,000 nodes")
    parser.add_argument("--fleet", action="append", type=int, metavar="NODES")
    parser.add_argument("--profile-controller", action="store_true",
                        help="run the fleet cases' controller under cProfile; keep its top entries")
    parser.add_argument("--out", default="slices", help="results file name under benchmarks/results/")
    args = parser.parse_args(argv)
    report(args.out, run(args.full, tuple(args.fleet or ()) or None, args.profile_controller))


if __name__ == "__main__":
    main()
