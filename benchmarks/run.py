"""`make bench`: the benchmarks one after the other, `prepare` (the kubelet plugin), `huge_prepare`
(one 10,000-claim call), `held_claims` (one claim's Prepare with up to 500 held), `slices` (the
ResourceSlice controller), `scheduler` (pods/s through the real kube-scheduler per claim shape)
and `health_storm` (Prepare latency and slice writes during a storm of health events). `slices`
and `scheduler` run a small fleet by default (minutes); `--full` runs them at fleet scale (5,000
nodes' slices; 100, 500 and 1,000 nodes with 5,000 pods: over an hour on 2 cores). The node
tier's figures (`python -m benchmarks.node`, and `python -m benchmarks.why_cpu` on the demo's
cluster) need the node binaries and run apart.

Each starts its own control plane and stops it before the next begins, so no benchmark
shares a machine with another; each one's figures go to benchmarks/results/<name>.json and
are printed as JSON when it ends (the method of each is in its own module's docstring, and
each is still runnable alone: `python -m benchmarks.<name>`). `--only NAME` runs a subset.
This module must NOT measure anything itself nor run two benchmarks at once.

Run: `python -m benchmarks.run [--only prepare] [--only slices] [--full]`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import health_storm, held_claims, huge_prepare, prepare, report, scheduler, slices

BENCHMARKS: dict[str, Callable[[], dict[str, Any]]] = {
    "prepare": prepare.run,
    "huge_prepare": huge_prepare.run,
    "held_claims": held_claims.run,
    "slices": slices.run,
    "scheduler": scheduler.run,
    "health_storm": health_storm.run,
}
# The ones with a fleet-scale size behind --full.
SIZED: dict[str, Callable[[bool], dict[str, Any]]] = {
    "slices": lambda full: slices.run(full=full),
    "scheduler": lambda full: scheduler.run(full=full),
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Run the benchmarks in turn; write benchmarks/results/<name>.json and print each.",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(BENCHMARKS),
        metavar="NAME",
        help=f"run only this benchmark (repeatable; one of: {', '.join(BENCHMARKS)})",
    )
    parser.add_argument("--full", action="store_true",
                        help="slices and scheduler at fleet scale (over an hour) instead of a small fleet")
    args = parser.parse_args(argv)
    for name in args.only or list(BENCHMARKS):
        print(f"== benchmark {name}", flush=True)
        report(name, SIZED[name](args.full) if name in SIZED else BENCHMARKS[name]())


if __name__ == "__main__":
    main()
