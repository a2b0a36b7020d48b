"""Stand-ins for `nvidia-imex` and `nvidia-imex-ctl`, for ComputeDomain tests without a rack.

They behave as the real tools do towards the driver: `nvidia-imex -c CFG` runs in the
foreground (the driver's config says DAEMONIZE=0), reads its peers from the config's
IMEX_NODE_CONFIG_FILE, re-reads them on SIGUSR1 and ends on SIGTERM; `nvidia-imex-ctl -c CFG -q`
prints READY once the daemon is up (and exits 1 with NOT_READY before). `fake-imex.json` beside
them sets how long a daemon takes to become ready (`ready_after`, seconds) and makes it fail
(`fail`). What the daemon saw goes to `fake-imex.state` beside its config. It shares no code
with the driver and is never shipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

DAEMON = """#!{python}
import json, os, signal, sys, time
here = os.path.dirname(os.path.abspath(__file__))
try:
    mode = json.load(open(os.path.join(here, "fake-imex.json")))
except OSError:
    mode = {{}}
cfg = sys.argv[sys.argv.index("-c") + 1]
settings = dict(l.strip().split("=", 1) for l in open(cfg) if "=" in l)
state_file = os.path.join(os.path.dirname(cfg), "fake-imex.state")
if mode.get("fail"):
    print("fake imex: cannot start", file=sys.stderr)
    sys.exit(3)
state = {{"pid": os.getpid(), "ready_at": time.time() + float(mode.get("ready_after", 0)), "reloads": 0,
         "settings": settings, "marker": os.environ.get("{marker}")}}

def save():
    state["peers"] = open(settings["IMEX_NODE_CONFIG_FILE"]).read().split()
    tmp = state_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, state_file)

def reload(*_):
    state["reloads"] += 1
    save()

def end(*_):
    os.unlink(state_file)
    sys.exit(0)

signal.signal(signal.SIGUSR1, reload)
signal.signal(signal.SIGTERM, end)
save()
while True:
    time.sleep(3600)
"""

CONTROL = """#!{python}
import json, os, sys, time
cfg = sys.argv[sys.argv.index("-c") + 1]
try:
    state = json.load(open(os.path.join(os.path.dirname(cfg), "fake-imex.state")))
    os.kill(state["pid"], 0)
except (OSError, ValueError):
    print("NOT_READY")
    sys.exit(1)
if time.time() < state["ready_at"]:
    print("NOT_READY")
    sys.exit(1)
print("READY")
"""


def install_fake_imex(driver_root: Path, python: str = sys.executable) -> Path:
    """Put the stand-ins at `<driver_root>/usr/bin/`; returns the directory."""
    from dra_driver.imex.daemons import CONTROL_BINARY, DAEMON_BINARY, MARKER_ENV

    bin_dir = driver_root / "usr" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in ((DAEMON_BINARY, DAEMON), (CONTROL_BINARY, CONTROL)):
        (bin_dir / name).write_text(text.format(python=python, marker=MARKER_ENV))
        (bin_dir / name).chmod(0o755)
    return bin_dir


def set_imex_mode(bin_dir: Path, **mode: object) -> None:
    (bin_dir / "fake-imex.json").write_text(json.dumps(mode))


def daemon_state(imex_root: Path, domain_uid: str) -> dict[str, object] | None:
    """What the domain's stand-in daemon saw (None: not running)."""
    try:
        data: dict[str, object] = json.loads((imex_root / domain_uid / "fake-imex.state").read_text())
    except (OSError, ValueError):
        return None
    return data


def stop_stand_ins(root: Path) -> list[int]:
    """SIGKILL the stand-in daemons started under `root` that are still running: a daemon outlives
    its plugin by design, so a test that fails before unpreparing would leave them behind."""
    killed = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"/nvidia-imex") for a in argv) and any(str(root).encode() in a for a in argv):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed
