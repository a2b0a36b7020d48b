"""Start cost of the kubelet plugin: CPU seconds from exec to registered, beside an older commit.

Method: `dra-driver kubelet-plugin` (the real command, `python -m dra_driver`, JSON logs at
`info` as the chart runs it) for a simulated 16-GPU node (the profile of benchmarks.prepare),
fresh kubelet, CDI and state dirs per start, default flags (slice publishing and the health
monitor on). Its kubeconfig names an API server that does not answer (https://127.0.0.1:1)
and one CA certificate, as a pod's service account does: nothing on the way to registration
asks the API server with fresh state, and what starts after registration (the probe port,
the slice publisher) is not timed. The plugin renames its registration socket into the
kubelet's registry only once that socket's server is started, so it answers from the moment
it appears: the benchmark polls the registry every millisecond and at the socket's
appearance reads the plugin's /proc/<pid>/stat (utime + stime, and its children's, in clock
ticks) and the wall time since the spawn; it then checks that the socket answers GetInfo
and stops the plugin. (Polling GetInfo itself, every 20 ms, let the plugin's
post-registration work run into the figure.) Sides alternate B C C B B C ... so that drift on the
machine hits both alike; each side's figure is the median of its starts (each start's own in
`per_start`). The baseline side runs its commit from a git worktree with the same
interpreter (benchmarks.prepare.commit_side). Every module of each side is imported and
byte-compiled once first, so no timed start compiles.

Run alone: `python -m benchmarks.start [--baseline-ref REF] [--starts N]` (default: d20fbb0,
10 starts per side; progress on stderr, the figures as JSON on stdout; writes
benchmarks/results/start.json).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.prepare import Side, _profile, check_imports, commit_side, working_tree_side
from tests.harness.driver import DriverProcess

RESULTS = Path(__file__).resolve().parent / "results" / "start.json"
NODE = "bench-start"
TICKS = os.sysconf("SC_CLK_TCK")
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:1", certificate-authority: ca.crt}}]
users: [{name: none, user: {token: none}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
"""


def one_ca(path: Path) -> Path:
    """One CA certificate (the first of the system's bundle), as a cluster's CA file: the client
    then loads that one certificate, as in a pod, not the system's whole store."""
    bundle = Path(ssl.get_default_verify_paths().openssl_cafile).read_text()
    end = "-----END CERTIFICATE-----"
    path.write_text(bundle[bundle.index("-----BEGIN CERTIFICATE-----"):bundle.index(end) + len(end)] + "\n")
    return path


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of `pid` from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return sum(int(f) for f in fields[11:15]) / TICKS  # fields 14-17 of proc(5), from state (3) on


def one_start(side: Side, work: Path, index: int) -> dict[str, float]:
    """Spawn one plugin of `side`, wait for GetInfo, read its CPU; stop it."""
    kubeconfig = work / "kubeconfig"
    plugin = DriverProcess(NODE, str(work / "bench16.yaml"), kubeconfig, work / f"{side.label}-{index}",
                           env=side.env, log_level="info")
    registry = plugin.kubelet_dir / "plugins_registry"
    t0 = time.perf_counter()
    plugin.start(wait=False)
    try:
        while not (registry.is_dir() and any(p.is_socket() for p in registry.glob("*-reg.sock"))):
            plugin.check_alive()
            if time.perf_counter() - t0 > 60:
                raise TimeoutError(f"no registration socket in {registry}:\n{plugin.log_tail()}")
            time.sleep(0.001)
        cpu = cpu_seconds(plugin.pid)
        wall = time.perf_counter() - t0
        plugin.wait_serving(timeout=60)
    finally:
        plugin.stop()
    return {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3)}


def run(baseline_ref: str | None, starts: int) -> dict[str, Any]:
    sides = [working_tree_side()] + ([commit_side(baseline_ref, "baseline")] if baseline_ref else [])
    for side in sides:
        check_imports(side)
    order = [s for k in range(starts) for s in (sides[::-1] if k % 2 == 0 else sides)]  # B C C B ...
    samples: dict[str, list[dict[str, float]]] = {s.label: [] for s in sides}
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        work = Path(tmp)
        _profile(work / "bench16.yaml")
        one_ca(work / "ca.crt")
        (work / "kubeconfig").write_text(KUBECONFIG)
        for i, side in enumerate(order):
            sample = one_start(side, work, i)
            samples[side.label].append(sample)
            print(f"start {i + 1}/{len(order)} {side.label}: {sample['cpu_s']:.3f} s CPU,"
                  f" {sample['wall_s']:.3f} s wall", file=sys.stderr)
    median = {
        label: {k: round(statistics.median(s[k] for s in own), 3) for k in ("cpu_s", "wall_s")}
        for label, own in samples.items()
    }
    result: dict[str, Any] = {
        "measured": {
            "commit": sides[0].describe,
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "cores": os.cpu_count(),
            "command": f"python -m benchmarks.start --baseline-ref '{baseline_ref or ''}' --starts {starts}",
        },
        "code": {side.label: side.describe for side in sides},
        "start_cpu_to_registered_s": {label: m["cpu_s"] for label, m in median.items()},
        "start_wall_to_registered_s": {label: m["wall_s"] for label, m in median.items()},
        "per_start": samples,
    }
    if baseline_ref:
        result["current_to_baseline"] = {
            f"start_{k}": round(median["current"][k] / median["baseline"][k], 2) for k in ("cpu_s", "wall_s")
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.start", description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-ref", default="d20fbb0", help="the commit to compare with ('' for none)")
    parser.add_argument("--starts", type=int, default=10, help="starts per side")
    args = parser.parse_args(argv)
    result = run(args.baseline_ref or None, args.starts)
    text = json.dumps(result, indent=2)
    RESULTS.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
