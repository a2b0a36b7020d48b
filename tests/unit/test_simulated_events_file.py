"""The simulated health control file is followed only while no one but the plugin's user
can have written it: refused (with the reason and the command that fixes it) when it is
readable or writable by others, owned by another user, a symlink, or too big; created 0600
when missing; over-long lines are skipped."""

from __future__ import annotations

import json
import os
from pathlib import Path

from structlog.testing import capture_logs

from dra_driver.gpu.sim.events import MAX_FILE_BYTES, MAX_LINE_BYTES, FakeEventSource

LOST = json.dumps({"gpu": 1, "lost": True}) + "\n"


def _refusals(logs: list[dict[str, object]]) -> list[str]:
    return [str(e["problem"]) for e in logs if e["event"] == "simulated health control file refused"]


def test_a_missing_file_is_created_owner_only(tmp_path: Path) -> None:
    control = tmp_path / "events.jsonl"
    FakeEventSource(2, control)
    st = control.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o600, os.geteuid())


def test_a_file_others_may_write_is_refused_until_fixed(tmp_path: Path) -> None:
    control = tmp_path / "events.jsonl"
    source = FakeEventSource(2, control)
    control.chmod(0o666)
    with control.open("a") as f:
        f.write(LOST)
    with capture_logs() as logs:
        source.poll()
        source.poll()
    assert not source.is_lost(1)
    assert _refusals(logs) == [f"has mode 0666; others could inject events: chmod 600 {control}"]
    control.chmod(0o600)
    source.poll()
    assert source.is_lost(1)


def test_another_owner_a_symlink_or_a_huge_file_is_refused(tmp_path: Path) -> None:
    control = tmp_path / "events.jsonl"
    control.write_text(LOST)
    control.chmod(0o600)
    os.chown(control, os.geteuid() + 1, -1)
    with capture_logs() as logs:
        source = FakeEventSource(2, control)
    assert not source.is_lost(1)
    assert _refusals(logs) == [
        f"is owned by uid {os.geteuid() + 1}, not by the plugin's uid {os.geteuid()}: "
        f"chown {os.geteuid()} {control}"
    ]

    real = tmp_path / "real.jsonl"
    real.write_text(LOST)
    real.chmod(0o600)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    with capture_logs() as logs:
        source = FakeEventSource(2, link)
    assert not source.is_lost(1) and "without following a link" in _refusals(logs)[0]

    huge = tmp_path / "huge.jsonl"
    huge.write_bytes(LOST.encode() * (MAX_FILE_BYTES // len(LOST) + 1))
    huge.chmod(0o600)
    with capture_logs() as logs:
        source = FakeEventSource(2, huge)
    assert not source.is_lost(1) and f"more than {MAX_FILE_BYTES}" in _refusals(logs)[0]


def test_an_overlong_line_is_skipped(tmp_path: Path) -> None:
    control = tmp_path / "events.jsonl"
    source = FakeEventSource(2, control)
    with control.open("a") as f:
        f.write("x" * (MAX_LINE_BYTES + 1))  # no end of line yet: it cannot grow without bound
    with capture_logs() as logs:
        source.poll()
    assert any("longer than" in str(e.get("problem")) for e in logs)
    with control.open("a") as f:
        f.write("\n" + LOST)
    source.poll()
    assert source.is_lost(1)
