"""`make test-versions`: the version matrix (issue 41), outside CI's time budget.

For each Kubernetes version (newest patch of 1.34, 1.35, 1.36, 1.37; DRA_VERSIONS to choose)
it builds the control plane (hack/cluster/build.sh, cached per version; the build's wall
time is printed), then runs a selection of integration tests twice: with the version's
default feature gates (a stock cluster) and with its DRA gates on. tests/integration/
test_versions.py records what the publisher carried on each; the end is a table version x
feature -> on / off (with the warning), and which runs passed.

    python -m tests.harness.versions [--versions v1.34.4,v1.35.4] [--keep-going]

It must NOT decide what a version can carry (the tests' expectations do) nor install anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests.harness.cluster import BUILD_SCRIPT, REPO_ROOT

VERSIONS = ("v1.34.4", "v1.35.4", "v1.36.3", "v1.37.2")
TESTS = (
    "tests/integration/test_versions.py",
    "tests/integration/test_chart_versions.py",
    "tests/integration/test_slice_controller.py",
)
FEATURES = ("--memory-shares", "--dynamic-mig", "device health taints", "list attributes")


def _say(line: str) -> None:
    print(f"[versions] {line}", file=sys.stderr, flush=True)


def build(version: str) -> tuple[Path, float]:
    t0 = time.monotonic()
    proc = subprocess.run(["nice", "-n", "10", "bash", str(BUILD_SCRIPT), version], stdout=subprocess.PIPE,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the control-plane build of {version} failed (exit {proc.returncode})")
    return Path(proc.stdout.strip().splitlines()[-1]), time.monotonic() - t0


def run_tests(version: str, gates: str, bin_dir: Path, report: Path) -> bool:
    env = {**os.environ, "DRA_K8S_VERSION": version, "DRA_FEATURE_GATES": gates,
           "DRA_CLUSTER_BIN": str(bin_dir), "DRA_VERSIONS_REPORT": str(report)}
    _say(f"{version}, {gates} gates: pytest {' '.join(TESTS)}")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                          env=env, cwd=REPO_ROOT, check=False)
    return proc.returncode == 0


def table(records: list[dict[str, object]], passed: dict[tuple[str, str], bool]) -> str:
    rows = ["| Kubernetes | gates | " + " | ".join(FEATURES) + " | tests |",
            "|---|---|" + "---|" * len(FEATURES) + "---|"]
    for rec in records:
        off = set(rec["off"])  # type: ignore[call-overload]
        cells = ["off (warning)" if f in off else "on" for f in FEATURES[:3]]
        cells.append("on" if rec["list_attributes"] else "off")
        ok = passed.get((str(rec["version"]), str(rec["gates"])))
        rows.append(f"| {rec['version']} | {rec['gates']} | " + " | ".join(cells) +
                    f" | {'pass' if ok else 'FAIL'} |")
    return "\n".join(rows)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.versions")
    parser.add_argument("--versions", default=os.environ.get("DRA_VERSIONS", ",".join(VERSIONS)))
    args = parser.parse_args(argv)
    report = Path(tempfile.mkstemp(prefix="dra-versions-", suffix=".jsonl")[1])
    passed: dict[tuple[str, str], bool] = {}
    builds: dict[str, float] = {}
    for version in args.versions.split(","):
        bin_dir, seconds = build(version)
        builds[version] = seconds
        _say(f"{version}: control plane in {bin_dir} ({seconds:.0f} s; a cached one takes about 1 s)")
        for gates in ("default", "all"):
            passed[(version, gates)] = run_tests(version, gates, bin_dir, report)
    records = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
    print(table(records, passed))
    print("\nbuild wall time: " + ", ".join(f"{v} {s:.0f} s" for v, s in builds.items()))
    report.unlink()
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
