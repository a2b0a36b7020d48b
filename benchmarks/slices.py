"""ResourceSlice controller figures against a real control plane: time to publish, and API requests used.

Method: a fresh control plane; `dra-driver controller` as a subprocess, timed from
process start until the benchmark sees every expected device in the API server
(polling LIST every 0.25 s). API requests are the API server's own counter
(`apiserver_request_total`, all resources) before and after, minus the benchmark's own
polls and metric reads, so the figure is what the controller sent (its initial
list/watch, node lookups, creates). Cases: one 8-GPU node (hgx-h200), one MIG node
(a100-mig), and fleets of 100 and 1000 simulated 8-GPU nodes (`--simulate-fleet`,
Node objects created beforehand so that node creation is not counted).

Run alone: `python -m benchmarks.slices` (prints JSON; writes benchmarks/results/slices.json).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks import fresh_control_plane, report
from controller.plan import SLICES
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
    for name in names:
        create_node(api, name)
    expected = per_node * nodes
    before = _requests_total(cp)
    polls = 0
    log = work / f"{prefix}.log"
    t0 = time.perf_counter()
    args = ["controller", "--simulate", profile, "--kubeconfig", str(cp.kubeconfig), *args]
    proc = spawn_dra_driver(args, log, log_level="warning")
    try:
        while _devices_published(api, prefix) < expected:
            polls += 1
            if proc.poll() is not None or time.perf_counter() - t0 > 900:
                raise RuntimeError(f"controller for {prefix} failed; see {log}")
            time.sleep(0.25)
        elapsed = time.perf_counter() - t0
        time.sleep(2)  # let the controller settle: it must not keep writing
        after = _requests_total(cp)
    finally:
        proc.terminate()
        proc.wait(30)
    own = polls + 1 + 2  # our LISTs and the two metric reads
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
    }


def run(fleets: tuple[int, ...] = (100, 1000)) -> dict[str, Any]:
    with fresh_control_plane("dra-bench-slices-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        cases = [_case(cp, api, "hgx-h200", 1, work), _case(cp, api, "a100-mig", 1, work)]
        cases += [_case(cp, api, "hgx-h200", n, work) for n in fleets]
        return {"driver": DRIVER, "cases": cases}


def main() -> None:
    report("slices", run())


if __name__ == "__main__":
    main()
