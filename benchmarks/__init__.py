"""Measured figures, each runnable alone (`python -m benchmarks.<name>`); all in turn: `benchmarks.run`."""

from __future__ import annotations

import json
import shutil
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
    """Write one benchmark's figures to benchmarks/results/<name>.json and print them as JSON."""
    text = json.dumps(result, indent=2)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(text + "\n")
    print(text, flush=True)
