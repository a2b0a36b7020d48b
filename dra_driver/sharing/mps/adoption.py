"""What a plugin finds of the MPS daemons a previous plugin left: whose root this is, which
claims have a directory, what each daemon was started with, and which processes are a claim's.

A daemon outlives the plugin that started it (`MpsControl`'s `host_cgroup`), so a restarted
plugin adopts it from what is on disk and in /proc: its processes carry a marker variable in
their environment (`GPU_DRA_MPS_CLAIM=<uid>`), so a stop after a plugin restart finds them
too, and a PID reused by another process does not pass for the daemon. The owner file
refuses a root that another driver's plugin uses; a root without one (kept from a release
that wrote none) is refused while a daemon lives in it for a claim this driver does not
know, since that daemon is another driver's and adopting the root would stop it.

It reads; the only write is the owner file of a root nobody owns. It must not start, signal
or remove anything (that is `dra_driver.sharing.mps.daemon`'s).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Set
from pathlib import Path
from typing import Final

import structlog

from dra_driver.atomic import write_file_atomic
from dra_driver.sharing.mps.errors import MpsRootInUse, MpsRootOfAnotherDriver, MpsRootRefused
from dra_driver.sharing.mps.layout import OWNER_FILE, ClaimDirs
from dra_driver.sharing.mps.settings import MpsSettings

log = structlog.get_logger(__name__)

CLAIM_MARKER_ENV: Final = "GPU_DRA_MPS_CLAIM"


def claim_root(root: Path, driver: str, known: Callable[[], Set[str]], api_unanswered: bool = False) -> None:
    """Make the MPS root this driver's, at start and before anything under it is read:
    raises MpsRootOfAnotherDriver if another driver's owner file is there (as the
    checkpoint refuses a state dir of another driver). A root without one (new, or kept by
    a build before owner files) is taken unless a daemon lives in it for a claim that
    `known()` (this driver's claims) does not name: then MpsRootInUse, nothing written.
    `api_unanswered`: `known` lacks the API server's answer, which it could not give."""
    path = root / OWNER_FILE
    try:
        owner = json.loads(path.read_text()).get("driver")
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError, AttributeError) as e:
        raise MpsRootRefused(f"MPS root owner file {path} cannot be read ({e}); remove it if no other "
                       "driver uses this MPS root, and restart this plugin") from None
    if owner is not None and owner != driver:
        raise MpsRootOfAnotherDriver(root, str(owner), driver)
    if owner is None:
        # The live daemons first, this driver's claims after: an instance of this driver
        # records a claim before it starts its daemon, so one started meanwhile is known.
        live = live_claims(root)
        foreign = live - known() if live else frozenset()
        if foreign:
            raise MpsRootInUse(root, driver, foreign, api_unanswered)
        root.mkdir(parents=True, exist_ok=True, mode=0o755)
        write_file_atomic(path, json.dumps({"driver": driver}).encode())


def live_claims(root: Path) -> frozenset[str]:
    """Claims with a directory here whose daemon (or a server of it) is alive, found by
    the claim marker in one pass over /proc."""
    dirs = claim_uids(root)
    if not dirs:
        return frozenset()
    markers = (_marker(pid) for pid in _proc_pids())
    return frozenset(uid for uid in markers if uid is not None and uid in dirs)


def claim_uids(root: Path) -> frozenset[str]:
    """Claims that have a daemon directory here (running or not)."""
    try:
        return frozenset(p.name for p in root.iterdir() if p.is_dir())
    except FileNotFoundError:
        return frozenset()


def saved_settings(dirs: ClaimDirs, claim_uid: str) -> MpsSettings | None:
    try:
        text = dirs.settings.read_text()
    except FileNotFoundError:
        return None
    try:
        return MpsSettings.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as e:
        log.error(
            "unreadable MPS settings file; treating the daemon as unknown",
            claim_uid=claim_uid,
            error=str(e),
        )
        return None


def daemon_pids(claim_uid: str) -> tuple[int, ...]:
    """Processes (control daemon, servers) started for this claim, found by their marker.
    With the host's PID namespace that includes those an earlier plugin started."""
    return tuple(sorted(pid for pid in _proc_pids() if has_marker(pid, claim_uid)))


def daemon_pid(dirs: ClaimDirs, claim_uid: str) -> int | None:
    """The claim's control daemon from its pid file, if that process is alive and is
    the claim's (a PID reused by another process does not carry the claim's marker)."""
    try:
        pid = int(dirs.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if has_marker(pid, claim_uid) else None


def has_marker(pid: int, claim_uid: str) -> bool:
    return _marker(pid) == claim_uid


def _marker(pid: int) -> str | None:
    prefix = f"{CLAIM_MARKER_ENV}=".encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return None
    found = next((v for v in environ if v.startswith(prefix)), None)
    return found[len(prefix):].decode(errors="replace") if found is not None else None


def _proc_pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
