"""An NVML event storm against a running kubelet plugin: Prepare latency and ResourceSlice writes.

Method: a real control plane (etcd, kube-apiserver) and one `dra-driver kubelet-plugin`
subprocess for a simulated 16-GPU node (the profile and driver root of benchmarks.prepare),
publishing its slices, with `--health-quiet-period 2`. Its simulated NVML follows a control
file (`--simulate-health-events`); the storm is appended there and comes out of the plugin's
real NVML event wait, so it costs the plugin what a real storm would (event wait, attribution,
coalescing, classification, the state machine), not a shortcut.

Phases, each `PHASE_SECONDS` long, with sequential Prepare + Unprepare cycles of claims on
GPUs 4..15 (never touched by the storm) timed on the client side of the socket, as in
benchmarks.prepare:
1. quiet: no events;
2. storm: on GPU 0 informational XID 13 at 5,000/s and fatal XID 79 (recovery action
   gpu-reset) at 1,000/s; on GPU 1 double-bit ECC at 1,000/s; on GPU 2 single-bit ECC at
   2,000/s (9,000 events/s in all);
3. recovery: `recover` for GPUs 0 and 1, then until their taints are gone.
ResourceSlice writes are the API server's own count (`apiserver_request_total` for
resourceslices, every verb but get/list/watch) read before and after each phase; the
plugin's CPU time comes from /proc. The figure that matters is the ratio of storm p50 (and
p99) to quiet; the slice writes must be a handful, not one per event.

Run alone: `python -m benchmarks.health_storm` (prints JSON; writes benchmarks/results/health_storm.json).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import fresh_control_plane, report
from benchmarks.prepare import GPUS, _driver_root, _percentiles, _profile
from tests.harness.cluster import ControlPlane
from tests.harness.driver import DRIVER, DriverProcess
from tests.harness.kubelet import ClaimName, KubeletSide
from tests.harness.objects import create_node, sync_client, sync_request

NODE = "storm-node"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims"
PHASE_SECONDS = 10.0
STORM = (
    {"gpu": 0, "xid": 13, "per_second": 5000},
    {"gpu": 0, "xid": 79, "recovery_action": 1, "per_second": 1000},
    {"gpu": 1, "event": "double-bit-ecc", "per_second": 1000},
    {"gpu": 2, "event": "single-bit-ecc", "per_second": 2000},
)
_WRITE = re.compile(
    r'^apiserver_request_total\{(?=[^}]*resource="resourceslices")(?=[^}]*verb="([A-Z]+)")[^}]*\}\s+(\S+)$'
)


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
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def run() -> dict[str, Any]:
    with fresh_control_plane("dra-storm-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        sync_request(api, "POST", "/api/v1/namespaces",
                     {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}})
        claims = _claims(api)
        control = work / "events.jsonl"
        plugin = DriverProcess(
            NODE, str(_profile(work / "bench16.yaml")), cp.kubeconfig, work / "p",
            extra_args=("--driver-root", str(_driver_root(work / "driver-root")),
                        "--health-quiet-period", "2", "--simulate-health-events", str(control)),
        )
        plugin.start(wait=True)
        assert plugin.proc is not None
        kubelet = KubeletSide(plugin.registration_socket())
        deadline = time.monotonic() + 60
        while not sync_request(api, "GET", "/apis/resource.k8s.io/v1/resourceslices",
                               query={"fieldSelector": f"spec.nodeName={NODE}"})["items"]:
            assert time.monotonic() < deadline, plugin.log_tail()
            time.sleep(0.2)
        spare = claims[4:]
        _cycles(kubelet, spare, 2.0)  # warm-up
        time.sleep(2)

        writes0, cpu0 = slice_writes(cp), cpu_seconds(plugin.proc.pid)
        quiet = _cycles(kubelet, spare, PHASE_SECONDS)
        writes1, cpu1 = slice_writes(cp), cpu_seconds(plugin.proc.pid)

        repeat = {k: int(r["per_second"] * PHASE_SECONDS) for k, r in enumerate(STORM)}
        with control.open("a") as f:
            for k, record in enumerate(STORM):
                f.write(json.dumps({**record, "repeat": repeat[k]}) + "\n")
        storm_start = time.monotonic()
        storm = _cycles(kubelet, spare, PHASE_SECONDS)
        storm_seconds = time.monotonic() - storm_start
        taints_in_storm = node_taints(api)
        time.sleep(3)  # the storm's tail and the last coalesced write
        writes2, cpu2 = slice_writes(cp), cpu_seconds(plugin.proc.pid)
        health = json.loads((plugin.data_dir / "health.json").read_text())

        with control.open("a") as f:
            f.writelines(json.dumps({"gpu": g, "recover": True}) + "\n" for g in (0, 1))
        recover_start = time.monotonic()
        while node_taints(api):
            assert time.monotonic() - recover_start < 60, node_taints(api)
            time.sleep(0.1)
        recovered_after = time.monotonic() - recover_start
        time.sleep(2)
        writes3 = slice_writes(cp)
        kubelet.close()
        plugin.stop()

        injected = sum(repeat.values())
        quiet_p, storm_p = _percentiles(quiet), _percentiles(storm)
        return {
            "events_injected": injected,
            "events_per_second_offered": sum(int(r["per_second"]) for r in STORM),
            "events_seen_by_plugin": health["eventsSeen"],
            "storm_seconds": round(storm_seconds, 2),
            "prepare_quiet": quiet_p,
            "prepare_storm": storm_p,
            "storm_to_quiet_p50": round(storm_p["p50_ms"] / quiet_p["p50_ms"], 2),
            "storm_to_quiet_p99": round(storm_p["p99_ms"] / quiet_p["p99_ms"], 2),
            "prepares_quiet": len(quiet),
            "prepares_storm": len(storm),
            "slice_writes_quiet": writes1 - writes0,
            "slice_writes_storm": writes2 - writes1,
            "slice_writes_recovery": writes3 - writes2,
            "taints_during_storm": taints_in_storm,
            "untainted_after_recover_s": round(recovered_after, 2),
            "plugin_cpu_s_quiet": round(cpu1 - cpu0, 2),
            "plugin_cpu_s_storm": round(cpu2 - cpu1, 2),
            "event_counts_gpu0": health["devices"]["gpu-0"]["counts"],
            "quiet_p50_stdev_ms": round(statistics.pstdev(quiet) * 1000, 3),
        }


def main() -> None:
    report("health_storm", run())


if __name__ == "__main__":
    main()
