"""Prepare latency while anyone who can reach the metrics port floods the probes.

Method: a real control plane (etcd, kube-apiserver) and one `dra-driver kubelet-plugin` for
the simulated 16-GPU node of benchmarks/prepare.py (same claims: admin-written allocations,
one GPU each; same driver root of stand-ins), with its metrics port on 127.0.0.1. The calls
come from `kubelet-client` (grpc-go, one connection, as the kubelet calls): sequential
Prepare then Unprepare of the 16 claims, repeated for the length of a phase (`--seconds`,
30 by default). Three kinds of phase alternate, `--cycles` times (quiet, flood, elsewhere,
quiet, ...), so that drift on the machine hits all alike:
* quiet: nothing else;
* flood: a separate process sends `--rate` GETs per second (1,000 by default) to the
  plugin's metrics port, taking the paths of `--paths` in turn (/livez and /metrics by
  default: probes and scrapes), open loop (a request leaves on schedule whether or not
  earlier ones were answered; at most 512 outstanding, the rest counted as skipped) on up
  to 64 keep-alive connections, and counts the answers by status;
* elsewhere: the same flood aimed at a minimal aiohttp server in another process: what the
  flood costs the plugin through the shared CPU alone (on a 2-core machine the flood's
  client is a busy process too), to set beside what answering it costs.
Meanwhile, in every phase, a prober stands in for the kubelet's probes: GET /livez and
/readyz of the plugin every 0.5 s, each on a new connection with the kubelet's default
1 s timeout; `probe_failures` counts those not answered 200 in time, per kind.
The figures: Prepare and Unprepare p50/p90 pooled per kind, each kind's p50 over quiet's.
With `--baseline-ref REF` a commit's plugin (a git worktree, as benchmarks/prepare.py does)
runs quiet and flood phases after the current one, on the same control plane and claims.

Run alone: `python -m benchmarks.probe_flood [--seconds S] [--rate R] [--cycles N]
[--paths /livez,/metrics] [--baseline-ref REF]` (figures as JSON on stdout, written to
benchmarks/results/probe_flood.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import fresh_control_plane, kubelet_client, report
from benchmarks.prepare import NODE, _claims, _driver_root, _profile, _run_root, commit_side
from tests.harness.driver import DriverProcess
from tests.harness.kubelet import KubeletSide
from tests.harness.objects import create_node, sync_client

FLOOD = r"""
import asyncio, collections, json, sys, time
import aiohttp

async def main(base, paths, rate, seconds):
    paths = paths.split(",")
    statuses = collections.Counter()
    outstanding = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        async def one(url):
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
                t = asyncio.create_task(one(base + paths[sent % len(paths)]))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            await asyncio.sleep(0.001)
        elapsed = time.monotonic() - start
        await asyncio.gather(*tasks)
    print(json.dumps({"sent": sent, "seconds": elapsed, "statuses": dict(statuses)}))

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
"""

# The same flood aimed at another process on the machine: what the flood costs the plugin
# through the shared CPU alone, to set beside what it costs when the plugin answers it.
ELSEWHERE = r"""
import sys
from aiohttp import web

async def livez(request):
    return web.Response(text="ok")

app = web.Application()
app.router.add_get("/{path:.*}", livez)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
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


def _flood(base: str, paths: str, rate: float, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", FLOOD, base, paths, str(rate), str(seconds)], stdout=subprocess.PIPE, text=True
    )


class _Prober(threading.Thread):
    """The kubelet's probes, as it sends them: a new connection each, 1 s timeout."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.sent = 0
        self.failures: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.5):
            for path in ("/livez", "/readyz"):
                self.sent += 1
                try:
                    with urllib.request.urlopen(self.base + path, timeout=1) as response:
                        response.read()
                except urllib.error.HTTPError as e:
                    self.failures.append(f"{path} {e.code}")
                except OSError as e:
                    self.failures.append(f"{path} {type(e).__name__}")


def _phase(
    kubelet: KubeletSide,
    binary: Path,
    refs: list[tuple[str, str, str]],
    seconds: float,
    flood_url: str | None,
    rate: float,
    paths: str,
    prober: _Prober,
) -> tuple[dict[str, list[float]], dict[str, Any] | None, dict[str, Any]]:
    """Prepare/Unprepare latencies for `seconds`, with a flood of `flood_url` meanwhile if
    given, and what the prober saw meanwhile."""
    sent, failed = prober.sent, len(prober.failures)
    flood = _flood(flood_url, paths, rate, seconds) if flood_url else None
    if flood is not None:
        time.sleep(1)  # the flood at its rate before the first timed call
    latencies: dict[str, list[float]] = {}
    end = time.monotonic() + seconds - (1 if flood else 0)
    while time.monotonic() < end:
        got = kubelet_client.run(binary, Path(kubelet.info.endpoint), refs, 40, 1)
        for phase in ("prepare_sequential", "unprepare_sequential"):
            latencies.setdefault(phase, []).extend(got[phase])
    answers = None
    if flood is not None:
        out, _ = flood.communicate(timeout=seconds + 30)
        answers = json.loads(out)
        answers["achieved_per_second"] = round(answers["sent"] / answers["seconds"], 1)
    probes = {"sent": prober.sent - sent, "failed": prober.failures[failed:]}
    return latencies, answers, probes


def _side(
    label: str,
    env: dict[str, str],
    kinds: list[str],
    cp: Any,
    work: Path,
    claims: list[Any],
    binary: Path,
    seconds: float,
    rate: float,
    elsewhere: str,
    paths: str,
) -> tuple[dict[str, dict[str, list[float]]], list[dict[str, Any]], dict[str, dict[str, Any]]]:
    port = _free_port()
    run_root, _ = _run_root()
    plugin = DriverProcess(
        NODE,
        str(_profile(work / "bench16.yaml")),
        cp.kubeconfig,
        work / f"plugin-{label}",
        extra_args=(
            "--driver-root",
            str(work / "driver-root"),
            "--metrics-port",
            str(port),
            "--metrics-bind-address",
            "127.0.0.1",
        ),
        env=env,
        log_level="info",
        run_root=run_root,
    )
    pooled: dict[str, dict[str, list[float]]] = {}
    floods: list[dict[str, Any]] = []
    probes: dict[str, dict[str, Any]] = {}
    targets = {"quiet": None, "flood": f"http://127.0.0.1:{port}", "elsewhere": elsewhere}
    prober = _Prober(f"http://127.0.0.1:{port}")
    try:
        plugin.start()
        kubelet = KubeletSide(plugin.registration_socket())
        refs = [(c.namespace, c.name, c.uid) for c in claims]
        prober.start()
        for kind in kinds:
            latencies, answers, seen = _phase(
                kubelet, binary, refs, seconds, targets[kind], rate, paths, prober
            )
            for phase, values in latencies.items():
                pooled.setdefault(kind, {}).setdefault(phase, []).extend(values)
            if answers is not None:
                floods.append({"side": label, "target": kind, **answers})
            total = probes.setdefault(kind, {"sent": 0, "failures": 0, "examples": []})
            total["sent"] += seen["sent"]
            total["failures"] += len(seen["failed"])
            total["examples"] = (total["examples"] + seen["failed"])[:5]
            print(f"{label}: {kind} done", file=sys.stderr, flush=True)
        kubelet.close()
    finally:
        prober.stopping.set()
        plugin.stop()
        shutil.rmtree(run_root, ignore_errors=True)
    return pooled, floods, probes


def run(seconds: float, rate: float, cycles: int, baseline_ref: str | None, paths: str) -> dict[str, Any]:
    binary = kubelet_client.build()
    with fresh_control_plane("dra-probe-flood-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        claims = _claims(api)
        _driver_root(work / "driver-root")
        other_port = _free_port()
        other = subprocess.Popen([sys.executable, "-c", ELSEWHERE, str(other_port)])
        elsewhere = f"http://127.0.0.1:{other_port}"
        result: dict[str, Any] = {
            "method": {
                "seconds_per_phase": seconds, "rate_per_second": rate, "cycles": cycles, "paths": paths
            },
        }
        try:
            kinds = ["quiet", "flood", "elsewhere"] * cycles
            current, floods, probes = _side(
                "current", {}, kinds, cp, work, claims, binary, seconds, rate, elsewhere, paths
            )
            result["current"] = {**_summary(current), "probe_failures": probes}
            if baseline_ref:
                side = commit_side(baseline_ref, "baseline")
                base, more, base_probes = _side(
                    "baseline",
                    side.env,
                    ["quiet", "flood"] * cycles,
                    cp,
                    work,
                    claims,
                    binary,
                    seconds,
                    rate,
                    elsewhere,
                    paths,
                )
                result["baseline"] = {"ref": side.describe, **_summary(base), "probe_failures": base_probes}
                floods += more
        finally:
            other.terminate()
            other.wait(timeout=10)
        result["floods"] = floods
    return result


def _summary(pooled: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        kind: {p: _percentiles(v) for p, v in phases.items()} for kind, phases in pooled.items()
    }
    for kind in ("flood", "elsewhere"):
        if kind in summary:
            summary[f"{kind}_to_quiet_p50"] = {
                p: round(summary[kind][p]["p50_ms"] / summary["quiet"][p]["p50_ms"], 3)
                for p in summary["quiet"]
            }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--paths", default="/livez,/metrics", help="the flood's paths, taken in turn")
    parser.add_argument("--baseline-ref", default=None, help="also a commit's plugin, quiet and flood phases")
    args = parser.parse_args()
    report("probe_flood", run(args.seconds, args.rate, args.cycles, args.baseline_ref, args.paths))


if __name__ == "__main__":
    main()
