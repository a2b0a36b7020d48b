"""Prepare latency while anyone who can reach the metrics port floods the probes.

Method: a real control plane (etcd, kube-apiserver) and one `dra-driver kubelet-plugin` for
the simulated 16-GPU node of benchmarks/prepare.py (same claims: admin-written allocations,
one GPU each; same driver root of stand-ins), with its metrics port on 127.0.0.1. The calls
come from `kubelet-client` (grpc-go, one connection, as the kubelet calls): sequential
Prepare then Unprepare of the 16 claims, repeated for the length of a phase. Phases
alternate quiet, flood, quiet, flood (`--phases 4`), `--seconds` each (30 by default), so
that drift on the machine hits both alike. During a flood phase a separate process sends
`--rate` GET /livez per second (1,000 by default), open loop (a request leaves on schedule
whether or not the ones before were answered; at most 512 outstanding) on up to 64
keep-alive connections, and counts the answers by status. The figures: Prepare and
Unprepare p50/p90 pooled per kind of phase, their flood/quiet ratios, and the flood's
achieved rate and statuses. On a 2-core machine the flood's own client takes CPU from the
plugin too: the ratio bounds what the probes cost the plugin from above.

Run alone: `python -m benchmarks.probe_flood [--seconds S] [--rate R] [--phases N]`
(figures as JSON on stdout, written to benchmarks/results/probe_flood.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import fresh_control_plane, kubelet_client, report
from benchmarks.prepare import NODE, _claims, _driver_root, _profile, _run_root
from tests.harness.driver import DriverProcess
from tests.harness.kubelet import KubeletSide
from tests.harness.objects import create_node, sync_client

FLOOD = r"""
import asyncio, collections, json, sys, time
import aiohttp

async def main(url, rate, seconds):
    statuses = collections.Counter()
    outstanding = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        async def one():
            nonlocal outstanding
            outstanding += 1
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    await r.read()
                    statuses[str(r.status)] += 1
            except Exception as e:
                statuses[type(e).__name__] += 1
            finally:
                outstanding -= 1
        tasks = set()
        start = time.monotonic()
        sent = 0
        while (now := time.monotonic()) < start + seconds:
            due = int((now - start) * rate) + 1
            while sent < due:
                sent += 1
                if outstanding >= 512:
                    statuses["skipped"] += 1
                    continue
                t = asyncio.create_task(one())
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            await asyncio.sleep(0.001)
        elapsed = time.monotonic() - start
        await asyncio.gather(*tasks)
    print(json.dumps({"sent": sent, "seconds": elapsed, "statuses": dict(statuses)}))

asyncio.run(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3])))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p90_ms": round(ordered[int(len(ordered) * 0.9)] * 1000, 3),
    }


def run(seconds: float, rate: float, phases: int) -> dict[str, Any]:
    binary = kubelet_client.build()
    with fresh_control_plane("dra-probe-flood-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        claims = _claims(api)
        port = _free_port()
        run_root, _ = _run_root()
        plugin = DriverProcess(
            NODE,
            str(_profile(work / "bench16.yaml")),
            cp.kubeconfig,
            work / "plugin",
            extra_args=(
                "--driver-root",
                str(_driver_root(work / "driver-root")),
                "--metrics-port",
                str(port),
                "--metrics-bind-address",
                "127.0.0.1",
            ),
            log_level="info",
            run_root=run_root,
        )
        pooled: dict[str, dict[str, list[float]]] = {"quiet": {}, "flood": {}}
        floods: list[dict[str, Any]] = []
        try:
            plugin.start()
            kubelet = KubeletSide(plugin.registration_socket())
            refs = [(c.namespace, c.name, c.uid) for c in claims]
            for index in range(phases):
                kind = "flood" if index % 2 else "quiet"
                flood = None
                if kind == "flood":
                    flood = subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            FLOOD,
                            f"http://127.0.0.1:{port}/livez",
                            str(rate),
                            str(seconds),
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    time.sleep(1)  # the flood at its rate before the first timed call
                end = time.monotonic() + seconds - (1 if flood else 0)
                while time.monotonic() < end:
                    got = kubelet_client.run(binary, Path(kubelet.info.endpoint), refs, 40, 1)
                    for phase in ("prepare_sequential", "unprepare_sequential"):
                        pooled[kind].setdefault(phase, []).extend(got[phase])
                if flood is not None:
                    out, _ = flood.communicate(timeout=seconds + 30)
                    floods.append(json.loads(out))
                print(f"phase {index + 1}/{phases} ({kind}) done", file=sys.stderr, flush=True)
            kubelet.close()
        finally:
            plugin.stop()
            shutil.rmtree(run_root, ignore_errors=True)
    result: dict[str, Any] = {
        "method": {"seconds_per_phase": seconds, "rate_per_second": rate, "phases": phases},
        "quiet": {p: _percentiles(v) for p, v in pooled["quiet"].items()},
        "flood": {p: _percentiles(v) for p, v in pooled["flood"].items()},
        "flood_clients": [{**f, "achieved_per_second": round(f["sent"] / f["seconds"], 1)} for f in floods],
    }
    result["flood_to_quiet_p50"] = {
        p: round(result["flood"][p]["p50_ms"] / result["quiet"][p]["p50_ms"], 3) for p in result["quiet"]
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--phases", type=int, default=4)
    args = parser.parse_args()
    report("probe_flood", run(args.seconds, args.rate, args.phases))


if __name__ == "__main__":
    main()
