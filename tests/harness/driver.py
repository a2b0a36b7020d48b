"""Run the driver's own processes (kubelet plugin, controller) for tests, benchmarks and the demo.

Each process is the real `dra-driver` command line in a subprocess, so a test
exercises argument parsing, logging and signal handling too, and can kill -9 it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from dra_driver import DEFAULT_DRIVER_NAME
from dra_driver.health.node import SIMULATED_EVENTS_FILE
from tests.harness.plugin_process import PluginProcess

DRIVER = DEFAULT_DRIVER_NAME


def spawn_dra_driver(
    args: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    detach: bool = False,
    log_level: str = "debug",
) -> subprocess.Popen[bytes]:
    """`dra-driver <args>` with JSON logs appended to `log_path`; it dies with this process
    unless `detach` (the demo's --keep)."""
    argv = [sys.executable, "-m", "dra_driver", "--log-format", "json", "--log-level", log_level, *args]
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv if detach else with_parent_death_signal(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=detach,
        )


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """`argv` that is SIGKILLed when this process dies, set by `setpriv` in the child rather
    than by a `preexec_fn`: a Python callback between fork and exec runs grpcio's fork
    handlers, and with a gRPC channel open (every plugin test holds one) grpcio >= 1.80
    aborts the child there (SIGABRT, "epoll_wait error: Bad file descriptor"; grpc#43055)."""
    return ["setpriv", "--pdeathsig", "KILL", "--", *argv]


@dataclass
class DriverProcess(PluginProcess):
    """One `dra-driver kubelet-plugin` for a simulated node, with its own kubelet and CDI dirs."""

    node: str
    profile: str
    kubeconfig: Path
    root: Path
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    detach: bool = False  # outlive this process (the demo's --keep); else die with it
    log_level: str = "debug"  # tests read the debug lines; benchmarks run at the default, info
    # What a node keeps under /run (a tmpfs there): CDI specs, the checkpoint; default: `root`.
    run_root: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    registered_driver: ClassVar[str] = DRIVER
    kind: ClassVar[str] = "plugin"

    @property
    def cdi_dir(self) -> Path:
        return (self.run_root or self.root) / "cdi"

    @property
    def state_dir(self) -> Path:
        return (self.run_root or self.root) / "state"

    @property
    def data_dir(self) -> Path:
        return self.kubelet_dir / "plugins" / DRIVER

    def start(self, wait: bool = True) -> DriverProcess:
        self.root.mkdir(parents=True, exist_ok=True)
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "kubelet-plugin",
            "--node-name",
            self.node,
            *(["--simulate", self.profile] if self.profile else []),  # "": real GPUs, NVML
            # the control file the node tier's health tests append to (a later flag wins)
            *(["--simulate-health-events", str(self.data_dir / SIMULATED_EVENTS_FILE)]
              if self.profile else []),
            "--kubeconfig",
            str(self.kubeconfig),
            "--kubelet-dir",
            str(self.kubelet_dir),
            "--cdi-dir",
            str(self.cdi_dir),
            "--state-dir",
            str(self.state_dir),
            "--mps-root",
            str(self.root / "mps"),
            *self.extra_args,
        ]
        self.proc = spawn_dra_driver(
            args, self.log_path, env=self.env, detach=self.detach, log_level=self.log_level
        )
        if wait:
            self.wait_serving(timeout=60)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"driver for {self.node} is not running (exit {code}):\n{self.log_tail()}")

    def wait_exit(self, timeout: float = 15.0) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self.proc = None
        return code
