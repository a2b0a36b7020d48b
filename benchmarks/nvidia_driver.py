"""NVIDIA's own GPU kubelet plugin as a side of benchmarks.prepare: build it, run it.

`build()` runs hack/bench/nvidia-driver.sh (cmd/gpu-kubelet-plugin of the module
`sigs.k8s.io/dra-driver-nvidia-gpu` from the Go module proxy at `NVIDIA_VERSION`, unless
`$DRA_NVIDIA_DRIVER_VERSION` names another, compiled with cgo into a cache outside the
repository; `$DRA_NVIDIA_DRIVER_BINARY` names one built elsewhere, as on the GPU host, which
has no Go). `NvidiaProcess` runs it for the benchmark's node with the same shape as
benchmarks.example_driver.ExampleProcess (start, wait_serving, registration_socket, stop,
proc, data_dir, kubelet_dir).

What it is given, read from its v0.5.0 source (cmd/gpu-kubelet-plugin/main.go, root.go,
nvlib.go, device_state.go) and its chart (templates/kubeletplugin.yaml, values.yaml):
* NVML: the real one. It dlopens `libnvidia-ml.so.1` found under `--container-driver-root`
  (in /, /usr/lib64, /usr/lib/x86_64-linux-gnu, /lib64, ...) and needs `nvidia-smi` under it
  (/opt/bin, /usr/bin, /bin, ...); both roots (`--nvidia-driver-root`, the host's, which its
  CDI specs point at, and `--container-driver-root`, where it reads) are `driver_root()`:
  `$DRA_NVIDIA_DRIVER_ROOT`, else the first of /usr/local/nvidia (the GPU host's), /run/nvidia/driver
  and / that holds both. Its device nodes: it looks for them under the container driver root
  when that has a dev/ (root.go getDevRoot), else under /; the GPU host's /usr/local/nvidia has
  a dev/ without the GPU's nodes, and there every Prepare failed ("invalid CDI Spec: failed add
  device "<uid>-gpu-0": invalid device, empty device edits"). So `--container-driver-root` is
  a copy of the root made of symbolic links to each of its entries but dev/ (in `root`), and
  the nodes come from /dev, where they are; `--nvidia-driver-root` is the real root. Its mock NVML
  (`ALT_PROC_DEVICES_PATH`, a libnvidia-ml.so.1 built from NVIDIA/k8s-test-infra's
  pkg/gpu/mocknvml, at most 8 GPUs, installed with sudo into /var/lib/nvml-mock) is not
  served by the Go module proxy, so without a GPU it does not start: start() raises with its
  log ("failed to locate driver libraries: error locating "libnvidia-ml.so.1"").
* Its CDI dir and plugin dir (checkpoint, the pu.lock and cp.lock files, the DRA socket) on
  `run_root`, a tmpfs, as the other two sides; the registration socket in
  `<root>/kubelet/plugins_registry`.
* `--nvidia-cdi-hook-path`: a copy of /bin/true in `root` (its image copies the toolkit's
  nvidia-cdi-hook; the path is only written into its CDI specs, which nothing runs here).
* `--image-name` (required; used only to render MPS control daemon pods, MPS is off).
* As its chart runs it: `-v 4` (the chart's logVerbosity; to a file), the gRPC health service
  (`--healthcheck-port`, the chart's 51515, here a free port) and the metrics endpoint
  (`--http-endpoint`, the chart's :8080, here 127.0.0.1 and a free port), feature gates at
  their defaults (time-slicing, MPS, DynamicMIG, passthrough, NVML health, Fabric Manager all
  off: nothing it does changes the GPU's settings), and
* one gate that is not the default: `ConsumableShares=true` with `--consumable-shares
  unlimited`. The benchmark prepares 16 claims at once, and a host may have one GPU; without
  it, a second claim on a GPU already prepared is refused ("requested device gpu-0 is already
  allocated to different claim"). With it the plugin checks that claims sharing a device ask
  for the same configuration and prepares each (its own CDI spec, its checkpoint entry).
  `claim_devices()` spreads the claims over the GPUs it published.
* Its API client is not rate-limited (`--kube-api-qps/--kube-api-burst` 10000), as the
  example's: client-go's default 5/s would time its limiter.

This module only runs NVIDIA's plugin for measurements: it must not be imported by the
driver, and must not download anything itself (the script does, once, through the proxy).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from benchmarks.kubelet_client import REPO
from tests.harness.driver import with_parent_death_signal
from tests.harness.objects import sync_request
from tests.harness.plugin_process import PluginProcess

NVIDIA_VERSION = "v0.5.0"
NVIDIA_DRIVER = "gpu.nvidia.com"
BUILD_SCRIPT = REPO / "hack" / "bench" / "nvidia-driver.sh"
LOG_VERBOSITY = "4"  # its chart's logVerbosity
DRIVER_ROOTS = ("/usr/local/nvidia", "/run/nvidia/driver", "/")
_LIBRARY_DIRS = (".", "usr/lib64", "usr/lib/x86_64-linux-gnu", "lib64", "lib/x86_64-linux-gnu")
_BINARY_DIRS = ("opt/bin", "usr/bin", "usr/sbin", "bin", "sbin")


def build() -> Path:
    """Build (or find cached) gpu-kubelet-plugin; its progress goes to our stderr."""
    if prebuilt := os.environ.get("DRA_NVIDIA_DRIVER_BINARY"):
        return Path(prebuilt)
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT), version()],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        check=False,
    )
    lines = done.stdout.splitlines()
    if done.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        raise RuntimeError(f"{BUILD_SCRIPT} {version()} failed (exit {done.returncode}): {done.stdout}")
    return Path(lines[-1])


def version() -> str:
    return os.environ.get("DRA_NVIDIA_DRIVER_VERSION", NVIDIA_VERSION)


def describe(binary: Path) -> str:
    """What was built: the version and the replacements the build script recorded beside it."""
    replaced = binary.with_name(binary.name + ".replaced")
    lines = replaced.read_text().splitlines()[1:] if replaced.is_file() else []
    built = f"; built with {', '.join(lines)}" if lines else ""
    return f"dra-driver-nvidia-gpu {version()} gpu-kubelet-plugin (Go, from the Go module proxy{built})"


def _holds(root: Path, name: str, dirs: tuple[str, ...]) -> bool:
    return any((root / d / name).is_file() for d in dirs)


def driver_root() -> Path:
    """Where the plugin finds libnvidia-ml.so.1 and nvidia-smi, as its root.go looks for them."""
    if named := os.environ.get("DRA_NVIDIA_DRIVER_ROOT"):
        return Path(named)
    for candidate in map(Path, DRIVER_ROOTS):
        nvml = _holds(candidate, "libnvidia-ml.so.1", _LIBRARY_DIRS)
        if nvml and _holds(candidate, "nvidia-smi", _BINARY_DIRS):
            return candidate
    return Path("/")  # it then says what it could not find


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def claim_devices(api: Any, node: str, timeout: float = 60.0) -> list[str]:
    """The full GPUs (`type` gpu) the plugin published for `node`, sorted; waits for its slices."""
    deadline = time.monotonic() + timeout
    while True:
        slices = sync_request(
            api,
            "GET",
            "/apis/resource.k8s.io/v1/resourceslices",
            query={"fieldSelector": f"spec.nodeName={node}"},
        )
        names = sorted(
            device["name"]
            for item in slices.get("items", [])
            if item["spec"].get("driver") == NVIDIA_DRIVER
            for device in item["spec"].get("devices") or []
            if (device.get("attributes") or {}).get("type", {}).get("string") == "gpu"
        )
        if names:
            return names
        if time.monotonic() > deadline:
            raise TimeoutError(f"{NVIDIA_DRIVER} published no GPU for {node} in {timeout} s")
        time.sleep(0.2)


@dataclass
class NvidiaProcess(PluginProcess):
    """One gpu-kubelet-plugin for `node`, its plugin and CDI dirs under `run_root`."""

    binary: Path
    node: str
    kubeconfig: Path
    root: Path
    run_root: Path
    proc: subprocess.Popen[bytes] | None = None
    registered_driver: ClassVar[str] = NVIDIA_DRIVER
    kind: ClassVar[str] = "NVIDIA's plugin"

    @property
    def data_dir(self) -> Path:
        return self.run_root / "plugins" / NVIDIA_DRIVER

    def start(self, wait: bool = True) -> NvidiaProcess:
        registry = self.kubelet_dir / "plugins_registry"
        registry.mkdir(parents=True, exist_ok=True)
        hook = self.root / "nvidia-cdi-hook"
        if not hook.exists():
            shutil.copy("/bin/true", hook)
        real = driver_root()
        root = self._without_dev(real)
        argv = [
            str(self.binary),
            "-v", LOG_VERBOSITY,
            "--node-name", self.node,
            "--image-name", "benchmark.invalid/unused:v0",
            "--cdi-root", str(self.run_root / "cdi"),
            "--nvidia-driver-root", str(real),
            "--container-driver-root", str(root),
            "--nvidia-cdi-hook-path", str(hook),
            "--kubelet-registrar-directory-path", str(registry),
            "--kubelet-plugins-directory-path", str(self.run_root / "plugins"),
            "--healthcheck-port", str(_free_port()),
            "--http-endpoint", f"127.0.0.1:{_free_port()}",
            "--feature-gates", "ConsumableShares=true",
            "--consumable-shares", "unlimited",
            "--kubeconfig", str(self.kubeconfig),
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

    def _without_dev(self, real: Path) -> Path:
        """`real` as symbolic links to its entries, all but dev/ (see the module's docstring)."""
        if real == Path("/") or not (real / "dev").is_dir():
            return real
        shadow = self.root / "driver-root"
        shadow.mkdir(parents=True, exist_ok=True)
        for entry in real.iterdir():
            if entry.name != "dev" and not (shadow / entry.name).is_symlink():
                (shadow / entry.name).symlink_to(entry)
        return shadow
