"""An NVML event storm against a running kubelet plugin: events handled per second, the lag of a
fatal XID injected mid-storm, the plugin's CPU, Prepare latency beside quiet, slice writes.

Method: a real control plane (etcd, kube-apiserver) and one `dra-driver kubelet-plugin`
subprocess for a simulated 16-GPU node (the profile and driver root of benchmarks.prepare),
publishing its slices, with its metrics port on. Its simulated NVML follows a control file
(`--simulate-health-events`); the storm is appended there and comes out of the plugin's real
NVML event wait, so it costs the plugin what a real storm would (event wait, attribution,
coalescing, classification, the state machine), not a shortcut.

First the monitor's own CPU: `ALONE_SECONDS` idle, then as long with the storm's rate of
informational events and nothing else (the plugin's CPU per second of each). Then phases
with sequential Prepare + Unprepare cycles of claims on GPUs 4..15 (never touched by the
storm) timed on the client side of the socket, as in benchmarks.prepare:
1. quiet, `QUIET_SECONDS`: no events;
2. storm, `--storm-seconds` (default 20): informational XID 13 on GPU 0 at `STORM_RATE`
   (10,000/s). Halfway through, one fatal XID 79 (recovery action gpu-reset) on GPU 3: its
   lag is the time from appending it to the control file until the API server's
   ResourceSlice shows GPU 3 tainted (slices polled every 20 ms; the taint write itself
   included);
3. drain: until the plugin has counted every injected event (its `gpu_dra_health_events_total`
   counter, read from /metrics every 0.5 s): how late the last storm event was handled;
4. capacity: `BURST` informational events injected at once (all due, no rate): the rate at
   which the plugin counts them is the most it can handle, the margin over the storm. Right
   behind them one fatal XID on `BACKLOG_GPU`, which NVML's queue holds behind the whole
   burst: its lag to the slice's taint, and how many burst events were still unread then
   (the periodic check's reading of NVML's recovery action, not the event, taints it).
Handled rate: events counted during the storm / the storm's seconds (the offered rate when
the plugin keeps up). Plugin CPU: utime + stime from /proc per second of each phase.
ResourceSlice writes: the API server's own count (`apiserver_request_total` for
resourceslices, every verb but get/list/watch) before and after each phase.

Run alone: `python -m benchmarks.health_storm [--storm-seconds N]` (prints JSON; writes
benchmarks/results/health_storm.json).
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import cpu_clock, fresh_control_plane, report
from benchmarks.prepare import GPUS, _driver_root, _percentiles, _profile
from tests.harness.cluster import ControlPlane, free_port
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_node, sync_client, sync_request

NODE = "storm-node"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims"
QUIET_SECONDS = 10.0
ALONE_SECONDS = 5.0
STORM_RATE = 10_000
STORM_GPU, FATAL_GPU, BACKLOG_GPU = 0, 3, 2
DRAIN_DEADLINE = 180.0
BURST = 200_000
_WRITE = re.compile(
    r'^apiserver_request_total\{(?=[^}]*resource="resourceslices")(?=[^}]*verb="([A-Z]+)")[^}]*\}\s+(\S+)$'
)
_EVENTS = re.compile(r'^gpu_dra_health_events_total\{kind="([^"]+)"\}\s+(\S+)$', re.M)


def slice_writes(cp: ControlPlane) -> int:
    """Writes to ResourceSlices the API server has answered so far (all clients: only the plugin writes)."""
    status, text = cp.get("/metrics", timeout=30)
    assert status == 200, text[:300]
    total = 0.0
    for line in text.splitlines():
        m = _WRITE.match(line)
        if m and m.group(1) not in ("GET", "LIST", "WATCH"):
            total += float(m.group(2))
    return int(total)


def cpu_seconds(pid: int) -> float:
    """The process's CPU time (benchmarks.cpu_clock: to the nanosecond, not in ticks)."""
    return cpu_clock.process_cpu_ns(pid) / 1e9


def _counts(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {kind: float(v) for kind, v in _EVENTS.findall(text)}


def events_counted(port: int) -> int:
    """NVML events the plugin has counted (every kind), from its /metrics."""
    return int(sum(v for kind, v in _counts(port).items() if kind not in ("unhealthy", "recovered")))


def unhealthy_transitions(port: int) -> int:
    """Devices the plugin has turned unhealthy so far (its keeper's transitions)."""
    return int(_counts(port).get("unhealthy", 0))


def node_taints(api: Any) -> dict[str, list[str]]:
    slices = sync_request(api, "GET", "/apis/resource.k8s.io/v1/resourceslices",
                          query={"fieldSelector": f"spec.nodeName={NODE}"})["items"]
    return {
        d["name"]: [f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in d["taints"]]
        for s in slices for d in s["spec"].get("devices", []) if d.get("taints")
    }


def _claims(api: Any) -> list[ClaimName]:
    claims = []
    for i in range(GPUS):
        claim = sync_request(api, "POST", CLAIMS, {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": f"c{i}"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "any"}}]}},
        })
        claim["status"] = {"allocation": {"devices": {
            "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": f"gpu-{i}"}]
        }}}
        claim = sync_request(api, "PUT", f"{CLAIMS}/c{i}/status", claim)
        claims.append(ClaimName("bench", f"c{i}", claim["metadata"]["uid"]))
    return claims


def _cycles(kubelet: KubeletSide, claims: list[ClaimName], seconds: float) -> list[float]:
    """Prepare + Unprepare cycles over `claims` for `seconds`; the Prepare latencies."""
    samples: list[float] = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        claim = claims[i % len(claims)]
        t = time.perf_counter()
        response = kubelet.prepare(claim)
        samples.append(time.perf_counter() - t)
        assert not [r.error for r in response.claims.values() if r.error]
        kubelet.unprepare(claim)
        i += 1
    return samples


def _inject(control: Path, record: dict[str, Any]) -> None:
    """One line for the plugin's simulated NVML (dra_driver.gpu.sim.events)."""
    with control.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _fatal_lag(api: Any, control: Path, port: int, gpu: int = FATAL_GPU) -> tuple[float, float]:
    """Append one fatal XID for `gpu`; seconds until the plugin turned that GPU unhealthy
    (its metrics), and until the slice shows it tainted."""
    device = f"gpu-{gpu}"
    unhealthy = unhealthy_transitions(port)
    _inject(control, {"gpu": gpu, "xid": 79, "recovery_action": 1})
    start = time.monotonic()
    handled = 0.0
    while device not in node_taints(api):
        if not handled and unhealthy_transitions(port) > unhealthy:
            handled = time.monotonic() - start
        assert time.monotonic() - start < DRAIN_DEADLINE, "the fatal XID never tainted its GPU"
        time.sleep(0.02)
    tainted = time.monotonic() - start
    return handled or tainted, tainted


def run(storm_seconds: float = 20.0) -> dict[str, Any]:
    with fresh_control_plane("dra-storm-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        sync_request(api, "POST", "/api/v1/namespaces",
                     {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}})
        claims = _claims(api)
        control = work / "events.jsonl"
        port = free_port()
        plugin = DriverProcess(
            NODE, str(_profile(work / "bench16.yaml")), cp.kubeconfig, work / "p",
            extra_args=("--driver-root", str(_driver_root(work / "driver-root")), "--metrics-port", str(port),
                        "--metrics-bind-address", "127.0.0.1", "--simulate-health-events", str(control)),
        )
        plugin.start(wait=True)
        assert plugin.proc is not None
        pid = plugin.proc.pid
        kubelet = KubeletSide(plugin.registration_socket())
        deadline = time.monotonic() + 60
        while not sync_request(api, "GET", "/apis/resource.k8s.io/v1/resourceslices",
                               query={"fieldSelector": f"spec.nodeName={NODE}"})["items"]:
            assert time.monotonic() < deadline, plugin.log_tail()
            time.sleep(0.2)
        spare = claims[4:]
        _cycles(kubelet, spare, 2.0)  # warm-up
        time.sleep(2)

        cpu_idle0 = cpu_seconds(pid)
        time.sleep(ALONE_SECONDS)  # what is measured: the idle plugin's CPU over this time
        cpu_idle1, counted_alone0 = cpu_seconds(pid), events_counted(port)
        alone = int(STORM_RATE * ALONE_SECONDS)
        _inject(control, {"gpu": STORM_GPU, "xid": 13, "per_second": STORM_RATE, "repeat": alone})
        alone_start = time.monotonic()
        while events_counted(port) - counted_alone0 < alone:
            assert time.monotonic() - alone_start < DRAIN_DEADLINE, "the storm alone was never counted"
            time.sleep(0.1)
        alone_seconds, cpu_alone = time.monotonic() - alone_start, cpu_seconds(pid) - cpu_idle1

        writes0, cpu0, t0 = slice_writes(cp), cpu_seconds(pid), time.monotonic()
        quiet = _cycles(kubelet, spare, QUIET_SECONDS)
        writes1, cpu1, t1 = slice_writes(cp), cpu_seconds(pid), time.monotonic()

        injected = int(STORM_RATE * storm_seconds)
        counted0 = events_counted(port)
        _inject(control, {"gpu": STORM_GPU, "xid": 13, "per_second": STORM_RATE, "repeat": injected})
        storm_start = time.monotonic()
        storm: list[float] = []
        cycler = threading.Thread(target=lambda: storm.extend(_cycles(kubelet, spare, storm_seconds)))
        cycler.start()
        time.sleep(storm_seconds / 2)
        fatal_handled, fatal_tainted = _fatal_lag(api, control, port)
        cycler.join()
        storm_end = time.monotonic()
        counted_at_end = events_counted(port) - counted0
        writes2, cpu2 = slice_writes(cp), cpu_seconds(pid)

        while (counted := events_counted(port) - counted0) < injected + 1:
            assert time.monotonic() - storm_end < DRAIN_DEADLINE, f"{counted} of {injected + 1} counted"
            time.sleep(0.5)
        drained_after = time.monotonic() - storm_end

        counted0, cpu3 = events_counted(port), cpu_seconds(pid)
        _inject(control, {"gpu": STORM_GPU, "xid": 13, "repeat": BURST})
        burst_start = time.monotonic()
        _, backlog_tainted = _fatal_lag(api, control, port, BACKLOG_GPU)
        unread_at_taint = BURST - (events_counted(port) - counted0)
        while (counted := events_counted(port) - counted0) < BURST:
            assert time.monotonic() - burst_start < DRAIN_DEADLINE, f"{counted} of {BURST} counted"
            time.sleep(0.1)
        burst_seconds, burst_cpu = time.monotonic() - burst_start, cpu_seconds(pid) - cpu3
        kubelet.close()
        plugin.stop()

        quiet_p, storm_p = _percentiles(quiet), _percentiles(storm)
        storm_wall = storm_end - storm_start
        return {
            "storm_events_per_second_offered": STORM_RATE,
            "storm_seconds": round(storm_wall, 2),
            "events_injected": injected + 1,
            "events_handled_per_second_in_storm": round(counted_at_end / storm_wall),
            "last_storm_event_handled_after_storm_end_s": round(drained_after, 2),
            "fatal_xid_to_unhealthy_s": round(fatal_handled, 3),
            "fatal_xid_to_slice_taint_s": round(fatal_tainted, 3),
            "capacity_events_per_second": round(BURST / burst_seconds),
            "plugin_cpu_us_per_event_at_capacity": round(burst_cpu / BURST * 1e6, 1),
            "fatal_xid_behind_backlog_to_slice_taint_s": round(backlog_tainted, 3),
            "burst_events_unread_at_that_taint": unread_at_taint,
            "plugin_cpu_cores_idle": round((cpu_idle1 - cpu_idle0) / ALONE_SECONDS, 3),
            "plugin_cpu_cores_storm_alone": round(cpu_alone / alone_seconds, 3),
            "plugin_cpu_cores_quiet": round((cpu1 - cpu0) / (t1 - t0), 3),
            "plugin_cpu_cores_storm": round((cpu2 - cpu1) / storm_wall, 3),
            "prepare_quiet": quiet_p,
            "prepare_storm": storm_p,
            "storm_to_quiet_p50": round(storm_p["p50_ms"] / quiet_p["p50_ms"], 2),
            "storm_to_quiet_p99": round(storm_p["p99_ms"] / quiet_p["p99_ms"], 2),
            "slice_writes_quiet": writes1 - writes0,
            "slice_writes_storm": writes2 - writes1,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storm-seconds", type=float, default=20.0)
    report("health_storm", run(parser.parse_args().storm_seconds))


if __name__ == "__main__":
    main()
