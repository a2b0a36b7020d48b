"""The CPU of one `kubectl gpu why` on the demo's cluster, beside `kubectl describe pod`.

Method: the demo as a user keeps it (`make demo DEMO_ARGS=--keep`, tests.harness.kept_demo:
four real nodes, every example running, one pod pending on purpose), then each command run
`--runs` times (default 20) in the shell the demo prints, the commands interleaved round by
round so that drift on the machine hits all alike, each after one untimed run. A run's CPU is
the user + system time of its process and its children, from `os.wait4`'s rusage (kubectl
execs a plugin in its own process, so `kubectl gpu why` is counted whole); its wall time from
`time.monotonic`. Per command: p50 (median) and max of each. The commands: `kubectl gpu why`
on the pending pod (whose selector is evaluated on every device) and on a running pod,
`dra-driver explain` on the pending pod, `kubectl describe pod` on it. `limit_cpu_s` is the
budget of issue 51; `within_limit` says whether every run of every `why` kept to it.

Run alone: `python -m benchmarks.why_cpu [--runs N]` (root; it starts real kubelets: one node
tier at a time on a machine); writes benchmarks/results/why_cpu.json. Never asserted in tests:
the figures depend on the machine (2 cores here, shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import report
from tests.harness.kept_demo import KeptDemo, kept_demo

LIMIT_CPU_S = 0.3
PENDING = "too-big-200gi"
RUNNING = "nvlink-pair"
COMMANDS: dict[str, str] = {
    "kubectl gpu why, the pending pod": f"kubectl gpu why -n gpu-demo {PENDING}",
    "kubectl gpu why, a running pod": f"kubectl gpu why -n gpu-demo {RUNNING}",
    "dra-driver explain, the pending pod": f"dra-driver explain -n gpu-demo {PENDING}",
    "kubectl describe pod, the pending pod": f"kubectl describe pod -n gpu-demo {PENDING}",
}


def timed(demo: KeptDemo, command: str, cwd: Path) -> tuple[float, float]:
    """(user + system CPU s, wall s) of one command line, typed in the demo's shell."""
    start = time.monotonic()
    proc = subprocess.Popen(command.split(), cwd=cwd, env=demo.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed ({proc.returncode}): "
                           f"{proc.stderr.read().decode() if proc.stderr else ''}")
    if proc.stderr:
        proc.stderr.close()
    return usage.ru_utime + usage.ru_stime, wall


def _summary(samples: Sequence[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(samples), 3), "max": round(max(samples), 3)}


def run(runs: int = 20) -> dict[str, Any]:
    cpu: dict[str, list[float]] = {name: [] for name in COMMANDS}
    wall: dict[str, list[float]] = {name: [] for name in COMMANDS}
    with kept_demo() as demo, tempfile.TemporaryDirectory(prefix="why-cpu-") as cwd:
        for command in COMMANDS.values():
            timed(demo, command, Path(cwd))  # untimed: the first run fills the page cache
        for _ in range(runs):
            for name, command in COMMANDS.items():
                c, w = timed(demo, command, Path(cwd))
                cpu[name].append(round(c, 3))
                wall[name].append(round(w, 3))
    worst_why = max(max(v) for k, v in cpu.items() if "why" in k or "explain" in k)
    return {
        "runs": runs,
        "demo": " ".join(demo.command),
        "limit_cpu_s": LIMIT_CPU_S,
        "within_limit": worst_why <= LIMIT_CPU_S,
        "commands": {
            name: {"command": COMMANDS[name], "cpu_s": _summary(cpu[name]), "wall_s": _summary(wall[name]),
                   "cpu_samples_s": cpu[name]}
            for name in COMMANDS
        },
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.why_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs of each command (default 20)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    report("why_cpu", run(args.runs))


if __name__ == "__main__":
    main()
