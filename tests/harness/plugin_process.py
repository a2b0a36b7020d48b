"""A kubelet plugin run as a child process, as the tests and benchmarks run ours, the
example driver's and NVIDIA's: waiting until the kubelet could register it and its
registration socket answers, its log's tail, stopping it. How each one is started is the
subclass's own.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path
from typing import ClassVar

import grpc

from dra_driver.kubeletapi.pluginregistration.v1.api_pb2 import InfoRequest
from dra_driver.kubeletapi.pluginregistration.v1.api_pb2_grpc import RegistrationStub
from tests.harness.kubelet import find_registration_socket


class PluginProcess:
    """Subclasses (dataclasses) give `node`, `root` (its kubelet dir and log are there), `proc`,
    `registered_driver` (the name it registers under) and `kind` (how errors name it)."""

    registered_driver: ClassVar[str]
    kind: ClassVar[str]
    node: str
    root: Path
    proc: subprocess.Popen[bytes] | None

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "kubelet"

    @property
    def label(self) -> str:
        return f"{self.kind} for {self.node}"

    def registration_socket(self, timeout: float = 30.0) -> Path:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(TimeoutError):
                return find_registration_socket(self.kubelet_dir, self.registered_driver, timeout=0.2)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label} did not register:\n{self.log_tail()}")

    def wait_serving(self, timeout: float = 60.0) -> Path:
        """Wait until the registration socket answers (a crashed predecessor's file does not)."""
        deadline = time.monotonic() + timeout
        while True:
            socket = self.registration_socket(timeout=max(deadline - time.monotonic(), 0.1))
            with grpc.insecure_channel(f"unix://{socket}") as channel:
                try:
                    RegistrationStub(channel).GetInfo(InfoRequest(), timeout=1)
                    return socket
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.label} does not answer:\n{self.log_tail()}") from None
                    time.sleep(0.02)  # the poll interval

    @property
    def log_path(self) -> Path:
        return self.root / "plugin.log"

    def log_tail(self, size: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-size:] if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal it, kill it after `timeout`; its exit code (None if it was not running)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code
