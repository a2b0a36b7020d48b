"""The daemons' common start path (`run_until_signalled`): SIGUSR2 dumps every thread's
stack to stderr and the daemon goes on; SIGTERM then stops it cleanly. Run in a child
process, as the daemon runs, since a signal handler is the process's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import asyncio, threading, time
from dra_driver.signals import run_until_signalled

def a_worker_thread_waits():
    time.sleep(3600)

threading.Thread(target=a_worker_thread_waits, name="worker", daemon=True).start()

async def the_daemon():
    print("ready", flush=True)
    await asyncio.sleep(3600)

run_until_signalled(the_daemon())
print("stopped", flush=True)
"""


def _wait_for(child: subprocess.Popen[bytes], path: Path, *texts: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text()
        if all(t in content for t in texts):
            return content
        if child.poll() is not None:
            raise AssertionError(f"the child exited ({child.returncode}):\n{content}")
        time.sleep(0.05)
    raise AssertionError(f"{texts} not all in {path.name} after {timeout} s:\n{path.read_text()}")


def test_sigusr2_dumps_every_threads_stack_to_stderr_and_the_daemon_carries_on(tmp_path: Path) -> None:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=stdout, stderr=stderr,
                                 cwd=Path(__file__).resolve().parents[2])
    try:
        _wait_for(child, out, "ready")
        os.kill(child.pid, signal.SIGUSR2)
        # every thread's stack, not just the one the signal hit: the worker's and the main
        # thread's, in the event loop under run_until_signalled
        dump = _wait_for(child, err, "in a_worker_thread_waits", "in run_until_signalled")
        assert dump.count("hread 0x") >= 2, dump
        assert child.poll() is None, "SIGUSR2 must not stop the daemon"
        os.kill(child.pid, signal.SIGTERM)
        assert child.wait(timeout=20) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "stopped" in out.read_text()
