"""Measured figures, each runnable alone (`python -m benchmarks.<name>`); all in turn: `benchmarks.run`."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.harness.cluster import ControlPlane

RESULTS = Path(__file__).parent / "results"


@contextmanager
def fresh_control_plane(prefix: str) -> Iterator[tuple[ControlPlane, Path]]:
    """A control plane of its own in a new scratch directory under /tmp; both gone afterwards."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    cp = ControlPlane.start(work_dir=work / "cluster")
    try:
        yield cp, work
    finally:
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(name: str, result: dict[str, Any]) -> None:
    """Write one benchmark's figures to benchmarks/results/<name>.json, stamped with where and
    when they were measured, print them as JSON, and render docs/performance.md from them."""
    from benchmarks import render  # here: render imports this package

    text = json.dumps({**result, "measured": measured_at()}, indent=2)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(text + "\n")
    print(text, flush=True)
    try:
        render.main([])
    except render.ResultsError as e:  # the figures are written; the page waits for a layout
        print(f"docs/performance.md not rendered: {e}", file=sys.stderr)


def measured_at() -> dict[str, Any]:
    """The commit (with `+changes` if the tree differs from it), the UTC time, the machine's
    1-minute load average and the command, for docs/performance.md to show beside the figures."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown (no git)"
    if git("status", "--porcelain", "--untracked-files=no").strip():
        commit += "+changes"
    return {
        "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cores": os.cpu_count(),
        "command": " ".join(["python -m benchmarks." + Path(sys.argv[0]).stem, *sys.argv[1:]]),
    }
