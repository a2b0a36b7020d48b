"""dra_driver.kube holds at most a bounded part of what the API server sends.

Each test runs tests/unit/kube_bounds_child.py in a subprocess (a fake aiohttp API server
and the client in one loop) and reads the growth of that process's peak RSS, so that a
client that holds a whole 1 GiB answer fails here without the test process paying for it.
The bounds asserted are far from both sides: the bounded client grows by tens of MiB, a
client that holds the answer by hundreds (the chart's memory limit is 512 MiB).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def _child(scenario: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.kube_bounds_child", scenario],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_a_1_gib_answer_is_refused_with_a_clear_error_after_the_cap() -> None:
    got = _child("huge")
    assert "TooLarge" in got.get("error", ""), got
    assert "larger than 16 MiB" in got["error"]
    assert got["requests"] == 1  # not retried
    assert got["grew_mib"] < 80, got


def test_a_150_mib_list_is_read_in_pages_well_under_the_charts_limit() -> None:
    got = _child("list")
    assert got.get("kept") == ["claim-480", "claim-7"], got
    assert got["grew_mib"] < 128, got  # the chart's limit is 512 MiB
    assert all("limit=" in q for q in got["queries"]), got["queries"]


def test_a_500_with_a_large_body_is_read_once_in_part_and_not_retried() -> None:
    got = _child("error500")
    assert got.get("error", "").startswith("ApiException: HTTP 500"), got
    assert "not read further" in got["error"]
    assert got["requests"] == 1, got
    assert got["grew_mib"] < 32, got


def test_a_watch_event_over_the_cap_is_an_error_not_an_oom() -> None:
    got = _child("watchline")
    assert "TooLarge" in got.get("error", ""), got
    assert got["grew_mib"] < 80, got
