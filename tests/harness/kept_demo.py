"""The demo's cluster as a user gets it: `make demo DEMO_ARGS=--keep`, run as a process, read
until it prints how to use it, then used with what it printed and stopped as it says.

For tests/node/test_readme_commands.py (the README's commands typed on that cluster) and
benchmarks/why_cpu.py. Where this Python is the checkout's own `.venv` (a clone's `make test`),
it runs `make demo DEMO_ARGS=--keep`; with another environment (a worktree sharing a venv) it
runs what `make demo` runs after its build steps, `python -m demo.run --keep`, since make would
reinstall the driver into that environment. It must NOT import demo/ (the demo is run, not
called), nor leave the demo running: the process group goes when the context ends.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEPT = "Left running (--keep)"
STOP = re.compile(r"^To stop it .*: Ctrl-C here, or kill (\d+)$")


class DemoFailed(RuntimeError):
    """The demo ended or stalled before it kept its cluster; the message carries its output."""


@dataclass
class KeptDemo:
    """A running demo: its output so far, the shell it told the user to set up, its pid."""

    command: tuple[str, ...]
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)  # everything printed, growing while it runs
    env: dict[str, str] = field(default_factory=dict)  # os.environ with its `export` lines applied
    suggested: tuple[str, ...] = ()  # the commands it suggested, as printed
    pid: int = 0  # the process it says to kill
    _reader: threading.Thread | None = None
    _queue: queue.Queue[str | None] = field(default_factory=queue.Queue)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def shell(self, command: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """One command line as typed in the shell the demo told the user to set up."""
        return subprocess.run(["bash", "-c", command], cwd=cwd, env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)

    def stop(self) -> int:
        """Stopped as it says (kill PID), or its process group where it never said; waited for,
        its last lines (the teardown's) read into `lines`; its exit status."""
        if self.proc.poll() is None:
            if self.pid:
                os.kill(self.pid, signal.SIGTERM)
            else:
                os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)
        while not self._queue.empty():
            line = self._queue.get()
            if line is not None:
                self.lines.append(line)
        return self.proc.returncode


def demo_command() -> tuple[str, ...]:
    venv = Path(sys.executable).parent.parent
    if venv.resolve() == (ROOT / ".venv").resolve():
        return ("make", "demo", "DEMO_ARGS=--keep")
    return (sys.executable, "-m", "demo.run", "--keep")


def _exports(lines: list[str], base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.pop("KUBERNETES_SERVICE_HOST", None)  # kubectl and the commands would read in-cluster config
    for line in lines:
        match = re.fullmatch(r"\s*export (\w+)=(\S+)", line)
        if match:
            env[match[1]] = match[2].replace("$PATH", base.get("PATH", ""))
    return env


@contextmanager
def kept_demo(timeout: float = 600) -> Iterator[KeptDemo]:
    """The demo up with its cluster kept; stopped on exit (KeptDemo.stop) unless stopped before."""
    command = demo_command()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    demo = KeptDemo(command, proc)
    lines = demo._queue

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    demo._reader = threading.Thread(target=read, daemon=True)
    demo._reader.start()
    try:
        deadline = time.monotonic() + timeout
        kept: list[str] | None = None
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise DemoFailed(f"{' '.join(command)} did not keep its cluster in {timeout:.0f} s:\n"
                                 + demo.output) from None
            if line is None:
                raise DemoFailed(f"{' '.join(command)} ended (exit {proc.wait()}) before keeping its "
                                 f"cluster:\n{demo.output}")
            demo.lines.append(line)
            if line.startswith(KEPT):
                kept = []
            elif kept is not None:
                stop = STOP.match(line)
                if stop:
                    demo.pid = int(stop[1])
                    break
                kept.append(line)
        demo.env = _exports(kept, dict(os.environ))
        demo.suggested = tuple(
            line.strip() for line in kept if not line.strip().startswith(("export ", "node files"))
        )
        yield demo
    finally:
        demo.stop()
