"""The kubelet plugin's memory as a node runs it: real GPUs through NVML where there are
some, as the chart runs it.

Method: a real control plane (etcd, kube-apiserver); one `dra-driver kubelet-plugin` for
this machine's GPUs (`--simulate PROFILE` for a simulated box instead, as on a machine
without one), with the chart's metrics port (on 127.0.0.1) and
MALLOC_ARENA_MAX (benchmarks.prepare._charted_env) and its `info` logging, its driver root
`$DRA_DRIVER_ROOT` (default /usr/local/nvidia if it has bin/, else benchmarks.prepare's
stand-in root). The process's VmRSS, RssAnon and RssFile from /proc are read:
* `registered`: 2 s after the kubelet registration socket answered;
* `served`: after a GET of /readyz, /livez and /metrics and `--cycles` Prepare/Unprepare
  cycles (kubelet's protocol, from this process) of one claim allocated gpu-0 by an admin
  write (default 1,000), then 2 s idle (the claim's status written and released);
* `peak`: VmHWM at the end.
Start to registered and the CPU spent to get there are recorded beside them, and the CPU
the process spends idle (`idle_cpu_ms_per_second`: its CPU time, benchmarks.cpu_clock, over
IDLE_S after the cycles, no call; on a GPU host the health monitor waits on real NVML
events, where benchmarks.prepare runs simulated GPUs).

`served_rss_kib_by_mapping`: where the served RSS is (benchmarks.plugin_profile.rss_by_mapping).
With `--profile DIR`, after every figure: a profile (py-spy samples and per-thread CPU) of
500 more cycles and of IDLE_S idle.

Run alone: `python -m benchmarks.node_rss [--simulate PROFILE] [--cycles N] [--profile DIR]` (figures as
JSON on stdout, written to benchmarks/results/node_rss.json). On the GPU host:
`H200_FOR=bench` carry, `H200_BENCH=node_rss` (hack/h200/run.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import fresh_control_plane, plugin_profile, report
from benchmarks.prepare import (
    NODE,
    _charted_env,
    _claims,
    _cpu_s,
    _driver_root,
    _free_port,
    _run_root,
    start_timed,
)
from dra_driver.health import history
from tests.harness.driver import DriverProcess
from tests.harness.kubelet import KubeletSide, prepared_cdi_ids
from tests.harness.objects import create_node, sync_client

SETTLE_S = 2.0
IDLE_S = 20.0  # seconds without a call over which idle CPU is read


def _memory(pid: int) -> dict[str, int]:
    wanted = {"VmRSS": "rss_kib", "RssAnon": "anon_kib", "RssFile": "file_kib", "VmHWM": "peak_kib"}
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in wanted:
            found[wanted[key]] = int(value.split()[0])
    return found


def _host_driver_root(work: Path) -> tuple[str, str]:
    explicit = os.environ.get("DRA_DRIVER_ROOT")
    if explicit:
        return explicit, "$DRA_DRIVER_ROOT"
    if Path("/usr/local/nvidia/bin").is_dir():
        return "/usr/local/nvidia", "the host's"
    return str(_driver_root(work / "driver-root")), "stand-ins (benchmarks.prepare)"


PROFILE_CYCLES = 500
LOG_TAIL_BYTES = 1 << 20


def _health_seen(history_file: Path, log_path: Path, metrics_port: int) -> dict[str, Any]:
    """What the health monitor saw while the figures were taken: its NVML waits by how they
    ended (gpu_dra_health_monitor_waits_total: a quiet monitor times out once per check), the
    history file's event count and registrations, and its log lines."""
    doc = history.read(history_file) or {}
    with log_path.open("rb") as log:  # its last MiB: a plugin's log grows with every call
        log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        tail = log.read().decode(errors="replace")
    lines = [line for line in tail.splitlines() if "health" in line or "NVML" in line][-20:]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
        waits = {
            sample.labels["result"]: sample.value
            for family in text_string_to_metric_families(answer.read().decode())
            if family.name == "gpu_dra_health_monitor_waits"
            for sample in family.samples
            if sample.name.endswith("_total")
        }
    return {"waits": waits, "events_seen": doc.get("eventsSeen"), "monitor": doc.get("monitor"), "log": lines}


def run(simulate: str | None, cycles: int, profile_dir: Path | None = None) -> dict[str, Any]:
    with fresh_control_plane("dra-node-rss-") as (cp, work):
        api = sync_client(str(cp.kubeconfig))
        create_node(api, NODE)
        claim = _claims(api)[0]  # allocated gpu-0 of NODE
        root, root_kind = _host_driver_root(work)
        run_root, _ = _run_root()
        port = _free_port()
        plugin = DriverProcess(
            NODE, simulate or "", cp.kubeconfig, work / "plugin",
            extra_args=("--driver-root", root, "--metrics-port", str(port),
                        "--metrics-bind-address", "127.0.0.1"),
            env=_charted_env(), log_level="info", run_root=run_root,
        )
        try:
            to_registered, pid, start_cpu = start_timed(plugin)
            kubelet = KubeletSide(plugin.registration_socket())
            time.sleep(SETTLE_S)
            registered = _memory(pid)
            for path in ("/readyz", "/livez", "/metrics"):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
                    answer.read()
            for i in range(cycles):
                _, error = prepared_cdi_ids(kubelet.prepare(claim), claim.uid)
                if error:
                    raise RuntimeError(f"Prepare of {claim.namespace}/{claim.name} (gpu-0) failed: {error}")
                kubelet.unprepare(claim)
                if (i + 1) % 250 == 0:
                    print(f"{i + 1} of {cycles} cycles", file=sys.stderr, flush=True)
            time.sleep(SETTLE_S)
            served = _memory(pid)
            idle_start = _cpu_s(pid)
            time.sleep(IDLE_S)
            idle_cpu = _cpu_s(pid) - idle_start
            rss_by_mapping = plugin_profile.rss_by_mapping(pid)
            health = _health_seen(plugin.data_dir / history.FILE_NAME, plugin.log_path, port)
            profile = {}
            if profile_dir is not None:
                with plugin_profile.profiled(pid, "node-cycles", profile_dir) as busy:
                    for _ in range(PROFILE_CYCLES):
                        kubelet.prepare(claim)
                        kubelet.unprepare(claim)
                with plugin_profile.profiled(pid, "node-idle", profile_dir) as idle:
                    time.sleep(IDLE_S)
                profile = {f"{PROFILE_CYCLES}_cycles": busy.as_dict(), f"idle_{IDLE_S:g}_s": idle.as_dict()}
            kubelet.close()
        finally:
            plugin.stop()
    return {
        "gpus": f"simulated: {simulate}" if simulate else "this machine's, through NVML",
        "driver_root": root_kind,
        "cycles": cycles,
        "start_to_registered_s": round(to_registered, 3),
        "start_cpu_s": round(start_cpu, 3),
        "registered": registered,
        "served": served,
        "idle_cpu_ms_per_second": round(idle_cpu / IDLE_S * 1000, 2),
        "served_rss_kib_by_mapping": rss_by_mapping,
        "health_monitor": health,
        **({"profile": profile} if profile else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", help="a simulated profile instead of this machine's GPUs")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument(
        "--profile", type=Path, metavar="DIR",
        help=f"after the figures, profile the plugin over {PROFILE_CYCLES} more cycles and {IDLE_S:g} s idle"
        " (benchmarks.plugin_profile); raw samples into DIR",
    )
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    report("node_rss", run(args.simulate, args.cycles, args.profile))


if __name__ == "__main__":
    main()
