"""Test modules of tests/unit and tests/integration have basenames of their own: neither folder
is a package, so pytest imports both by basename, and two of one name stop the collection of
the whole suite ("import file mismatch"), which only a full `make test` shows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    names = Counter(p.name for folder in ("unit", "integration") for p in (TESTS / folder).glob("test_*.py"))
    assert not [n for n, count in names.items() if count > 1], names.most_common(3)
