"""docs/performance.md is what `python -m benchmarks.render` makes of benchmarks/results/*.json:
a results file changed without re-rendering the page fails here, so the page never shows a
figure the files do not hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.render import PAGE, RESULTS, ResultsError, render


def test_the_committed_page_is_the_rendered_results() -> None:
    assert PAGE.read_text() == render(RESULTS), (
        "docs/performance.md is stale: run python -m benchmarks.render"
    )


def test_a_changed_result_changes_the_page(tmp_path: Path) -> None:
    for f in RESULTS.glob("*.json"):
        (tmp_path / f.name).write_text(f.read_text())
    health = json.loads((tmp_path / "health_storm.json").read_text())
    health["fatal_xid_to_slice_taint_s"] = 123.456
    (tmp_path / "health_storm.json").write_text(json.dumps(health))
    page = render(tmp_path)
    assert page != PAGE.read_text()
    assert "| 123.456 |" in page


def test_a_file_without_a_layout_is_rendered_flat(tmp_path: Path) -> None:
    (tmp_path / "new_bench.json").write_text(
        json.dumps({"commit": "abc1234", "p50_ms": 1.5, "nested": {"n": 3}})
    )
    page = render(tmp_path)
    assert "## new_bench" in page and "| p50_ms | 1.5 |" in page and "| nested.n | 3 |" in page
    assert "commit: abc1234" in page


def test_a_result_missing_a_shown_value_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "huge_prepare.json").write_text(json.dumps({"claims": 1}))
    with pytest.raises(ResultsError, match=r"huge_prepare.json.*prepare_seconds"):
        render(tmp_path)


def test_each_table_says_when_and_where_it_was_measured() -> None:
    page = PAGE.read_text()
    sections = page.split("\n## ")[1:]
    assert sections
    for section in sections:
        assert "Measured at: " in section, section.splitlines()[0]


def test_a_benchmark_report_is_stamped_and_rendered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks
    from benchmarks import render as render_module

    monkeypatch.setattr(benchmarks, "RESULTS", tmp_path)
    monkeypatch.setattr(render_module, "RESULTS", tmp_path)
    monkeypatch.setattr(render_module, "PAGE", tmp_path / "performance.md")
    benchmarks.report("huge_prepare", json.loads((RESULTS / "huge_prepare.json").read_text()))
    stamp = json.loads((tmp_path / "huge_prepare.json").read_text())["measured"]
    assert set(stamp) == {"commit", "date", "load_average_1m", "cores", "command"}
    page = (tmp_path / "performance.md").read_text()
    assert f"commit: {stamp['commit']}; date: {stamp['date']}" in page
    assert "not recorded in the file" not in page
