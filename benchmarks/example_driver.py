"""dra-example-driver's kubelet plugin as a side of benchmarks.prepare: build it, run it.

`build()` runs hack/bench/example-driver.sh (the module `sigs.k8s.io/dra-example-driver`
from the Go module proxy at a pinned version, `EXAMPLE_VERSION` unless
`$DRA_EXAMPLE_DRIVER_VERSION` names another, compiled into a cache outside the
repository). `ExampleProcess` runs `dra-example-kubeletplugin` for the benchmark's node
with the same shape as tests.harness.driver.DriverProcess (start, wait_serving,
registration_socket, stop, proc): its registration socket in `<root>/kubelet/plugins_registry`,
its plugin dir (the DRA socket and its checkpoint) and its CDI dir on `run_root`, a tmpfs,
as ours keeps its state and CDI specs there; `--num-devices` GPUs named gpu-0, gpu-1, ...,
driver `EXAMPLE_DRIVER`; it logs at klog's default verbosity (its chart's default is
higher), to a file; its API client is not rate-limited (client-go's default of 5 requests/s
makes its sequential Prepare p50 about 200 ms, the limiter's wait, not the plugin's work).

This module only runs the example for measurements: it must not be imported by the driver,
and must not download anything itself (the script does, once, through the Go module proxy).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from benchmarks.kubelet_client import REPO
from tests.harness.driver import with_parent_death_signal
from tests.harness.plugin_process import PluginProcess

EXAMPLE_VERSION = "v0.2.0"
EXAMPLE_DRIVER = "gpu.example.com"
BUILD_SCRIPT = REPO / "hack" / "bench" / "example-driver.sh"


def build() -> Path:
    """Build (or find cached) dra-example-kubeletplugin; its progress goes to our stderr.
    `$DRA_EXAMPLE_DRIVER_BINARY` names one built elsewhere (the GPU host has no Go)."""
    if prebuilt := os.environ.get("DRA_EXAMPLE_DRIVER_BINARY"):
        return Path(prebuilt)
    version = os.environ.get("DRA_EXAMPLE_DRIVER_VERSION", EXAMPLE_VERSION)
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT), version],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        check=False,
    )
    lines = done.stdout.splitlines()
    if done.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        raise RuntimeError(f"{BUILD_SCRIPT} {version} failed (exit {done.returncode}): {done.stdout}")
    return Path(lines[-1])


@dataclass
class ExampleProcess(PluginProcess):
    """One dra-example-kubeletplugin for `node`, its plugin and CDI dirs under `run_root`."""

    binary: Path
    node: str
    kubeconfig: Path
    root: Path
    run_root: Path
    gpus: int
    proc: subprocess.Popen[bytes] | None = None
    registered_driver: ClassVar[str] = EXAMPLE_DRIVER
    kind: ClassVar[str] = "example plugin"

    @property
    def data_dir(self) -> Path:
        return self.run_root / "plugins" / EXAMPLE_DRIVER

    def start(self, wait: bool = True) -> ExampleProcess:
        registry = self.kubelet_dir / "plugins_registry"
        registry.mkdir(parents=True, exist_ok=True)
        argv = [
            str(self.binary),
            "--node-name", self.node,
            "--cdi-root", str(self.run_root / "cdi"),
            "--num-devices", str(self.gpus),
            "--kubelet-registrar-directory-path", str(registry),
            "--kubelet-plugins-directory-path", str(self.run_root / "plugins"),
            "--kubeconfig", str(self.kubeconfig),
            # client-go's defaults (5/s, burst 10) hold each sequential GET of the claim for
            # about 200 ms; ours has no client-side limit, so the example gets none either
            "--kube-api-qps", "10000",
            "--kube-api-burst", "10000",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                with_parent_death_signal(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        if wait:
            self.wait_serving()
        return self
