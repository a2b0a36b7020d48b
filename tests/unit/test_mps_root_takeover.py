"""An MPS root without an owner file (kept from a release that wrote none) is taken only when
no daemon of another driver lives in it (issue 49, item 5): a live process carrying the claim
marker of a claim this driver has not prepared refuses the root, names the fix (another
--mps-root) and leaves the root and the process as they were; a root whose daemons are gone,
or are all this driver's, is taken.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.sharing.mps import adoption
from dra_driver.sharing.mps.adoption import CLAIM_MARKER_ENV
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.errors import MpsRootInUse
from dra_driver.sharing.mps.layout import OWNER_FILE
from tests.harness.fake_mps import run_unique_uid

DRIVER = "gpu.dra-driver.dev"


@pytest.fixture
def daemon_of_another_driver(tmp_path: Path) -> Iterator[tuple[Path, str, subprocess.Popen[bytes]]]:
    """A root as an older release of another driver leaves it: a claim's directory and a
    live process carrying that claim's marker, no owner file."""
    root = tmp_path / "mps"
    uid = run_unique_uid("takeover")
    (root / uid / "pipe").mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, CLAIM_MARKER_ENV: uid},
    )
    try:
        yield root, uid, proc
    finally:
        proc.kill()
        proc.wait()


def _tree(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*"))


def test_a_root_with_a_live_daemon_of_an_unknown_claim_is_refused_and_left_alone(
    daemon_of_another_driver: tuple[Path, str, subprocess.Popen[bytes]],
) -> None:
    root, uid, proc = daemon_of_another_driver
    mps = MpsControl(root, "/nonexistent")
    assert mps.live_claims() == {uid}
    before = _tree(root)
    with pytest.raises(MpsRootInUse, match=r"has no owner file, and MPS daemons live in it for claims "
                       + uid + r".*Give each release its own MPS root \(--mps-root") as refused:
        mps.claim_root(DRIVER, lambda: {"a-claim-of-this-driver"})
    assert refused.value.claims == {uid}
    assert "could not say" not in str(refused.value)
    assert _tree(root) == before and not (root / OWNER_FILE).exists()
    assert proc.poll() is None, "the other driver's daemon was stopped"


def test_the_refusal_says_when_the_api_server_could_not_say_whose_claim_it_is(
    daemon_of_another_driver: tuple[Path, str, subprocess.Popen[bytes]],
) -> None:
    root = daemon_of_another_driver[0]
    with pytest.raises(MpsRootInUse, match="the API server could not say"):
        MpsControl(root, "/nonexistent").claim_root(DRIVER, frozenset, api_unanswered=True)


def test_a_root_whose_live_daemons_are_all_this_drivers_is_taken(
    daemon_of_another_driver: tuple[Path, str, subprocess.Popen[bytes]],
) -> None:
    root, uid, proc = daemon_of_another_driver
    MpsControl(root, "/nonexistent").claim_root(DRIVER, lambda: {uid})
    assert (root / OWNER_FILE).exists() and proc.poll() is None


def test_a_root_whose_daemons_are_gone_is_taken(
    daemon_of_another_driver: tuple[Path, str, subprocess.Popen[bytes]],
) -> None:
    root, _, proc = daemon_of_another_driver
    proc.kill()
    proc.wait()
    mps = MpsControl(root, "/nonexistent")
    assert mps.live_claims() == frozenset()
    mps.claim_root(DRIVER, frozenset)
    assert (root / OWNER_FILE).exists()


def test_this_drivers_claims_are_read_after_the_live_daemons(
    daemon_of_another_driver: tuple[Path, str, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance of this driver records a claim before it starts its daemon: with the
    claims read after the daemons are found, a daemon started meanwhile is known."""
    root, uid, _ = daemon_of_another_driver
    order: list[str] = []
    real = adoption.live_claims

    def live(r: Path) -> frozenset[str]:
        order.append("live")
        return real(r)

    def known() -> set[str]:
        order.append("known")
        return {uid}

    monkeypatch.setattr(adoption, "live_claims", live)
    MpsControl(root, "/nonexistent").claim_root(DRIVER, known)
    assert order == ["live", "known"]
