"""`make bench`: the benchmarks one after the other, `prepare` (the kubelet plugin), `huge_prepare`
(one 10,000-claim call), `slices` (the ResourceSlice controller) and `health_storm` (Prepare
latency and slice writes during a storm of health events). The node tier's figures
(`python -m benchmarks.node`) need the node binaries and run apart.

Each starts its own control plane and stops it before the next begins, so no benchmark
shares a machine with another; each one's figures go to benchmarks/results/<name>.json and
are printed as JSON when it ends (the method of each is in its own module's docstring, and
each is still runnable alone: `python -m benchmarks.<name>`). `--only NAME` runs a subset.
This module must NOT measure anything itself nor run two benchmarks at once.

Run: `python -m benchmarks.run [--only prepare] [--only slices]`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import health_storm, huge_prepare, prepare, report, slices

BENCHMARKS: dict[str, Callable[[], dict[str, Any]]] = {
    "prepare": prepare.run,
    "huge_prepare": huge_prepare.run,
    "slices": slices.run,
    "health_storm": health_storm.run,
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
    args = parser.parse_args(argv)
    for name in args.only or list(BENCHMARKS):
        print(f"== benchmark {name}", flush=True)
        report(name, BENCHMARKS[name]())


if __name__ == "__main__":
    main()
