"""Prepare with the API server far away: 16 NodePrepareResources at once when every byte to
and from the API server takes DELAY_S longer each way.

Method: benchmarks.prepare's setup (a real etcd/apiserver, a simulated 16-GPU node, 16
claims allocated by an admin write, the plugin as the chart runs it, kubelet-client on the
plugin's socket), but each plugin is given a kubeconfig whose server is a
tests/harness/delay_proxy.py relay in front of the API server (TLS passes through it), so
that its claim reads, status writes and slice publishing all cross the delay. The sides,
each started STARTS times in alternation (B H C C H B ...): dra-example-driver's plugin
(`baseline`; client-go, HTTP/2), this plugin at an earlier commit (`http1`, `--http1-ref`,
default the commit before HTTP/2 came: its 8 keep-alive HTTP/1.1 connections) and the
working tree's (`current`). Per start: ROUNDS sequential Prepare/Unprepare calls and
CONCURRENT_ROUNDS rounds of 16 at once, timed by kubelet-client, which also GETs the same
claims through a relay of its own with the same delay (`get_go`, `get_go_16_concurrent`:
what Go's client takes for the reads alone); `tcp_connections` is how many connections the
plugin opened through its relay from its start to the end of the calls, and
`rss_kib_after_calls` its VmRSS then (the medians over its starts).

Run alone: `python -m benchmarks.far_api [--delay-ms 200] [--starts 2] [--http1-ref REF]`
(prints JSON; writes benchmarks/results/far_api.json). About five minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import example_driver, fresh_control_plane, kubelet_client, report
from benchmarks.prepare import (
    GPUS,
    NODE,
    Side,
    _charted_env,
    _claims,
    _driver_root,
    _free_port,
    _percentiles,
    _profile,
    _rss_kib,
    _run_root,
    check_imports,
    commit_side,
    example_side,
    start_timed,
    working_tree_side,
)
from tests.harness.cluster import ADMIN_TOKEN, ControlPlane
from tests.harness.delay_proxy import DelayProxy
from tests.harness.driver import DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_node, sync_client

DELAY_S = 0.2
STARTS = 2
ROUNDS = 10  # sequential calls per phase and start
CONCURRENT_ROUNDS = 10  # rounds of 16 at once per start
HTTP1_REF = "841d822"  # the last commit whose plugin spoke only HTTP/1.1 to the API server


def _far_kubeconfig(cp: ControlPlane, proxy: DelayProxy, path: Path) -> Path:
    config = json.loads(cp.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://{proxy.address}"
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


def _block(
    side: Side, index: int, cp: ControlPlane, work: Path, claims: list[ClaimName], binary: Path, delay: float
) -> dict[str, Any]:
    run_root, _ = _run_root()
    proxy = DelayProxy(("127.0.0.1", cp.api_port), delay).start()
    go_proxy = DelayProxy(("127.0.0.1", cp.api_port), delay).start()  # kubelet-client's own GETs
    kubeconfig = _far_kubeconfig(cp, proxy, work / f"far-{index}.kubeconfig")
    plugin: Any
    if side.example is not None:
        plugin = example_driver.ExampleProcess(
            side.example, NODE, kubeconfig, work / f"p-{side.label}-{index}", run_root, GPUS
        )
    else:
        plugin = DriverProcess(
            NODE,
            str(_profile(work / "bench16.yaml")),
            kubeconfig,
            work / f"p-{side.label}-{index}",
            extra_args=("--driver-root", str(work / "driver-root"), "--metrics-port", str(_free_port()),
                        "--metrics-bind-address", "127.0.0.1"),
            env=side.env | _charted_env(),
            log_level="info",
            run_root=run_root,
        )
    try:
        start_s, pid, _ = start_timed(plugin)
        kubelet = KubeletSide(plugin.registration_socket())
        token_file = work / "bench.token"
        token_file.write_text(ADMIN_TOKEN)
        api_server = kubelet_client.ApiServer(f"https://{go_proxy.address}", cp.ca_file, token_file)
        phases = kubelet_client.run(
            binary, Path(kubelet.info.endpoint), [(c.namespace, c.name, c.uid) for c in claims],
            ROUNDS, CONCURRENT_ROUNDS, api=api_server,
        )
        plugin_connections = proxy.connections
        rss_kib = _rss_kib(pid)
        kubelet.close()
    finally:
        plugin.stop()
        proxy.stop()
        go_proxy.stop()
    p50 = statistics.median(phases["prepare_concurrent"]) * 1000
    print(f"start {index + 1} {side.label}: 16 at once p50 {p50:.1f} ms, {plugin_connections} connections "
          f"(registered in {start_s:.2f} s)", file=sys.stderr, flush=True)
    return {"phases": phases, "tcp_connections": plugin_connections, "rss_kib": rss_kib}


def run(delay: float = DELAY_S, starts: int = STARTS, http1_ref: str = HTTP1_REF) -> dict[str, Any]:
    sides = [example_side(), commit_side(http1_ref, "http1"), working_tree_side()]
    for side in sides:
        check_imports(side)
    order: list[Side] = []
    for i in range(starts):
        order += sides if i % 2 == 0 else sides[::-1]
    blocks: dict[str, list[dict[str, Any]]] = {side.label: [] for side in sides}
    with fresh_control_plane("dra-far-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        ours = _claims(api)
        theirs = _claims(api, example_driver.EXAMPLE_DRIVER, "e")
        _driver_root(work / "driver-root")
        binary = kubelet_client.build()
        for index, side in enumerate(order):
            claims = theirs if side.example is not None else ours
            blocks[side.label].append(_block(side, index, cp, work, claims, binary, delay))
    results: dict[str, Any] = {}
    for side in sides:
        def pooled(phase: str, label: str = side.label) -> dict[str, float]:
            return _percentiles([t for b in blocks[label] for t in b["phases"][phase]])

        results[side.label] = {
            "prepare_sequential": pooled("prepare_sequential"),
            "prepare_16_concurrent": pooled("prepare_concurrent"),
            "unprepare_16_concurrent": pooled("unprepare_concurrent"),
            "get_go": pooled("get_sequential"),
            "get_go_16_concurrent": pooled("get_concurrent"),
            "tcp_connections": statistics.median(b["tcp_connections"] for b in blocks[side.label]),
            "rss_kib_after_calls": statistics.median(b["rss_kib"] for b in blocks[side.label]),
        }

    def ratio(a: str, b: str, phase: str) -> float:
        return round(results[a][phase]["p50_ms"] / results[b][phase]["p50_ms"], 2)

    return {
        "method": f"API server {delay * 1000:g} ms away each way (a TCP relay); {starts} starts of each"
        f" side in the order {' '.join(s.label for s in order)}; {ROUNDS} sequential calls and"
        f" {CONCURRENT_ROUNDS} rounds of 16 at once per start",
        "delay_ms_each_way": delay * 1000,
        "code": {side.label: side.describe for side in sides},
        **results,
        "ratios": {
            "current_to_baseline_16_concurrent_p50": ratio("current", "baseline", "prepare_16_concurrent"),
            "http1_to_baseline_16_concurrent_p50": ratio("http1", "baseline", "prepare_16_concurrent"),
            "current_to_http1_16_concurrent_p50": ratio("current", "http1", "prepare_16_concurrent"),
            "current_to_baseline_sequential_p50": ratio("current", "baseline", "prepare_sequential"),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.far_api", description=__doc__.split("\n")[0])
    parser.add_argument("--delay-ms", type=float, default=DELAY_S * 1000, help="added each way, in ms")
    parser.add_argument("--starts", type=int, default=STARTS, help="plugin starts per side")
    parser.add_argument("--http1-ref", default=HTTP1_REF, help="the commit whose plugin is the HTTP/1.1 side")
    args = parser.parse_args()
    started = time.monotonic()
    result = run(args.delay_ms / 1000, args.starts, args.http1_ref)
    result["wall_s"] = round(time.monotonic() - started, 1)
    report("far_api", result)


if __name__ == "__main__":
    main()
