"""`make test-versions`: the version matrix (issue 41), outside CI's time budget.

For each Kubernetes version (newest patch of 1.34, 1.35, 1.36, 1.37; DRA_VERSIONS to choose)
it builds the control plane (hack/cluster/build.sh, cached per version; the build's wall
time is printed), then runs a selection of integration tests twice: with the version's
default feature gates (a stock cluster) and with its DRA gates on. tests/integration/
test_versions.py records what the publisher carried on each; the end is a table version x
feature -> on / off (with the warning), and which runs passed. Then, with the version's
default gates, the node-tier smoke (tests/node/test_version_smoke.py: the chart installed with
helm on a real kubelet of that version, built by hack/node/build.sh and cached per version;
a whole-GPU pod, a memory share, a dynamic MIG slice), and a second table of what ran there.
DRA_HEAVY_LOCK=<file> runs each node-tier smoke under `flock <file>` (a shared machine).

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
from tests.harness.node import BUILD_SCRIPT as NODE_BUILD_SCRIPT
from tests.harness.node import SETUP_SCRIPT as NODE_SETUP_SCRIPT

VERSIONS = ("v1.34.4", "v1.35.4", "v1.36.3", "v1.37.2")
TESTS = (
    "tests/integration/test_versions.py",
    "tests/integration/test_chart_versions.py",
    "tests/integration/test_slice_controller.py",
)
NODE_TESTS = ("tests/node/test_version_smoke.py",)
NODE_FEATURES = ("whole GPU", "share", "MIG", "sick GPU", "warnings")
FEATURES = ("--memory-shares", "--dynamic-mig", "device health taints", "list attributes")


def _say(line: str) -> None:
    print(f"[versions] {line}", file=sys.stderr, flush=True)


def build(version: str, script: Path = BUILD_SCRIPT, what: str = "control-plane") -> tuple[Path, float]:
    t0 = time.monotonic()
    proc = subprocess.run(["nice", "-n", "10", "bash", str(script), version], stdout=subprocess.PIPE,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {what} build of {version} failed (exit {proc.returncode})")
    return Path(proc.stdout.strip().splitlines()[-1]), time.monotonic() - t0


def run_node_smoke(version: str, bin_dir: Path, node_bin: Path, report: Path) -> bool:
    env = {**os.environ, "DRA_K8S_VERSION": version, "DRA_FEATURE_GATES": "default",
           "DRA_CLUSTER_BIN": str(bin_dir), "DRA_NODE_BIN": str(node_bin), "DRA_VERSIONS_REPORT": str(report)}
    lock = os.environ.get("DRA_HEAVY_LOCK")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NODE_TESTS]
    _say(f"{version}, default gates: node-tier smoke, pytest {' '.join(NODE_TESTS)}")
    proc = subprocess.run(["flock", lock, *argv] if lock else argv, env=env, cwd=REPO_ROOT, check=False)
    return proc.returncode == 0


def node_table(records: list[dict[str, object]], passed: dict[str, bool]) -> str:
    rows = ["| Kubernetes (default gates, real kubelet) | " + " | ".join(NODE_FEATURES) + " | smoke |",
            "|---|" + "---|" * len(NODE_FEATURES) + "---|"]
    for version, ok in passed.items():
        cells = {str(r["feature"]): str(r["outcome"]) for r in records if r["version"] == version}
        rows.append(f"| {version} | " + " | ".join(cells.get(f, "-") for f in NODE_FEATURES) +
                    f" | {'pass' if ok else 'FAIL'} |")
    return "\n".join(rows)


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
    parser.add_argument("--no-node", action="store_true", help="skip the node-tier smoke (needs root)")
    args = parser.parse_args(argv)
    report = Path(tempfile.mkstemp(prefix="dra-versions-", suffix=".jsonl")[1])
    passed: dict[tuple[str, str], bool] = {}
    node_passed: dict[str, bool] = {}
    builds: dict[str, float] = {}
    node_builds: dict[str, float] = {}
    if not args.no_node:
        subprocess.run(["bash", str(NODE_SETUP_SCRIPT)], check=True, stdin=subprocess.DEVNULL)
    for version in args.versions.split(","):
        bin_dir, seconds = build(version)
        builds[version] = seconds
        _say(f"{version}: control plane in {bin_dir} ({seconds:.0f} s; a cached one takes about 1 s)")
        for gates in ("default", "all"):
            passed[(version, gates)] = run_tests(version, gates, bin_dir, report)
        if not args.no_node:
            node_bin, seconds = build(version, NODE_BUILD_SCRIPT, "kubelet")
            node_builds[version] = seconds
            _say(f"{version}: kubelet and containerd in {node_bin} ({seconds:.0f} s)")
            node_passed[version] = run_node_smoke(version, bin_dir, node_bin, report)
    records = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
    print(table([r for r in records if not r.get("node")], passed))
    print("\nbuild wall time: " + ", ".join(f"{v} {s:.0f} s" for v, s in builds.items()))
    if node_passed:
        print("\n" + node_table([r for r in records if r.get("node")], node_passed))
        print("\nkubelet build wall time: " + ", ".join(f"{v} {s:.0f} s" for v, s in node_builds.items()))
    report.unlink()
    return 0 if all(passed.values()) and all(node_passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
