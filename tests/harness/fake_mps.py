"""A stand-in for `nvidia-cuda-mps-control`, for MPS tests on machines without a GPU.

It behaves as the real one does towards the driver: `-d` forks a daemon that creates the
control pipe in CUDA_MPS_PIPE_DIRECTORY and logs to CUDA_MPS_LOG_DIRECTORY; client mode
writes its stdin to the pipe; `quit` ends the daemon. `fake.json` beside it switches on
failures (`fail`, `no_pipe`, `ignore_quit`, `shm_marker`). It shares no code with the driver
and is never shipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from dra_driver.sharing.mps.adoption import CLAIM_MARKER_ENV
from dra_driver.sharing.mps.daemon import MpsControl
from dra_driver.sharing.mps.layout import CONTROL_BINARY
from tests.harness.objects import wait_for

FAKE = """#!{python}
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
try:
    mode = json.load(open(os.path.join(here, "fake.json")))
except OSError:
    mode = {{}}
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
logd = os.environ["CUDA_MPS_LOG_DIRECTORY"]
ctl = os.path.join(pipe, "control")

def log(msg):
    with open(os.path.join(logd, "control.log"), "a") as f:
        f.write(msg + "\\n")

if sys.argv[1:] == ["-d"]:
    if mode.get("fail"):
        print("fake: cannot start", file=sys.stderr)
        sys.exit(3)
    if os.fork():
        sys.exit(0)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    with open(os.path.join(logd, "env.json"), "w") as f:
        json.dump(dict(os.environ), f)
    if mode.get("shm_marker"):
        with open("/dev/shm/fake-mps-" + os.environ["{marker}"], "w") as f:
            f.write("x")
    if not mode.get("no_pipe"):
        os.mkfifo(ctl)
    log("started")
    while True:
        with open(ctl) as f:
            for line in f:
                log("cmd " + line.strip())
                if line.strip() == "quit" and not mode.get("ignore_quit"):
                    os.unlink(ctl)
                    sys.exit(0)
else:
    data = sys.stdin.read()
    with open(ctl, "w") as f:
        f.write(data)
    print("ok")
"""



def install_fake_mps_control(driver_root: Path, python: str = sys.executable) -> Path:
    """Put the stand-in at `<driver_root>/bin/nvidia-cuda-mps-control`; returns its path.
    `python`: the interpreter where it runs (the driver image's, in a plugin pod)."""
    (driver_root / "bin").mkdir(parents=True, exist_ok=True)
    binary = driver_root / "bin" / CONTROL_BINARY
    binary.write_text(FAKE.format(python=python, marker=CLAIM_MARKER_ENV))
    binary.chmod(0o755)
    return binary


def mps_driver_root(root: Path) -> Path:
    """A driver root at `root` for a plugin whose claims use MPS: ELF files under the real
    library names (the scanner keeps only those) and the stand-in MPS control tool."""
    lib = root / "lib64"
    lib.mkdir(parents=True)
    elf = Path("/bin/true").resolve()
    for name in ("libcuda.so", "libnvidia-ml.so"):
        real = lib / f"{name}.580.159.04"
        shutil.copy(elf, real)
        (lib / f"{name}.1").symlink_to(real.name)
    install_fake_mps_control(root)
    return root


def set_mode(fake_bin: Path, **mode: bool) -> None:
    (fake_bin.parent / "fake.json").write_text(json.dumps(mode))


def kill_daemons(mps: MpsControl, claim_uid: str, timeout: float = 10.0) -> None:
    """SIGKILL the claim's MPS processes and wait until they are gone: a killed process runs
    on until the kernel has ended it, and one still exiting carries the claim's marker, so a
    check made right after the kill can still find it alive (it did under load)."""
    for pid in mps.daemon_pids(claim_uid):
        os.kill(pid, signal.SIGKILL)
    wait_for("the killed MPS daemon to be gone", lambda: not mps.daemon_pids(claim_uid) or None, timeout)


def run_unique_uid(prefix: str) -> str:
    """A claim UID that starts with `prefix` (8 characters) and that no other test run on this
    machine uses: the driver finds a claim's MPS processes by their claim marker among all
    processes, so two runs of one test at once (two checkouts) would stop each other's daemons."""
    return prefix + str(uuid.uuid4())[len(prefix) :]


@contextlib.contextmanager
def shared_mps_root(prefix: str) -> Iterator[Path]:
    """A fresh folder under /tmp (socket paths must stay short) with the stand-in control
    binary in driver/, for plugins that share one MPS root (mps/); afterwards every MPS
    daemon still running there is stopped and the folder removed."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)  # MPS servers run as the client's user: the MPS root must be searchable
    install_fake_mps_control(path / "driver")
    try:
        yield path
    finally:
        mps = MpsControl(path / "mps", path / "driver")
        for uid in mps.claim_uids():
            mps.stop(uid)
        shutil.rmtree(path, ignore_errors=True)
