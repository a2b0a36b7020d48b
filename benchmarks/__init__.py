"""Measured figures, each runnable alone (`python -m benchmarks.<name>`); all in turn: `benchmarks.run`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def report(name: str, result: dict[str, Any]) -> None:
    """Write one benchmark's figures to benchmarks/results/<name>.json and print them as JSON."""
    text = json.dumps(result, indent=2)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(text + "\n")
    print(text, flush=True)
